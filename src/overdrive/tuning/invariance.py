"""Batch invariance: a row's answer must not depend on the rows it is batched with.

`serve` batches one client's rows with other clients' rows, and `run` batches records by length.
A technique that computes something over the whole batch (int8 dynamic quantization takes one
activation scale per batch) can be faithful for rows served alone and wrong for the same rows
next to an outlier. The probe runs chosen real rows in two contexts, each against the eager fp32
model in the same context:

- *alone*: a batch of copies of the row (the same shape as the batches the plan runs, so a
  compiled model sees no new batch size), which has the statistics of the row alone;
- *mixed*: the row in a batch with other real rows and one outlier row (`outlier_samples`: the
  real row with the largest input values scaled by `OUTLIER_SCALE`, and a one-spike row; for
  token inputs, the longest real sample).

The outlier row itself is not judged: an outlier may lose precision; its batch-mates must not.

Rows of varying sizes (`Workload.dynamic_dims`) have an edge the evaluation rows rarely hold: a row
that is all padding. `EdgeProbe` batches one with the longest real rows, and every candidate, lossless
or not, must answer it with finite values where the eager fp32 model does, and keep the batch within
the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from overdrive.core.memory import owned_host_float32, to_device
from overdrive.core.errors import one_line
from overdrive.core.workload import BATCH_MATES, BatchDependence, Workload

OUTLIER_SCALE = 100.0
MAX_ROWS = 8


@dataclass(kw_only=True)
class Verdict:
    """The worst judged row's figures in each context, against the eager fp32 model in the same context.

    Attributes:
        alone: the figures (the workload's fidelity figures, or max_abs_error for a degenerate
            reference) of the rows run alone.
        mixed: the figures of the rows batched with other rows and an outlier row, for the outlier
            whose batch-mates fared worst.
        outlier: that outlier ("the largest row × 100", ...).
        rows: rows judged.
    """

    alone: dict[str, float]
    mixed: dict[str, float]
    outlier: str
    rows: int

    def breaks(self, rule, hints: list[str]) -> str | None:
        """Why the rows break `rule` (a `guard.FidelityRule`) inside a batch with other rows and an
        outlier, batch-dependent when they pass alone (`hints`: the techniques' own words for why), or None."""
        mixed = rule.violation(self.mixed)
        if mixed is None:
            return None
        where = f"for rows batched with other rows and {self.outlier}"
        alone = rule.violation(self.alone)
        if alone:
            return f"{mixed} {where} (alone: {alone})"
        why = f"; {hints[0]}" if hints else ""
        figure = self.alone.get(rule.key, math.nan)
        return f"batch-dependent: {mixed} {where}, {rule.key} {figure:.4g} alone{why}; unfit for serve and run"


def _columns(sample):
    return sample if isinstance(sample, tuple) else (sample,)


def _rebuilt(sample, columns):
    return tuple(columns) if isinstance(sample, tuple) else columns[0]


def _magnitude(sample) -> float:
    floats = [c for c in _columns(sample) if isinstance(c, torch.Tensor) and c.is_floating_point() and c.numel()]
    return max((float(c.abs().max()) for c in floats), default=0.0)


def outlier_samples(workload: Workload, indices: list[int]) -> list[tuple[str, object]]:
    """The outlier rows, each with what it is. For models with float inputs: the real row with the
    largest value scaled by OUTLIER_SCALE, and a spike (that row's float inputs zeroed but for one
    value, OUTLIER_SCALE × its largest: a row whose shape of values differs, which survives a leading
    normalisation that a scaled row does not); otherwise the longest real sample."""
    samples = [workload.samples[i] for i in indices]
    largest = max(samples, key=_magnitude)
    peak = _magnitude(largest)
    if peak > 0:
        scaled = [c * OUTLIER_SCALE if isinstance(c, torch.Tensor) and c.is_floating_point() else c
                  for c in _columns(largest)]
        spike = []
        for c in _columns(largest):
            if isinstance(c, torch.Tensor) and c.is_floating_point() and c.numel():
                c = torch.zeros_like(c)
                c.view(-1)[0] = OUTLIER_SCALE * peak
            spike.append(c)
        return [(f"the largest row × {OUTLIER_SCALE:g}", _rebuilt(largest, scaled)),
                ("a one-spike row", _rebuilt(largest, spike))]
    if workload.sample_length is not None:
        return [("the longest row", max(samples, key=workload.sample_length))]
    return [("the largest row", max(samples, key=lambda s: sum(c.numel() for c in _columns(s)
                                                               if isinstance(c, torch.Tensor))))]


class InvarianceProbe:
    """The alone and mixed batches of a few real rows, with the eager fp32 outputs in each context.

    Args:
        workload: the rows (its samples) and their collate.
        reference_model: the eager fp32 model, on `device`.
        device: where the model runs.
        batch_size: rows per batch of the plan (at least 2 are used, so that a row has batch-mates;
            a model with a fixed batch size gets exactly that size).
        indices: the distinct evaluation samples to choose rows from.
    """

    def __init__(self, workload: Workload, reference_model: nn.Module, *, device: torch.device, batch_size: int,
                 indices: list[int]):
        distinct = list(dict.fromkeys(indices))
        size = workload.fixed_batch_size or max(2, batch_size)
        step = max(1, len(distinct) // MAX_ROWS)
        self.rows = distinct[::step][:MAX_ROWS]
        self.workload, self.device = workload, device
        samples = workload.samples
        # (context, [(position in the batch, row)], inputs); context "alone" or the outlier's description
        self.batches: list[tuple[str, list[tuple[int, int]], tuple[torch.Tensor, ...]]] = []
        if size >= 2:
            mates = size - 1
            for name, outlier in outlier_samples(workload, distinct):
                for start in range(0, len(self.rows), mates):
                    chunk = [self.rows[(start + j) % len(self.rows)] for j in range(mates)]
                    judged = [(chunk.index(i), i) for i in dict.fromkeys(chunk)]
                    self._add(name, judged, [samples[i] for i in chunk] + [outlier])
        for i in self.rows:
            self._add("alone", [(0, i)], [samples[i]] * size)
        self.reference = self._outputs(reference_model)

    def _add(self, context: str, judged: list[tuple[int, int]], batch: list) -> None:
        self.batches.append((context, judged, to_device(self.workload.collate(batch), self.device)))

    @torch.no_grad()
    def _outputs(self, model: nn.Module) -> dict[str, dict[int, torch.Tensor]]:
        """{context: {row: float32 output [...]}}."""
        rows: dict[str, dict[int, torch.Tensor]] = {}
        for context, judged, inputs in self.batches:
            out = owned_host_float32(model(*inputs))  # a copy: the model may reuse its output buffer
            for position, row in judged:
                rows.setdefault(context, {})[row] = out[position]
        return rows

    def _figures(self, outputs: dict[int, torch.Tensor], reference: dict[int, torch.Tensor], degenerate: bool) -> dict:
        rows = sorted(reference)
        out, ref = torch.stack([outputs[r] for r in rows]), torch.stack([reference[r] for r in rows])
        figures = {} if degenerate else dict(self.workload.fidelity(out, ref))
        figures["max_abs_error"] = float((out - ref).abs().max())
        return figures

    def check(self, model: nn.Module, *, rule) -> Verdict:
        """The candidate's figures alone and mixed, each against the fp32 model in the same context;
        `rule` (a `guard.FidelityRule`) picks the worst outlier."""
        outputs = self._outputs(model)
        degenerate = bool(rule.degenerate)
        alone = self._figures(outputs["alone"], self.reference["alone"], degenerate)
        mixed = [(context, self._figures(outputs[context], self.reference[context], degenerate))
                 for context in self.reference if context != "alone"]
        if not mixed:  # a model that takes one row per batch has no batch-mates
            return Verdict(alone=alone, mixed=alone, outlier="", rows=len(self.rows))
        outlier, figures = max(mixed, key=lambda cf: (rule.violation(cf[1]) is not None, _badness(cf[1], rule)))
        return Verdict(alone=alone, mixed=figures, outlier=outlier, rows=len(self.rows))

    def model_dependence(self, *, rule) -> tuple[str, dict[str, float]] | None:
        """Whether the eager fp32 model's own rows depend on their batch-mates: (the outlier, the
        figures of its rows in that batch against the same rows alone) when they break `rule`, else None."""
        degenerate = bool(rule.degenerate)
        for context, outputs in self.reference.items():
            if context == "alone":
                continue
            alone = {r: self.reference["alone"][r] for r in outputs}
            figures = self._figures(outputs, alone, degenerate)
            if rule.violation(figures):
                return context, figures
        return None


    def record_dependence(self, *, rule) -> str | None:
        """Record on the workload what `model_dependence` finds (as `BATCH_MATES`, unless the workload
        already knows a dependence: a text model's on padding), so the plan keeps it and serve and run
        batch by it; returns the warning that names it, or None."""
        workload = self.workload
        own = self.model_dependence(rule=rule)
        if own is not None and workload.batch_dependence is None:
            workload.batch_dependence = BatchDependence(kind=BATCH_MATES, detail=f"{rule.violation(own[1])} between rows "
                                                                                 f"alone and batched with other rows and {own[0]}")
        dependence = workload.batch_dependence
        if dependence is None:
            return None
        what, how = ("batch-mates", "give each row a batch of its own") if dependence.kind == BATCH_MATES else \
            ("padding", "batch only rows of the same token length, as measured here")
        return (f"the eager fp32 model's own rows depend on their {what} ({dependence.detail}): the plan records it, and "
                f"serve and run {how}")


def _badness(figures: dict[str, float], rule) -> float:
    """How far `figures` are from passing `rule`'s main figure: larger is worse, NaN worst."""
    value = figures.get(rule.key, float("nan"))
    if value != value:
        return float("inf")
    return value if rule.degenerate else -value


# -- the edge of padding ---------------------------------------------------------------------------


def all_padding_sample(workload: Workload, index: int):
    """Sample `index` with every input that varies in size (`Workload.dynamic_dims`) cut to size 1 there
    and zeroed: a row that is all padding (zero is what `pad_stack` pads with, checked to leave the answers
    unchanged), which a key padding mask turns into attention over no key at all."""
    columns = []
    for i, column in enumerate(_columns(workload.samples[index])):
        dims = workload.dynamic_dims.get(i, ())
        if dims and isinstance(column, torch.Tensor):
            column = column.new_zeros([1 if d + 1 in dims else n for d, n in enumerate(column.shape)])
        columns.append(column)
    return _rebuilt(workload.samples[index], columns)


class EdgeProbe:
    """A row that is all padding (`all_padding_sample`) batched with the longest real rows, run by the eager
    fp32 model once; every candidate runs the same batch. A plan with dynamic dimensions meets such rows in
    `run` and `serve` (a compiled `nn.TransformerEncoder` with a key padding mask answers one with NaN where
    eager answers 0, issue 30), and the evaluation rows rarely hold one.

    Args:
        workload: with `dynamic_dims`.
        reference_model: the eager fp32 model, on `device`.
        device, batch_size, indices: as `InvarianceProbe`'s.
    """

    description = "a row that is all padding, batched with the longest rows"

    def __init__(self, workload: Workload, reference_model: nn.Module, *, device: torch.device, batch_size: int,
                 indices: list[int]):
        distinct = list(dict.fromkeys(indices))
        size = workload.fixed_batch_size or max(2, batch_size)
        longest = sorted(distinct, key=lambda i: -sum(c.numel() for c in _columns(workload.samples[i])
                                                      if isinstance(c, torch.Tensor)))
        mates = [workload.samples[longest[j % len(longest)]] for j in range(size - 1)]
        self.workload = workload
        self.inputs = to_device(workload.collate([all_padding_sample(workload, longest[0]), *mates]), device)
        with torch.no_grad():
            self.reference = owned_host_float32(reference_model(*self.inputs))
        flat = self.reference.reshape(len(self.reference), -1)
        # judged: rows the fp32 model answers with finite values; cosine only where its answer is not ~0
        self.finite = torch.isfinite(flat).all(dim=1)
        scale = float(flat[self.finite].abs().max()) if self.finite.any() else 0.0
        self.nonzero = self.finite & (flat.abs().amax(dim=1) > 1e-6 * scale)

    @classmethod
    def of(cls, workload: Workload, reference_model: nn.Module, **kwargs) -> tuple[EdgeProbe | None, str | None]:
        """(the probe, None) for a workload with dynamic dimensions; (None, why not) when the fp32 model
        fails on such a row (nothing to hold candidates to); (None, None) without dynamic dimensions."""
        if not workload.dynamic_dims:
            return None, None
        try:
            return cls(workload, reference_model, **kwargs), None
        except Exception as exc:  # noqa: BLE001 - the user's model refuses a row of padding only
            return None, f"a row that is all padding was not tried: the eager fp32 model fails on it ({one_line(exc)})"

    def check(self, model: nn.Module, *, rule) -> str | None:
        """Why the candidate's answers on the edge batch break `rule` (a `guard.FidelityRule`), or None."""
        with torch.no_grad():
            out = owned_host_float32(model(*self.inputs))
        flat = out.reshape(len(out), -1)
        bad = int((~torch.isfinite(flat[self.finite])).sum())
        if bad:
            return f"{bad} non-finite output values for {self.description}, where fp32 gives finite ones"
        judged = self.nonzero if not rule.degenerate else self.finite
        if not judged.any():
            return None
        ref = self.reference[judged]
        figures = {} if rule.degenerate else dict(self.workload.fidelity(out[judged], ref))
        figures["max_abs_error"] = float((out[judged] - ref).abs().max())
        broken = rule.violation(figures)
        return f"{broken} for {self.description}" if broken else None
