"""Structured channel pruning that physically shrinks conv and Linear layers.

Engine: Torch-Pruning's dependency graph (Fang et al., "DepGraph: Towards Any Structural
Pruning", CVPR 2023; the `torch-pruning` package), which removes coupled channels together
(residual adds, concatenations, BatchNorm, grouped and depthwise convs) so the pruned model
stays consistent. Importance is the L1 or L2 norm of each channel group's weights, or the
first-order Taylor criterion |w · ∂L/∂w| on labelled training batches (Molchanov et al.,
CVPR 2019). Channel counts are rounded to a hardware multiple (8 by default). The output
layer (the module whose output is the model's output) and layers the user names are never
pruned. Recovery fine-tuning and the checks are `recovery.PruningTechnique`'s.

Opt-in: the tuner tries it only when named in `techniques` (it fine-tunes, which takes time).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.errors import one_line
from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import CONV_OPS, LINEAR_OPS, missing_layers_reason
from overdrive.techniques.pruning.recovery import PruningConfig, PruningTechnique, example_inputs, importance_gradients
from overdrive.techniques.registry import register


class ChannelImportance(str, enum.Enum):
    L1 = "l1"
    L2 = "l2"
    TAYLOR = "taylor"


@dataclass(frozen=True, kw_only=True)
class PruneChannelsConfig(PruningConfig):
    """Attributes (and PruningConfig's fine-tune fields):
    ratio: fraction of each prunable layer's output channels to remove, in (0, 1).
    importance: how channels are ranked (weight norm, or Taylor on labelled training data).
    round_to: kept channel counts are multiples of this (tensor-core / vector width).
    global_pruning: rank channels across layers (uneven ratios) instead of per layer.
    ignored: module names (as in `named_modules`) left unpruned.
    """
    name: ClassVar[str] = "prune-channels"

    ratio: float = 0.5
    importance: ChannelImportance = ChannelImportance.L2
    round_to: int = 8
    global_pruning: bool = False
    ignored: tuple[str, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "importance", ChannelImportance(self.importance))
        object.__setattr__(self, "ignored", tuple(self.ignored))
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"PruneChannelsConfig.ratio must be in (0, 1), got {self.ratio}")
        if self.round_to < 1:
            raise ValueError(f"PruneChannelsConfig.round_to must be ≥ 1, got {self.round_to}")


_PRUNABLE = (nn.Linear, nn.modules.conv._ConvNd)


def output_layers(model: nn.Module, example: tuple[torch.Tensor, ...]) -> list[nn.Module]:
    """The conv/Linear modules whose output tensor is the model's output (the classifier head)."""
    produced: dict[int, nn.Module] = {}

    def hook(module, _inputs, output):
        produced[id(output)] = module

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, _PRUNABLE)]
    try:
        with torch.no_grad():
            out = model(*example)
    finally:
        for h in handles:
            h.remove()
    return [produced[id(out)]] if id(out) in produced else []


def _unprunable_layers(pruner, importance) -> dict[nn.Module, str]:
    """Layers whose channel group the engine fails to score (e.g. Torch-Pruning 1.6 on a tensor
    chunked and concatenated with itself), with the error: they are left unpruned."""
    graph = pruner.DG
    bad: dict[nn.Module, str] = {}
    for group in graph.get_all_groups(ignored_layers=pruner.ignored_layers, root_module_types=pruner.root_module_types):
        try:
            importance(group)
        except Exception as exc:  # noqa: BLE001 - recorded with the layer names in the report
            for item in group:
                module = item.dep.target.module
                if isinstance(module, _PRUNABLE) and graph.is_out_channel_pruning_fn(item.dep.handler):
                    bad[module] = f"Torch-Pruning cannot score its channel group: {one_line(exc)}"
    return bad


@register
class PruneChannels(PruningTechnique):
    config_cls = PruneChannelsConfig
    description = "structured channel pruning (Torch-Pruning DepGraph), physically smaller layers, then a recovery fine-tune; opt-in"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        try:
            import torch_pruning  # noqa: F401
        except ImportError:
            return "needs the torch-pruning package (pip install torch-pruning)"
        if not any(isinstance(m, _PRUNABLE) for m in workload.model.modules()):
            return missing_layers_reason(workload.model, layers="conv / nn.Linear", ops=CONV_OPS + LINEAR_OPS,
                                         rewrites="prune-channels (Torch-Pruning) cuts channels out of conv and Linear modules")
        if any("Attention" in type(m).__name__ for m in workload.model.modules()):
            return "not applicable: attention blocks need head-aware pruning (prune-heads / prune-ffn)"
        return None

    def prune(self, model, config, *, workload, device):
        import torch_pruning as tp

        example = example_inputs(workload, device)
        named = dict(model.named_modules())
        unknown = [n for n in config.ignored if n not in named]
        if unknown:
            raise ValueError(f"prune-channels: no module named {unknown}; names come from model.named_modules()")
        ignored = output_layers(model, example) + [named[n] for n in config.ignored]
        if config.importance is ChannelImportance.TAYLOR:
            importance = tp.importance.GroupTaylorImportance()
            importance_gradients(model, workload, device)
        else:
            importance = tp.importance.GroupMagnitudeImportance(p=1 if config.importance is ChannelImportance.L1 else 2)

        def make_pruner(ignored_layers):  # builds the dependency graph by tracing `example`
            return tp.pruner.BasePruner(
                model, example, importance=importance, pruning_ratio=config.ratio, global_pruning=config.global_pruning,
                ignored_layers=ignored_layers, round_to=config.round_to,
            )

        try:
            pruner = make_pruner(ignored)
            unprunable = _unprunable_layers(pruner, importance)
            if unprunable:  # leave the structures the engine cannot handle alone; prune the rest
                pruner = make_pruner(ignored + list(unprunable))
            pruner.step()
        except Exception as exc:  # noqa: BLE001 - an engine failure is this technique's failure, said plainly
            raise RuntimeError(f"Torch-Pruning could not prune this structure: {one_line(exc)}") from None
        finally:
            model.zero_grad(set_to_none=True)
        names = {id(m): n for n, m in model.named_modules()}
        notes = {"importance": config.importance.value}
        if unprunable:
            notes["left_unpruned"] = {names[id(m)]: reason for m, reason in unprunable.items()}
        return notes

    def shrink_to(self, model, state, *, workload, device):
        """Remove trailing output channels of each conv/Linear (and everything coupled to them,
        through the dependency graph) until the shapes match `state`."""
        import torch_pruning as tp

        graph = None
        for name, module in model.named_modules():
            if not isinstance(module, _PRUNABLE) or f"{name}.weight" not in state:
                continue
            current, target = module.weight.shape[0], state[f"{name}.weight"].shape[0]
            if isinstance(module, nn.modules.conv._ConvTransposeMixin):
                current, target = module.weight.shape[1] * module.groups, state[f"{name}.weight"].shape[1] * module.groups
            if target >= current:
                continue
            if graph is None:
                graph = tp.DependencyGraph().build_dependency(model, example_inputs=example_inputs(workload, device))
            fn = tp.prune_linear_out_channels if isinstance(module, nn.Linear) else tp.prune_conv_out_channels
            graph.get_pruning_group(module, fn, idxs=list(range(target, current))).prune()
