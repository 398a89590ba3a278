"""`overdrive run`: offline batch inference over a whole dataset, resumable, at the device's speed.

This module sets a run up (claim the output, build the replicas, choose the batch size), then
hands it to the threads in `overdrive.run.threads`, and assembles the output at the end.

The flow, one process:

    main thread      chunk planner -> DataLoader (worker processes read, decode, tokenize) -> input queue
    replica threads  one per device: the next batch's host->device copy on a side CUDA stream
                     while the current batch computes; device->host copy (non_blocking, pinned)
    writer thread    waits for each batch's copy, places its rows, writes every finished chunk
    at the end       the chunks are assembled into OUTPUT (atomic rename), errors into OUTPUT.errors.jsonl

Invariants:
- Chunks: records [k·C, (k+1)·C) form chunk k. A chunk's batches are cut from the chunk alone
  (for text: sorted by token count, longest first, ties by index), so a chunk's results do not depend
  on which chunks ran before it, in this run or an earlier one. This is what makes
  resuming byte-identical to an uninterrupted run.
- A chunk is done when `OUTPUT.parts/chunk-K.npy` exists: it is written to a temporary name,
  flushed to disk, then renamed. A kill at any point leaves whole chunks or no chunk.
- Every input index gets exactly one row: an output, or a line in the errors file (a record
  that cannot be read or decoded, or whose inputs are outside what the model takes: an id past
  an embedding's rows, a NaN; `overdrive.core.input_limits`, checked in the reader so such a
  record never reaches the model), or that the model answered with NaN or an infinity (its `.npy`
  row stays NaN); none is duplicated or lost. Outputs are keyed by input index
  and written in input order whatever the bucketing and the number of workers or replicas.
- One process writes an output at a time: `OUTPUT.parts/` is claimed and flock-ed before the
  model is built (`overdrive.run.resume`), and a second run into it is refused.
- A row's answer does not depend on its batch-mates: a text model whose answer depends on padding
  gets batches of records of one token count only, and a model whose rows depend on their
  batch-mates runs one record per batch (`Workload.batch_dependence`, a plan's record or measured).
- On CPU the same code path runs without streams or pinned memory (copies are no-ops).

Timing: on CUDA, copies and compute are timed with CUDA events on their streams; the device
busy fraction is the compute stream's busy time over wall time. On CPU, perf_counter.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from overdrive.core.devices import replica_devices, resolve_device, serial_main_thread, settle_host_allocator
from overdrive.core.errors import ConfigError, DataError, OverdriveError, RunAborted, arg, one_line
from overdrive.core.input_limits import workload_input_limits
from overdrive.core.measure import compiled_graphs
from overdrive.core.row_dependence import checked_dependence
from overdrive.core.workload import BATCH_MATES, Workload
from overdrive.files.inputs import RecordSource, open_source
from overdrive.files.tensor_sources import input_names
from overdrive.run.outputs import OutputChunk, write_output
from overdrive.run.replica import (
    Collate,
    pad_records,
    Replica,
    batch_from,
    warm_up_batches,
    measure_auto_batch_size,
    probe_inputs,
    text_lengths,
)
from overdrive.core.digest import weights_fingerprint
from overdrive.run.resume import (
    MANIFEST_VERSION,
    Parts,
    atomic_write,
    check_manifest,
    check_probe,
    checkpoint_fingerprints,
    claim_output,
    errors_file,
    file_sha256,
)
from overdrive.run.threads import _execute, _records, _Run, _write_failed

DEFAULT_CHUNK_SIZE = 4096
AUTO_MAX_BATCH = 1024


@dataclass(kw_only=True)
class RunConfig:
    """What to run.

    Attributes:
        workload: workload spec (`minilm`, `digits-cnn`, a torchvision name, module:factory), or None with a plan.
        input: input file or image folder (see `overdrive.files.inputs`).
        output: `.npy`, `.parquet`, `.csv` or `.jsonl`.
        plan: plan.json from `optimize`: its techniques and batch size.
        device: "auto", "cpu", "cuda" (every GPU, one replica each) or "cuda:N".
        batch_size: rows per batch; "auto" measures it; None: the plan's, else the workload's.
        text_field: JSONL field / CSV column holding the text (default "text").
        num_workers: DataLoader worker processes; None: 0 on a CPU device with ≤ 2 cores, else up to 8.
        chunk_size: records per chunk (rounded up to a multiple of the batch size).
        resume, overwrite: what to do with an existing output (see `claim_output`).
        max_errors: stop once more records than this have failed (None: no limit).
        bucket: sort text by length within each chunk (length bucketing).
        weights: a checkpoint loaded into the model (`overdrive.workloads.weights`); a plan loads its own.
        replicas: model replicas; None: one per GPU on `cuda`, 1 otherwise (tests set 2 on CPU).
    """

    workload: str | None
    input: Path
    output: Path
    plan: Path | None = None
    device: str = "auto"
    batch_size: int | str | None = None
    text_field: str | None = None
    num_workers: int | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    resume: bool = False
    overwrite: bool = False
    max_errors: int | None = None
    bucket: bool = True
    replicas: int | None = None
    weights: Path | None = None


@dataclass
class RunSummary:
    """What a run did. Times in seconds; `phases_s` says where the wall time went: `read_decode`
    (worker processes' time reading, decoding and collating, summed over workers), `wait_input`
    (replicas idle waiting for a batch), `h2d_copy`, `compute`, `d2h_copy`, `write` (chunks),
    `assemble` (the final output)."""

    output: str
    errors_path: str | None
    records: int
    done_before: int
    processed: int
    failed: int
    wall_s: float
    items_per_s: float
    batch_size: int
    batch_size_source: str
    auto_batch: list[dict[str, float]]
    device: str
    replicas: int
    num_workers: int
    device_busy_fraction: float
    phases_s: dict[str, float]
    nothing_to_resume: bool = False  # `resume` found OUTPUT and no interrupted run recorded for it
    setup_s: float = 0.0  # building the model, reading the first records, warm-up, `auto` (before wall_s)
    recompiles: int = 0  # graphs torch.compile compiled while the records ran (after the warm-up)
    warnings: list[str] = field(default_factory=list)  # the run against what the plan claimed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _build(config: RunConfig, workload: Workload | None):
    """(workload, plan, devices, models) from the config; OverdriveError for the user's mistakes."""
    from overdrive.tuning.plan import load_plan
    from overdrive.techniques.compose import build_on_devices
    from overdrive.workloads import create_workload

    plan = None
    device_name = config.device
    if config.plan is not None:
        plan, resolved, device_name = load_plan(config.plan, device=config.device, workload=config.workload)
    else:
        resolved = resolve_device(device_name)
    if workload is None:
        workload = plan.create_workload() if plan else create_workload(config.workload)
        if config.weights is not None:
            from overdrive.workloads.weights import load_weights

            load_weights(workload, config.weights)
    devices = replica_devices(resolved, device_name)
    count = config.replicas or len(devices)
    devices = [devices[i % len(devices)] for i in range(count)]
    return workload, plan, devices, build_on_devices(workload, plan.steps if plan else [], devices)


def run_offline(config: RunConfig, *, workload: Workload | None = None, progress=None, status=None) -> RunSummary:
    """Run the workload's (or plan's) model over every record of `config.input` into `config.output`.

    Args:
        workload: a built workload to use instead of building `config.workload` (tests, benchmarks).
        progress: called as progress(items_done, items_failed, device_busy_fraction) from the
            writer thread, and once as progress(None, total, 0.0) before the first batch.
        status: called with a line of text before slow steps (building, measuring `auto`).

    Returns:
        The RunSummary (`nothing_to_resume` when `resume` finds OUTPUT and no interrupted run).

    Raises:
        OverdriveError: bad input, output or options (one line for the CLI, exit 2).
        RunAborted: more than `max_errors` records failed, or the model raised (exit 1).
        KeyboardInterrupt: Ctrl-C; the finished chunks stay for a `resume`.
    """
    out_fmt, mode, parts = claim_output(config)
    if mode == "complete":
        return _complete_summary(config)
    settle_host_allocator()  # eager activations from the heap, not page faults every call (devices.settle_host_allocator)
    cores = serial_main_thread()  # the model runs in the replicas' threads (devices.serial_main_thread)
    try:
        return _run_claimed(config, workload, out_fmt, mode, parts, progress, status or (lambda text: None),
                            cores)
    finally:
        torch.set_num_threads(cores)
        parts.unlock()  # a process's end releases it too (SIGKILL included); this is for errors in-process


def _run_claimed(config: RunConfig, workload: Workload | None, out_fmt: str, mode: str, parts: Parts, progress, say,
                 cores: int) -> RunSummary:
    setup_start = time.perf_counter()
    try:
        say("building the model")
        workload, plan, devices, models = _build(config, workload)
        source = open_source(config.input, workload, text_field=config.text_field)
        if len(source) == 0:
            raise DataError(f"{arg('input', config.input)} holds no records")
        on_cpu = sum(d.type == "cpu" for d in devices)  # CPU replicas split the cores
        replicas = [Replica(m, d, workload.fixed_batch_size, max(1, cores // on_cpu) if d.type == "cpu" else None)
                    for m, d in zip(models, devices)]
        limits = replicas[0].in_own_thread(workload_input_limits, workload)  # one call of the fp32 model, off the main thread
        # whether a row's answer depends on its batch-mates: the plan's record, or measured (text); rows are batched by it
        replicas[0].in_own_thread(checked_dependence, workload, plan.batch_dependence if plan else None)
        padded = functools.partial(pad_records, workload.dynamic_dims, max_size=workload.extra.get("max_dynamic_size")) \
            if workload.dynamic_dims else None
        names = [f"input {n!r}" for n in input_names(workload)] if source.kind == "tensor" else None
        collate = Collate(workload.collate if source.kind == "text" else padded, 1, limits, names)
        # The manifest: everything a resumed run must share with the first one to give the same bytes.
        manifest = {"version": MANIFEST_VERSION, "workload": workload.name,
                    "plan": file_sha256(config.plan) if config.plan else None,
                    "weights": weights_fingerprint(workload.model),
                    "checkpoints": checkpoint_fingerprints(plan.steps) if plan else {}, "device": devices[0].type,
                    "input": source.fingerprint(), "text_field": config.text_field, "output_format": out_fmt,
                    "bucket": config.bucket, "batch_size": None, "chunk_size": None}
        stored = check_manifest(parts, manifest, config.output) if mode == "resume" else manifest
        values = probe_inputs(source, lengths=text_lengths(workload) if source.kind == "text" else None)
        if not values:
            raise DataError(f"{arg('input', config.input)}: none of its first records can be read (e.g. {_first_error(source)})")
        taken = [v for v in values if collate.accepts(v)]  # warm-up and `auto` run on records the model takes
        if not taken:
            raise DataError(f"{arg('input', config.input)}: none of its first {len(values)} readable records is an input "
                            f"this model takes (the first: {collate(([(0, values[0], False, 0.0)])).errors[0][1]})")
        values = taken
        row_shape = tuple(replicas[0].in_own_thread(replicas[0].warm_up, batch_from(values, 1, collate)))
        # What the model answers for one record: a change the weights' fingerprint cannot see (code, a plain
        # attribute) shows here, before a resume mixes two models in one output.
        manifest["probe"] = probe_answer(replicas[0], values, collate)
        if mode == "resume":
            check_probe(stored, manifest["probe"], config.output)
        for r in replicas[1:]:
            r.in_own_thread(r.warm_up, batch_from(values, 1, collate))
        auto: list[dict[str, float]] = []
        if stored.get("batch_size"):
            batch_size, origin, chunk_size = stored["batch_size"], "the interrupted run", stored["chunk_size"]
            if isinstance(config.batch_size, int) and config.batch_size != batch_size:
                raise ConfigError(f"{arg('resume', True)} continues the interrupted run at its batch size {batch_size}, "
                                  f"which cut its finished chunks; leave out {arg('batch_size', config.batch_size)}, or "
                                  f"pass {arg('overwrite', True)} to start over at the new size")
        else:
            batch_size, origin = _choose_batch_size(config, workload, plan, replicas[0], values, collate, len(source), say, auto)
            if workload.fixed_batch_size and batch_size > workload.fixed_batch_size:
                raise ConfigError(f"this model runs only at batch size {workload.fixed_batch_size}; {arg('batch_size')} must be ≤ that")
            chunk_size = math.ceil(config.chunk_size / batch_size) * batch_size
            stored = manifest | {"batch_size": batch_size, "chunk_size": chunk_size}
            atomic_write(parts.dir / "manifest.json", json.dumps(stored, indent=1).encode())
        if batch_size > 1:  # the shapes the records will come in: a compiled model builds its graphs for them now,
            for r in replicas:  # in the set-up, not in the first batch (torch.compile specialises a batch of 1)
                for inputs in warm_up_batches(values, batch_size, collate, equal_lengths_only=workload.equal_lengths_only):
                    r.in_own_thread(r.warm_up, inputs)
        collate.chunk_size = chunk_size
    except BaseException as exc:
        if not parts.done():  # nothing ran yet: leave no half-made run behind to resume
            parts.remove()
        if isinstance(exc, Exception) and not isinstance(exc, OverdriveError):
            raise RunAborted(f"the model failed on a first batch of the input: {one_line(exc)}") from exc
        raise

    parts.clean_temporaries()
    chunks = math.ceil(len(source) / chunk_size)
    finished = parts.done() & set(range(chunks))
    pending = [k for k in range(chunks) if k not in finished]
    done_before = sum(min(len(source), (k + 1) * chunk_size) - k * chunk_size for k in finished)
    failed_before = sum(len(parts.read_errors(k)) for k in finished)
    if config.max_errors is not None and failed_before > config.max_errors:
        raise RunAborted(f"{_records(failed_before)} failed in the chunks already done, more than {arg('max_errors')} "
                         f"{config.max_errors}; the reasons are in {parts.dir}/chunk-*.errors.json")
    num_workers = config.num_workers if config.num_workers is not None else _default_workers(devices[0], source)
    if num_workers and source.kind == "text":
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers: no tokenizer thread pools

    run = _Run(source=source, replicas=replicas, parts=parts, chunk_size=chunk_size, row_shape=row_shape, pending=pending,
               max_errors=config.max_errors, progress=progress, done_before=done_before, failed_before=failed_before,
               normalize=bool(workload.extra.get("normalize_embeddings")))
    if progress:
        progress(None, len(source), 0.0)
        progress(done_before, failed_before, 0.0)
    start = time.perf_counter()
    setup_s = start - setup_start
    graphs_before = compiled_graphs()
    if pending:
        _execute(run, source, collate, batch_size, chunk_size, config.bucket, num_workers, devices[0].type == "cuda",
                 text_lengths(workload) if source.kind == "text" else None,
                 equal_lengths=workload.equal_lengths_only and source.kind == "text")
    wall = time.perf_counter() - start
    start = time.perf_counter()
    try:
        failed = _assemble(config.output, out_fmt, parts, source, chunk_size, row_shape, workload)
    except OSError as exc:
        raise _write_failed(exc) from exc
    run.clock.add("assemble", time.perf_counter() - start)
    wall += run.clock.phases["assemble"]
    busy = run.clock.phases["compute"] / max(wall, 1e-9) / len(replicas)
    compiled = compiled_graphs() - graphs_before
    warnings = _slower_than_the_plan(plan, run.processed, run.clock.phases["compute"], batch_size, compiled)
    if workload.extra.get("weights_differ_from_plan"):
        warnings.insert(0, workload.extra["weights_differ_from_plan"])
    if workload.batch_dependence is not None:
        warnings.insert(0, workload.batch_dependence.describe())
    return RunSummary(
        output=str(config.output), errors_path=str(errors_file(config.output)) if failed else None,
        records=len(source), done_before=done_before, processed=run.processed, failed=failed, wall_s=wall,
        items_per_s=run.processed / wall if wall else 0.0, batch_size=batch_size, batch_size_source=origin,
        auto_batch=auto, device=str(devices[0]) if len(set(devices)) == 1 else f"{len(set(devices))} × {devices[0].type}",
        replicas=len(replicas), num_workers=num_workers, device_busy_fraction=busy, phases_s=dict(run.clock.phases),
        setup_s=setup_s, recompiles=compiled, warnings=warnings)


def _slower_than_the_plan(plan, processed: int, compute_s: float, batch_size: int, recompiles: int) -> list[str]:
    """What to tell the user when the model computed rows at under half the rate `optimize` measured
    for the plan (its rows differ from these: longer, other shapes that recompile), or recompiled
    while the run went on (each new shape costs seconds)."""
    warnings = []
    if recompiles:
        warnings.append(f"torch.compile compiled {recompiles} new graph(s) during the run (shapes the warm-up did not "
                        "cover); each costs seconds, and a plan that compiles per shape is slower here than eager")
    claimed = (plan.measured or {}).get("samples_per_s") if plan is not None else None
    if claimed and processed >= 4 * batch_size and compute_s > 0 and processed / compute_s < 0.5 * claimed:
        warnings.append(f"the model computed {processed / compute_s:,.1f} rows/s here, under half the {claimed:,.1f} samples/s "
                        f"optimize measured for this plan at batch {plan.batch_size} on its evaluation rows: these rows "
                        "differ from those (longer, or shapes that recompile), or the machine is busy; the plan's speedup "
                        "may not hold for them")
    return warnings


def probe_answer(replica: Replica, values: list, collate: Collate) -> dict[str, Any]:
    """The model's outputs for 4 records from the middle of `values` (the first readable records,
    text sorted by length), in one batch: {"values": their first 64 numbers, "norm": their L2 norm}."""
    n = min(4, len(values), replica.fixed_batch_size or 4)
    rows = replica.in_own_thread(replica.outputs, batch_from(values, n, collate))
    flat = rows.reshape(-1).double()
    return {"values": [float(v) for v in flat[:64]], "norm": float(flat.norm())}


def _choose_batch_size(config, workload, plan, replica, values, collate, records, say, auto) -> tuple[int, str]:
    dependence = workload.batch_dependence
    if dependence is not None and dependence.kind == BATCH_MATES:  # only a batch of one row gives a row its own answer
        asked = isinstance(config.batch_size, int) and config.batch_size > 1
        if asked or (workload.fixed_batch_size or 1) > 1:
            what = arg("batch_size", config.batch_size) if asked else f"the model's fixed batch size {workload.fixed_batch_size}"
            raise ConfigError(f"{what} would change the answers: the model's answer for a row depends on its batch-mates "
                              f"({dependence.detail}), so rows must run one at a time ({arg('batch_size', 1)})")
        return 1, "one row per batch (the model's rows depend on their batch-mates)"
    if config.batch_size == "auto":
        if workload.fixed_batch_size:
            return workload.fixed_batch_size, "the model's fixed batch size"
        say("measuring the batch size (auto)")
        size, tried = replica.in_own_thread(functools.partial(measure_auto_batch_size, replica, values, collate,
                                                              limit=min(AUTO_MAX_BATCH, records)))
        auto.extend(tried)
        return size, "auto (measured)"
    if config.batch_size is not None:
        return int(config.batch_size), "the batch size asked for"
    if plan is not None:
        return plan.batch_size, "the plan"
    return workload.fixed_batch_size or workload.default_batch_size, "the workload's default"


def _default_workers(device: torch.device, source: RecordSource) -> int:
    cores = os.cpu_count() or 1
    if device.type == "cpu" and cores <= 2:
        return 0  # on 2 cores a worker process takes a core from compute; reading in-line is faster
    return max(1, min(8, cores - 2))


def _first_error(source: RecordSource) -> str:
    try:
        source.read(0)
    except Exception as exc:  # noqa: BLE001
        return f"{source.source_key(0)}: {exc}"
    return "?"


def _assemble(output: Path, fmt: str, parts: Parts, source: RecordSource, chunk_size: int, row_shape, workload) -> int:
    """Write OUTPUT and OUTPUT.errors.jsonl from the chunks (each to a temporary name, then
    renamed), then remove the chunks. Returns the number of failed records."""
    chunks = math.ceil(len(source) / chunk_size)
    all_errors: list[tuple[int, str]] = []

    def read_all() -> Iterator[OutputChunk]:
        for k in range(chunks):
            chunk, errors = parts.read_chunk(k, k * chunk_size)
            all_errors.extend(errors)
            yield chunk

    tmp = output.with_name(output.name + ".tmp")
    keys = source.source_key if source.format == "images" else None
    write_output(tmp, fmt, read_all(), total=len(source), row_shape=tuple(row_shape), keys=keys,
                 classifier=workload.has_task_metric or bool(workload.extra.get("classifier")))
    errors_path = errors_file(output)
    if all_errors:
        lines = "".join(json.dumps({"index": i, "source": source.source_key(i), "reason": r}) + "\n" for i, r in all_errors)
        atomic_write(errors_path, lines.encode())
    else:
        errors_path.unlink(missing_ok=True)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, output)
    parts.remove()
    return len(all_errors)


def _complete_summary(config: RunConfig) -> RunSummary:
    errors = errors_file(config.output)
    failed = sum(1 for _ in errors.open()) if errors.exists() else 0
    return RunSummary(output=str(config.output), errors_path=str(errors) if failed else None, records=0,
                      done_before=0, processed=0, failed=failed, wall_s=0.0, items_per_s=0.0, batch_size=0,
                      batch_size_source="", auto_batch=[], device="-", replicas=0, num_workers=0,
                      device_busy_fraction=0.0, phases_s={}, nothing_to_resume=True)


# -- the command ---------------------------------------------------------------------------------
