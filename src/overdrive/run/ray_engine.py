"""`overdrive run --engine ray` and `overdrive.ray.Predictor`: a plan's model on Ray Data, for
datasets larger than one machine.

`Predictor` is the callable class Ray Data's `map_batches` wants (one model per actor, built once
in `__init__`): each block is cut into batches of the plan's batch size, text sorted by token
count inside the block (length bucketing; of one token count only for a model whose answer depends
on padding), records collated, checked and refused as `overdrive run` does (an `error` column says
why; their `output` rows are NaN, as are those the model answered with a non-finite value), the
model called, and rows returned in the block's order:

    import ray, overdrive.ray
    ds = ray.data.from_items([{"text": s} for s in sentences])
    out = ds.map_batches(overdrive.ray.Predictor, fn_constructor_kwargs={"plan": "out/minilm/plan.json"},
                         concurrency=4, batch_size=256, batch_format="numpy")

`run_on_ray` is what the command line does: the input file is read by overdrive's own sources,
the records go through `map_batches` with `concurrency` actors (order preserved), and the output
is written by `overdrive run`'s writers, so the file equals `overdrive run`'s on the same input.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from overdrive.core.errors import ConfigError, DataError, arg
from overdrive.core.workload import BATCH_MATES

BLOCK_ROWS = 1024  # records per Ray block handed to one actor call


class Predictor:
    """One plan's model on one Ray actor (or in-process): `predictor({"text": [...]})` or
    `predictor({"input": array [N, ...]})` (a model with several inputs: a column per input name,
    as `overdrive run` names them) -> {"output": float32 [N, ...], "error": str [N] ("" when fine),
    "prediction": int64 [N] for classifiers (-1 where failed), and every other column passed through}.

    Args:
        plan: a plan.json `optimize` wrote (it names its model).
        device: "cpu", "cuda", "auto" (the plan's device type).
        threads: intra-op threads for this actor (default: torch's).

    Raises:
        PlanError, WorkloadError: as `overdrive run` for the plan and its model.
        DataError (from `__call__`): a block none of whose records the model takes.
    """

    def __init__(self, plan: str | Path, *, device: str = "auto", threads: int | None = None):
        from overdrive.core.input_limits import workload_input_limits
        from overdrive.core.row_dependence import checked_dependence
        from overdrive.run.replica import Collate, Replica, pad_records, text_lengths
        from overdrive.files.tensor_sources import input_names
        from overdrive.tuning.plan import load_plan
        from overdrive.techniques.compose import build

        if threads:
            torch.set_num_threads(threads)
        loaded, resolved, _ = load_plan(plan, device=device)
        workload = loaded.create_workload()
        model, _ = build(workload, loaded.steps, resolved)
        dependence = checked_dependence(workload)  # the plan's record (Plan.create_workload), or measured for text
        self.batch_size = 1 if dependence is not None and dependence.kind == BATCH_MATES else loaded.batch_size
        self.equal_lengths = workload.equal_lengths_only
        self.text = workload.is_text
        self.names = None if self.text else input_names(workload)
        self.replica = Replica(model, resolved, workload.fixed_batch_size, threads)
        limits = workload_input_limits(workload)
        padded = functools.partial(pad_records, workload.dynamic_dims, max_size=workload.extra.get("max_dynamic_size")) \
            if workload.dynamic_dims else None
        self.collate = Collate(workload.collate if self.text else padded, 1 << 62, limits,
                               None if self.text else [f"input {n!r}" for n in self.names])
        self.lengths = text_lengths(workload) if self.text else None
        self.normalize = bool(workload.extra.get("normalize_embeddings"))
        self.classifier = workload.has_task_metric or bool(workload.extra.get("classifier"))

    def _values(self, batch: dict[str, Any]) -> tuple[list, list[str]]:
        """The block's records (texts, or a tensor / tuple of tensors per row) and the columns they came from."""
        if self.text:
            if "text" not in batch:
                raise DataError(f"a text model's block needs a 'text' column; it has {sorted(batch)}")
            return [str(t) for t in batch["text"]], ["text"]
        missing = [n for n in self.names if n not in batch]
        if missing:
            raise DataError(f"the block lacks the input column(s) {missing}; it has {sorted(batch)}")
        columns = [[torch.as_tensor(np.asarray(v)) for v in batch[n]] for n in self.names]
        values = columns[0] if len(columns) == 1 else list(zip(*columns))
        return values, list(self.names)

    def __call__(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        from overdrive.core.workload import equal_length_batches
        from overdrive.run.threads import nonfinite_rows, normalize_rows

        values, used = self._values(batch)
        n = len(values)
        order = list(range(n))
        counts = self.lengths(values) if self.lengths is not None else None
        if counts is not None:  # length bucketing inside the block: longest first, ties by position
            order.sort(key=lambda i: (-counts[i], i))
        if counts is not None and self.equal_lengths:  # none padded: the model's answer depends on it
            chunks = equal_length_batches(order, counts.__getitem__, self.batch_size)
        else:
            chunks = [order[start:start + self.batch_size] for start in range(0, n, self.batch_size)]
        outputs, errors = None, [""] * n
        for chunk in chunks:
            host = self.collate([(i, values[i], False, 0.0) for i in chunk])
            for i, why in host.errors:
                errors[i] = why
            if host.inputs is None:
                continue
            rows = self.replica.outputs(host.inputs).numpy()
            for r, why in nonfinite_rows(rows):  # a failed record, as `overdrive run` files it
                errors[host.indices[r]] = why
                rows[r] = np.nan
            rows = normalize_rows(rows) if self.normalize else rows
            if outputs is None:
                outputs = np.full((n, *rows.shape[1:]), np.nan, dtype=np.float32)
            outputs[host.indices] = rows
        if outputs is None:
            first = next(e for e in errors if e)
            raise DataError(f"none of the block's {n} records is an input this model takes (the first: {first})")
        result = {k: np.asarray(v) for k, v in batch.items() if k not in used}
        result["output"] = outputs
        result["error"] = np.asarray(errors, dtype=object)
        if self.classifier:
            failed = np.asarray([bool(e) for e in errors])
            result["prediction"] = np.where(failed, -1, np.nan_to_num(outputs.reshape(n, -1)).argmax(axis=1)).astype(np.int64)
        return result


def run_on_ray(*, plan: str | Path, input: Path, output: Path, concurrency: int = 1, text_field: str | None = None,
               overwrite: bool = False, address: str | None = None) -> dict[str, Any]:
    """`overdrive run PLAN --engine ray`: the input's records through `Predictor` actors on Ray Data, written
    as `overdrive run` writes them. Starts a local Ray instance unless one is running (or `address` is given).

    Returns:
        {"records", "failed", "wall_s", "items_per_s", "concurrency"}.

    Raises:
        ConfigError: no plan, Ray not installed, or OUTPUT exists without `overwrite`.
        DataError: the input cannot be read.
    """
    import time

    try:
        import ray
    except ImportError:
        raise ConfigError(f"{arg('engine', 'ray')} needs Ray Data: pip install 'ray[data]'") from None
    from overdrive.files.inputs import RecordError, open_source
    from overdrive.run.outputs import OutputChunk, output_format, write_output
    from overdrive.run.resume import errors_file
    from overdrive.files.tensor_sources import input_names
    from overdrive.tuning.plan import load_plan

    fmt = output_format(Path(output))
    if Path(output).exists() and not overwrite:
        raise ConfigError(f"{arg('output', output)} exists; pass {arg('overwrite', True)} to replace it")
    loaded, _, _ = load_plan(plan, device="cpu")
    workload = loaded.create_workload()
    source = open_source(Path(input), workload, text_field=text_field)
    if len(source) == 0:
        raise DataError(f"{arg('input', input)} holds no records")
    names = ["text"] if workload.is_text else input_names(workload)
    items, unreadable = [], {}
    for i in range(len(source)):
        try:
            value = source.read(i)
        except RecordError as exc:
            unreadable[i] = str(exc)
            continue
        columns = (value,) if workload.is_text or not isinstance(value, tuple) else value
        items.append({"index": i, **{n: (c if workload.is_text else np.asarray(c)) for n, c in zip(names, columns)}})
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, num_cpus=max(concurrency, 1) if address is None else None, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray Data's progress lines; overdrive prints its own summary
    try:
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        start = time.perf_counter()
        threads = max(1, torch.get_num_threads() // max(concurrency, 1))
        blocks = max(concurrency, math.ceil(len(items) / BLOCK_ROWS))
        ds = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
            Predictor, fn_constructor_kwargs={"plan": str(Path(plan).resolve()), "device": "cpu", "threads": threads},
            concurrency=concurrency, batch_size=math.ceil(len(items) / blocks), batch_format="numpy", num_cpus=1)
        rows = sorted(ds.take_all(), key=lambda r: int(r["index"]))
        wall = time.perf_counter() - start
    finally:
        if started:
            ray.shutdown()
    if not rows:
        raise DataError(f"{arg('input', input)}: none of its records could be read")
    row_shape = tuple(np.asarray(rows[0]["output"]).shape)
    outputs = np.full((len(source), *row_shape), np.nan, dtype=np.float32)
    failed = np.ones(len(source), dtype=bool)
    errors = dict(unreadable)
    for r in rows:
        i = int(r["index"])
        if r["error"]:
            errors[i] = str(r["error"])
        else:
            outputs[i], failed[i] = np.asarray(r["output"], dtype=np.float32), False
    write_output(Path(output), fmt, [OutputChunk(0, outputs, failed)], total=len(source), row_shape=row_shape,
                 keys=source.source_key if source.format == "images" else None,
                 classifier=workload.has_task_metric or bool(workload.extra.get("classifier")))
    errors_path = errors_file(Path(output))
    if errors:
        errors_path.write_text("".join(json.dumps({"index": i, "source": source.source_key(i), "reason": r}) + "\n"
                                       for i, r in sorted(errors.items())))
    else:
        errors_path.unlink(missing_ok=True)
    return {"records": len(source), "failed": len(errors), "wall_s": wall, "items_per_s": len(source) / wall if wall else 0.0,
            "concurrency": concurrency}
