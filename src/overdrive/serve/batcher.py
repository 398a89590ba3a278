"""The dynamic batcher: requests from many clients joined into one model batch.

Invariant (what every caller may rely on):

- `max_batch_size` counts rows, not requests. No batch handed to the model holds more rows;
  a request larger than that is split into chunks of at most `max_batch_size` rows, which are
  queued one after another and whose outputs are joined back in order.
- A batch is released as soon as it is full, and otherwise no later than `max_queue_delay_s`
  after its oldest request arrived (while a model instance is free to take it). With the
  `adaptive` policy (the server's default) it is released earlier, at once when waiting is not
  expected to pay (`overdrive.serve.adaptive`: the rule, from the measured time per batch size
  and arrival rate); with `fixed` it waits the whole delay unless it fills.
- Batches are formed around the oldest waiting request (so none starves). With a `length`
  function (variable-length inputs), only requests of its length bucket join it (lengths
  within a factor of two; one length where `bucket` says so: a model whose answer depends on
  padding), so no row is padded to more than twice its length (of the policies
  measured on MiniLM, one bucket per batch served the most requests: benchmarks/RESULTS.md,
  serve_cpu 2026-12-01 morning).
- Each request gets back exactly its own rows' outputs, in its own row order (the model's
  `execute` pads and unpads; the batcher slices and joins).
- The queue holds at most `max_queue_size` rows; a request that would exceed it is refused at
  once (`QueueFull`), never parked.
- A request is dropped before execution when its deadline passes (`RequestTimeout`), its
  client goes away (`ClientDisconnected`) or the batcher is shut down (`ShuttingDown`). Once a
  batch has started it runs to the end.
- If a batch raises, it is split in halves and re-run until each failing request is alone;
  only those get the error, the others their outputs, and the batcher keeps serving.
- Model work runs off the event loop: one thread per model instance, so `instances` batches
  can run at the same time (one per GPU, or several on a many-core CPU).

All state changes happen on the event loop that called `start()`; only `BatchModel.execute`
runs in the instance threads. The scheduling follows Triton Inference Server's dynamic batcher
(preferred size = max size, `max_queue_delay_microseconds`, queue policy with rejection).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from overdrive.serve.adaptive import ADAPTIVE, FIXED, POLICIES, ArrivalRate, CostCurve, best_wait


class BatchModel(Protocol):
    """What the batcher needs from a model. Payloads are opaque to the batcher."""

    def rows(self, payload: Any) -> int:
        """Leading dimension of a validated payload (≥ 1)."""

    def slice(self, payload: Any, start: int, stop: int) -> Any:
        """Rows [start, stop) of a payload, as a payload."""

    def execute(self, payloads: list[Any], instance: int) -> list[Any]:
        """Run one batch on model instance `instance` (called in that instance's thread).
        Returns one result per payload, in order, each holding exactly that payload's rows."""

    def concat(self, results: list[Any]) -> Any:
        """Join the results of a split request's chunks, in chunk order."""

    # Optional: `start_instance(instance)`, called once in instance `instance`'s thread before
    # anything else runs there (thread-local set-up such as its intra-op thread count).


class BatcherMetrics(Protocol):
    """Observations the batcher reports (the server turns them into Prometheus metrics)."""

    def batch(self, rows: int, requests: int, compute_s: float, instance: int = 0) -> None: ...
    def queued(self, seconds: float) -> None: ...
    def depth(self, rows: int) -> None: ...
    def rejected(self, reason: str) -> None: ...


class _NoMetrics(BatcherMetrics):
    """Observes nothing (the Protocol's methods do nothing)."""


class BatcherError(Exception):
    """Base of the errors a request can get from the batcher; `reason` is a metric label."""

    reason = "error"


class QueueFull(BatcherError):
    reason = "queue_full"


class RequestTimeout(BatcherError):
    reason = "timeout"


class ClientDisconnected(BatcherError):
    reason = "client_disconnected"


class ShuttingDown(BatcherError):
    reason = "shutting_down"


class RequestTooLarge(BatcherError):
    reason = "too_large"


class ExecutionError(BatcherError):
    """The model raised on this request (alone, after the batch was split to find it)."""

    reason = "model_error"


_QUEUED, _RUNNING, _DONE = "queued", "running", "done"


@dataclass(eq=False)
class _Request:
    future: asyncio.Future
    deadline: float  # time.monotonic() seconds; math.inf for none
    results: list[Any]
    remaining: int
    state: str = _QUEUED
    entries: list[_Entry] = field(default_factory=list)


@dataclass(eq=False)
class _Entry:
    request: _Request
    chunk: int
    payload: Any
    rows: int
    bucket: int
    arrived: float
    seq: int
    live: bool = True  # False once taken into a batch or dropped


def length_bucket(length: int) -> int:
    """Bucket of a row length: powers of two (≤16, 17–32, 33–64, ...), as in common
    bucketing servers; padding within a bucket is at most 2× the shortest row's length."""
    return max(4, math.ceil(math.log2(max(1, length))))


class DynamicBatcher:
    """Queue requests and run them in batches on `instances` model threads.

    Args:
        model: the `BatchModel`.
        max_batch_size: rows per batch, ≥ 1.
        max_queue_delay_s: longest a request waits for others to join its batch, ≥ 0.
        max_queue_size: rows that may wait at once; more are refused with `QueueFull`.
        instances: model threads; batch i runs on whichever instance is free.
        length: row length of a payload (the longest row), for length bucketing; None for
            fixed-shape inputs (one bucket).
        bucket: a length's bucket (`length_bucket`: lengths within a factor of two share one; the
            length itself for a model whose answer depends on padding, so batches hold one length).
        metrics: observer of batch sizes, queue times, depth and rejections.
        policy: "fixed" (wait up to `max_queue_delay_s` for a full batch, as Triton does) or
            "adaptive" (wait only while it is expected to pay, `max_queue_delay_s` the cap).

    Raises:
        ValueError: a size, delay or policy out of range.
    """

    def __init__(self, model: BatchModel, *, max_batch_size: int, max_queue_delay_s: float, max_queue_size: int,
                 instances: int = 1, length=None, metrics: BatcherMetrics | None = None, policy: str = FIXED,
                 bucket: Callable[[int], int] | None = None):
        if max_batch_size < 1 or instances < 1 or max_queue_size < 1:
            raise ValueError("max_batch_size, instances and max_queue_size must be ≥ 1")
        if not 0 <= max_queue_delay_s < math.inf:
            raise ValueError(f"max_queue_delay_s must be a finite number ≥ 0, got {max_queue_delay_s}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.curve = CostCurve()  # seconds per batch by rows (adaptive): seeded by `observe`, then every batch
        self.arrivals = ArrivalRate()
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.max_queue_size = max_queue_size
        self.instances = instances
        self.length = length
        self.bucket = bucket or length_bucket
        self.metrics = metrics or _NoMetrics()
        self.queued_rows = 0
        self.in_flight = 0  # admitted requests not yet answered
        self.closing = False
        self._order: deque[_Entry] = deque()  # arrival order, with dead entries skipped lazily
        self._buckets: dict[int, deque[_Entry]] = {}
        self._seq = itertools.count()
        self._arrival = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._workers: list[asyncio.Task] = []
        self._executors: list[ThreadPoolExecutor] = []

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start one scheduler task and thread per instance on the running event loop."""
        start_instance = getattr(self.model, "start_instance", None)
        self._executors = [ThreadPoolExecutor(1, thread_name_prefix=f"overdrive-instance-{i}",
                                              initializer=start_instance, initargs=(i,) if start_instance else ())
                           for i in range(self.instances)]
        self._workers = [asyncio.get_running_loop().create_task(self._worker(i)) for i in range(self.instances)]

    async def on_instances(self, fn: Callable[[int], Any]) -> list[Any]:
        """Run `fn(instance)` in every instance's thread at once (after `start()`); their results, in order."""
        loop = asyncio.get_running_loop()
        return list(await asyncio.gather(*(loop.run_in_executor(e, fn, i) for i, e in enumerate(self._executors))))

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, let the admitted ones finish, then stop the workers.

        Requests still queued after `timeout_s` get `ShuttingDown`; batches already running
        are waited for. Returns the number of requests that were refused that way.
        """
        self.closing = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        refused = 0
        for entry in list(self._order):
            if entry.live and entry.request.state == _QUEUED:
                refused += self._fail(entry.request, ShuttingDown("the server is shutting down; retry on another replica"))
        await self._idle.wait()  # running batches end on their own
        self._wake()
        await asyncio.gather(*self._workers, return_exceptions=True)
        for executor in self._executors:
            executor.shutdown(wait=True)
        return refused

    def observe(self, rows: int, seconds: float, length: int | None = None) -> None:
        """A measured batch of `rows` rows (of row length `length`, for text) that took `seconds`:
        seeds the adaptive policy's cost curve (the server passes its warm-up timings)."""
        self.curve.observe(self.bucket(length) if self.length is not None and length else 0, rows, seconds)

    # -- the request side ---------------------------------------------------------------------

    async def infer(self, payload: Any, *, timeout_s: float | None = None,
                    disconnected: Callable[[], Awaitable] | None = None) -> Any:
        """Queue a validated payload and return its result.

        Args:
            payload: what `model.rows/slice/execute` accept.
            timeout_s: seconds from now after which a still-queued request is dropped.
            disconnected: returns an awaitable that completes when the client goes away (called
                once the request is admitted); the request is then dropped if it has not started.

        Raises:
            QueueFull, RequestTooLarge, RequestTimeout, ClientDisconnected, ShuttingDown:
                refused or dropped before execution.
            ExecutionError: the model raised on this request.
        """
        if self.closing:
            self.metrics.rejected(ShuttingDown.reason)
            raise ShuttingDown("the server is shutting down; retry on another replica")
        rows = self.model.rows(payload)
        if rows > self.max_queue_size:
            self.metrics.rejected(RequestTooLarge.reason)
            raise RequestTooLarge(f"the request has {rows} rows, more than the queue holds ({self.max_queue_size} rows)")
        if self.queued_rows + rows > self.max_queue_size:
            self.metrics.rejected(QueueFull.reason)
            raise QueueFull(f"the queue is full ({self.queued_rows} of {self.max_queue_size} rows waiting)")
        now = time.monotonic()
        request = self._enqueue(payload, rows, now, now + timeout_s if timeout_s is not None else math.inf)
        try:
            return await self._wait(request, disconnected() if disconnected is not None else None)
        finally:
            if request.state == _QUEUED:  # this coroutine was cancelled while its request waited
                self._fail(request, ClientDisconnected("the request was cancelled"))
                request.future.exception()  # retrieved: nobody else awaits it

    async def _wait(self, request: _Request, disconnected: Awaitable | None) -> Any:
        waiters: set = {request.future}
        if disconnected is not None:
            disconnected = asyncio.ensure_future(disconnected)
            waiters.add(disconnected)
        try:
            while not request.future.done():
                timeout = request.deadline - time.monotonic() if request.state == _QUEUED else None
                if timeout is not None and timeout <= 0:
                    self._fail(request, RequestTimeout("the request timed out while queued, before execution"))
                    break
                timeout = None if timeout == math.inf else timeout
                done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if disconnected is not None and disconnected in done:
                    waiters.discard(disconnected)
                    if request.state == _QUEUED:
                        self._fail(request, ClientDisconnected("the client disconnected before execution"))
            return request.future.result()
        finally:
            if disconnected is not None and not disconnected.done():
                disconnected.cancel()

    def _enqueue(self, payload: Any, rows: int, now: float, deadline: float) -> _Request:
        chunks = [(start, min(start + self.max_batch_size, rows)) for start in range(0, rows, self.max_batch_size)]
        request = _Request(future=asyncio.get_running_loop().create_future(), deadline=deadline,
                           results=[None] * len(chunks), remaining=len(chunks))
        for i, (start, stop) in enumerate(chunks):
            part = payload if len(chunks) == 1 else self.model.slice(payload, start, stop)
            bucket = self.bucket(self.length(part)) if self.length is not None else 0
            entry = _Entry(request=request, chunk=i, payload=part, rows=stop - start, bucket=bucket, arrived=now,
                           seq=next(self._seq))
            request.entries.append(entry)
            self.arrivals.arrived(bucket, stop - start, now)
            self._order.append(entry)
            self._buckets.setdefault(bucket, deque()).append(entry)
        self.queued_rows += rows
        self.in_flight += 1
        self._idle.clear()
        self.metrics.depth(self.queued_rows)
        self._wake()
        return request

    def _fail(self, request: _Request, error: BatcherError) -> int:
        """Drop a request's queued chunks and answer it with `error`. Returns 1 if it was answered."""
        self._unqueue(e for e in request.entries if e.live)
        if request.future.done():
            return 0
        request.state = _DONE
        request.future.set_exception(error)
        self.metrics.rejected(error.reason)
        self._finished()
        return 1

    def _unqueue(self, entries) -> None:
        for entry in entries:
            entry.live = False
            self.queued_rows -= entry.rows
        self.metrics.depth(self.queued_rows)

    def _finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def _wake(self) -> None:
        self._arrival.set()
        self._arrival = asyncio.Event()

    # -- the model side -------------------------------------------------------------------------

    def _head(self) -> _Entry | None:
        while self._order and not self._order[0].live:
            self._order.popleft()
        return self._order[0] if self._order else None

    def _select(self, head: _Entry) -> tuple[list[_Entry], int]:
        """The batch around `head`: waiting entries of its bucket in arrival order, up to
        max_batch_size rows (an entry that does not fit waits for the next batch)."""
        batch, rows = [], 0
        queue = self._buckets[head.bucket]
        while queue and not queue[0].live:
            queue.popleft()
        for entry in queue:
            if entry.live and rows + entry.rows <= self.max_batch_size:
                batch.append(entry)
                rows += entry.rows
                if rows == self.max_batch_size:
                    break
        return batch, rows

    async def _next_batch(self) -> list[_Entry] | None:
        waited_in_vain = False  # adaptive: the last wait brought no row, so the next decision is to run
        while True:
            now = time.monotonic()
            for entry in list(self._order):  # a request past its deadline never starts
                if entry.live and entry.request.deadline <= now:
                    self._fail(entry.request, RequestTimeout("the request timed out while queued, before execution"))
            head = self._head()
            arrival = self._arrival
            if head is None:
                if self.closing:
                    return None
                await arrival.wait()
                continue
            batch, rows = self._select(head)
            latest = head.arrived + self.max_queue_delay_s
            if self.policy == ADAPTIVE:
                wait = 0.0 if waited_in_vain else best_wait(
                    self.curve, self.arrivals, bucket=head.bucket, rows=rows, room=self.max_batch_size - rows, now=now,
                    latest=latest)
            else:
                wait = latest - now
            if rows >= self.max_batch_size or wait <= 0 or self.closing:
                return batch
            try:
                await asyncio.wait_for(arrival.wait(), timeout=min(wait, head.request.deadline - now))
                waited_in_vain = False
            except asyncio.TimeoutError:
                waited_in_vain = self.policy == ADAPTIVE

    async def _worker(self, instance: int) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if batch is None:
                return
            self._unqueue(batch)
            started = time.monotonic()
            for entry in batch:
                entry.request.state = _RUNNING
                self.metrics.queued(started - entry.arrived)
            outcomes, seconds = await loop.run_in_executor(self._executors[instance], self._timed_run, batch, instance)
            rows = sum(e.rows for e in batch)
            if not any(isinstance(o, BaseException) for o in outcomes):  # a bisected batch's time is not its size's
                self.curve.observe(batch[0].bucket, rows, seconds)
            self.metrics.batch(rows, len(batch), seconds, instance)
            for entry, outcome in zip(batch, outcomes):
                self._deliver(entry, outcome)

    def _timed_run(self, batch: list[_Entry], instance: int) -> tuple[list[Any], float]:
        start = time.perf_counter()
        outcomes = self._run(batch, instance)
        return outcomes, time.perf_counter() - start

    def _run(self, batch: list[_Entry], instance: int) -> list[Any]:
        """Results (or the exception each entry earned), bisecting a failing batch (instance thread)."""
        try:
            results = self.model.execute([e.payload for e in batch], instance)
            if len(results) != len(batch):
                raise RuntimeError(f"the model returned {len(results)} results for {len(batch)} requests")
            return results
        except Exception as exc:  # noqa: BLE001 — isolated below, reported to the request that caused it
            if len(batch) == 1:
                return [exc if isinstance(exc, BatcherError) else ExecutionError(f"{type(exc).__name__}: {exc}")]
            half = len(batch) // 2
            return self._run(batch[:half], instance) + self._run(batch[half:], instance)

    def _deliver(self, entry: _Entry, outcome: Any) -> None:
        request = entry.request
        if request.future.done():
            return  # already failed through another chunk
        if isinstance(outcome, BaseException):
            self._fail(request, outcome)
            return
        request.results[entry.chunk] = outcome
        request.remaining -= 1
        if request.remaining == 0:
            try:
                result = outcome if len(request.results) == 1 else self.model.concat(request.results)
            except Exception as exc:  # noqa: BLE001 — the worker must survive whatever one request does
                self._fail(request, ExecutionError(f"joining the request's chunks failed: {type(exc).__name__}: {exc}"))
                return
            request.state = _DONE
            request.future.set_result(result)
            self._finished()
        else:
            request.state = _QUEUED if any(e.live for e in request.entries) else _RUNNING
