"""Whether a text model's answer for a row depends on the rows batched with it.

A text encoder that never receives its attention mask (pooling over every position), or that takes
the last position's state under right padding, answers a sentence padded next to a longer one
differently from the same sentence alone: issue 30 saw 51 of 64 sentences below cosine 0.99 (mean
pooling) and a median cosine of 0.415 (last token), with `run` reporting no failure. Tensor
workloads are checked when built (`workloads.signature.padding_check`: rows of varying sizes are
taken only where zero padding leaves the answers unchanged); text workloads are checked here, on the
fp32 model, by `text_dependence`:

- padding: a few of the shortest sentences, each alone, against the same sentences in one batch with
  the longest (padded to its length). A difference beyond float noise (`RTOL` of the outputs' scale)
  makes the workload `PADDING`-dependent: `run`, `serve` and `optimize`'s measurement batches then
  hold only rows of one token length (`core.workload.equal_length_batches`), so no row is padded;
- batch-mates: where padding matters, two different sentences of one token length, alone and
  together. A difference there too makes it `BATCH_MATES`-dependent: each row runs alone.

The tuner's batch-invariance probe (`tuning.invariance.InvarianceProbe.model_dependence`) finds the
same of a tensor model (a row beside an outlier row) and records it as `BATCH_MATES`; the plan keeps
what was found, so `run` and `serve` of a plan know it without measuring again.
"""

from __future__ import annotations

from typing import Any

import torch

from overdrive.core.workload import BATCH_MATES, PADDING, BatchDependence, Workload

RTOL = 1e-4  # of the outputs' largest magnitude, as `padding_check`: beyond it, padding changed the answer
ATOL = 1e-6
NUM_SHORT = 4  # sentences judged alone and padded
MAX_SCAN = 64  # samples whose lengths are read to choose them
CHECKED = "batch_dependence_checked"  # Workload.extra key: text_dependence ran on this workload


def _outputs(workload: Workload, rows: list[Any]) -> torch.Tensor:
    """The fp32 model's float32 outputs [len(rows), ...] for `rows` collated into one batch (filled up
    with copies of the first row for a model that takes only one batch size)."""
    size = max(workload.fixed_batch_size or 0, len(rows))
    with torch.no_grad():
        out = workload.model(*workload.collate(list(rows) + rows[:1] * (size - len(rows))))
    return out.detach().float().cpu().clone()[: len(rows)].reshape(len(rows), -1)  # owned before the next call


def _alone(workload: Workload, rows: list[Any]) -> torch.Tensor:
    return torch.cat([_outputs(workload, [row]) for row in rows])


def _differs(alone: torch.Tensor, batched: torch.Tensor) -> str | None:
    """What separates two runs of the same rows, or None within float noise."""
    diff = float((alone - batched).abs().max())
    scale = float(alone.abs().max())
    if diff <= RTOL * scale + ATOL:  # NaN fails this, and is reported
        return None
    cosine = float(torch.nn.functional.cosine_similarity(alone, batched, dim=-1).min())
    return f"cosine {cosine:.4g}, largest difference {diff:.3g} of outputs up to {scale:.3g}"


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b


def text_dependence(workload: Workload) -> BatchDependence | None:
    """Measure whether the fp32 model's answer for a sentence depends on padding or batch-mates (see the
    module docstring). None when it does not, or when the samples cannot tell (every one of one length).

    Raises:
        Exception: whatever the model or collate raise on the workload's own samples.
    """
    samples = list(workload.samples[:MAX_SCAN])
    if len(samples) < 2 or workload.sample_length is None:
        return None
    lengths = [workload.sample_length(s) for s in samples]
    room = (workload.fixed_batch_size or NUM_SHORT + 1) - 1
    if room < 1:
        return None
    longest = max(range(len(samples)), key=lambda i: lengths[i])
    shorts = sorted((i for i in range(len(samples)) if lengths[i] < lengths[longest]), key=lambda i: lengths[i])
    shorts = shorts[:min(NUM_SHORT, room)]
    if not shorts:
        return None
    rows = [samples[i] for i in shorts]
    padded = _differs(_alone(workload, rows), _outputs(workload, rows + [samples[longest]])[: len(rows)])
    if padded is None:
        return None
    by_length: dict[int, int] = {}
    for i, n in enumerate(lengths):
        j = by_length.setdefault(n, i)
        if j != i and not _same(samples[j], samples[i]):
            pair = [samples[j], samples[i]]
            mates = _differs(_alone(workload, pair), _outputs(workload, pair))
            if mates is not None:
                return BatchDependence(kind=BATCH_MATES, detail=f"{mates} between a row alone and beside another of "
                                                                "its length, with no padding")
            break
    return BatchDependence(kind=PADDING, detail=f"{padded} between rows alone and the same rows padded next to a "
                                                "longer one")


def checked_dependence(workload: Workload, recorded: dict[str, str] | None = None) -> BatchDependence | None:
    """The workload's batch dependence, measured once: `recorded` (a plan's `batch_dependence`) when
    given, else what the workload holds, measured now for a text workload not checked before
    (`text_dependence`, with a note on the workload when it depends). A model that fails on its own
    samples here is left to fail where it runs."""
    if recorded:
        workload.batch_dependence = BatchDependence.from_dict(recorded)
        workload.extra[CHECKED] = True
    if workload.batch_dependence is None and workload.is_text and not workload.extra.get(CHECKED):
        workload.extra[CHECKED] = True
        try:
            workload.batch_dependence = text_dependence(workload)
        except Exception:  # noqa: BLE001 - the model's failures are reported where it runs
            return None
        if workload.batch_dependence is not None:
            workload.notes.append(workload.batch_dependence.describe())
    return workload.batch_dependence
