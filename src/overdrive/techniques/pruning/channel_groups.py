"""Which channels `prune-channels` removes: one dependency group at a time, under its group constraints.

Torch-Pruning's dependency graph (`torch_pruning.DependencyGraph`) gives, for each conv / Linear
layer, the group of everything coupled to its output channels (BatchNorm, residual adds,
concatenations, the next layers' inputs). This module ranks the channels of each group, decides
how many to keep, and prunes them through the graph. It replaces `BasePruner.step`, whose
rounding (`round_to`) counts channels per group against the whole width, so a layer followed by
GroupNorm(8) with `round_to=8` rounds back to its full width and is never pruned.

A group's channels are removed in units that keep its structures valid:
- plain layers: single channels;
- a GroupNorm (and no grouped conv): whole normalisation groups, and its `num_groups` shrinks;
  the groups kept normalise over exactly the channels they did before;
- a grouped (not depthwise) conv: the same offsets in every group (the conv keeps its group
  count; GroupNorms in the same group keep theirs too), as Torch-Pruning does.
The kept width is rounded down to a multiple of `round_to` that such units can make: kept units
are a multiple of round_to / gcd(unit width, round_to), and at least one such multiple.

Groups that touch a recurrent layer (nn.LSTM / GRU / RNN, whose gate weights Torch-Pruning 1.6
mis-indexes), whose channels the engine cannot score, or whose GroupNorm channels do not line
up with the units (a concatenation at an offset) are left whole, and the reason names the layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from overdrive.core.errors import one_line

PRUNABLE = (nn.Linear, nn.modules.conv._ConvNd)
UNSUPPORTED = (nn.RNNBase,)  # Torch-Pruning 1.6 mis-indexes the gate weights of LSTM / GRU / RNN


def describe(module: nn.Module, names: dict[int, str]) -> str:
    """"nn.LSTM 'rnn'" for a module of `names` (id -> qualified name)."""
    kind = type(module)
    prefix = "nn." if kind.__module__.startswith("torch.nn") else ""
    return f"{prefix}{kind.__name__} '{names.get(id(module), '?')}'"


def grouped_conv(module: nn.Module) -> bool:
    """A conv with groups that constrain its channels (depthwise convs just follow their input)."""
    return isinstance(module, nn.modules.conv._ConvNd) and module.groups > 1 and module.groups != module.out_channels


@dataclass(kw_only=True)
class Candidate:
    """One dependency group, ready to rank: its root layer, units and their importance.

    Attributes:
        root: the conv / Linear whose output channels root the group.
        handler: Torch-Pruning's pruning function for the root.
        width: the root's output channels.
        unit_width: channels per removable unit.
        layout: "plain" (unit j = channel j), "blocks" (unit u = channels u·w .. u·w + w − 1: whole
            GroupNorm groups) or "even" (unit j = channels j + g·width/chunks for every chunk g).
        chunks: the number of chunks of an "even" layout (1 otherwise).
        importance: float [width / unit_width], one score per unit (higher = keep).
        step: the number of kept units is a multiple of this (round_to).
        norms: GroupNorms in the group with their channels per group ("blocks" shrinks their groups).
    """

    root: nn.Module
    handler: object
    width: int
    unit_width: int
    layout: str
    chunks: int
    importance: torch.Tensor
    step: int
    norms: list[tuple[nn.GroupNorm, int]] = field(default_factory=list)

    @property
    def num_units(self) -> int:
        return self.width // self.unit_width

    def kept_units(self, remove: int) -> int:
        """Units to keep when `remove` would go: rounded down to the step, at least one step."""
        keep = (self.num_units - remove) // self.step * self.step
        return max(keep, self.step)

    def channels(self, units: list[int]) -> list[int]:
        """Root channel indices of `units`."""
        if self.layout == "blocks":
            return [u * self.unit_width + i for u in units for i in range(self.unit_width)]
        if self.layout == "even":
            size = self.width // self.chunks
            return sorted(u + g * size for u in units for g in range(self.chunks))
        return list(units)


def _candidate(graph, group, importance, round_to: int, names: dict[int, str]) -> tuple[Candidate | None, str | None]:
    """The Candidate of `group`, or (None, why it stays whole) (None, None when there is nothing to say)."""
    root, handler = group[0].dep.target.module, group[0].dep.handler
    modules = [item.dep.target.module for item in group]
    for module in modules:
        if isinstance(module, UNSUPPORTED):
            return None, f"coupled to {describe(module, names)}, which the dependency graph does not support"
    width = graph.get_out_channels(root)
    try:
        scores = importance(group)
    except Exception as exc:  # noqa: BLE001 - recorded with the layer names in the report
        return None, f"Torch-Pruning cannot score its channel group: {one_line(exc)}"
    if scores is None or not width:
        return None, None
    scores = scores.detach().float().cpu()
    chunks = [m.groups for m in modules if grouped_conv(m)]
    norms = list({id(m): m for m in modules if isinstance(m, nn.GroupNorm)}.values())
    norm_sizes = [(m, m.num_channels // m.num_groups) for m in norms]
    if chunks:
        count = math.lcm(*chunks, *(m.num_groups for m in norms))
        if width % count or len(scores) != width:
            return None, f"{width} channels do not split into the {count} groups of its grouped convs / GroupNorms"
        layout, unit, unit_scores = "even", count, scores.view(count, -1).mean(0)
    elif norms:
        unit = math.lcm(*(size for _, size in norm_sizes))
        if width % unit or len(scores) != width:
            return None, (f"{width} channels do not split into whole groups of "
                          f"{', '.join(describe(m, names) for m in norms)} ({unit} channels each)")
        layout, unit_scores = "blocks", scores.view(-1, unit).mean(1)
    else:
        if len(scores) != width:
            return None, f"Torch-Pruning scored {len(scores)} of its {width} channels"
        layout, unit, unit_scores = "plain", 1, scores
    step = round_to // math.gcd(unit, round_to)
    candidate = Candidate(root=root, handler=handler, width=width, unit_width=unit, layout=layout,
                          chunks=unit if layout == "even" else 1, importance=unit_scores, step=step, norms=norm_sizes)
    return candidate, None


def _aligned(pruning_group, candidate: Candidate, names: dict[int, str]) -> str | None:
    """Why the channels reaching a GroupNorm of `candidate` would break its groups, or None when they do not."""
    from torch_pruning._helpers import to_plain_idxs

    for item in pruning_group:
        module = item.dep.target.module
        if not isinstance(module, nn.GroupNorm):
            continue
        idxs = set(int(i) for i in to_plain_idxs(item.idxs))
        size = module.num_channels // module.num_groups
        per_group = [sum(1 for i in idxs if i // size == g) for g in range(module.num_groups)]
        whole = all(n in (0, size) for n in per_group)
        even = len(set(per_group)) == 1
        if (candidate.layout == "blocks" and not whole) or (candidate.layout == "even" and not even):
            return (f"the channels it would remove do not line up with the {module.num_groups} groups of "
                    f"{describe(module, names)} (a concatenation at an offset?)")
    return None


def prune_groups(model: nn.Module, graph, importance, *, ratio: float, round_to: int, global_pruning: bool,
                 ignored: list[nn.Module]) -> tuple[int, dict[str, str]]:
    """Prune `ratio` of the channels of every dependency group of `graph` (see the module docstring).

    Args:
        model: the model `graph` was built on; pruned in place.
        graph: a `torch_pruning.DependencyGraph` of `model`.
        importance: a Torch-Pruning group importance (group -> float [channels], higher = keep).
        ratio: fraction of each group's channels (or, global, of all channels) to remove, in (0, 1).
        round_to: kept widths are multiples of this (as far as each group's units allow).
        global_pruning: rank units across groups instead of within each.
        ignored: layers whose output channels are kept (and their submodules).

    Returns:
        (number of groups pruned, {layer name: why its group was left whole}).
    """
    names = {id(m): n for n, m in model.named_modules()}
    ignored = [sub for m in ignored for sub in m.modules()]
    candidates: list[Candidate] = []
    left: dict[str, str] = {}
    for group in list(graph.get_all_groups(ignored_layers=ignored, root_module_types=PRUNABLE)):
        candidate, why = _candidate(graph, group, importance, round_to, names)
        if candidate is not None:
            candidates.append(candidate)
        elif why:
            for item in group:
                module = item.dep.target.module
                if isinstance(module, PRUNABLE) and graph.is_out_channel_pruning_fn(item.dep.handler):
                    left[names.get(id(module), "?")] = why
    removals = _removals(candidates, ratio, global_pruning)
    pruned = 0
    for candidate, remove in zip(candidates, removals, strict=True):
        name = names.get(id(candidate.root), "?")
        keep = candidate.kept_units(remove)
        if keep >= candidate.num_units:
            if candidate.num_units > 1 and remove:
                multiple = candidate.step * candidate.unit_width
                structure = {"blocks": " (whole GroupNorm groups)", "even": " (as many from each group)"}.get(candidate.layout, "")
                left[name] = f"{candidate.width} channels, kept in multiples of {multiple}{structure}: none can go at this ratio"
            continue
        units = candidate.importance.argsort()[:candidate.num_units - keep].tolist()
        pruning_group = graph.get_pruning_group(candidate.root, candidate.handler, candidate.channels(units))
        why = _aligned(pruning_group, candidate, names)
        if why is None and not graph.check_pruning_group(pruning_group):
            why = "pruning it would remove every channel of a coupled layer"
        if why:
            left[name] = why
            continue
        pruning_group.prune()
        pruned += 1
        if candidate.layout == "blocks":  # whole groups went: the group count shrinks, each group keeps its channels
            for norm, size in candidate.norms:
                norm.num_groups = norm.num_channels // size
    return pruned, left


def _removals(candidates: list[Candidate], ratio: float, global_pruning: bool) -> list[int]:
    """Units to remove from each candidate before rounding: `ratio` of its units (local), or the units
    under one importance threshold that removes `ratio` of all channels (global)."""
    if not global_pruning:
        return [candidate.num_units - int(candidate.num_units * (1.0 - ratio)) for candidate in candidates]
    units = sorted((float(score), c.unit_width, i) for i, c in enumerate(candidates) for score in c.importance)
    target = ratio * sum(c.width for c in candidates)
    removed, threshold = 0, -math.inf
    for score, width, _ in units:
        if removed >= target:
            break
        removed, threshold = removed + width, score
    return [int((c.importance <= threshold).sum()) for c in candidates]
