"""Batches of records and the model replica that runs them, for `overdrive run`.

A `HostBatch` is what the DataLoader delivers: the decoded records of one batch, collated into
the model's inputs by worker processes (`RecordDataset`, `Collate`). `chunk_batches` cuts a
chunk into batches (text sorted by token count). A `Replica` is one model on one device: it
starts a batch's host->device copy on a side CUDA stream (`upload`), then runs the model and
starts the device->host copy into pinned memory (`compute`); on CPU the same calls run without
streams. `measure_auto_batch_size` is `batch_size="auto"`.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from overdrive.core.errors import one_line
from overdrive.core.input_limits import InputLimits
from overdrive.core.memory import owned_host_float32
from overdrive.core.timer import Timer
from overdrive.core.workload import Workload, equal_length_batches, pad_stack, warm_up_rows
from overdrive.files.inputs import RecordError, RecordSource

AUTO_GAIN = 1.05  # batch_size "auto" doubles while items/s rises by at least 5%


@dataclass
class HostBatch:
    """One batch as the DataLoader delivers it: the decoded records' indices (batch order), their
    collated inputs (None when all failed), the records that failed with their reasons, and the
    worker's seconds spent reading, decoding and collating it."""

    chunk: int
    indices: list[int]
    inputs: tuple[torch.Tensor, ...] | None
    errors: list[tuple[int, str]]
    read_s: float

    def pin_memory(self) -> HostBatch:  # called by the DataLoader's pin-memory thread (CUDA runs)
        if self.inputs is not None:
            self.inputs = tuple(t.pin_memory() for t in self.inputs)
        return self


class RecordDataset(torch.utils.data.Dataset):
    """Map-style view of a RecordSource: item i is (i, record or failure reason, seconds)."""

    def __init__(self, source: RecordSource):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        start = time.perf_counter()
        try:
            value, failed = self.source.read(i), False
        except RecordError as exc:
            value, failed = str(exc), True
        except Exception as exc:  # a reader bug or an odd file must not end the run: file it for this record
            value, failed = f"cannot read: {one_line(exc)}", True
        return i, value, failed, time.perf_counter() - start


def pad_records(dims: dict[int, tuple[int, ...]], values: list, max_size: int | None = None) -> tuple[torch.Tensor, ...]:
    """Tensor records (a tensor, or a tuple per input) whose sizes vary at `dims`
    (`Workload.dynamic_dims`) -> the model's inputs, zero-padded per batch (`pad_stack`; a record
    that cannot be padded raises ValueError, and `Collate` files it)."""
    return pad_stack(dims, [v if isinstance(v, tuple) else (v,) for v in values], max_size=max_size)


class Collate:
    """Picklable collate_fn: good records -> the model's inputs (`collate_text`: the workload's
    tokenizer for text, or `pad_records` for tensors of varying sizes; else stacked); a collate failure is narrowed to the records that cause it, and a record
    whose inputs break the model's `limits` (an id past an embedding's rows, a NaN) is filed as
    failed and never reaches the model."""

    def __init__(self, collate_text: Callable | None, chunk_size: int, limits: InputLimits | None = None,
                 names: list[str] | None = None):
        self.collate_text = collate_text
        self.chunk_size = chunk_size
        self.limits = limits or InputLimits()
        self.names = names  # what errors call each model input ("input 'input_ids'"); None: "model input i"

    def accepts(self, value) -> bool:
        """Whether one record collates into inputs within the model's limits."""
        try:
            return not self.limits.row_problems(self._collate([value]))
        except Exception:  # noqa: BLE001
            return False

    def _collate(self, values: list) -> tuple[torch.Tensor, ...]:
        if self.collate_text is not None:
            return tuple(self.collate_text(values))
        if isinstance(values[0], tuple):  # a model with several inputs: a tensor per input, stacked
            return tuple(torch.stack(column) for column in zip(*values))
        return (torch.stack(values),)

    def __call__(self, items) -> HostBatch:
        start = time.perf_counter()
        good = [(i, v) for i, v, failed, _ in items if not failed]
        errors = [(i, v) for i, v, failed, _ in items if failed]
        inputs = None
        if good:
            try:
                inputs = self._collate([v for _, v in good])
            except Exception:  # find the records that break it; the rest go on
                kept = []
                for i, v in good:
                    try:
                        self._collate([v])
                        kept.append((i, v))
                    except Exception as exc:
                        errors.append((i, f"cannot prepare as model input: {one_line(exc)}"))
                good = kept
                inputs = self._collate([v for _, v in good]) if good else None
            problems = self.limits.row_problems(inputs, self.names) if inputs is not None and self.limits else {}
            if problems:  # collated again without them, so they are not even padding for the others
                errors += [(good[r][0], f"not an input this model takes: {reason}") for r, reason in problems.items()]
                good = [g for r, g in enumerate(good) if r not in problems]
                inputs = self._collate([v for _, v in good]) if good else None
        read_s = sum(s for *_, s in items) + time.perf_counter() - start
        return HostBatch(items[0][0] // self.chunk_size, [i for i, _ in good], inputs, sorted(errors), read_s)


def chunk_batches(source: RecordSource, chunk: int, chunk_size: int, batch_size: int, bucket: bool,
                  lengths: Callable[[list[str]], list[int]] | None = None, *,
                  equal_lengths: bool = False) -> list[list[int]]:
    """The batches of chunk `chunk`: lists of input indices. Text is sorted by length (longest
    first, ties by index) when `bucket`, so each batch pads to similar lengths; otherwise input order.
    With `equal_lengths` (a model whose answer depends on padding), text batches hold records of one
    token count only, whatever `bucket` says, so none is padded (`equal_length_batches`).

    Args:
        lengths: texts -> token counts (`text_lengths`); None: the source's cheap hint (characters).
    """
    start, stop = chunk * chunk_size, min(len(source), (chunk + 1) * chunk_size)
    order = list(range(start, stop))
    if (bucket or equal_lengths) and source.kind == "text":
        if lengths is None:
            hints = source.length_hints(order)
        else:
            texts = []
            for i in order:
                try:
                    texts.append(source.read(i))
                except RecordError:
                    texts.append("")  # it fails again in the reader, which files it
            hints = lengths(texts)
        if equal_lengths:
            count = dict(zip(order, hints))
            return equal_length_batches(order, count.__getitem__, batch_size)
        order = [i for _, i in sorted(zip(hints, order), key=lambda p: (-p[0], p[1]))]
    return [order[s: s + batch_size] for s in range(0, len(order), batch_size)]


def text_lengths(workload: Workload) -> Callable[[list[str]], list[int]] | None:
    """Token counts for length bucketing: the workload's tokenizer on a whole chunk at once
    (`extra["tokenizer"]`, truncated at `extra["max_seq_length"]`), else its `sample_length` per
    text. Characters are a poor proxy: in CPython's documentation, sorting by characters left
    batches padded to 45 tokens on average where sorting by tokens gives 29 (MiniLM, batch 32)."""
    tokenizer = workload.extra.get("tokenizer")
    if tokenizer is not None:
        limit = workload.extra.get("max_seq_length")
        options = {"truncation": True, "max_length": limit} if limit else {}

        def count(texts: list[str]) -> list[int]:
            if limit:  # a token spans at most a word (WordPiece stops at 100 characters): no need to read a huge line whole
                texts = [t[: 128 * limit] for t in texts]
            return [len(x) for x in tokenizer(texts, **options)["input_ids"]]

        return count
    if workload.sample_length is not None:
        return lambda texts: [workload.sample_length(t) for t in texts]
    return None


# -- replicas ------------------------------------------------------------------------------------


@dataclass
class Staged:
    batch: HostBatch
    inputs: tuple[torch.Tensor, ...] | None
    ready: Any = None  # CUDA event: the copy is done
    events: tuple = ()


@dataclass
class Result:
    batch: HostBatch
    output: torch.Tensor | None  # host float32 [rows, ...] (pinned on CUDA; valid after `done`)
    done: Any = None  # CUDA event after the device->host copy
    events: tuple = ()  # CUDA (h2d start, h2d end, compute start, compute end, d2h end)
    times: tuple = ()  # CPU seconds (h2d, compute, d2h)


class Replica:
    """One model on one device, with its copy stream (CUDA).

    Its work (warm-up, the auto batch-size search, the run's batches) runs in threads of its
    own, never in the main thread, each set to `threads` intra-op threads (`in_own_thread`;
    why: `devices.serial_main_thread`).
    """

    def __init__(self, model: nn.Module, device: torch.device, fixed_batch_size: int | None, threads: int | None = None):
        self.model = model
        self.device = device
        self.fixed_batch_size = fixed_batch_size
        self.threads = threads  # intra-op threads of the replica's threads (None: leave as they are)
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def enter_thread(self) -> None:
        """Set up the calling thread to run this replica: its intra-op threads, its CUDA device."""
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.cuda:
            torch.cuda.set_device(self.device)

    def in_own_thread(self, fn, *args):
        """`fn(*args)` in a new thread set up by `enter_thread`; its result, or its exception re-raised."""
        outcome: list = []

        def target():
            try:
                self.enter_thread()
                outcome.append((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
                outcome.append((False, exc))

        thread = threading.Thread(target=target, name=f"replica-{self.device}-setup", daemon=True)
        thread.start()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def upload(self, batch: HostBatch) -> Staged:
        """Start the host->device copy of `batch` (CUDA: on the copy stream, non_blocking from pinned memory)."""
        if batch.inputs is None:
            return Staged(batch, None)
        inputs = batch.inputs
        if self.fixed_batch_size and inputs[0].shape[0] < self.fixed_batch_size:  # a static-batch program: pad with row 0
            pad = self.fixed_batch_size - inputs[0].shape[0]
            inputs = tuple(torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) for t in inputs)
        if not self.cuda:
            return Staged(batch, inputs)
        start, ready = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            start.record()
            moved = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            ready.record()
        return Staged(batch, moved, ready, (start, ready))

    def compute(self, staged: Staged) -> Result:
        """Run the model on a staged batch and start copying the float32 output back."""
        batch = staged.batch
        if staged.inputs is None:
            return Result(batch, None)
        rows = len(batch.indices)
        if not self.cuda:
            start = time.perf_counter()
            output = self.model(*staged.inputs)
            mid = time.perf_counter()
            host = owned_host_float32(_check_output(output, staged.inputs[0].shape[0])[:rows])  # the writer reads it later
            return Result(batch, host, times=(0.0, mid - start, time.perf_counter() - mid))
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.ready)
        for t in staged.inputs:
            t.record_stream(stream)  # the copy stream allocated them; keep them alive until this stream is done
        begin, end, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        begin.record(stream)
        output = self.model(*staged.inputs)
        end.record(stream)
        output = _check_output(output, staged.inputs[0].shape[0])[:rows].float()
        # Owned before the next call: the copy is enqueued on `stream` now, and the model's next
        # call is enqueued on the same stream after it, so it cannot overwrite a buffer the model
        # reuses (CUDA graphs) before the copy has read it.
        host = torch.empty(output.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(output, non_blocking=True)
        done.record(stream)
        return Result(batch, host, done, (*staged.events, begin, end, done))

    @torch.inference_mode()
    def outputs(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One call on a host batch: its float32 outputs [rows, ...] on the host, once they are there."""
        staged = self.upload(HostBatch(0, list(range(inputs[0].shape[0])), inputs, [], 0.0))
        result = self.compute(staged)
        if result.done is not None:
            result.done.synchronize()
        return result.output

    def warm_up(self, inputs: tuple[torch.Tensor, ...]) -> torch.Size:
        """One call (lazy initialisation, kernel selection); returns the output's row shape."""
        return self.outputs(inputs).shape[1:]


def _check_output(output, rows: int) -> torch.Tensor:
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != rows:
        shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise RuntimeError(f"the model returned {shape} for a batch of {rows} rows; expected one tensor [rows, ...]")
    return output


def probe_inputs(source: RecordSource, limit: int = 256, lengths: Callable[[list[str]], list[int]] | None = None) -> list:
    """Decoded records from the start of the input (the ones that decode), for warm-up and `auto`;
    text sorted by `lengths` (token counts, `text_lengths`), else by characters."""
    values = []
    for i in range(min(len(source), 4 * limit)):
        try:
            values.append(source.read(i))
        except Exception:  # noqa: BLE001 (a bad record at the start is just skipped here)
            continue
        if len(values) >= limit:
            break
    if source.kind == "text":
        counts = lengths(values) if lengths is not None else [len(v) for v in values]
        values = [v for _, v in sorted(zip(counts, values), key=lambda pair: pair[0])]
    return values


def batch_from(values: list, size: int, collate: Collate) -> tuple[torch.Tensor, ...]:
    """`size` records centred on the middle of `values` (sorted by length for text), cycled when too few."""
    mid = max(0, len(values) // 2 - size // 2)
    picked = [values[(mid + j) % len(values)] for j in range(size)]
    return collate._collate(picked)


def warm_up_batches(values: list, size: int, collate: Collate, *, equal_lengths_only: bool = False
                    ) -> list[tuple[torch.Tensor, ...]]:
    """The batches of `size` records a run's warm-up calls the model with (`core.workload.warm_up_rows`: records
    of different lengths, padded, and one record repeated), so that a compiled model builds every graph the
    records need before they run: an unwarmed path cost MiniLM's mixed-int8 plan a 20-60 s Inductor compile
    in the middle of a 2,048-sentence run (benchmarks/RESULTS.md, run_cpu)."""
    return [collate._collate(rows) for rows in warm_up_rows(values, size, equal_lengths_only=equal_lengths_only)]


def measure_auto_batch_size(replica: Replica, values: list, collate: Collate, *, limit: int,
                            min_time_s: float = 0.3, patience: int = 2) -> tuple[int, list[dict[str, float]]]:
    """The largest batch size, doubling from 1, whose items/s beat the best smaller size's by
    ≥ 5%, among those that fit in memory (a CUDA out-of-memory error ends the search).

    The search goes on through `patience` doublings without such a gain before it stops: on a
    flat stretch of the curve one doubling can gain 4% and the next two 10% each, and a single
    noisy pair of sizes must not settle the batch at 1.

    Each size: one warm-up call, then calls until `min_time_s` and ≥ 3 calls; items/s = size /
    median call time (CUDA: synchronised). Text batches are records of median length.

    Returns:
        (batch size, [{"batch_size", "items_per_s"}, ...] for each size tried).
    """
    tried: list[dict[str, float]] = []
    best, best_rate, misses = 1, 0.0, 0
    size = 1
    while size <= limit and misses < patience:
        inputs = batch_from(values, size, collate)
        try:
            rate = _items_per_s(replica, inputs, min_time_s)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            tried.append({"batch_size": size, "items_per_s": math.nan})
            break
        tried.append({"batch_size": size, "items_per_s": rate})
        if rate >= AUTO_GAIN * best_rate:
            best, best_rate, misses = size, rate, 0
        else:
            misses += 1
        size *= 2
    return best, tried


def _items_per_s(replica: Replica, inputs: tuple[torch.Tensor, ...], min_time_s: float) -> float:
    rows = inputs[0].shape[0]
    times = []
    timer = Timer(replica.device)
    with torch.inference_mode():
        replica.warm_up(inputs)
        total_start = time.perf_counter()
        while len(times) < 3 or time.perf_counter() - total_start < min_time_s:
            times.append(timer(replica.warm_up, inputs)[1])  # copies, compute and the copy back
            if len(times) >= 50:
                break
    return rows / statistics.median(times)
