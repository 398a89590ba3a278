"""The branch finder: regions of independent branches in a torch.fx graph (see `concurrent_streams`,
which runs them on their own CUDA streams, for the method and its sources)."""

from __future__ import annotations

import inspect
import operator
import os
from dataclasses import dataclass, field

import torch
from torch import fx, nn

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
