"""torch.inference_mode instead of no_grad: no autograd version counters or view tracking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register


class InferenceModeModule(ForwardWrapper):
    """Runs `inner` under `torch.inference_mode()` (no autograd version counters or views tracking)."""

    def forward(self, *args, **kwargs):
        with torch.inference_mode():
            return self.inner(*args, **kwargs)


@dataclass(frozen=True, kw_only=True)
class InferenceModeConfig(TechniqueConfig):
    name: ClassVar[str] = "inference-mode"


@register
class InferenceMode(Technique):
    config_cls = InferenceModeConfig
    stage = Stage.RUNTIME
    lossless = True
    description = "torch.inference_mode instead of no_grad"

    def apply(self, model, config, *, workload, device):
        return InferenceModeModule(model)
