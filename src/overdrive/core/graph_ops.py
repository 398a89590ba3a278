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


def training_mode_ops(model: nn.Module) -> list[str]:
    """The graph ops of `model` that run in training mode, one description per kind with its
    count: dropout with `train=True`, batch norm with `training=True` (batch statistics and a
    running-statistics update). A program exported in train mode keeps them whatever
    `.eval()` says (torch.export's module refuses `.eval()`)."""
    found: Counter[str] = Counter()
    for node in call_nodes(model):
        name = op_name(node.target)
        if name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"):
            if _scalar_arg(node, 2, "train", True) and (_scalar_arg(node, 1, "p", 0.0) or 0.0) > 0:
                found[f"{name} (train=True)"] += 1
        elif name in ("batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm",
                      "_batch_norm_impl_index"):
            if _scalar_arg(node, 5, "training", False) is True:
                found[f"{name} (training=True)"] += 1
        elif name == "_native_batch_norm_legit_functional" or name == "_batch_norm_with_update":
            found[f"{name} (batch statistics)"] += 1
    return [f"{count} × aten.{what}" for what, count in found.items()]


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


