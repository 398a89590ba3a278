"""One model of a server: its batching settings (`ServerConfig`), and the slot that holds its
served model, batcher, metrics and repository state (READY, LOADING, UNLOADING, UNAVAILABLE), and
warms it up (`ModelSlot`). The server (`serve.app`) routes requests to slots."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

from overdrive.serve.adaptive import ADAPTIVE, FIXED, POLICIES
from overdrive.serve.batcher import DynamicBatcher
from overdrive.serve.metrics import ModelMetrics
from overdrive.serve.model import ServedModel

log = logging.getLogger("overdrive.cli.serve")

DEFAULT_DELAY_MS = {FIXED: 2.0, ADAPTIVE: 10.0}
READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"


@dataclass(kw_only=True)
class ServerConfig:
    """One model's batching and load limits (the `overdrive serve` flags).

    Attributes:
        max_batch_size: rows per model batch.
        batching: "adaptive" (a batch waits only while waiting is expected to pay, up to the
            delay: `overdrive.serve.adaptive`) or "fixed" (waits up to the delay for a full batch).
        max_queue_delay_ms: the longest a request waits for others to join its batch, ms (None:
            2 ms for fixed, a 10 ms cap for adaptive).
        max_queue_size: rows that may wait; beyond it requests get 503 with Retry-After.
        instances: model threads (one per GPU on a multi-GPU machine).
        request_timeout_ms: default per-request timeout while queued, ms (None: none).
        drain_timeout_s: on SIGTERM/SIGINT, how long admitted requests may take to finish.
        max_request_bytes: largest request body accepted (413 beyond).
        warmup_s: seconds the model may spend at load running each batch size the batcher
            warms (`ServedModel.warmup`); it is not ready meanwhile.
    """

    max_batch_size: int
    batching: str = ADAPTIVE
    max_queue_delay_ms: float | None = None
    max_queue_size: int = 512
    instances: int = 1
    request_timeout_ms: float | None = 30_000.0
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 64 << 20
    warmup_s: float = 0.0

    def __post_init__(self):
        if self.batching not in POLICIES:
            raise ValueError(f"batching must be one of {', '.join(POLICIES)}, got {self.batching!r}")
        if self.max_queue_delay_ms is None:
            self.max_queue_delay_ms = DEFAULT_DELAY_MS[self.batching]


class InferError(Exception):
    """A request answered with an error status (HTTP status; gRPC maps it to a code)."""

    def __init__(self, status: int, message: str, retry_after: bool = False):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class ModelSlot:
    """One model in the repository: its served model, batcher, metrics and state.

    `loader` rebuilds the served model after an unload (None: the unloaded one is kept in
    memory and reused).
    """

    def __init__(self, served: ServedModel, config: ServerConfig, metrics: ModelMetrics,
                 loader: Callable[[], ServedModel] | None = None):
        self.name = served.name
        self.served: ServedModel | None = served
        self.config = config
        self.metrics = metrics
        self.loader = loader
        self.batcher: DynamicBatcher | None = None
        self.lock = asyncio.Lock()  # load and unload of this model, one at a time
        self.state, self.reason = UNAVAILABLE, "not loaded"
        self._warmup: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.state == READY

    def start(self) -> None:
        """Start the batcher and the warm-up on the running loop (state LOADING until warm)."""
        served, c = self.served, self.config
        served.on_cold_batch = self.metrics.cold_batch
        self.batcher = DynamicBatcher(
            served, max_batch_size=c.max_batch_size, max_queue_delay_s=c.max_queue_delay_ms / 1e3,
            max_queue_size=c.max_queue_size, instances=c.instances, policy=c.batching,
            length=served.length if served.workload.is_text else None, metrics=self.metrics,
            bucket=(lambda length: length) if served.workload.equal_lengths_only else None)  # then none is padded
        self.batcher.start()
        self.state, self.reason = LOADING, "warming up"
        self._warmup = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        c, batcher = self.config, self.batcher
        if c.warmup_s > 0:
            warmed = await batcher.on_instances(lambda i: self.served.warmup(c.max_batch_size, c.warmup_s, instance=i))
            for _, _, timings in warmed:
                for rows, seconds, length in timings:
                    batcher.observe(rows, seconds, length)
            sizes = sorted(set.intersection(*(set(w[0]) for w in warmed)))
            cold = c.max_batch_size - len(sizes)
            log.info("%s ready: warmed batch sizes %s in %.1f s%s", self.name, ", ".join(map(str, sizes)),
                     max(w[1] for w in warmed),
                     f"; {cold} other size{'s' if cold > 1 else ''} up to {c.max_batch_size} run{'' if cold > 1 else 's'} "
                     "cold the first time (counted in overdrive_cold_batches_total)" if cold else "")
        self.served.watch_recompiles()
        # What loading and warming built (the model, gRPC's message classes, kernel caches' Python
        # side) lives as long as the model: out of the cyclic collector's reach, or every gen-2
        # collection walks it and stalls the event loop ~150 ms (benchmarks/RESULTS.md, serve_cpu
        # 2026-12-03, "gen-2 collections"; serve.runner freezes what exists before the server starts).
        gc.collect()
        gc.freeze()
        self.state, self.reason = READY, ""

    async def stop(self, timeout_s: float) -> int:
        """Drain: queued requests finish (up to `timeout_s`), new ones get 503. Returns the refused."""
        if self._warmup:
            self._warmup.cancel()
        if self.batcher is None or self.batcher.closing:
            return 0
        return await self.batcher.drain(timeout_s)


def unavailable_message(slot: ModelSlot) -> str:
    """What a request for a model that is not ready is told (HTTP 503, gRPC UNAVAILABLE)."""
    if slot.state == UNLOADING:
        return f"model {slot.name!r} is {slot.reason}; retry in a moment (on another replica if it unloads)"
    return f"model {slot.name!r} is {slot.reason or 'unavailable'}; load it through /v2/repository/models/{slot.name}/load"
