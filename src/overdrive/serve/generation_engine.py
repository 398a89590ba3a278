"""The generation server's engine: a `ContinuousGenerator` stepped by one thread, requests submitted and cancelled
from the event loop through an inbox applied between steps, and the Prometheus metrics read from it
(`serve/generation.py` serves them)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from overdrive.generate.continuous import ContinuousGenerator, TokenEvent
from overdrive.generate.engine import SamplingParams

log = logging.getLogger("overdrive.serve")


class QueueFull(Exception):
    pass


class GenerationEngine:
    """Steps a `ContinuousGenerator` in its own thread while it has work. `submit` and `cancel` come from any thread
    (the event loop's) without waiting for a step: they are queued and applied by the engine thread between two
    steps. A listener gets each `TokenEvent` of its request, or the exception that ended it (a step that raised
    ends every request in flight). A request given a deadline is ended between two steps once it has passed: its
    listener gets a `TokenEvent` with token_id -1 and its `Completion` (finish_reason "timeout", the tokens it had),
    and its blocks are freed at once."""

    def __init__(self, gen: ContinuousGenerator, *, max_waiting: int):
        self.gen, self.max_waiting = gen, max_waiting
        self._cv = threading.Condition()
        self._inbox: deque[tuple] = deque()  # ("submit", ticket, ids, params, listener, deadline) | ("cancel", ticket)
        #                                      | ("abort_all", finish_reason)
        self._tickets = itertools.count()
        self._open: set[int] = set()  # tickets submitted and not yet ended or cancelled
        self._ids: dict[int, int] = {}  # ticket -> the generator's request id (engine thread only)
        self._listeners: dict[int, tuple[int, Callable]] = {}  # request id -> (ticket, listener) (engine thread only)
        self._deadlines: dict[int, float] = {}  # request id -> time.monotonic() it must end by (engine thread only)
        self._stopped = False
        self.on_step: Callable[[float, int], None] | None = None  # (seconds, sequences) after each step
        self._thread = threading.Thread(target=self._loop, name="overdrive-generate", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], params: SamplingParams, listener: Callable, deadline: float | None = None) -> int:
        """Queues a request; returns its ticket (for `cancel`). `deadline`: the `time.monotonic()` it must end by
        (None: none).

        Raises:
            ValueError: it could never fit (`ContinuousGenerator.check`); QueueFull: `max_waiting` requests wait."""
        self.gen.check(ids, params)
        with self._cv:
            waiting = len(self.gen.waiting) + sum(1 for item in self._inbox if item[0] == "submit")
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting already")
            ticket = next(self._tickets)
            self._open.add(ticket)
            self._inbox.append(("submit", ticket, ids, params, listener, deadline))
            self._cv.notify()
        return ticket

    def abort_all(self, finish_reason: str) -> None:
        """Ends every request in flight between two steps, as a deadline does (the class docstring), with
        `finish_reason` (a drain that ran out of time: "abort", vLLM's name for a request the server ended)."""
        with self._cv:
            self._inbox.append(("abort_all", finish_reason))
            self._cv.notify()

    def cancel(self, ticket: int) -> None:
        with self._cv:
            if ticket in self._open:
                self._open.discard(ticket)
                self._inbox.append(("cancel", ticket))
                self._cv.notify()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended or cancelled."""
        return len(self._open)

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._inbox and not self.gen.has_unfinished and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                inbox = list(self._inbox)
                self._inbox.clear()
            calls = self._apply(inbox)
            if self._deadlines:
                calls += self._expire()
            if self.gen.has_unfinished:
                calls += self._step()
            for listener, event in calls:
                listener(event)

    def _apply(self, inbox: list[tuple]) -> list[tuple]:
        calls = []
        for item in inbox:
            if item[0] == "submit":
                _, ticket, ids, params, listener, deadline = item
                try:
                    request_id = self.gen.submit(ids, params)
                except ValueError as exc:  # checked at submit; kept for safety, never silent
                    calls.append((listener, exc))
                    self._end(ticket)
                    continue
                self._ids[ticket] = request_id
                self._listeners[request_id] = (ticket, listener)
                if deadline is not None:
                    self._deadlines[request_id] = deadline
            elif item[0] == "abort_all":
                calls += self._end_requests(list(self._listeners), item[1])
            else:
                request_id = self._ids.pop(item[1], None)
                if request_id is not None:
                    self._listeners.pop(request_id, None)
                    self._deadlines.pop(request_id, None)
                    self.gen.cancel(request_id)
        return calls

    def _expire(self) -> list[tuple]:
        """Ends the requests whose deadline has passed (the class docstring)."""
        now = time.monotonic()
        return self._end_requests([r for r, deadline in self._deadlines.items() if deadline <= now], "timeout")

    def _end_requests(self, request_ids: list[int], finish_reason: str) -> list[tuple]:
        """Ends `request_ids` now with `finish_reason`: each listener gets a `TokenEvent` with token_id -1 and the
        request's `Completion` (the tokens it had), its blocks are freed."""
        calls = []
        for request_id in request_ids:
            self._deadlines.pop(request_id, None)
            completion = self.gen.abort(request_id, finish_reason)
            ticket, listener = self._listeners.pop(request_id, (None, None))
            if listener is not None and completion is not None:
                calls.append((listener, TokenEvent(request_id, -1, completion)))
            if ticket is not None:
                self._end(ticket)
        return calls

    def _step(self) -> list[tuple]:
        running = len(self.gen.running)
        started = time.perf_counter()
        try:
            events = self.gen.step()
        except Exception as exc:  # noqa: BLE001 — every request in flight is told; the engine goes on
            log.exception("a generation step failed; the requests in flight get 500")
            calls = [(listener, exc) for _, listener in self._listeners.values()]
            for request_id, (ticket, _) in list(self._listeners.items()):
                self.gen.cancel(request_id)
                self._end(ticket)
            self._listeners.clear()
            self._deadlines.clear()
            return calls
        calls = []
        for e in events:
            ticket, listener = self._listeners.get(e.request_id, (None, None))
            if listener is None:
                continue
            calls.append((listener, e))
            if e.finished is not None:
                del self._listeners[e.request_id]
                self._deadlines.pop(e.request_id, None)
                self._end(ticket)
        if self.on_step is not None:
            self.on_step(time.perf_counter() - started, max(running, len(self.gen.running)))
        return calls

    def _end(self, ticket: int) -> None:
        self._ids.pop(ticket, None)
        with self._cv:
            self._open.discard(ticket)


class GenerationMetrics:
    def __init__(self, gen: ContinuousGenerator):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("overdrive_time_to_first_token_seconds", "time to first token", registry=r,
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("overdrive_inter_token_latency_seconds", "time per decode step", registry=r,
                             buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1))
        self.tokens = Counter("overdrive_generation_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("overdrive_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.requests = Counter("overdrive_generation_requests", "generation requests by outcome", ["outcome"], registry=r)
        for name, doc, read in (
                ("overdrive_running_requests", "sequences admitted: decoding, or their prompt prefilling in chunks",
                 lambda: len(gen.running) + len(gen.prefilling)),
                ("overdrive_waiting_requests", "requests waiting for a row or KV blocks", lambda: len(gen.waiting)),
                ("overdrive_kv_blocks_in_use", "KV cache blocks held", lambda: gen.pool.capacity - gen.pool.num_free),
                ("overdrive_kv_blocks_total", "KV cache blocks in the pool", lambda: gen.pool.capacity),
                ("overdrive_kv_waste_ratio", "share of held KV slots that are empty, over all decode steps",
                 lambda: gen.stats.kv_waste),
                ("overdrive_preemptions", "sequences preempted for KV blocks (recomputed later)",
                 lambda: gen.stats.preemptions),
                ("overdrive_kv_blocks_cached", "KV blocks nobody holds, kept for the prefix they hold",
                 lambda: gen.pool.num_cached),
                ("overdrive_prefix_cache_hit_rate", "share of admitted context tokens found in the prefix cache",
                 lambda: gen.stats.prefix_hit_rate)):
            Gauge(name, doc, registry=r).set_function(read)
