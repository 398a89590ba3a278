"""Batch invariance: a row's answer must not depend on the rows it is batched with.

`serve` batches one client's rows with other clients' rows, and `run` batches records by length.
A technique that computes something over the whole batch (int8 dynamic quantization takes one
activation scale per batch) can be faithful for rows served alone and wrong for the same rows
next to an outlier. The probe runs chosen real rows in two contexts, each against the eager fp32
model in the same context:

- *alone*: a batch of copies of the row (the same shape as the batches the plan runs, so a
  compiled model sees no new batch size), which has the statistics of the row alone;
- *mixed*: the row in a batch with other real rows and one outlier row (the real row with the
  largest input values, scaled by `OUTLIER_SCALE`; for token inputs, the longest real sample).

The outlier row itself is not judged: an outlier may lose precision; its batch-mates must not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from overdrive.core.measure import owned_host_float32, to_device
from overdrive.core.workload import Workload

OUTLIER_SCALE = 100.0
MAX_ROWS = 8


@dataclass(kw_only=True)
class Verdict:
    """Per-context figure of the worst judged row (the workload's fidelity key, or max_abs_error)."""

    alone: float
    mixed: float
    rows: int


def _columns(sample):
    return sample if isinstance(sample, tuple) else (sample,)


def _scaled(sample, scale: float):
    cols = tuple(c * scale if isinstance(c, torch.Tensor) and c.is_floating_point() else c for c in _columns(sample))
    return cols if isinstance(sample, tuple) else cols[0]


def _magnitude(sample) -> float:
    floats = [c for c in _columns(sample) if isinstance(c, torch.Tensor) and c.is_floating_point() and c.numel()]
    return max((float(c.abs().max()) for c in floats), default=0.0)


def outlier_sample(workload: Workload, indices: list[int]):
    """The outlier row: the sample with the largest float input scaled by OUTLIER_SCALE, or for
    models without float inputs (token ids, strings) the longest sample."""
    samples = [workload.samples[i] for i in indices]
    if any(_magnitude(s) > 0 for s in samples):
        return _scaled(max(samples, key=_magnitude), OUTLIER_SCALE)
    if workload.sample_length is not None:
        return max(samples, key=workload.sample_length)
    return max(samples, key=lambda s: sum(c.numel() for c in _columns(s) if isinstance(c, torch.Tensor)))


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
        outlier = outlier_sample(workload, distinct)
        samples = workload.samples
        self.batches: list[tuple[str, list[int], tuple[torch.Tensor, ...]]] = []
        self.judged: list[tuple[str, int, int]] = []  # (context, batch number, position in the batch)
        if size >= 2:
            mates = size - 1
            for start in range(0, len(self.rows), mates):
                chunk = [self.rows[(start + j) % len(self.rows)] for j in range(mates)]
                judged = list(dict.fromkeys(chunk))
                batch = [samples[i] for i in chunk] + [outlier]
                self._add("mixed", [chunk.index(i) for i in judged], batch)
        for i in self.rows:
            self._add("alone", [0], [samples[i]] * size)
        self.reference = self._outputs(reference_model)

    def _add(self, context: str, positions: list[int], batch: list) -> None:
        number = len(self.batches)
        self.batches.append((context, positions, to_device(self.workload.collate(batch), self.device)))
        self.judged += [(context, number, p) for p in positions]

    @torch.no_grad()
    def _outputs(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """{context: float32 [judged rows, ...]} in `judged` order."""
        rows: dict[str, list[torch.Tensor]] = {"alone": [], "mixed": []}
        for context, positions, inputs in self.batches:
            out = owned_host_float32(model(*inputs))  # a copy: the model may reuse its output buffer
            rows[context] += [out[p] for p in positions]
        return {c: torch.stack(r) for c, r in rows.items() if r}

    def check(self, model: nn.Module, *, key: str, degenerate: bool) -> Verdict:
        """The worst judged row's figure alone and mixed, against the fp32 model in the same context:
        the workload's fidelity figure `key` (higher is better), or the max absolute error when the
        reference is degenerate (`degenerate`: lower is better)."""
        outputs = self._outputs(model)
        figures = {}
        for context, reference in self.reference.items():
            out = outputs[context]
            if degenerate:
                figures[context] = float((out - reference).abs().max())
            else:
                figures[context] = float(self.workload.fidelity(out, reference)[key])
        alone = figures["alone"]
        return Verdict(alone=alone, mixed=figures.get("mixed", alone), rows=len(self.rows))  # a batch of one has no mates
