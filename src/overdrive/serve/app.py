"""The HTTP server: Open Inference Protocol (KServe v2) on Starlette + uvicorn, in front of
the dynamic batcher, with Prometheus metrics and a graceful drain.

Endpoints (KServe v2 REST; the binary tensor data extension as Triton defines it):
    GET  /v2/health/live, /v2/health/ready, /v2
    GET  /v2/models/{name}[/versions/1], /v2/models/{name}[/versions/1]/ready, .../config
    POST /v2/models/{name}[/versions/1]/infer
    GET  /metrics (Prometheus text format)

Status codes: 400 a request that does not decode or match the model (the message names what
was expected), 404 an unknown model, 413 a body or row count over the limits, 500 the model
raised on this request, 503 queue full or shutting down (with Retry-After), 504 the request's
timeout passed before it ran. A request's timeout is the `timeout` request parameter in
microseconds (as tritonclient sends it; 0: none), or the server default. Unknown paths and
methods get the same JSON error object, `{"error": "..."}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from overdrive import __version__
from overdrive.serve.batcher import BatcherError, DynamicBatcher, QueueFull, RequestTooLarge, ShuttingDown
from overdrive.serve.model import ServedModel, ValidationError
from overdrive.serve.protocol import (
    HEADER_LENGTH,
    ProtocolError,
    TooLarge,
    decompress,
    encode_response,
    error_body,
    parse_request,
)

log = logging.getLogger("overdrive.cli.serve")

_STATUS = {"queue_full": 503, "shutting_down": 503, "timeout": 504, "client_disconnected": 499, "too_large": 413,
           "model_error": 500}


@dataclass(kw_only=True)
class ServerConfig:
    """Batching and load limits (the `overdrive serve` flags).

    Attributes:
        max_batch_size: rows per model batch.
        max_queue_delay_ms: longest a request waits for others to join its batch, ms.
        max_queue_size: rows that may wait; beyond it requests get 503 with Retry-After.
        instances: model threads (one per GPU on a multi-GPU machine).
        request_timeout_ms: default per-request timeout while queued, ms (None: none).
        drain_timeout_s: on SIGTERM/SIGINT, how long admitted requests may take to finish.
        max_request_bytes: largest request body accepted (413 beyond).
        warmup_s: seconds the server may spend at start running each batch size once
            (`ServedModel.warmup`); it is live but not ready meanwhile.
    """

    max_batch_size: int
    max_queue_delay_ms: float = 2.0
    max_queue_size: int = 512
    instances: int = 1
    request_timeout_ms: float | None = 30_000.0
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 64 << 20
    warmup_s: float = 0.0


class Metrics:
    """Prometheus metrics of one server, in their own registry (several servers per process in tests)."""

    def __init__(self, model: str, max_batch_size: int):
        self.registry = CollectorRegistry()
        r, m = self.registry, [model]
        self.requests = Counter("overdrive_requests", "Inference requests by HTTP status", ["model", "status"], registry=r)
        self.queue_seconds = Histogram("overdrive_queue_duration_seconds", "Time from arrival to the start of its batch",
                                       ["model"], registry=r,
                                       buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30))
        self.compute_seconds = Histogram("overdrive_compute_duration_seconds", "Model time per batch", ["model"], registry=r,
                                         buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10))
        sizes = sorted({2 ** i for i in range(max_batch_size.bit_length())} | {max_batch_size})
        self.batch_rows = Histogram("overdrive_batch_size", "Rows per model batch", ["model"], registry=r, buckets=sizes)
        self.batch_requests = Histogram("overdrive_batch_requests", "Requests (or chunks) per model batch", ["model"],
                                        registry=r, buckets=sizes)
        self.queue_depth = Gauge("overdrive_queue_depth", "Rows waiting in the queue", ["model"], registry=r)
        self.rejections = Counter("overdrive_rejections", "Requests refused or dropped, by reason", ["model", "reason"],
                                  registry=r)
        self._m = m

    # BatcherMetrics
    def batch(self, rows: int, requests: int, compute_s: float) -> None:
        self.batch_rows.labels(*self._m).observe(rows)
        self.batch_requests.labels(*self._m).observe(requests)
        self.compute_seconds.labels(*self._m).observe(compute_s)

    def queued(self, seconds: float) -> None:
        self.queue_seconds.labels(*self._m).observe(seconds)

    def depth(self, rows: int) -> None:
        self.queue_depth.labels(*self._m).set(rows)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(*self._m, reason).inc()


class InferenceServer:
    """The ASGI app (`self.app`) for one served model, and its batcher.

    The batcher starts with the app (lifespan) and is drained by `drain()`.
    """

    def __init__(self, served: ServedModel, config: ServerConfig):
        self.served = served
        self.config = config
        self.metrics = Metrics(served.name, config.max_batch_size)
        self.batcher = DynamicBatcher(
            served, max_batch_size=config.max_batch_size, max_queue_delay_s=config.max_queue_delay_ms / 1e3,
            max_queue_size=config.max_queue_size, instances=config.instances,
            length=served.length if served.workload.is_text else None, metrics=self.metrics)
        self.draining = False
        self.started = False
        self.warmed = False
        model_routes = []
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            model_routes += [Route(prefix, self.model_metadata), Route(prefix + "/ready", self.model_ready),
                             Route(prefix + "/config", self.model_config),
                             Route(prefix + "/infer", self.infer, methods=["POST"])]
        self.app = Starlette(routes=[
            Route("/v2/health/live", self.live), Route("/v2/health/ready", self.ready), Route("/v2", self.server_metadata),
            Route("/metrics", self.prometheus), *model_routes,
        ], lifespan=self._lifespan, exception_handlers={HTTPException: _http_error})

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.batcher.start()
        self.started = True
        warmup = asyncio.get_running_loop().create_task(self._warm_up())
        yield
        warmup.cancel()
        if not self.batcher.closing:  # stopped without a drain (tests, a second signal)
            await self.drain()

    async def _warm_up(self) -> None:
        if self.config.warmup_s > 0:
            warmed = await self.batcher.on_instances(
                lambda i: self.served.warmup(self.config.max_batch_size, self.config.warmup_s, instance=i))
            sizes, seconds = min(n for n, _ in warmed), max(s for _, s in warmed)
            log.info("ready: warmed batch sizes up to %d in %.1f s", sizes, seconds)
        self.served.watch_recompiles()
        self.warmed = True

    async def drain(self) -> None:
        """Readiness false, new requests 503, admitted ones finish (up to drain_timeout_s)."""
        self.draining = True
        start = time.monotonic()
        refused = await self.batcher.drain(self.config.drain_timeout_s)
        log.info("drained in %.1f s%s", time.monotonic() - start,
                 f"; {refused} still-queued request(s) got 503 at the {self.config.drain_timeout_s:g} s limit" if refused else "")

    # -- health and metadata -------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self.started and self.warmed and not self.draining

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": self.is_ready}, status_code=200 if self.is_ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": "overdrive", "version": __version__, "extensions": ["binary_tensor_data"]})

    def _unknown(self, request: Request) -> Response | None:
        name, version = request.path_params["name"], request.path_params.get("version", "1")
        if name != self.served.name:
            return _error(404, f"unknown model {name!r}; this server serves {self.served.name!r}")
        if version != "1":
            return _error(404, f"model {name!r} has version '1' only, not {version!r}")
        return None

    async def model_metadata(self, request: Request) -> Response:
        return self._unknown(request) or JSONResponse(self.served.metadata())

    async def model_ready(self, request: Request) -> Response:
        return self._unknown(request) or JSONResponse({"name": self.served.name, "ready": self.is_ready},
                                                      status_code=200 if self.is_ready else 503)

    async def model_config(self, request: Request) -> Response:
        c = self.config
        return self._unknown(request) or JSONResponse({
            "name": self.served.name, "max_batch_size": c.max_batch_size,
            "dynamic_batching": {"max_queue_delay_microseconds": int(c.max_queue_delay_ms * 1000),
                                 "default_queue_policy": {"max_queue_size": c.max_queue_size,
                                                          "default_timeout_microseconds": int((c.request_timeout_ms or 0) * 1000)}},
            "instance_group": [{"count": c.instances, "kind": self.served.devices[0].type.upper()}],
            "input": [s.to_dict() for s in self.served.inputs], "output": [s.to_dict() for s in self.served.outputs]})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- inference ----------------------------------------------------------------------------------------

    async def infer(self, request: Request) -> Response:
        response = await self._infer(request)
        self.metrics.requests.labels(self.served.name, str(response.status_code)).inc()
        return response

    async def _infer(self, request: Request) -> Response:
        unknown = self._unknown(request)
        if unknown:
            return unknown
        if self.draining:
            self.metrics.rejected(ShuttingDown.reason)
            return _error(503, "the server is shutting down; retry on another replica", retry_after=True)
        if not self.warmed:
            self.metrics.rejected("warming_up")
            return _error(503, "the model is warming up; retry when /v2/health/ready says ready", retry_after=True)
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            self.metrics.rejected(RequestTooLarge.reason)
            return _error(413, f"the body is {declared} bytes; this server takes at most {limit}")
        try:
            body = decompress(await _read_body(request, limit), request.headers.get("content-encoding"), limit)
            parsed = parse_request(body, request.headers.get(HEADER_LENGTH.lower()))
            payload = self.served.validate(parsed)
            timeout_s = _timeout_s(parsed.parameters.get("timeout"), self.config.request_timeout_ms)
        except TooLarge as exc:
            self.metrics.rejected(RequestTooLarge.reason)
            return _error(413, str(exc))
        except (ProtocolError, ValidationError) as exc:
            self.metrics.rejected("invalid")
            return _error(400, str(exc))
        try:
            output = await self.batcher.infer(payload, timeout_s=timeout_s, disconnected=lambda: _disconnected(request))
        except BatcherError as exc:
            return _error(_STATUS.get(exc.reason, 500), str(exc), retry_after=isinstance(exc, (QueueFull, ShuttingDown)))
        parts = [(n, a) for n, a in self.served.split_output(output) if not parsed.outputs or n in parsed.outputs]
        binary = {n for n, _ in parts if parsed.binary_outputs or parsed.outputs.get(n)}
        bad = sum(int((~np.isfinite(a)).sum()) for n, a in parts if n not in binary)
        if bad:  # JSON has no NaN or infinity; never send invalid JSON
            self.metrics.rejected("nonfinite_output")
            return _error(500, f"the model gave {bad} non-finite output value(s) (NaN/inf) for this request, which JSON "
                               "cannot carry; ask for the output as binary data to receive them")
        body, headers = encode_response(self.served.name, parsed.id, parts, binary)
        return Response(body, headers=headers,
                        media_type="application/octet-stream" if binary else "application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in (also chunked), refused as soon as it passes `limit` bytes."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the body is more than {limit} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


def _timeout_s(value, default_ms: float | None) -> float | None:
    """A request's `timeout` parameter (µs; 0 means none, as in Triton) or the server default, in s."""
    if value is None:
        return default_ms / 1e3 if default_ms else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f'the "timeout" parameter is in microseconds and must be an integer ≥ 0, got {value!r}')
    return value / 1e6 if value else None


async def _disconnected(request: Request) -> None:
    """Completes when the client closes its connection (the ASGI `http.disconnect` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 as the protocol's JSON error object."""
    if exc.status_code == 405:
        allowed = ", ".join(sorted(m.strip() for m in (exc.headers or {}).get("Allow", "").split(",") if m.strip()))
        return _error(405, f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}")
    if exc.status_code == 404:
        return _error(404, f"no endpoint {request.url.path}; the Open Inference Protocol paths are under /v2 "
                           "(e.g. /v2/models/<name>/infer), metrics at /metrics")
    return _error(exc.status_code, str(exc.detail))


def _error(status: int, message: str, *, retry_after: bool = False) -> Response:
    headers = {"Retry-After": "1"} if retry_after else None
    return Response(error_body(message), status_code=status, headers=headers, media_type="application/json")
