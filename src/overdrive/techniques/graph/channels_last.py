"""channels_last (NHWC) memory layout for conv nets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.graph_ops import call_nodes, count_ops, op_name
from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import holds_graph
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


def _graph_conv2d(model: nn.Module) -> bool:
    """True when the graph calls `aten.convolution` with a 4-D weight (a decomposed program's 2-D conv)."""
    for node in call_nodes(model):
        if op_name(node.target) == "convolution" and len(node.args) > 1:
            value = getattr(node.args[1], "meta", {}).get("val")
            if value is not None and value.dim() == 4:
                return True
    return False


@dataclass(frozen=True, kw_only=True)
class ChannelsLastConfig(TechniqueConfig):
    name: ClassVar[str] = "channels-last"


@register
class ChannelsLast(Technique):
    """NHWC memory layout for conv nets (cuDNN/oneDNN pick faster kernels for it); input conversion is timed."""

    config_cls = ChannelsLastConfig
    exportable = True  # survives export to ONNX / OpenVINO
    stage = Stage.GRAPH
    lossless = True
    rewrites_modules = True
    description = "channels_last (NHWC) weights and inputs for conv nets"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if any(isinstance(m, nn.Conv2d) for m in workload.model.modules()):
            return None
        if holds_graph(workload.model):  # a torch.export program: its weights are attributes, `.to` converts them
            if count_ops(workload.model, "conv2d") or _graph_conv2d(workload.model):
                return None
            return "not applicable: the program runs no 2-D convolution (no aten.conv2d op)"
        return "not applicable: the model has no 2-D convolutions"

    def apply(self, model, config, *, workload, device):
        return ChannelsLastInputs(model.to(memory_format=torch.channels_last))
