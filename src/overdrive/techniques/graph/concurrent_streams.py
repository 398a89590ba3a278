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
import operator
import os
import threading
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import fx, nn

from overdrive.core.errors import one_line
from overdrive.core.workload import Workload
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register
from overdrive.techniques.runtime.cuda_graphs import tensors_in
from overdrive.workloads.signature import SignatureModel

_HEAVY_FUNCTIONS = {torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.einsum, operator.matmul,
                    torch.nn.functional.linear, torch.nn.functional.conv1d, torch.nn.functional.conv2d,
                    torch.nn.functional.conv3d, torch.nn.functional.scaled_dot_product_attention, torch.conv2d}
_HEAVY_METHODS = {"matmul", "mm", "bmm"}
_SOURCE = "<inputs>"


@dataclass
class Region:
    """A fork, its join and the independent branches between them.

    Attributes:
        fork: the node whose output the branches share (`<inputs>` for a model's several inputs).
        join: the first node after the fork that every path passes through.
        branches: each branch's nodes, in graph order.
        names: each branch's name (the module path its layer calls share).
        merged: nodes between the fork and the join that read two branches (or a merged node), in graph
            order: they run after the branches, on the main stream.
    """

    fork: str
    join: str
    branches: list[list[fx.Node]]
    names: list[str] = field(default_factory=list)
    merged: list[fx.Node] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.fork} → {self.join}: {len(self.branches)} branches ({', '.join(self.names)})"


def _heavy(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return any(True for _ in modules[node.target].parameters())
    if node.op == "call_function":
        return node.target in _HEAVY_FUNCTIONS
    return node.op == "call_method" and node.target in _HEAVY_METHODS


# Calls that always return a new tensor (never their input or a view of it). Every other call is assumed to
# possibly return its first argument or an alias of it (views, `.to()` / `.float()` / `.type_as()` of a tensor
# already so, `.data`, an in-place module's output), so a write through it reaches that argument.
_FRESH_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.matmul,
                    operator.neg, operator.pow, torch.add, torch.sub, torch.mul, torch.div, torch.matmul, torch.mm,
                    torch.bmm, torch.cat, torch.stack, torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.softmax,
                    torch.sum, torch.mean, torch.clone, torch.nn.functional.linear, torch.nn.functional.conv1d,
                    torch.nn.functional.conv2d, torch.nn.functional.conv3d, torch.nn.functional.gelu,
                    torch.nn.functional.softmax, torch.nn.functional.layer_norm, torch.nn.functional.max_pool2d,
                    torch.nn.functional.avg_pool2d, torch.nn.functional.adaptive_avg_pool2d}
_FRESH_METHODS = {"add", "sub", "mul", "div", "matmul", "sum", "mean", "softmax", "clone", "exp", "sigmoid", "tanh",
                  "__add__", "__sub__", "__mul__", "__truediv__", "__matmul__", "__neg__", "pow"}


def _writes_into(node: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The node whose tensor `node` writes into (an in-place method or function, `inplace=True`, an
    `out=`, an item assignment, an in-place module), or None."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_method":
        return first if node.target.endswith("_") and not node.target.endswith("__") else None
    if node.op == "call_module":
        return first if getattr(modules[node.target], "inplace", False) is True else None
    if node.op != "call_function":
        return None
    if isinstance(node.kwargs.get("out"), fx.Node):
        return node.kwargs["out"]
    name = getattr(node.target, "__name__", "")
    if node.target is operator.setitem or (name.endswith("_") and not name.startswith("__")):
        return first
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):  # builtins without a signature, calls that do not bind
        return None
    return first if bound.get("inplace") is True else None


def _fresh(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether `node`'s output is a new tensor, never its input or an alias of it (see `_FRESH_FUNCTIONS`)."""
    if node.op == "call_module":
        module = modules[node.target]
        return not isinstance(module, nn.Identity) and getattr(module, "inplace", False) is not True
    if node.op == "call_function":
        if node.target not in _FRESH_FUNCTIONS:
            return False
        try:
            return inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments.get("inplace") is not True
        except (TypeError, ValueError):
            return True
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return True  # placeholders, attributes: roots


def _aliases(node: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """`node` and the nodes whose tensor it may be, back through every call not known to return a new
    tensor (`_fresh`), itself first."""
    chain = [node]
    while not _fresh(node, modules) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        chain.append(node)
    return chain


def _unsafe_write(span: list[fx.Node], branches: list[list[fx.Node]], modules: dict[str, nn.Module]) -> fx.Node | None:
    """A node between the fork and the join that writes into a tensor the reordering could expose: one
    not made, and read only, inside the writer's own branch. None when every write is branch-local."""
    branch_of = {n: k for k, b in enumerate(branches) for n in b}
    for node in span:
        target = _writes_into(node, modules)
        if target is None:
            continue
        k = branch_of.get(node)
        local = k is not None and all(branch_of.get(a) == k and all(branch_of.get(u) == k for u in a.users)
                                      for a in _aliases(target, modules))
        if not local:
            return node
    return None


def _immediate_post_dominators(nodes: list, users: dict, order: dict, exit_node) -> dict:
    """ipdom of every node (keyed as in `users`), in one pass over the nodes in reverse topological
    order (a DAG: each node's users are done before it). `exit_node` (the output) is its own; a node
    nothing uses (dead code) is post-dominated by the exit."""
    ipdom = {exit_node: exit_node}

    def intersect(a, b):
        while a is not b:
            while order[a] < order[b]:
                a = ipdom[a]
            while order[b] < order[a]:
                b = ipdom[b]
        return a

    for node in reversed(nodes):
        succ = users[node]
        if node is exit_node:
            continue
        if not succ:
            ipdom[node] = exit_node
            continue
        common = succ[0]
        for other in succ[1:]:
            common = intersect(common, other)
        ipdom[node] = common
    return ipdom


def _branch_name(branch: list[fx.Node]) -> str:
    """The longest module path the branch's module calls share (its first call's when they share none)."""
    targets = [n.target.split(".") for n in branch if n.op == "call_module"]
    if not targets:
        return branch[0].name
    prefix = targets[0]
    for parts in targets[1:]:
        keep = 0
        while keep < min(len(prefix), len(parts)) and prefix[keep] == parts[keep]:
            keep += 1
        prefix = prefix[:keep]
    return ".".join(prefix) or ".".join(targets[0])


def _branch_names(branches: list[list[fx.Node]]) -> list[str]:
    """Each branch's name: the module path its layer calls share, or where two branches would share a
    name, its first and last module calls ("Mixed_5b.branch5x5_1…branch5x5_2")."""
    names = [_branch_name(b) for b in branches]
    if len(set(names)) == len(names):
        return names
    out = []
    for branch in branches:
        calls = [n.target for n in branch if n.op == "call_module"] or [n.name for n in branch]
        last = calls[-1][len(os.path.commonprefix([calls[0], calls[-1]])):] if len(calls) > 1 else ""
        name = calls[0] + (f"…{last}" if last else "")
        out.append(name if name not in out else f"{name} (call {sum(o.split(' (call')[0] == name for o in out) + 1})")
    return out


def find_regions(gm: fx.GraphModule) -> list[Region]:
    """The regions of independent branches in a traced model (see the module docstring), outermost
    first, none inside another's branches. The graph is not changed."""
    modules = dict(gm.named_modules())
    graph_nodes = [n for n in gm.graph.nodes]
    source = object()  # the virtual fork of a model's several inputs
    placeholders = [n for n in graph_nodes if n.op == "placeholder"]
    nodes = [source, *graph_nodes]
    order = {n: i for i, n in enumerate(nodes)}
    users = {n: [u for u in n.users] for n in graph_nodes}
    users[source] = placeholders
    exit_node = next(n for n in reversed(graph_nodes) if n.op == "output")
    ipdom = _immediate_post_dominators(nodes, users, order, exit_node)

    def descendants_before(fork, end):
        seen, stack = set(), list(users[fork])
        while stack:
            node = stack.pop()
            if node in seen or order[node] >= order[end]:
                continue
            seen.add(node)
            stack.extend(users[node])
        return seen

    regions: list[Region] = []
    kept_until = -1  # regions do not overlap: a fork inside the last kept region's span is passed over
    forks = [source] if len(placeholders) > 1 else []
    forks += [n for n in graph_nodes if len(users[n]) > 1 and n.op not in ("get_attr", "output")]
    for fork in forks:
        join = ipdom[fork]
        if join is fork or order[fork] < kept_until:
            continue
        inside = descendants_before(fork, join) - ({source} | set(placeholders) if fork is source else set())
        inside = {n for n in inside if n.op not in ("get_attr", "placeholder")}
        # Label propagation in graph order: a node reading no region node starts a chain; one reading
        # one chain continues it; one reading two chains (or a merged node) is merged: it runs after
        # the branches, on the main stream.
        label: dict = {}
        merged: list = []
        for node in sorted(inside, key=order.__getitem__):
            read = [a for a in node.all_input_nodes if a in inside]
            chains = {label[a] for a in read if a in label}
            if any(a not in label for a in read) or len(chains) > 1:
                merged.append(node)
            else:
                label[node] = chains.pop() if chains else node
        chains_of: dict = {}
        for node in sorted(label, key=order.__getitem__):
            chains_of.setdefault(label[node], []).append(node)
        branches = [c for c in chains_of.values() if any(_heavy(n, modules) for n in c)]
        if len(branches) < 2:
            continue
        span = [n for n in graph_nodes if order[fork] < order[n] < order[join]]
        if _unsafe_write(span, branches, modules) is not None:
            continue  # moving the branches past that write would change what they read
        regions.append(Region(fork=_SOURCE if fork is source else fork.name, join=join.name, branches=branches,
                              names=_branch_names(branches), merged=merged))
        kept_until = order[join]
    return regions


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
