"""True reasons for techniques that rewrite nn.Module layers, when the model is a graph of aten ops.

A torch.export program (`torch.export.load(...).module()`) runs its convolutions, linears and
norms as `call_function` nodes (`aten.conv2d.default`, `aten.linear.default`), not as
`nn.Conv2d` / `nn.Linear` modules. "The model has no nn.Linear layers" is then untrue of a
program that runs twelve linear ops; the reason a module rewrite does not apply is that the
program has no modules to rewrite. `missing_layers_reason` says which, with the op counts read
from the graph (`overdrive.core.graph_ops`).
"""

from __future__ import annotations

from torch import nn

from overdrive.core.graph_ops import aten_op_counts

CONV_OPS = ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")
LINEAR_OPS = ("linear", "addmm")
ATTENTION_OPS = ("scaled_dot_product_attention", "_native_multi_head_attention")

FACTORY_ADVICE = "to use it, give the nn.Module itself (`package.module:factory`)"


def ops_phrase(counts: list[tuple[str, int]]) -> str:
    """[("conv2d", 20), ("linear", 1)] -> "20 aten.conv2d and 1 aten.linear ops"."""
    parts = [f"{count} aten.{name}" for name, count in counts]
    text = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return text + (" op" if len(counts) == 1 and counts[0][1] == 1 else " ops")


def graph_op_counts(model: nn.Module, ops: tuple[str, ...]) -> list[tuple[str, int]]:
    """(op, count) for each of `ops` that the fx graphs in `model` call, in the order of `ops`."""
    counts = aten_op_counts(model)
    return [(name, counts[name]) for name in ops if counts[name]]


def holds_graph(model: nn.Module) -> bool:
    """True when `model` runs (part of) its forward as fx graph calls (a torch.export program)."""
    return bool(aten_op_counts(model))


def missing_layers_reason(model: nn.Module, *, layers: str, ops: tuple[str, ...], rewrites: str) -> str:
    """The reason a technique that rewrites `layers` modules does not apply to `model`, which has none.

    Args:
        model: the workload's model (it has no `layers` modules: the caller checked).
        layers: the module kinds the technique rewrites, as the user knows them ("nn.Linear").
        ops: aten op names (`graph_ops.op_name`) that such layers become in a graph ("linear").
        rewrites: what the technique does to them ("int8-dynamic swaps nn.Linear modules for
            quantized ones").

    Returns:
        "not applicable: ..." naming the graph's op counts when `model` is a graph program that
        calls `ops`, else that the model has no such layers.
    """
    if holds_graph(model):
        found = graph_op_counts(model, ops)
        if found:
            return (f"not applicable: the program runs {ops_phrase(found)} in its graph, not as {layers} modules; "
                    f"{rewrites}, which a torch.export program does not have; {FACTORY_ADVICE}")
        return f"not applicable: the program calls no {' / '.join('aten.' + o for o in ops[:3])} op (no {layers} layers)"
    return f"not applicable: the model has no {layers} layers"
