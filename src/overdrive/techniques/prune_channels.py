"""Structured channel pruning that physically shrinks conv and Linear layers.

Engine: Torch-Pruning's dependency graph (Fang et al., "DepGraph: Towards Any Structural
Pruning", CVPR 2023; the `torch-pruning` package), which removes coupled channels together
(residual adds, concatenations, BatchNorm, grouped and depthwise convs) so the pruned model
stays consistent. Importance is the L1 or L2 norm of each channel group's weights. Channel
counts are rounded to a hardware multiple (8 by default). The output layer (the module whose
output is the model's output) and layers the user names are never pruned.

Opt-in: the tuner tries it only when named in `--techniques`, since it is lossy until a
recovery fine-tune (a later step of this technique) restores accuracy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from overdrive.errors import one_line
from overdrive.techniques.base import Stage, Technique, TechniqueConfig, register
from overdrive.workloads.base import Workload


class ChannelImportance(str, enum.Enum):
    L1 = "l1"
    L2 = "l2"


@dataclass(frozen=True, kw_only=True)
class PruneChannelsConfig(TechniqueConfig):
    """Attributes:
    ratio: fraction of each prunable layer's output channels to remove, in (0, 1).
    importance: channel-group norm used to rank channels.
    round_to: kept channel counts are multiples of this (tensor-core / vector width).
    global_pruning: rank channels across layers (uneven ratios) instead of per layer.
    ignored: module names (as in `named_modules`) left unpruned.
    """

    ratio: float = 0.5
    importance: ChannelImportance = ChannelImportance.L2
    round_to: int = 8
    global_pruning: bool = False
    ignored: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "importance", ChannelImportance(self.importance))
        object.__setattr__(self, "ignored", tuple(self.ignored))
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"PruneChannelsConfig.ratio must be in (0, 1), got {self.ratio}")
        if self.round_to < 1:
            raise ValueError(f"PruneChannelsConfig.round_to must be ≥ 1, got {self.round_to}")


def output_layers(model: nn.Module, example: tuple[torch.Tensor, ...]) -> list[nn.Module]:
    """The conv/Linear modules whose output tensor is the model's output (the classifier head)."""
    produced: dict[int, nn.Module] = {}

    def hook(module, _inputs, output):
        produced[id(output)] = module

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))]
    try:
        with torch.no_grad():
            out = model(*example)
    finally:
        for h in handles:
            h.remove()
    return [produced[id(out)]] if id(out) in produced else []


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@register
class PruneChannels(Technique):
    name = "prune-channels"
    config_cls = PruneChannelsConfig
    stage = Stage.PRUNE
    lossless = False
    opt_in = True
    rewrites_modules = True
    description = "structured channel pruning (Torch-Pruning DepGraph), physically smaller layers; opt-in"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        try:
            import torch_pruning  # noqa: F401
        except ImportError:
            return "needs the torch-pruning package (pip install torch-pruning)"
        if not any(isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for m in workload.model.modules()):
            return "not applicable: the model has no conv or Linear layers"
        if any("Attention" in type(m).__name__ for m in workload.model.modules()):
            return "not applicable: attention blocks need head-aware pruning (prune-heads / prune-ffn)"
        return None

    def apply(self, model, config, *, workload, device):
        import torch_pruning as tp

        example = tuple(t.to(device) for t in workload.collate(list(workload.samples[:2])))
        with torch.no_grad():
            reference_shape = tuple(model(*example).shape)
        named = dict(model.named_modules())
        unknown = [n for n in config.ignored if n not in named]
        if unknown:
            raise ValueError(f"prune-channels: no module named {unknown}; names come from model.named_modules()")
        ignored = output_layers(model, example) + [named[n] for n in config.ignored]
        p = 1 if config.importance is ChannelImportance.L1 else 2
        pruner = tp.pruner.BasePruner(  # builds the dependency graph by tracing `example`
            model, example, importance=tp.importance.GroupMagnitudeImportance(p=p),
            pruning_ratio=config.ratio, global_pruning=config.global_pruning,
            ignored_layers=ignored, round_to=config.round_to,
        )
        before = num_parameters(model)
        try:
            pruner.step()
        except Exception as exc:  # noqa: BLE001 - an engine failure is this technique's failure, said plainly
            raise RuntimeError(f"Torch-Pruning could not prune this structure: {one_line(exc)}") from None
        with torch.no_grad():
            shape = tuple(model(*example).shape)
        if shape != reference_shape:  # the guard the issue asks for: same outputs shapes, or no pruning
            raise RuntimeError(f"pruned model returns shape {shape}, expected {reference_shape}")
        if num_parameters(model) >= before:
            raise RuntimeError("nothing could be pruned (every layer is coupled to an ignored one)")
        return model
