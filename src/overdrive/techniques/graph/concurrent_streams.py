"""Concurrent streams: independent branches of the computation graph run on their own CUDA streams.

A multi-tower, multi-head or Inception-style model has siblings with no data path between them.
On one stream the GPU runs their kernels one after another; when each kernel is too small to fill
the device (small batches, narrow branches), running the siblings on separate streams lets them
overlap (as TensorFlow's and TVM's inter-operator parallelism do, and as "IOS: Inter-Operator
Scheduler for CNN Acceleration", Ding et al., MLSys 2021, measures).

**Finding the branches** (`find_regions`, CPU-only logic, on a `torch.fx` trace):
1. A *fork* is a node whose output has two or more users (or, for a model with several inputs,
   the inputs taken together).
2. Its *join* is its immediate post-dominator: the first node every path from the fork to the
   output passes through (Cooper, Harvey and Kennedy's iterative dominator algorithm, on the
   reversed graph).
3. The nodes between them (descendants of the fork before the join) are labelled in graph order:
   a node reading no other node of the region starts a chain, a node reading one chain continues it,
   and a node reading two chains (an add of two heads) is *merged* and runs after the branches.
   Chains that do real work (a module with parameters, or a matmul / convolution / linear call) are
   the *branches*; light chains (a mean, a reshape) stay on the main stream. A region with two or
   more branches is kept; regions do not overlap (one level of streams).
4. Running branches concurrently reorders them, so a region is passed over when anything between its
   fork and join writes in place into a tensor (directly or through a view) that is not made and read
   only inside the writer's own branch: `h.clamp_()` on the fork's output between two heads would
   otherwise be seen by a head that ran before it. Writes inside one branch (`F.relu(x, inplace=True)`
   on that branch's own activations) are fine.

**Running them** (`StreamedGraph`): the traced graph is reordered so each branch's nodes are
contiguous, and four calls are inserted per region: `fork` records an event on the main stream;
`enter(k)` makes stream k current and waits for that event; `leave(k)` records stream k's event
and makes the main stream current again; `join` makes the main stream wait for every branch's event.
Tensors that cross streams are marked with `Tensor.record_stream` so the caching allocator never
hands their memory to another stream while one still reads it. The math is unchanged (lossless),
and the speed gate judges whether the overlap pays on this device.

On the CPU the same rewritten graph runs with recording stand-ins for the streams (`fake=True`),
which the tests use to check which node ran on which stream.
"""

from __future__ import annotations

import copy
import inspect
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx, nn

from overdrive.core.errors import one_line
from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register
from overdrive.techniques.graph.branches import Region, find_regions
from overdrive.techniques.runtime.cuda_graphs import tensors_in
from overdrive.workloads.signature import SignatureModel

class StreamOps(nn.Module):
    """The stream switches of one region (see the module docstring), called from the rewritten graph
    as `ops("fork")`, `ops("enter", k, *read)`, `ops("leave", k)`, `ops("join", *crossing)`. With `fake`
    (CPU, tests) the streams are names, every switch is appended to `log` and `current` names the
    stream running now."""

    def __init__(self, num_branches: int, device: torch.device, fake: bool = False):
        super().__init__()
        self.fake = fake
        self.device = torch.device(device)
        self.streams = [f"side{k}" for k in range(num_branches)] if fake else \
            [torch.cuda.Stream(device=self.device) for _ in range(num_branches)]
        self.log: list[tuple] = []
        self.current = "main"
        self._main = None
        self._fork_event = None
        self._events: list = [None] * num_branches

    def forward(self, op: str, *args) -> None:
        if self.fake:
            self.log.append((op, *args[:1]) if op in ("enter", "leave") else (op,))
            self.current = self.streams[args[0]] if op == "enter" else "main"
            return
        if op == "fork":  # every branch starts after the main stream's work so far
            self._main = torch.cuda.current_stream(self.device)
            self._fork_event = self._main.record_event()
        elif op == "enter":
            k, reads = args[0], args[1:]
            stream = self.streams[k]
            stream.wait_event(self._fork_event)
            torch.cuda.set_stream(stream)
            for tensor in reads:  # made on the main stream, read on stream k: not reused before k is done
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    tensor.record_stream(stream)
        elif op == "leave":
            self._events[args[0]] = self.streams[args[0]].record_event()
            torch.cuda.set_stream(self._main)
        elif op == "join":
            for event in self._events:
                self._main.wait_event(event)
            for tensor in args:  # made on a side stream, read on the main one
                if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
                    tensor.record_stream(self._main)


def _reads(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes `nodes` read that they do not hold, in graph order of first read."""
    inside, out = set(nodes), []

    def note(n: fx.Node):
        if n not in inside and n not in out:
            out.append(n)

    for node in nodes:
        fx.node.map_arg((node.args, node.kwargs), note)
    return out


def trace(model: nn.Module, supplied: int | tuple[str, ...]) -> fx.GraphModule:
    """`model` traced by torch.fx, with the parameters the caller never passes (beyond `supplied`: a
    count of positional inputs, or their names) fixed at their defaults, as the model runs them.

    Raises:
        RuntimeError: fx cannot trace it.
    """
    params = list(inspect.signature(model.forward).parameters.values())
    given = set(supplied) if isinstance(supplied, tuple) else {p.name for p in params[:supplied]}
    concrete = {p.name: p.default for p in params
                if p.name not in given and p.default is not inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    try:
        return fx.symbolic_trace(model, concrete_args=concrete or None)
    except Exception as exc:  # noqa: BLE001 - data-dependent control flow, untraceable calls
        raise RuntimeError(f"torch.fx could not trace the model: {one_line(exc)}") from None


def streamed_graph(model: nn.Module, device: torch.device, *, fake: bool = False,
                   supplied: int | tuple[str, ...] | None = None) -> tuple[fx.GraphModule, list[Region]]:
    """`model` traced and rewritten so each region's branches run on their own streams: the branches'
    nodes move, in order, to just before the join (only merged nodes read them, and those move after
    them), each between `enter(k)` and `leave(k)`, after one `fork`; then the `join` wait, then the
    merged nodes.

    Args:
        supplied: the inputs the caller passes (a count, or names); the other parameters are traced at
            their defaults. None: all of them.

    Raises:
        RuntimeError: torch.fx cannot trace the model, or it has no independent branches.
    """
    gm = trace(model, supplied if supplied is not None else len(inspect.signature(model.forward).parameters))
    regions = find_regions(gm)
    if not regions:
        raise RuntimeError("no independent branches (siblings with no data path between them)")
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    for index, region in enumerate(regions):
        name = f"overdrive_streams_{index}"
        gm.add_submodule(name, StreamOps(len(region.branches), device, fake=fake))
        join = by_name[region.join]
        members = {n for b in region.branches for n in b}
        with graph.inserting_before(join):
            graph.call_module(name, ("fork",))
        for k, branch in enumerate(region.branches):
            with graph.inserting_before(join):
                graph.call_module(name, ("enter", k, *_reads(branch)))
            for node in branch:
                join.prepend(node)
            with graph.inserting_before(join):
                graph.call_module(name, ("leave", k))
        crossing = [n for b in region.branches for n in b if any(u not in members for u in n.users)]
        with graph.inserting_before(join):
            graph.call_module(name, ("join", *crossing))
        for node in region.merged:  # after the join's wait, in graph order
            join.prepend(node)
    graph.lint()
    gm.recompile()
    return gm, regions


@dataclass(frozen=True, kw_only=True)
class ConcurrentStreamsConfig(TechniqueConfig):
    name: ClassVar[str] = "concurrent-streams"


class StreamedModel(ForwardWrapper):
    """The rewritten graph, run with the caller's stream restored afterwards whatever happens
    (`inner` is the `fx.GraphModule`; `regions` what was found). Calls are serialised: the regions'
    events belong to one call at a time (serve's instance threads may share the model)."""

    def __init__(self, inner: fx.GraphModule, regions: list[Region], device: torch.device):
        super().__init__(inner)
        self.regions = regions
        self.device = torch.device(device)
        self._lock = threading.Lock()

    def forward(self, *args, **kwargs):
        if self.device.type != "cuda":
            return self.inner(*args, **kwargs)
        with self._lock, torch.cuda.stream(torch.cuda.current_stream(self.device)):  # restores the stream on exit
            return self.inner(*args, **kwargs)


def _users_module(model: nn.Module, workload: Workload) -> tuple[nn.Module, int | tuple[str, ...]]:
    """The module to trace and the inputs it is given: inside overdrive's keyword-input / structured-output
    wrapper, the user's module and the names passed; else the model and the count of its inputs."""
    if isinstance(model, SignatureModel):
        return model.model, model.input_names or len(workload.collate(workload.samples[:1]))
    return model, len(workload.collate(workload.samples[:1]))


def _parent_of(model: nn.Module, target: nn.Module) -> nn.Module:
    """The ForwardWrapper in `model`'s chain whose `inner` is `target`."""
    while model.inner is not target:
        model = model.inner
    return model


def _check_against_eager(streamed: nn.Module, reference: nn.Module, workload: Workload, device: torch.device) -> None:
    """The rewritten model must give `reference`'s (the same model before the rewrite, inside the same
    wrappers' reach) outputs on the workload's first rows: torch.fx
    records one run of the Python code, and a forward whose work is not all in its graph (a write into
    a buffer outside any traced value, an augmented assignment fx records as a new tensor) would
    otherwise change answers silently.

    Raises:
        RuntimeError: the outputs differ (the largest difference named).
    """
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t
                   for t in workload.collate(workload.samples[: min(4, len(workload.samples))]))
    with torch.no_grad():
        want, got = reference(*inputs), streamed(*inputs)
    wants, gots = tensors_in(want), tensors_in(got)
    if len(wants) != len(gots) or any(w.shape != g.shape or not torch.allclose(w.float(), g.float(), rtol=1e-5, atol=1e-6)
                                      for w, g in zip(wants, gots)):
        worst = max(((w.float() - g.float()).abs().max().item() for w, g in zip(wants, gots) if w.shape == g.shape),
                    default=float("nan"))
        raise RuntimeError(f"the traced graph does not reproduce the model (largest difference {worst:.3g}): its forward "
                           "does work torch.fx does not record (a write into a buffer, an in-place update fx records as "
                           "a new tensor)")


def describe_regions(regions: list[Region]) -> str:
    shown = "; ".join(r.describe() for r in regions[:4]) + ("; …" if len(regions) > 4 else "")
    return f"{len(regions)} regions, {sum(len(r.branches) for r in regions)} branches: {shown}"


@register
class ConcurrentStreams(Technique):
    """Independent branches on their own CUDA streams (see the module docstring)."""

    config_cls = ConcurrentStreamsConfig
    stage = Stage.GRAPH
    lossless = True
    devices = ("cuda",)
    rewrites_modules = True
    description = "independent branches (multi-tower, multi-head, Inception) on their own CUDA streams"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        model, supplied = _users_module(copy.deepcopy(workload.model), workload)  # tracing runs its code: a copy
        try:
            regions = find_regions(trace(model, supplied))
        except RuntimeError as exc:
            return f"not applicable: {exc}"
        return None if regions else "not applicable: no independent branches (siblings with no data path between them)"

    def apply(self, model, config, *, workload, device):
        holder, attribute = model, None
        while isinstance(holder, ForwardWrapper) and not isinstance(holder, StreamedModel):  # autocast / layout wrappers
            holder, attribute = holder.inner, "inner"
        parent = model if attribute is None else _parent_of(model, holder)
        reference = copy.deepcopy(holder)  # before tracing, which runs the forward's Python once
        user, supplied = _users_module(holder, workload)
        gm, regions = streamed_graph(user, device, fake=device.type != "cuda", supplied=supplied)
        streamed = StreamedModel(gm, regions, device)
        if user is not holder:  # the user's module inside keyword inputs / structured outputs
            holder.model = streamed
            streamed = holder
        _check_against_eager(streamed, reference, workload, device)
        if attribute is not None:
            parent.inner = streamed
            streamed = model
        streamed.overdrive_report = {"technique": self.name, "regions": describe_regions(regions)}
        return streamed

    def describe_report(self, report, fidelity_key):
        return f"concurrent-streams: {report['regions']}"
