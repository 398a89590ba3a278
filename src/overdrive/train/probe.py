"""Which parameters the objective reaches, found by probing a few training batches before data
parallelism wraps the model.

DDP and FSDP reduce each parameter's gradient across the ranks every step, and each rank must
offer the same parameters: one that no rank's forward reaches leaves DDP waiting for its
gradient ("Expected to have finished reduction"), and one that some ranks reach and others do
not (a branch that depends on the data) does the same, or under FSDP mismatches the ranks'
reduce-scatters. So before wrapping, every rank runs the forward pass of its first
`NUM_PROBE_BATCHES` micro-batches of the real batch size, finds in each loss's autograd graph the
parameters it would give gradients (the walk DDP's `find_unused_parameters` does; no backward
runs), and the ranks sum, per parameter, the batches that reached it:

- reached by none: frozen (`requires_grad` off) and listed in the summary; no step would train
  it (unless a later batch reaches it: then it stays untrained, and the list says so);
- reached by some batches but not all: the branch depends on the data, so DDP's
  `find_unused_parameters` (FSDP2: `set_reduce_scatter_unused_params`) is turned on and the
  summary says so; such a parameter is never frozen. In a step no rank reached it, DDP leaves
  its gradient None (AdamW skips it, as one process would); FSDP2 reduces a zero gradient, which
  AdamW would still move by its momentum, so `UnreachedGrads` drops that gradient.

The probe leaves no trace: it computes no gradients, and buffers (BatchNorm's running statistics
and batch count) and the RNG state (CPU, and the model's CUDA device) are restored. Pipeline and
tensor parallelism need no probe: their ranks form one replica and see the same batch, and a
parameter without a gradient is simply skipped by the optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.errors import ConfigError, arg
from overdrive.core.workload import Workload

NUM_PROBE_BATCHES = 4  # per rank: with dp ranks, dp × 4 batches in all


def reached_leaves(loss: torch.Tensor) -> set[int]:
    """The ids of the leaf tensors (parameters) whose gradients `loss`'s autograd graph reaches:
    its AccumulateGrad nodes, found by walking `grad_fn.next_functions` from the loss, as DDP's
    `find_unused_parameters` walks the graph after each forward."""
    reached: set[int] = set()
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)  # an AccumulateGrad node
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def probe_parameter_use(model: nn.Module, workload: Workload, objective, batches: Sequence[Sequence[int]],
                        device: torch.device) -> dict[str, int]:
    """For each trainable parameter, how many of `batches` (lists of training-sample indices)
    reach it through `objective`: forward passes only, each loss's autograd graph walked for the
    parameters it would give gradients (`reached_leaves`). Activations are not kept (a saved-tensor
    hook drops them: no backward runs). Runs in the model's current mode; leaves no trace.

    Returns:
        {parameter name: number of batches that reached it}, in `named_parameters` order.
    """
    from overdrive.train.data import train_inputs

    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    buffers = [(b, b.clone()) for b in model.buffers()]
    counts = dict.fromkeys((name for name, _ in named), 0)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for idx in batches:
                inputs = train_inputs(workload, list(idx), device)
                target = objective.target(list(idx), inputs, device)
                with torch.autograd.graph.saved_tensors_hooks(lambda _t: None, lambda _packed: None):
                    reached = reached_leaves(objective(model(*inputs), target))
                for name, p in named:
                    counts[name] += id(p) in reached
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    return counts


@dataclass(frozen=True, kw_only=True)
class ParameterUse:
    """What the probe decided: parameters to freeze, those whose use varies, and whether the
    data-parallel wrapper must find unused parameters each step; `note` says so in words."""

    frozen: list[str]
    varying: list[str]
    find_unused_parameters: bool
    note: str | None = None


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def plan_parameter_use(counts: dict[str, int], *, num_probes: int, strategy: str,
                       requested: bool | None) -> ParameterUse:
    """Decide from `probe_parameter_use` counts summed over ranks (`num_probes` batches in all).

    Args:
        strategy: "ddp" and "fsdp" act on the counts; other strategies freeze nothing.
        requested: `TrainConfig.find_unused_parameters` (None: decide from the counts).

    Raises:
        ConfigError: `requested` is False but some parameters were reached by only some batches.
    """
    wrapper = {"ddp": "DDP's find_unused_parameters", "fsdp": "FSDP's reduce-scatter of unused parameters"}.get(strategy)
    if wrapper is None:
        return ParameterUse(frozen=[], varying=[], find_unused_parameters=False)
    if requested:
        return ParameterUse(frozen=[], varying=[], find_unused_parameters=True,
                            note=f"{wrapper} is on, as asked; no parameter is frozen")
    never = sorted(name for name, c in counts.items() if c == 0)
    varying = sorted(name for name, c in counts.items() if 0 < c < num_probes)
    if varying and requested is False:
        raise ConfigError(f"{_names(varying)} were reached by only some of {num_probes} probe batches (a branch that "
                          f"depends on the data), which {arg('strategy', strategy)} cannot reduce with "
                          f"{arg('find_unused_parameters', False)}; leave it unset or set {arg('find_unused_parameters')}")
    if not varying:
        return ParameterUse(frozen=never, varying=[], find_unused_parameters=False)
    return ParameterUse(frozen=never, varying=varying, find_unused_parameters=True,
                        note=f"{wrapper} is on: {_names(varying)} were reached by only some of {num_probes} probe "
                             "batches (a branch that depends on the data), so each step reduces a zero gradient for "
                             "what a rank did not reach")


class UnreachedGrads:
    """Drops, after a step's backward passes, the gradients of `varying` parameters that no rank
    reached in the step: FSDP2 reduces zeros for them, and AdamW would move a parameter with a
    zero gradient by its momentum where one process skips it. A parameter counts as reached when
    the module holding it ran a forward (a forward pre-hook counts the calls).

    Args:
        model: the model, wrapped or not (parameter names as in `named_parameters`).
        varying: `ParameterUse.varying`.
    """

    def __init__(self, model: nn.Module, varying: list[str]):
        wanted = set(varying)
        self.groups: list[list[nn.Parameter]] = []
        self.handles = []
        for prefix, module in model.named_modules():
            own = [p for name, p in module.named_parameters(prefix=prefix, recurse=False) if name in wanted]
            if own:
                self.handles.append(module.register_forward_pre_hook(self._count(len(self.groups))))
                self.groups.append(own)
        self.calls = [0] * len(self.groups)

    def _count(self, i: int):
        def hook(_module, _args):
            self.calls[i] += 1

        return hook

    def drop(self, device: torch.device) -> None:
        """Sum this step's calls over the ranks, set the gradients of modules no rank ran to None,
        and start counting the next step."""
        if not self.groups:
            return
        calls = torch.tensor(self.calls, dtype=torch.int64, device=device)
        dist.all_reduce(calls)
        for count, params in zip(calls.tolist(), self.groups, strict=True):
            if count == 0:
                for p in params:
                    p.grad = None
        self.calls = [0] * len(self.groups)
