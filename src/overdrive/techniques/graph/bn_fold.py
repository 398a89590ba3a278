"""BatchNorm folding: a graph rewrite that keeps the math (eval mode only).

Each eval-mode BatchNorm that reads nothing but a convolution's (or a Linear's) output is folded
into it: W' = W·γ/σ, b' = (b − μ)·γ/σ + β, with σ = sqrt(running_var + eps), and the BatchNorm
is removed. Two kinds of model are folded:

- an nn.Module: traced with torch.fx; a BatchNorm module called on the output of an nn.Conv1d/2d/3d
  (BatchNorm of the same dimension) or of an nn.Linear with a 2-D output (BatchNorm1d over its
  features) is folded into a copy of that layer. A layer module called more than once is left
  alone (its other calls would get the folded weights), as are subclasses of the layer types
  (their forward may transform the weight, e.g. weight standardisation).
- a torch.export program (an fx graph of aten ops: `aten.conv2d` → `aten.batch_norm` with
  `training=False` and constant running statistics): the graph is rewritten in place, the conv
  node reading new folded weight attributes and the batch-norm node removed.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import fx, nn
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from overdrive.core.errors import one_line
from overdrive.core.graph_ops import count_ops, op_name, training_mode_ops
from overdrive.core.workload import Workload, eval_mode
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV_FOR_BN = {nn.BatchNorm1d: (nn.Conv1d, nn.Linear), nn.BatchNorm2d: (nn.Conv2d,), nn.BatchNorm3d: (nn.Conv3d,)}
_GRAPH_BN_OPS = ("batch_norm", "_native_batch_norm_legit_no_training")
_GRAPH_LAYER_OPS = ("conv1d", "conv2d", "conv3d", "convolution", "linear")


def num_batchnorm(model: nn.Module) -> int:
    """BatchNorm modules in `model` plus batch-norm ops in the fx graphs it holds (a torch.export program)."""
    return sum(isinstance(m, _BN) for m in model.modules()) + count_ops(model, *_GRAPH_BN_OPS)


def _arg(node: fx.Node, position: int, name: str, default=None):
    """Argument `name` of a call node, given by position or keyword."""
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _fetch(module: nn.Module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


# ---- nn.Module models: fold BatchNorm modules into the conv / Linear module before them -------------------------

def _module_pairs(gm: fx.GraphModule, example: tuple[torch.Tensor, ...] | None) -> list[tuple[fx.Node, fx.Node]]:
    """(layer node, BatchNorm node) pairs of a traced model that fold exactly."""
    modules = dict(gm.named_modules())
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    shapes_known = False
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_module" or type(modules[node.target]) not in _CONV_FOR_BN or not node.args:
            continue
        bn, layer_node = modules[node.target], node.args[0]
        if not isinstance(layer_node, fx.Node) or layer_node.op != "call_module" or len(layer_node.users) != 1:
            continue
        layer = modules[layer_node.target]
        if type(layer) not in _CONV_FOR_BN[type(bn)] or calls[layer_node.target] != 1:
            continue  # a subclass, or a layer called again elsewhere: its other calls must keep their weights
        if bn.training or not bn.track_running_stats or bn.running_mean is None:
            continue
        if isinstance(layer, nn.Linear):  # BatchNorm1d normalises dim 1: the Linear's features only when 2-D
            if example is None or layer.out_features != bn.num_features:
                continue
            if not shapes_known:
                from torch.fx.passes.shape_prop import ShapeProp

                with torch.no_grad():
                    ShapeProp(gm).propagate(*example)
                shapes_known = True
            meta = layer_node.meta.get("tensor_meta")
            if meta is None or len(meta.shape) != 2:
                continue
        pairs.append((layer_node, node))
    return pairs


def fold_modules(model: nn.Module, example: tuple[torch.Tensor, ...] | None = None) -> tuple[nn.Module, int]:
    """Fold BatchNorm modules into the conv / Linear modules that feed them.

    Args:
        model: an eval-mode nn.Module that torch.fx can trace.
        example: inputs of one batch, needed to fold Linear → BatchNorm1d (their shapes show
            whether the BatchNorm normalises the Linear's features); None folds convs only.

    Returns:
        (a traced copy of `model` with the folds, number of BatchNorm layers folded).

    Raises:
        RuntimeError: torch.fx cannot trace the model.
    """
    try:
        gm = fx.symbolic_trace(model)
    except Exception as exc:  # fx cannot trace data-dependent control flow
        raise RuntimeError(f"torch.fx could not trace the model: {one_line(exc)}") from None
    modules = dict(gm.named_modules())
    pairs = _module_pairs(gm, example)
    for layer_node, bn_node in pairs:
        layer, bn = modules[layer_node.target], modules[bn_node.target]
        fused = copy.deepcopy(layer)
        fuse = fuse_linear_bn_weights if isinstance(layer, nn.Linear) else fuse_conv_bn_weights
        weight = bn.weight if bn.weight is not None else torch.ones_like(bn.running_mean)
        bias = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
        with torch.no_grad():
            fused.weight, fused.bias = fuse(fused.weight, layer.bias, bn.running_mean, bn.running_var, bn.eps, weight, bias)
        parent, _, name = layer_node.target.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, name, fused)
        bn_node.replace_all_uses_with(layer_node)
        gm.graph.erase_node(bn_node)
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm, len(pairs)


# ---- torch.export programs: fold aten batch_norm nodes into the aten conv / linear node before them -------------

def _graph_bn_parts(node: fx.Node):
    """(input, weight, bias, running_mean, running_var, eps) of a foldable batch-norm node, else None."""
    name = op_name(node.target)
    if name == "batch_norm":
        if _arg(node, 5, "training", False) is not False:
            return None
        args = [_arg(node, i, key) for i, key in enumerate(("input", "weight", "bias", "running_mean", "running_var"))]
        eps = _arg(node, 7, "eps", 1e-5)
    elif name == "_native_batch_norm_legit_no_training":
        if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
            return None  # the saved statistics are read: not a plain normalisation
        args = [_arg(node, i, key) for i, key in enumerate(("input", "weight", "bias", "running_mean", "running_var"))]
        eps = _arg(node, 6, "eps", 1e-5)
    else:
        return None
    if not all(a is None or (isinstance(a, fx.Node) and a.op == "get_attr") for a in args[1:]):
        return None
    if args[3] is None or args[4] is None:
        return None
    return (*args, eps)


def _graph_layer(node, bn_node: fx.Node) -> str | None:
    """"conv" or "linear" when `node` is an aten conv (not transposed) / 2-D linear whose output only `bn_node` reads
    and whose weight and bias are attributes; else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or set(node.users) != {bn_node}:
        return None
    name = op_name(node.target)
    if name not in _GRAPH_LAYER_OPS or node.kwargs.get("bias") is not None:
        return None
    if name == "convolution" and _arg(node, 6, "transposed", False):
        return None
    weight = node.args[1] if len(node.args) > 1 else None
    bias = node.args[2] if len(node.args) > 2 else None
    if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
        return None
    if bias is not None and not (isinstance(bias, fx.Node) and bias.op == "get_attr"):
        return None
    if name == "linear":
        value = node.meta.get("val")
        if value is None or value.dim() != 2:  # batch norm normalises dim 1: the linear's features only when 2-D
            return None
        return "linear"
    return "conv"


def graph_pairs(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node, str]]:
    """(layer node, batch-norm node, "conv" / "linear") pairs of an aten graph that fold exactly."""
    pairs = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node.target) not in _GRAPH_BN_OPS:
            continue
        parts = _graph_bn_parts(node)
        kind = _graph_layer(parts[0], node) if parts else None
        if kind:
            pairs.append((parts[0], node, kind))
    return pairs


def _unique_attr(gm: nn.Module, base: str) -> str:
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def fold_graph(gm: fx.GraphModule) -> int:
    """Fold the batch-norm nodes of an aten graph (a torch.export program's module) into the
    conv / linear nodes before them, in place; drop the attributes no node reads any more.

    Returns:
        the number of batch-norm nodes folded.
    """
    pairs = graph_pairs(gm)
    replaced: list[fx.Node] = []  # get_attr nodes the folds stop reading
    for layer, bn, kind in pairs:
        _, weight, bias, mean, var, eps = _graph_bn_parts(bn)
        fetch = lambda n: None if n is None else _fetch(gm, n.target)  # noqa: E731
        old_bias = layer.args[2] if len(layer.args) > 2 else None
        replaced += [n for n in (layer.args[1], old_bias, weight, bias, mean, var) if n is not None]
        fuse = fuse_linear_bn_weights if kind == "linear" else fuse_conv_bn_weights
        running_mean = fetch(mean)
        with torch.no_grad():
            new_weight, new_bias = fuse(
                fetch(layer.args[1]), fetch(old_bias), running_mean, fetch(var), eps,
                fetch(weight) if weight is not None else torch.ones_like(running_mean),
                fetch(bias) if bias is not None else torch.zeros_like(running_mean))
        w_name = _unique_attr(gm, f"bn_folded_{layer.name}_weight")
        gm.register_parameter(w_name, new_weight)
        b_name = _unique_attr(gm, f"bn_folded_{layer.name}_bias")
        gm.register_parameter(b_name, new_bias)
        with gm.graph.inserting_before(layer):
            w_node, b_node = gm.graph.get_attr(w_name), gm.graph.get_attr(b_name)
        args = list(layer.args)
        args[1] = w_node
        if len(args) > 2:
            args[2] = b_node
        else:
            args.append(b_node)
        layer.args = tuple(args)
        if op_name(bn.target) == "batch_norm":
            bn.replace_all_uses_with(layer)
        else:
            for user in list(bn.users):
                if user.target is operator.getitem:
                    user.replace_all_uses_with(layer)
                    gm.graph.erase_node(user)
        gm.graph.erase_node(bn)
    if pairs:
        _drop_unread_attributes(gm, replaced)
        gm.graph.lint()
        gm.recompile()
    return len(pairs)


def _drop_unread_attributes(gm: fx.GraphModule, candidates: list[fx.Node]) -> None:
    """Remove the get_attr nodes among `candidates` (the folded layers' old weights and biases, the
    batch norms' parameters and statistics) that nothing reads any more, and the attributes they
    named when no other node of this graph reads them. Attributes the graph never named (those of
    submodules it calls) are not touched."""
    dropped = set()
    for node in dict.fromkeys(candidates):
        if node.op == "get_attr" and not node.users:
            dropped.add(node.target)
            gm.graph.erase_node(node)
    still_read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for target in dropped - still_read:
        owner, _, attr = target.rpartition(".")
        module = gm.get_submodule(owner) if owner else gm
        if hasattr(module, attr):
            delattr(module, attr)


@dataclass(frozen=True, kw_only=True)
class BatchNormFoldConfig(TechniqueConfig):
    name: ClassVar[str] = "bn-fold"


@register
class BatchNormFold(Technique):
    """Fold each eval-mode BatchNorm into the conv (or Linear) that feeds it (module docstring).

    Raises RuntimeError when no pair could be folded, so the tuner reports it rather than
    keeping a no-op.
    """

    config_cls = BatchNormFoldConfig
    exportable = True  # survives export to ONNX / OpenVINO
    stage = Stage.GRAPH
    lossless = True
    rewrites_modules = True
    description = "fold BatchNorm into the preceding conv (eval mode; nn.Module via torch.fx, or a torch.export graph)"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        model = workload.model
        if any(isinstance(m, _BN) for m in model.modules()):
            return None
        graph_bn = count_ops(model, *_GRAPH_BN_OPS)
        if not graph_bn:
            return "not applicable: the model has no BatchNorm layers"
        training = [t for t in training_mode_ops(model) if "batch_norm" in t]
        if training:
            return (f"not applicable: the program was exported in training mode ({', '.join(training)}: batch statistics); "
                    "export it after model.eval() to fold its batch norms")
        if not any(graph_pairs(m) for m in model.modules() if isinstance(m, fx.GraphModule)):
            return (f"not applicable: none of the program's {graph_bn} aten.batch_norm ops directly follows an aten.conv "
                    "(or 2-D aten.linear) whose output only it reads")
        return None

    def apply(self, model, config, *, workload, device):
        if isinstance(model, ForwardWrapper):  # fold inside autocast / layout wrappers, which fx cannot trace
            model.inner = self.apply(model.inner, config, workload=workload, device=device)
            return model
        graphs = [m for m in model.modules() if isinstance(m, fx.GraphModule) and count_ops(m, *_GRAPH_BN_OPS)]
        if graphs:  # a torch.export program: rewrite its aten graph in place
            before = num_batchnorm(model)
            folded = sum(fold_graph(gm) for gm in graphs)
            if not folded:
                raise RuntimeError(f"the program's {before} batch-norm op(s): none directly after an aten.conv (or 2-D "
                                   "aten.linear) whose output only it reads, with constant statistics")
            return model
        before = num_batchnorm(model)
        example = None
        if workload is not None and workload.samples:
            example = tuple(t.to(device) for t in workload.collate(list(workload.samples[:2])))
        folded_model, folded = fold_modules(eval_mode(model), example)
        if not folded:
            raise RuntimeError(f"found {before} BatchNorm layer(s) but none directly after a conv or Linear "
                               "(called once, whose output only it reads)")
        return folded_model
