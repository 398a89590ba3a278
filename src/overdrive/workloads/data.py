"""The user's own evaluation rows for any workload: `optimize --data FILE`, `optimize(..., data=...)`.

A built-in workload (or a factory's) is judged on its own samples; with data, it is judged on the
user's instead, read the way `overdrive run` reads its input (`overdrive.files.inputs`): a `.txt`,
`.jsonl` or `.csv` file of text for text models, a `.npy` array [N, *row] or a folder of images
for tensor models. The workload's labels and metric belong to its own samples, so they are
dropped: the user's rows are judged by agreement with the eager fp32 outputs (fidelity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

import torch

from overdrive.core.errors import DataError, arg, one_line
from overdrive.core.workload import Workload

DEFAULT_MAX_ROWS = 4096
MIN_ROWS_TO_HOLD_OUT = 100  # a workload without training rows (a factory's) gets a fifth of the user's, held out


def hold_out(rows: list, whose: str = "your") -> tuple[list, list | None, list[str]]:
    """The user's rows split for a workload without training rows of its own: of `MIN_ROWS_TO_HOLD_OUT` or more,
    the last fifth is kept apart as training rows (calibration, pruning's recovery, `train`) and never judged.

    Args:
        rows: the evaluation rows, in order (the user's data, or the rows of their example batch).
        whose: how the note names them: "your" (data), "your example's".

    Returns:
        (evaluation rows, training rows or None, the note saying so, or none when fewer rows).
    """
    if len(rows) < MIN_ROWS_TO_HOLD_OUT:
        return rows, None, []
    held = len(rows) // 5
    return rows[:-held], rows[-held:], [_held_out_note(held, len(rows), whose)]


def _held_out_note(held: int, total: int, whose: str) -> str:
    return (f"the last {held} of {whose} {total} rows are held out for calibration and recovery fine-tunes (training "
            f"rows, never judged); the first {total - held} are the evaluation rows")


def with_data(workload: Workload, data: str | Path | Iterable, *, text_field: str | None = None,
              max_rows: int | None = None) -> Workload:
    """`workload` judged on the user's rows `data` instead of its own samples.

    Args:
        workload: any workload.
        data: a file or folder (see the module docstring); or, for a text workload, strings; or,
            for a tensor workload, batches shaped like its samples (a tensor [B, *row], or a
            tuple of such tensors for a model with several inputs).
        text_field: the JSONL field / CSV column holding the text.
        max_rows: read at most this many rows (the first ones); None: `DEFAULT_MAX_ROWS`.

    Returns:
        A copy of `workload` with `samples` the user's rows (`rows_source` "data"), no labels and
        no task metric, and a note naming what was left out. A workload without training rows of
        its own (a factory's) keeps the last fifth of 100 or more rows apart as `train_samples`
        (calibration, pruning's recovery, `train`), never judged (`hold_out`); a fifth its example
        kept apart goes with the example's rows, which the user's replace.

    Raises:
        DataError: the data cannot be read, holds no readable row, or does not suit the model
            (text for a tensor model, rows of another shape or dtype); the message names `data`.
    """
    limit = max_rows or DEFAULT_MAX_ROWS
    notes: list[str] = []
    if isinstance(data, (str, Path)):
        rows, skipped = _rows_from_file(Path(data), workload, text_field=text_field, limit=limit)
        if not rows and skipped:
            raise DataError(f"{arg('data', data)}: none of its {len(skipped)} record(s) can be read (the first: {skipped[0]})")
        if skipped:
            notes.append(f"{len(skipped)} record(s) of {data} could not be read and were left out (the first: "
                         f"{skipped[0]})")
        origin = str(data)
    else:
        rows = _rows_from_objects(workload, data, limit)
        origin = "data"
    if not rows:
        raise DataError(f"{arg('data')} holds no rows the model can read")
    _check_like(workload, rows[0], origin)
    rows, refused = _within_limits(workload, rows)
    if refused:
        notes.append(f"{len(refused)} row(s) of {origin} hold values the model cannot take and were left out (the "
                     f"first: {refused[0]}); a compiled model given them could abort the process")
    if not rows:
        raise DataError(f"{arg('data')}: no row holds values the model can take (the first: {refused[0]})")
    train, kept_notes = workload.train_samples, list(workload.notes)
    if workload.rows_source == "example" and train is not None:  # the example's held-out fifth goes with its rows
        held_note = _held_out_note(len(train), len(workload.samples) + len(train), "your example's")
        train, kept_notes = None, [n for n in kept_notes if n != held_note]
    if train is None:  # a workload without training rows (a factory's): a fifth of the user's, never judged
        rows, train, held_notes = hold_out(rows)
        notes += held_notes
    dropped = [what for what, present in (("labels", workload.labels is not None), ("metric", workload.metric is not None))
               if present]
    if dropped:
        notes.append(f"the workload's {' and '.join(dropped)} belong to its own samples: your rows are judged by "
                     "agreement with the eager fp32 outputs")
    return dataclasses.replace(workload, samples=rows, labels=None, metric=None, rows_source="data", train_samples=train,
                               notes=[*kept_notes, *notes],
                               description=f"{workload.description} — on your data ({origin})")


def _within_limits(workload: Workload, rows: list) -> tuple[list, list[str]]:
    """The rows whose values the model can take (ids within its embeddings' rows, finite floats;
    `overdrive.core.input_limits`), and a reason for each one left out."""
    if workload.is_text:
        return rows, []
    from overdrive.core.input_limits import workload_input_limits

    limits = workload_input_limits(workload)
    if not limits:
        return rows, []
    kept, refused = [], []
    for i, row in enumerate(rows):
        problems = limits.row_problems([c.unsqueeze(0) for c in (row if isinstance(row, tuple) else (row,))])
        if problems:
            refused.append(f"row {i}: {problems[0]}")
        else:
            kept.append(row)
    return kept, refused


def _rows_from_file(path: Path, workload: Workload, *, text_field: str | None, limit: int) -> tuple[list, list[str]]:
    from overdrive.files.inputs import RecordError, open_source

    source = open_source(path, workload, text_field=text_field, argument="data")
    rows, skipped = [], []
    for i in range(len(source)):
        if len(rows) >= limit:
            break
        try:
            value = source.read(i)
        except RecordError as exc:
            skipped.append(f"{source.source_key(i)}: {exc}")
            continue
        except Exception as exc:  # noqa: BLE001 - an odd record is reported, not a crash
            skipped.append(f"{source.source_key(i)}: {one_line(exc)}")
            continue
        rows.append(_as_sample(workload, value))
    return rows, skipped


def _as_sample(workload: Workload, value):
    """A record in the structure of the workload's samples (a 1-tuple for factories' workloads)."""
    if isinstance(workload.samples[0], tuple) and isinstance(value, torch.Tensor):
        return (value,)
    return value


def _rows_from_objects(workload: Workload, data: Iterable, limit: int) -> list:
    rows: list = []
    for i, item in enumerate(data):
        if workload.is_text:
            if not isinstance(item, str):
                raise DataError(f"{arg('data')}: item {i} is {type(item).__name__}; {workload.name!r} is a text model "
                                "and takes strings")
            rows.append(item)
        else:
            batch = (item,) if isinstance(item, torch.Tensor) else tuple(item)
            if not batch or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in batch) or \
                    len({t.shape[0] for t in batch}) != 1:
                raise DataError(f"{arg('data')}: batch {i} is not a tensor [B, ...] or a tuple of tensors with one first "
                                "dimension")
            columns = [t.detach().cpu() for t in batch]
            rows += [_as_sample(workload, columns[0][r]) if len(columns) == 1 else tuple(c[r] for c in columns)
                     for r in range(columns[0].shape[0])]
        if len(rows) >= limit:
            break
    return rows[:limit]


def _check_like(workload: Workload, row, origin: str) -> None:
    """The user's row has the structure, per-row shape and dtype of the workload's samples."""
    sample = workload.samples[0]
    if workload.is_text:
        return
    want = sample if isinstance(sample, tuple) else (sample,)
    got = row if isinstance(row, tuple) else (row,)
    dims = workload.dynamic_dims
    if len(got) != len(want) or any(not isinstance(g, torch.Tensor) or g.dtype != w.dtype or g.dim() != w.dim() or
                                    any(a != b for d, (a, b) in enumerate(zip(g.shape, w.shape), start=1)
                                        if d not in dims.get(i, ()))
                                    for i, (g, w) in enumerate(zip(got, want))):
        describe = lambda cols: ", ".join(f"{c.dtype} {list(c.shape)}" if isinstance(c, torch.Tensor)  # noqa: E731
                                          else type(c).__name__ for c in cols)
        raise DataError(f"{arg('data', origin)}: rows are {describe(got)}; {workload.name!r} takes rows of "
                        f"{describe(want)}")
