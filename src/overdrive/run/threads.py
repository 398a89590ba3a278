"""The threads of one `overdrive run` and what they share (the flow is in `overdrive.run.job`'s
docstring): the main thread feeds batches from the DataLoader, one replica thread per device
uploads and computes, and the writer thread places rows and writes each finished chunk.
`RunAborted` is how any of them stops the run.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from overdrive.core.errors import RunAborted, arg, one_line
from overdrive.files.inputs import RecordSource
from overdrive.run.replica import RecordDataset, Replica, Result, Staged, chunk_batches
from overdrive.run.resume import Parts

# -- the run -------------------------------------------------------------------------------------


@dataclass
class _Clock:
    lock: threading.Lock = field(default_factory=threading.Lock)
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("read_decode", "wait_input", "h2d_copy", "compute", "d2h_copy", "write", "assemble"), 0.0))

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.phases[name] += seconds


_END = object()


class _Run:
    """The threads of one run and what they share; see the module docstring for the flow."""

    def __init__(self, *, source: RecordSource, replicas: list[Replica], parts: Parts, chunk_size: int,
                 row_shape: tuple[int, ...], pending: list[int], max_errors: int | None, progress, done_before: int,
                 failed_before: int, normalize: bool = False):
        self.source, self.replicas, self.parts = source, replicas, parts
        self.chunk_size, self.row_shape, self.pending = chunk_size, row_shape, pending
        self.max_errors, self.progress = max_errors, progress
        self.inputs: queue.Queue = queue.Queue(maxsize=2 * len(replicas))
        self.results: queue.Queue = queue.Queue(maxsize=4 * len(replicas))
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.clock = _Clock()
        self.done_items = done_before
        self.failed = failed_before
        self.processed = 0
        self.crash_after_batches = _crash_after_batches
        self.batches_written = 0
        self.started = time.perf_counter()
        self.first_error: tuple[int, str] | None = None
        self.normalize = normalize

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.stop.set()

    # Queues are polled so that a stopping run (an error, Ctrl-C) never leaves a thread blocked.
    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=0.1)
            except queue.Empty:
                continue
        return _END

    def _put(self, q: queue.Queue, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # replica threads
    def replica_loop(self, replica: Replica) -> None:
        current = None
        try:
            replica.enter_thread()
            with torch.inference_mode():
                current = self._next_staged(replica)
                while current is not None:
                    result = replica.compute(current)  # queued on the device (CUDA) ...
                    current = self._next_staged(replica)  # ... while the next batch is read and copied
                    if not self._put(self.results, result):
                        return
        except BaseException as exc:  # noqa: BLE001 (re-raised on the main thread)
            if isinstance(exc, Exception):
                where = ""
                if current is not None and current.batch.indices:
                    keys = [self.source.source_key(i) for i in current.batch.indices[:3]]
                    where = f" (a batch of {len(current.batch.indices)} records: {', '.join(keys)}, ...)"
                exc = RunAborted(f"the model failed on {replica.device}{where}: {one_line(exc)}; the chunks finished "
                                 f"so far are kept for {arg('resume', True)}")
            self.fail(exc)

    def _next_staged(self, replica: Replica) -> Staged | None:
        start = time.perf_counter()
        batch = self._get(self.inputs)
        self.clock.add("wait_input", time.perf_counter() - start)
        return None if batch is _END else replica.upload(batch)

    # writer thread
    def writer_loop(self) -> None:
        buffers: dict[int, dict[str, Any]] = {}
        try:
            while (result := self._get(self.results)) is not _END:
                self._place(result, buffers)
        except OSError as exc:  # disk full, a name too long, ...
            self.fail(_write_failed(exc))
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)

    def _place(self, result: Result, buffers: dict[int, dict[str, Any]]) -> None:
        batch = result.batch
        if result.done is not None:
            result.done.synchronize()
            h2d0, h2d1, c0, c1, d1 = result.events
            self.clock.add("h2d_copy", h2d0.elapsed_time(h2d1) / 1e3)
            self.clock.add("compute", c0.elapsed_time(c1) / 1e3)
            self.clock.add("d2h_copy", c1.elapsed_time(d1) / 1e3)
        elif result.times:
            for name, seconds in zip(("h2d_copy", "compute", "d2h_copy"), result.times):
                self.clock.add(name, seconds)
        self.clock.add("read_decode", batch.read_s)
        start = time.perf_counter()
        k = batch.chunk
        first = k * self.chunk_size
        size = min(len(self.source), first + self.chunk_size) - first
        buf = buffers.setdefault(k, {"outputs": np.full((size, *self.row_shape), np.nan, dtype=np.float32),
                                     "errors": [], "left": size})
        errors = batch.errors
        if result.output is not None:
            rows = result.output.numpy()
            nonfinite = nonfinite_rows(rows)
            if nonfinite:  # failed records: a NaN row in .npy, a line in the errors file, counted in "failed"
                rows[[r for r, _ in nonfinite]] = np.nan
                errors = sorted(errors + [(batch.indices[r], why) for r, why in nonfinite])
            if self.normalize:
                rows = normalize_rows(rows)
            buf["outputs"][np.asarray(batch.indices) - first] = rows
        buf["errors"].extend(errors)
        if errors and (self.first_error is None or errors[0][0] < self.first_error[0]):
            self.first_error = errors[0]
        buf["left"] -= len(batch.indices) + len(batch.errors)
        self.failed += len(errors)
        self.processed += len(batch.indices) + len(batch.errors)
        if buf["left"] == 0:
            self.parts.write_chunk(k, buf.pop("outputs"), sorted(buf["errors"]))
            del buffers[k]
            self.done_items += size
        self.clock.add("write", time.perf_counter() - start)
        self.batches_written += 1
        if self.progress:
            busy = self.clock.phases["compute"] / max(time.perf_counter() - self.started, 1e-9) / len(self.replicas)
            self.progress(self.done_items + sum(b["outputs"].shape[0] - b["left"] for b in buffers.values()), self.failed,
                          min(busy, 1.0))
        if self.max_errors is not None and self.failed > self.max_errors:
            first = self.first_error or (0, "")
            raise RunAborted(f"{_records(self.failed)} failed, more than {arg('max_errors', self.max_errors)} (the first: "
                             f"{self.source.source_key(first[0])}: {first[1]}); {arg('resume', True)} continues after the chunks "
                             "finished")
        if self.crash_after_batches is not None and self.batches_written >= self.crash_after_batches:
            raise _SimulatedCrash(f"crash after {self.batches_written} batches (test hook)")

    # main thread
    def feed(self, loader) -> None:
        for batch in loader:
            if not self._put(self.inputs, batch):
                return


def _write_failed(exc: OSError) -> RunAborted:
    return RunAborted(f"cannot write {exc.filename or 'the output'}: {exc.strerror or exc}; the chunks finished so far "
                      f"are kept, and {arg('resume', True)} continues once the cause is fixed")


class _SimulatedCrash(Exception):
    """Raised by the `crash_after` test hook: the run dies as if killed after that many batches."""


_crash_after_batches: int | None = None


@contextlib.contextmanager
def crash_after(batches: int):
    """Test hook: a run started inside this block dies as if killed once `batches` batches are written."""
    global _crash_after_batches
    _crash_after_batches = batches
    try:
        yield
    finally:
        _crash_after_batches = None


def _execute(run: _Run, source, collate, batch_size, chunk_size, bucket, num_workers, cuda, lengths, *,
             equal_lengths: bool = False) -> None:
    def batches() -> Iterator[list[int]]:
        for k in run.pending:
            yield from chunk_batches(source, k, chunk_size, batch_size, bucket, lengths, equal_lengths=equal_lengths)

    loader = torch.utils.data.DataLoader(
        RecordDataset(source), batch_sampler=batches(), collate_fn=collate, num_workers=num_workers,
        pin_memory=cuda, prefetch_factor=4 if num_workers else None)
    threads = [threading.Thread(target=run.replica_loop, args=(r,), name=f"replica-{i}", daemon=True)
               for i, r in enumerate(run.replicas)]
    writer = threading.Thread(target=run.writer_loop, name="writer", daemon=True)
    for t in threads + [writer]:
        t.start()
    interrupted: BaseException | None = None
    try:
        run.feed(loader)
    except BaseException as exc:  # KeyboardInterrupt, a worker's death: stop the threads, keep finished chunks
        interrupted = exc
        run.stop.set()
    finally:
        for _ in threads:
            run._put(run.inputs, _END)
        for t in threads:
            t.join()
        run._put(run.results, _END)
        writer.join()
    if interrupted is not None:
        raise interrupted
    if run.error is not None:
        raise run.error


def _records(n: int) -> str:
    return f"{n} record" + ("" if n == 1 else "s")


def nonfinite_rows(rows: np.ndarray) -> list[tuple[int, str]]:
    """The rows of a model's output [B, ...] that hold NaN or an infinity, each with the reason its
    record failed (no finite answer is there to write; `serve` answers such a request with a 500)."""
    counts = (~np.isfinite(rows.reshape(len(rows), -1))).sum(axis=1)
    return [(int(r), f"the model gave {int(counts[r])} non-finite output value(s) (NaN/inf) for this record")
            for r in np.flatnonzero(counts)]


def normalize_rows(rows: np.ndarray) -> np.ndarray:
    """Each row over its L2 norm, as sentence-transformers' Normalize: x / max(‖x‖₂, 1e-12)."""
    norms = np.linalg.norm(rows.reshape(len(rows), -1), axis=1)
    return rows / np.maximum(norms, 1e-12).reshape((-1,) + (1,) * (rows.ndim - 1))
