"""channels_last (NHWC) memory layout for conv nets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register


class ChannelsLastInputs(ForwardWrapper):
    """Converts 4-D floating-point inputs [N, C, H, W] to channels_last before `inner` runs."""

    def forward(self, *args):
        args = tuple(
            a.contiguous(memory_format=torch.channels_last)
            if isinstance(a, torch.Tensor) and a.dim() == 4 and a.is_floating_point()
            else a
            for a in args
        )
        return self.inner(*args)


@dataclass(frozen=True, kw_only=True)
class ChannelsLastConfig(TechniqueConfig):
    name: ClassVar[str] = "channels-last"


@register
class ChannelsLast(Technique):
    """NHWC memory layout for conv nets (cuDNN/oneDNN pick faster kernels for it); input conversion is timed."""

    config_cls = ChannelsLastConfig
    stage = Stage.GRAPH
    lossless = True
    rewrites_modules = True
    description = "channels_last (NHWC) weights and inputs for conv nets"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not any(isinstance(m, nn.Conv2d) for m in workload.model.modules()):
            return "not applicable: the model has no 2-D convolutions"
        return None

    def apply(self, model, config, *, workload, device):
        return ChannelsLastInputs(model.to(memory_format=torch.channels_last))
