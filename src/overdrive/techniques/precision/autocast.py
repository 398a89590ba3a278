"""bf16 and fp16 mixed precision with torch.autocast (ops on autocast's lists run in the
low-precision dtype; the rest, e.g. softmax and norms, stay fp32). Output is cast back to fp32."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.devices import supports_bf16, supports_fp16
from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register


class AutocastModule(ForwardWrapper):
    """Runs `inner` under `torch.autocast(device_type, dtype)`; returns fp32 outputs."""

    def __init__(self, inner: nn.Module, *, device_type: str, dtype: torch.dtype):
        super().__init__(inner)
        self.device_type = device_type
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            out = self.inner(*args, **kwargs)
        return out.float()


@dataclass(frozen=True, kw_only=True)
class Bf16AutocastConfig(TechniqueConfig):
    name: ClassVar[str] = "bf16"


@dataclass(frozen=True, kw_only=True)
class Fp16AutocastConfig(TechniqueConfig):
    name: ClassVar[str] = "fp16"


@register
class Bf16Autocast(Technique):
    config_cls = Bf16AutocastConfig
    stage = Stage.PRECISION
    lossless = False
    group = "precision"
    description = "bfloat16 autocast (fp32 range, 8-bit mantissa)"
    compute_dtype = "bfloat16"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not supports_bf16(device):
            return "this GPU has no native bf16 (needs compute capability ≥ 8.0)"
        return None

    def apply(self, model, config, *, workload, device):
        return AutocastModule(model, device_type=device.type, dtype=torch.bfloat16)


@register
class Fp16Autocast(Technique):
    config_cls = Fp16AutocastConfig
    stage = Stage.PRECISION
    lossless = False
    group = "precision"
    description = "float16 autocast (GPU; CPU only with AMX-FP16); activations above 65504 overflow to inf"
    compute_dtype = "float16"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        ok, why = supports_fp16(device)
        return None if ok else why

    def apply(self, model, config, *, workload, device):
        return AutocastModule(model, device_type=device.type, dtype=torch.float16)
