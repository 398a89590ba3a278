"""What a model's inputs may hold, found from the model itself, so that a bad value is refused
before it reaches compiled code.

Eager PyTorch raises a Python error for a token id past an embedding's rows; a kernel that
Inductor generated checks the index with a C++ assertion that aborts the whole process (a
server with every request in flight, a batch job with its parts). So `serve`, `run` and
`optimize(data=...)` check rows against these limits first, and refuse only the rows that break
them.

How the limits are found (`derive_input_limits`): one call of the eager fp32 model on an example
batch under a `TorchDispatchMode` that watches the embedding lookups (`aten.embedding`,
`aten._embedding_bag`, ...; so nn.Embedding, nn.EmbeddingBag, F.embedding, torch.export programs
and TorchScript alike). A lookup whose indices are one of the model's inputs (the same tensor, or
the same values; an input whose example holds a single value is matched only as the same tensor)
bounds that input to [0, rows of the table); an input feeding several tables gets the smallest.
Indices the model computes from an input (shifted, clamped, hashed) bound nothing. Floating-point
inputs must be finite (NaN or ±inf in a request is a malformed request), unless the example
itself holds non-finite values there (an additive -inf mask).

Not covered: other indexing ops on inputs (gather, index_select, one_hot); a model whose probe
call fails gives no limits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_LOOKUPS = {  # op -> (position of the table, position of the indices)
    "aten::embedding": (0, 1),
    "aten::embedding_bag": (0, 1),
    "aten::_embedding_bag": (0, 1),
    "aten::_embedding_bag_forward_only": (0, 1),
}


@dataclass(frozen=True, kw_only=True)
class IdRange:
    """Model input `input` holds ids in [low, high): the rows of the table `table` it indexes.

    Attributes:
        input: position among the model's inputs.
        low: smallest id allowed (inclusive).
        high: largest id allowed + 1 (the table's rows).
        table: what it indexes, e.g. "embeddings.word_embeddings.weight (30522 rows)".
    """

    input: int
    low: int
    high: int
    table: str


@dataclass(frozen=True, kw_only=True)
class InputLimits:
    """The limits of a model's inputs (picklable: `run`'s reader processes check with it).

    Attributes:
        ranges: the id ranges of integer inputs that index embedding tables.
        finite: positions of floating-point inputs that must hold finite values only.
    """

    ranges: tuple[IdRange, ...] = ()
    finite: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ranges or self.finite)

    def lowest_high(self) -> int | None:
        """The smallest `high` of the id ranges (None without any)."""
        return min((r.high for r in self.ranges), default=None)

    def row_problems(self, inputs: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> dict[int, str]:
        """The rows of a batch that break a limit, with the first reason for each.

        Args:
            inputs: the model's inputs, each [B, ...] with the same B.
            names: what to call each input in the reasons (default: "model input i").

        Returns:
            {row: reason}, e.g. {3: "model input 0 holds 30522, outside [0, 30522): the model looks it
            up in embeddings.word_embeddings.weight (30522 rows)"}; empty when every row is within limits.
        """
        problems: dict[int, str] = {}
        for r in self.ranges:
            t = inputs[r.input] if r.input < len(inputs) else None
            if t is None or t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() == 0:
                continue
            bad = (t < r.low) | (t >= r.high)
            for row in _bad_rows(bad):
                if row not in problems:
                    value = int(t[row][bad[row]].reshape(-1)[0]) if t.dim() > 1 else int(t[row])
                    problems[row] = (f"{_name(names, r.input)} holds {value}, outside [{r.low}, {r.high}): the model "
                                     f"looks it up in {r.table}")
        for i in self.finite:
            t = inputs[i] if i < len(inputs) else None
            if t is None or not t.dtype.is_floating_point or t.dim() == 0:
                continue
            bad = ~torch.isfinite(t)
            for row in _bad_rows(bad):
                if row not in problems:
                    value = float(t[row][bad[row]].reshape(-1)[0]) if t.dim() > 1 else float(t[row])
                    problems[row] = f"{_name(names, i)} holds {value}; the model takes finite values only"
        return problems


def _name(names: Sequence[str] | None, i: int) -> str:
    return names[i] if names is not None and i < len(names) else f"model input {i}"


def _bad_rows(bad: torch.Tensor) -> list[int]:
    if not bool(bad.any()):
        return []
    return torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).reshape(-1).tolist()


class _LookupWatcher(TorchDispatchMode):
    """Records (table, indices) of every embedding lookup it sees."""

    def __init__(self):
        super().__init__()
        self.lookups: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = _LOOKUPS.get(func._schema.name)
        if where is not None and len(args) > max(where):
            self.lookups.append((args[where[0]], args[where[1]]))
        return func(*args, **(kwargs or {}))


def derive_input_limits(model: nn.Module, example: Sequence[torch.Tensor]) -> InputLimits:
    """The limits of `model`'s inputs, from one call on `example` (see the module docstring).

    Args:
        model: the eager fp32 model (not a compiled one: its lookups are not visible).
        example: one batch of its inputs, each [B, ...] (several distinct rows match best).

    Returns:
        The limits; no id ranges when the model makes no lookup on an input, or fails under the
        probe. A model without integer inputs is not called.
    """
    example = tuple(example)
    if not any(isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and t.dtype != torch.bool for t in example):
        return InputLimits(finite=_finite_inputs(example))  # no integer input: no lookup can be bounded, no call needed
    watcher = _LookupWatcher()
    try:
        with torch.no_grad(), watcher:
            model(*example)
    except Exception:  # noqa: BLE001 - a model that cannot run under a dispatch mode gets no limits
        return InputLimits(finite=_finite_inputs(example))
    tables = {t.data_ptr(): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    bounds: dict[int, IdRange] = {}
    for table, indices in watcher.lookups:
        i = _matching_input(indices, example)
        if i is None:
            continue
        rows = int(table.shape[0])
        if i not in bounds or rows < bounds[i].high:
            label = tables.get(table.data_ptr(), f"an embedding table [{', '.join(map(str, table.shape))}]")
            bounds[i] = IdRange(input=i, low=0, high=rows, table=f"{label} ({rows} rows)")
    return InputLimits(ranges=tuple(bounds[i] for i in sorted(bounds)), finite=_finite_inputs(example))


def _matching_input(indices: torch.Tensor, example: tuple[torch.Tensor, ...]) -> int | None:
    for i, t in enumerate(example):
        if indices is t:
            return i
    for i, t in enumerate(example):
        if (isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and t.numel() == indices.numel() > 0
                and t.unique().numel() > 1 and torch.equal(t.reshape(-1).to(indices.dtype), indices.reshape(-1))):
            return i
    return None


def _finite_inputs(example: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(example)
                 if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and bool(torch.isfinite(t).all()))


def workload_input_limits(workload) -> InputLimits:
    """`derive_input_limits` of a Workload's fp32 model on a batch of its first (up to 4) samples."""
    samples = list(workload.samples[: min(4, len(workload.samples))])
    if workload.fixed_batch_size:
        samples = [samples[i % len(samples)] for i in range(workload.fixed_batch_size)]
    try:
        example = workload.collate(samples)
    except Exception:  # noqa: BLE001 - no example batch, no limits (the verbs report collate errors themselves)
        return InputLimits()
    return derive_input_limits(workload.model, example)
