"""The server: Open Inference Protocol (KServe v2) over HTTP (Starlette + uvicorn) and gRPC
(`overdrive.serve.grpc_service`), one or several models each with its own dynamic batcher and
queue bound, Prometheus metrics (`overdrive.serve.metrics`) and a graceful drain.

HTTP endpoints (KServe v2 REST; the binary tensor data extension and the model repository
extension as Triton defines them):
    GET  /v2/health/live, /v2/health/ready, /v2
    GET  /v2/models/{name}[/versions/1], /v2/models/{name}[/versions/1]/ready, .../config
    POST /v2/models/{name}[/versions/1]/infer
    GET|POST /v2/repository/index; POST /v2/repository/models/{name}/load, .../unload
    GET  /metrics (Prometheus text format)

Status codes: 400 a request that does not decode or match the model (the message names what
was expected), 404 an unknown model, 413 a body or row count over the limits, 500 the model
raised on this request, 503 queue full, shutting down, warming up or unloaded (with
Retry-After), 504 the request's timeout passed before it ran; a client gone before its answer
is logged in one line and counted (499), never answered. A request's timeout is the `timeout`
request parameter in microseconds (as tritonclient sends it; 0: none), or the server default.
Unknown paths and methods get the same JSON error object, `{"error": "..."}`.

The server is ready when every model is, but those unloaded through the repository extension; a
model is ready once loaded and warmed up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from overdrive import __version__
from overdrive.serve.batcher import BatcherError, DynamicBatcher, QueueFull, RequestTooLarge, ShuttingDown
from overdrive.serve.http_util import BodyCut, disconnected, read_body
from overdrive.serve.metrics import Metrics
from overdrive.serve.model import ServedModel, ValidationError
from overdrive.serve.protocol import (
    HEADER_LENGTH,
    InferRequest,
    ProtocolError,
    TooLarge,
    decompress,
    encode_response,
    error_body,
    leading_rows,
    parse_request,
)
from overdrive.serve.slot import (  # noqa: F401 — ServerConfig and InferError are imported from here too
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    InferError,
    ModelSlot,
    ServerConfig,
    unavailable_message,
)

log = logging.getLogger("overdrive.cli.serve")

_STATUS = {"queue_full": 503, "shutting_down": 503, "timeout": 504, "client_disconnected": 499, "too_large": 413,
           "model_error": 500}
OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are decoded in a worker thread, not on the event loop


class InferenceServer:
    """The ASGI app (`self.app`) for one or more served models, and their batchers.

    Args:
        served: a ServedModel, or a list of (ServedModel, ServerConfig[, loader]) for several.
        config: the ServerConfig when `served` is one model.
        grpc_port: also serve KServe v2 gRPC on this port (0: any free one; None: no gRPC).
        host: the address gRPC binds.

    The batchers start with the app (lifespan) and are drained by `drain()`.
    """

    def __init__(self, served, config: ServerConfig | None = None, *, grpc_port: int | None = None,
                 host: str = "127.0.0.1"):
        models = [(served, config)] if isinstance(served, ServedModel) else served
        names = [m[0].name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"two models are named alike in {names}; give each its own name")
        self.metrics = Metrics()
        self.slots = {m[0].name: ModelSlot(m[0], m[1], self.metrics.add_model(m[0].name, m[1].instances),
                                           m[2] if len(m) > 2 else None) for m in models}
        self.config = models[0][1]  # server-wide limits (drain, body size) are the first model's
        self.draining = False
        self.started = False
        self.grpc_port, self.grpc_host, self.grpc_server = grpc_port, host, None
        model_routes = []
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            model_routes += [Route(prefix, self.model_metadata), Route(prefix + "/ready", self.model_ready),
                             Route(prefix + "/config", self.model_config),
                             Route(prefix + "/infer", self.infer, methods=["POST"])]
        self.app = Starlette(routes=[
            Route("/v2/health/live", self.live), Route("/v2/health/ready", self.ready), Route("/v2", self.server_metadata),
            Route("/metrics", self.prometheus), *model_routes,
            Route("/v2/repository/index", self.repository_index, methods=["GET", "POST"]),
            Route("/v2/repository/models/{name}/load", self.repository_load, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self.repository_unload, methods=["POST"]),
        ], lifespan=self._lifespan, exception_handlers={HTTPException: _http_error})

    # back-compatible views of a one-model server
    @property
    def served(self) -> ServedModel:
        return next(iter(self.slots.values())).served

    @property
    def batcher(self) -> DynamicBatcher:
        return next(iter(self.slots.values())).batcher

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        for slot in self.slots.values():
            slot.start()
        if self.grpc_port is not None:
            from overdrive.serve.grpc_service import start_grpc

            self.grpc_server, self.grpc_port = await start_grpc(self, self.grpc_host, self.grpc_port)
        self.started = True
        yield
        if not self.draining:  # stopped without a drain (tests, a second signal)
            await self.drain()

    async def drain(self) -> None:
        """Readiness false, new requests 503, admitted ones finish (up to drain_timeout_s)."""
        self.draining = True
        start = time.monotonic()
        timeout = self.config.drain_timeout_s
        refused = sum(await asyncio.gather(*(slot.stop(timeout) for slot in self.slots.values())))
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
        log.info("drained in %.1f s%s", time.monotonic() - start,
                 f"; {refused} still-queued request(s) got 503 at the {timeout:g} s limit" if refused else "")

    # -- health, metadata, repository ------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """Every model is ready but those unloaded on purpose (Triton's strict readiness: a model that
        is loading, or failed to load, keeps the server not ready)."""
        return self.started and not self.draining and all(s.ready or s.reason == "unloaded" for s in self.slots.values())

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": self.is_ready}, status_code=200 if self.is_ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse(self.metadata())

    def metadata(self) -> dict:
        return {"name": "overdrive", "version": __version__, "extensions": ["binary_tensor_data", "model_repository"]}

    def slot(self, name: str, version: str | None = None) -> ModelSlot:
        """The model named `name` (version '1' or none).

        Raises:
            InferError: 404 naming the models this server holds.
        """
        slot = self.slots.get(name)
        if slot is None:
            held = ", ".join(repr(n) for n in self.slots)
            raise InferError(404, f"unknown model {name!r}; this server serves {held}")
        if version not in (None, "", "1"):
            raise InferError(404, f"model {name!r} has version '1' only, not {version!r}")
        return slot

    def _slot_of(self, request: Request) -> ModelSlot:
        return self.slot(request.path_params["name"], request.path_params.get("version"))

    async def model_metadata(self, request: Request) -> Response:
        try:
            slot = self._slot_of(request)
        except InferError as exc:
            return _error(exc.status, str(exc))
        if slot.served is None:
            return _error(503, f"model {slot.name!r} is unloaded; load it through /v2/repository/models/{slot.name}/load",
                          retry_after=True)
        return JSONResponse(slot.served.metadata())

    async def model_ready(self, request: Request) -> Response:
        try:
            slot = self._slot_of(request)
        except InferError as exc:
            return _error(exc.status, str(exc))
        ready = slot.ready and not self.draining
        return JSONResponse({"name": slot.name, "ready": ready}, status_code=200 if ready else 503)

    async def model_config(self, request: Request) -> Response:
        try:
            slot = self._slot_of(request)
        except InferError as exc:
            return _error(exc.status, str(exc))
        return JSONResponse(self.model_config_dict(slot))

    @staticmethod
    def model_config_dict(slot: ModelSlot) -> dict:
        c, served = slot.config, slot.served
        doc = {"name": slot.name, "max_batch_size": c.max_batch_size,
               "dynamic_batching": {"max_queue_delay_microseconds": int(c.max_queue_delay_ms * 1000),
                                    "default_queue_policy": {"max_queue_size": c.max_queue_size,
                                                             "default_timeout_microseconds":
                                                                 int((c.request_timeout_ms or 0) * 1000)}},
               "parameters": {"overdrive_batching": c.batching}}
        if served is not None:
            doc |= {"instance_group": [{"count": c.instances, "kind": served.devices[0].type.upper()}],
                    "input": [s.to_dict() for s in served.inputs], "output": [s.to_dict() for s in served.outputs]}
        return doc

    async def repository_index(self, request: Request) -> Response:
        try:
            body = await _repository_body(request, allowed=("ready",))
        except InferError as exc:
            return _error(exc.status, str(exc))
        if body is None:
            return Response(status_code=499)
        ready_only = body.get("ready", False)
        if not isinstance(ready_only, bool):
            return _error(400, f'"ready" must be true or false, got {ready_only!r}')
        return JSONResponse(self.index(ready_only))

    def index(self, ready_only: bool = False) -> list[dict]:
        """The repository index: every model (or the ready ones) with its state and the reason for it."""
        return [{"name": s.name, "version": "1", "state": s.state, "reason": s.reason} for s in self.slots.values()
                if not ready_only or s.ready]

    async def repository_load(self, request: Request) -> Response:
        return await self._repository_call(request, self.load)

    async def repository_unload(self, request: Request) -> Response:
        return await self._repository_call(request, self.unload, allowed=("parameters",), parameters=("unload_dependents",))

    async def _repository_call(self, request: Request, action, allowed=("parameters",), parameters=()) -> Response:
        try:
            body = await _repository_body(request, allowed=allowed)
            if body is None:  # the client went away before its body's end: nothing is done
                return Response(status_code=499)
            extra = set(_object_param(body.get("parameters", {}))) - set(parameters)
            if extra:
                raise InferError(400, f"overdrive takes no {', '.join(sorted(extra))} parameter here: a model is rebuilt "
                                      "from the plan or workload it was served from")
            await action(request.path_params["name"])
        except InferError as exc:
            return _error(exc.status, str(exc))
        return JSONResponse({})

    async def load(self, name: str) -> None:
        """Load (or reload) a model of the repository and wait until it is warm and ready. Calls
        for one model run one at a time, in order (a second load waits, then reloads).

        Raises:
            InferError: 404 unknown, 503 while draining, 500 the model failed to build.
        """
        slot = self.slot(name)
        async with slot.lock:
            if self.draining:
                raise InferError(503, "the server is shutting down", retry_after=True)
            if slot.state == READY:  # a reload: the queued requests finish first
                slot.state, slot.reason = UNLOADING, "reloading"
                await slot.stop(slot.config.drain_timeout_s)
            slot.state, slot.reason = LOADING, "loading"
            if slot.served is None:
                try:
                    slot.served = await asyncio.to_thread(slot.loader)
                except Exception as exc:  # noqa: BLE001 — reported in the index and to the caller
                    slot.state, slot.reason = UNAVAILABLE, f"load failed: {type(exc).__name__}: {exc}"
                    raise InferError(500, f"model {name!r} failed to load: {exc}") from None
            slot.start()
            await slot._warmup  # noqa: SLF001

    async def unload(self, name: str) -> None:
        """Drain a model (its queued requests finish) and unload it; its URL answers 503 until
        loaded. Waits for a load of the same model that is under way.

        Raises:
            InferError: 404 unknown.
        """
        slot = self.slot(name)
        async with slot.lock:
            if slot.state != READY:
                return
            slot.state, slot.reason = UNLOADING, "unloading"
            await slot.stop(slot.config.drain_timeout_s)
            if slot.loader is not None:
                slot.served = None  # its memory goes (once the requests still holding it finish); the loader rebuilds it
            slot.state, slot.reason = UNAVAILABLE, "unloaded"

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- inference ----------------------------------------------------------------------------------------

    async def run(self, slot: ModelSlot, parsed: InferRequest, parsed_bytes: int = 0,
                  disconnected=None) -> list[tuple[str, np.ndarray]]:
        """Validate a decoded request, run it through the model's batcher, and return its outputs
        as (name, array) pairs (those it asked for, or all). Shared by HTTP and gRPC.

        Raises:
            InferError: with the HTTP status of the failure.
        """
        lease = self.admit(slot)
        payload = await self.validate(slot, lease, parsed, parsed_bytes)
        return await self.execute(slot, lease, parsed, payload, disconnected)

    def admit(self, slot: ModelSlot) -> tuple[ServedModel, DynamicBatcher]:
        """The model and batcher this request will use, taken now: an unload or reload meanwhile
        closes that batcher (the request then gets 503), never the model under it.

        Raises:
            InferError: 503 while draining, or while the model is not ready.
        """
        if self.draining:
            slot.metrics.rejected(ShuttingDown.reason)
            raise InferError(503, "the server is shutting down; retry on another replica", retry_after=True)
        if slot.state == LOADING:
            slot.metrics.rejected("warming_up")
            raise InferError(503, f"model {slot.name!r} is warming up; retry when /v2/health/ready says ready",
                             retry_after=True)
        if slot.state != READY:
            slot.metrics.rejected("unavailable")
            raise InferError(503, unavailable_message(slot), retry_after=True)
        return slot.served, slot.batcher

    async def validate(self, slot: ModelSlot, lease: tuple, parsed: InferRequest, parsed_bytes: int):
        served = lease[0]
        try:
            if parsed_bytes > OFF_LOOP_BYTES:
                return await asyncio.to_thread(served.validate, parsed)
            return served.validate(parsed)
        except ValidationError as exc:
            slot.metrics.rejected("invalid")
            raise InferError(400, str(exc)) from None

    async def execute(self, slot: ModelSlot, lease: tuple, parsed: InferRequest, payload,
                      disconnected) -> list[tuple[str, np.ndarray]]:
        served, batcher = lease
        try:
            timeout_s = _timeout_s(parsed.parameters.get("timeout"), slot.config.request_timeout_ms)
        except ProtocolError as exc:
            slot.metrics.rejected("invalid")
            raise InferError(400, str(exc)) from None
        slot.metrics.admitted(1)
        try:
            output = await batcher.infer(payload, timeout_s=timeout_s, disconnected=disconnected)
        except ShuttingDown as exc:  # the server drains, or only this model unloads
            raise InferError(503, str(exc) if self.draining else unavailable_message(slot), retry_after=True) from None
        except BatcherError as exc:
            raise InferError(_STATUS.get(exc.reason, 500), str(exc), retry_after=isinstance(exc, QueueFull)) from None
        finally:
            slot.metrics.admitted(-1)
        return [(n, a) for n, a in served.split_output(output) if not parsed.outputs or n in parsed.outputs]

    async def infer(self, request: Request) -> Response:
        started = time.perf_counter()
        try:
            slot = self._slot_of(request)
        except InferError as exc:
            return _error(exc.status, str(exc))
        try:
            response = await self._infer(slot, request)
        except BodyCut as cut:  # the body never arrived whole: nobody to answer
            log.warning("%s: a client disconnected while sending its request body (%d of %s bytes came); dropped",
                        slot.name, cut.received, request.headers.get("content-length", "unknown"))
            slot.metrics.rejected("client_disconnected")
            return Response(status_code=499)
        except InferError as exc:
            if exc.status == 499:
                return Response(status_code=499)  # counted by the batcher; nobody to answer
            response = _error(exc.status, str(exc), retry_after=exc.retry_after)
        slot.metrics.answered(response.status_code, started)
        return response

    async def _infer(self, slot: ModelSlot, request: Request) -> Response:
        lease = self.admit(slot)
        limit = self.config.max_request_bytes
        try:
            raw = await read_body(request, limit)
            encoding, header = request.headers.get("content-encoding"), request.headers.get(HEADER_LENGTH.lower())
            if len(raw) > OFF_LOOP_BYTES:
                # json.loads of 60 MB takes seconds and holds the GIL even in a thread: a request with more rows
                # than the queue holds is refused from its "shape" before any parsing; the rest decode in a thread.
                rows = leading_rows(raw) if not encoding and header is None else None
                if rows is not None and rows > slot.config.max_queue_size:
                    raise TooLarge(f"the request has {rows} rows, more than the queue holds "
                                   f"({slot.config.max_queue_size} rows)")
                parsed = await asyncio.to_thread(lambda: parse_request(decompress(raw, encoding, limit), header))
            else:
                parsed = parse_request(decompress(raw, encoding, limit), header)
        except TooLarge as exc:
            slot.metrics.rejected(RequestTooLarge.reason)
            raise InferError(413, str(exc)) from None
        except ProtocolError as exc:
            slot.metrics.rejected("invalid")
            raise InferError(400, str(exc)) from None
        payload = await self.validate(slot, lease, parsed, len(raw))
        parts = await self.execute(slot, lease, parsed, payload, lambda: disconnected(request))
        binary = {n for n, _ in parts if parsed.binary_outputs or parsed.outputs.get(n)}
        bad = sum(int((~np.isfinite(a)).sum()) for n, a in parts if n not in binary)
        if bad:  # JSON has no NaN or infinity; never send invalid JSON
            slot.metrics.rejected("nonfinite_output")
            raise InferError(500, f"the model gave {bad} non-finite output value(s) (NaN/inf) for this request, which "
                                  "JSON cannot carry; ask for the output as binary data to receive them")
        body, headers = encode_response(slot.name, parsed.id, parts, binary)
        return Response(body, headers=headers, media_type="application/octet-stream" if binary else "application/json")


async def _repository_body(request: Request, allowed: tuple[str, ...]) -> dict | None:
    """A repository call's JSON body ({} when empty), or None when the client went away before its end.

    Raises:
        InferError: 400 a body that is not a JSON object, or has keys other than `allowed`.
    """
    try:
        raw = await read_body(request, 1 << 20)
    except BodyCut:
        return None
    except TooLarge as exc:
        raise InferError(413, str(exc)) from None
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise InferError(400, "the body is not valid JSON; send a JSON object or nothing") from None
    if not isinstance(body, dict):
        raise InferError(400, "the body must be a JSON object")
    unknown = set(body) - set(allowed)
    if unknown:
        raise InferError(400, f"unknown field(s) {sorted(unknown)}; this call takes {list(allowed) or 'no body'}")
    return body


def _object_param(value) -> dict:
    if not isinstance(value, dict):
        raise InferError(400, '"parameters" must be a JSON object')
    return value


def _timeout_s(value, default_ms: float | None) -> float | None:
    """A request's `timeout` parameter (µs; 0 means none, as in Triton) or the server default, in s."""
    if value is None:
        return default_ms / 1e3 if default_ms else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(f'the "timeout" parameter is in microseconds and must be an integer ≥ 0, got {value!r}')
    return value / 1e6 if value else None


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
