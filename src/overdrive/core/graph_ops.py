"""What a torch.export program's graph holds, for checks that cannot look for nn.Module types.

`torch.export.load(...).module()` is an `fx.GraphModule` whose layers are gone: a convolution
is a `call_function` node targeting `aten.conv2d.default`, not an `nn.Conv2d`. Techniques and
checks that ask "does the model have convolutions / batch norms / dropout in training mode?"
read the graph through these helpers instead of `model.modules()`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from torch import fx, nn


def is_graph_program(model: nn.Module) -> bool:
    """True for an fx.GraphModule (a torch.export program's `.module()`, or an fx-traced model)."""
    return isinstance(model, fx.GraphModule)


def op_name(target) -> str:
    """`aten.conv2d.default` -> "conv2d"; `aten.add_.Tensor` -> "add_"; a Python callable -> its name."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return getattr(packet, "__name__", str(packet)).split(".")[-1]
    return getattr(target, "__name__", str(target))


def call_nodes(model: nn.Module) -> Iterator[fx.Node]:
    """Every `call_function` node of the graphs in `model` (its own and its submodules' graphs)."""
    for module in model.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                if node.op == "call_function":
                    yield node


def aten_op_counts(model: nn.Module) -> Counter[str]:
    """How many times each op is called in the graphs of `model`, by `op_name` (empty when the
    model holds no fx graph)."""
    return Counter(op_name(node.target) for node in call_nodes(model))


def count_ops(model: nn.Module, *names: str) -> int:
    """Calls in the graphs of `model` of any op named in `names` (e.g. "conv2d", "convolution")."""
    counts = aten_op_counts(model)
    return sum(counts[n] for n in names)


def _scalar_arg(node: fx.Node, position: int, name: str, default=None):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


_DROPOUT = ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")
_BATCH_NORM = ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm", "_batch_norm_impl_index")
_BATCH_STATS = ("_native_batch_norm_legit_functional", "_batch_norm_with_update")


def _training_kind(node: fx.Node) -> str | None:
    """"dropout (train=True)" / "batch_norm (training=True)" / ... for a node that behaves
    differently in training mode, else None."""
    name = op_name(node.target)
    if name in _DROPOUT and _scalar_arg(node, 2, "train", True) and (_scalar_arg(node, 1, "p", 0.0) or 0.0) > 0:
        return f"{name} (train=True)"
    if name in _BATCH_NORM and _scalar_arg(node, 5, "training", False) is True:
        return f"{name} (training=True)"
    if name in _BATCH_STATS:
        return f"{name} (batch statistics)"
    return None


def training_mode_ops(model: nn.Module) -> list[str]:
    """The graph ops of `model` that run in training mode, one description per kind with its
    count: dropout with `train=True`, batch norm with `training=True` (batch statistics and a
    running-statistics update). A program exported in train mode keeps them whatever
    `.eval()` says (torch.export's module refuses `.eval()`)."""
    found = Counter(kind for node in call_nodes(model) if (kind := _training_kind(node)))
    return [f"{count} × aten.{what}" for what, count in found.items()]


def to_eval_ops(model: nn.Module) -> list[str]:
    """Switch the training-mode ops of `model`'s graphs to their eval-mode form, in place: what
    `model.eval()` does for modules, for a torch.export program exported in train mode. Dropout
    (`aten.dropout`, train=True) becomes the identity and batch norm (`aten.batch_norm`,
    training=True) uses its running statistics and no longer updates them.

    Returns:
        The descriptions `training_mode_ops` gave before (empty when nothing changed).

    Raises:
        RuntimeError: a training-mode op this cannot rewrite (another dropout kind, a functional
            batch norm that returns its updated statistics), named; the graph is then unchanged.
    """
    nodes = [(node, _training_kind(node)) for node in call_nodes(model)]
    nodes = [(node, kind) for node, kind in nodes if kind]
    for node, kind in nodes:
        if op_name(node.target) not in ("dropout", "batch_norm"):
            raise RuntimeError(f"cannot switch aten.{kind} to eval mode in the graph; export the model after model.eval()")
    found = training_mode_ops(model)
    for node, _ in nodes:
        if op_name(node.target) == "dropout":
            node.replace_all_uses_with(node.args[0])
            node.graph.erase_node(node)
        elif len(node.args) > 5:
            node.args = (*node.args[:5], False, *node.args[6:])
        else:
            node.kwargs = {**node.kwargs, "training": False}
    for module in model.modules():
        if isinstance(module, fx.GraphModule) and nodes:
            module.graph.lint()
            module.recompile()
    return found


def training_mode_modules(model: nn.Module) -> list[str]:
    """Names of dropout and batch-norm modules of `model` that are in training mode (p > 0 for dropout)."""
    dropout = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
    norms = (nn.modules.batchnorm._BatchNorm,)
    names = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, dropout) and module.p > 0 or isinstance(module, norms):
            names.append(name or type(module).__name__)
    return names
