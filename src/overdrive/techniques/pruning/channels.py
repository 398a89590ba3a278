"""Structured channel pruning that physically shrinks conv and Linear layers.

Engine: Torch-Pruning's dependency graph (Fang et al., "DepGraph: Towards Any Structural
Pruning", CVPR 2023; the `torch-pruning` package), which removes coupled channels together
(residual adds, concatenations, BatchNorm, grouped and depthwise convs) so the pruned model
stays consistent. Importance is the L1 or L2 norm of each channel group's weights, or the
first-order Taylor criterion |w · ∂L/∂w| on labelled training batches (Molchanov et al.,
CVPR 2019). Which channels go is `channel_groups.prune_groups`'s: kept widths are rounded down
to a hardware multiple (8 by default) that the group's structures allow (whole GroupNorm groups,
as many channels from each group of a grouped conv); groups coupled to a recurrent layer, which
the dependency graph does not support, stay whole and the report names the layer. The output
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
from overdrive.techniques.pruning.channel_groups import PRUNABLE, UNSUPPORTED, describe, grouped_conv, prune_groups
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


_PRUNABLE = PRUNABLE


def output_layers(model: nn.Module, example: tuple[torch.Tensor, ...]) -> list[nn.Module]:
    """The conv/Linear modules whose output channels are the model's output channels (the
    classifier head): the module that returns the output tensor itself, or, when the output is
    computed from module outputs by other ops (`F.normalize(head(x))`, `softmax`, `2 * head(x)`,
    a residual add), the modules reached first walking the autograd graph back from the output."""
    produced: dict[int, nn.Module] = {}
    by_grad_fn: dict[object, nn.Module] = {}

    def hook(module, _inputs, output):
        if isinstance(output, torch.Tensor):
            produced[id(output)] = module
            if output.grad_fn is not None:
                by_grad_fn[output.grad_fn] = module

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, _PRUNABLE)]
    try:
        try:
            with torch.enable_grad():  # the autograd graph links the output to the modules that made it
                out = model(*example)
        except RuntimeError:  # e.g. an in-place op autograd refuses: the output's own module only
            produced.clear()
            by_grad_fn.clear()
            with torch.no_grad():
                out = model(*example)
    finally:
        for h in handles:
            h.remove()
    if id(out) in produced:
        return [produced[id(out)]]
    found: dict[int, nn.Module] = {}
    todo, seen = [out.grad_fn] if isinstance(out, torch.Tensor) and out.grad_fn is not None else [], set()
    while todo:  # breadth-first back from the output, stopping at the first module on each path
        fn = todo.pop(0)
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if fn in by_grad_fn:
            found[id(by_grad_fn[fn])] = by_grad_fn[fn]
            continue
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return list(found.values())


def nothing_pruned(model: nn.Module, config: PruneChannelsConfig, left: dict[str, str], ignored: list[nn.Module]) -> str:
    """The message when no channel group could be pruned: each layer left whole and why, the
    structures the dependency graph does not support, and the layers kept on purpose."""
    names = {id(m): n for n, m in model.named_modules()}
    parts = [f"{name} ({why})" for name, why in left.items()]
    unsupported = [describe(m, names) for m in model.modules() if isinstance(m, UNSUPPORTED)]
    if unsupported and not any("does not support" in why for why in left.values()):
        parts.append(f"{', '.join(unsupported)} is not supported by the dependency graph")
    kept = [f"'{names[id(m)]}'" for m in ignored if id(m) in names]
    if kept:
        parts.append(f"kept on purpose: {', '.join(kept)} (the output layer and `ignored`)")
    return (f"prune-channels: nothing could be pruned at ratio {config.ratio}: "
            + ("; ".join(parts) if parts else "every prunable layer is coupled to a kept one"))


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
        layers = [m for m in workload.model.modules() if isinstance(m, _PRUNABLE)]
        recurrent = [m for m in workload.model.modules() if isinstance(m, UNSUPPORTED)]
        if recurrent and len(layers) == 1:  # the one layer is the output, coupled to the recurrent layer, or shapes it
            names = {id(m): n for n, m in workload.model.named_modules()}
            return (f"not applicable: {', '.join(describe(m, names) for m in recurrent)} is not supported by the dependency "
                    f"graph (Torch-Pruning 1.6 mis-indexes its gate weights), and {describe(layers[0], names)} is the "
                    "model's only conv / Linear layer")
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

        try:  # the dependency graph is built by tracing `example`
            graph = tp.DependencyGraph().build_dependency(model, example_inputs=example)
        except Exception as exc:  # noqa: BLE001 - an engine failure is this technique's failure, said plainly
            model.zero_grad(set_to_none=True)
            raise RuntimeError(f"prune-channels: Torch-Pruning could not trace the model: {one_line(exc)}") from None
        try:
            pruned, left = prune_groups(model, graph, importance, ratio=config.ratio, round_to=config.round_to,
                                        global_pruning=config.global_pruning, ignored=ignored)
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"prune-channels: Torch-Pruning could not prune this structure: {one_line(exc)}") from None
        finally:
            model.zero_grad(set_to_none=True)
        if not pruned:
            raise RuntimeError(nothing_pruned(model, config, left, ignored))
        notes = {"importance": config.importance.value}
        if left:
            notes["left_unpruned"] = left
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
            group = graph.get_pruning_group(module, fn, idxs=list(range(target, current)))
            coupled = [item.dep.target.module for item in group]
            norms = [(m, m.num_channels // m.num_groups) for m in dict.fromkeys(coupled) if isinstance(m, nn.GroupNorm)]
            group.prune()
            if not any(grouped_conv(m) for m in coupled):  # pruned in whole GroupNorm groups (channel_groups)
                for norm, size in norms:
                    norm.num_groups = norm.num_channels // size
