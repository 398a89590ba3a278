"""int8 dynamic quantization of Linear layers: int8 weights, activations quantized per batch
at run time (torch.ao.quantization.quantize_dynamic, FBGEMM/x86 kernels; CPU only)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


@dataclass(frozen=True, kw_only=True)
class Int8DynamicConfig(TechniqueConfig):
    """No options: per-tensor int8 weights, dynamic per-batch uint8 activations (torch.ao defaults)."""
    name: ClassVar[str] = "int8-dynamic"


@register
class Int8Dynamic(Technique):
    config_cls = Int8DynamicConfig
    stage = Stage.PRECISION
    lossless = False
    group = "precision"
    devices = ("cpu",)  # torch.ao dynamic quantization has CPU kernels only
    rewrites_modules = True
    description = "int8 dynamic quantization of nn.Linear (weights int8, activations per batch)"
    batch_dependence = "int8-dynamic quantizes each Linear's input with one scale for the whole batch"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not any(isinstance(m, nn.Linear) for m in workload.model.modules()):
            return "not applicable: the model has no nn.Linear layers"
        return None

    def apply(self, model, config, *, workload, device):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization is deprecated in favour of torchao
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
            from torch.ao.quantization import quantize_dynamic

            return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
