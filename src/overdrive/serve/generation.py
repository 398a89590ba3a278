"""Serving a causal LM: a `ContinuousGenerator` (continuous batching over a paged KV cache) stepped by one engine
thread, behind OpenAI-compatible and KServe v2 generate endpoints (Starlette on uvicorn, `runner.run_server`).

HTTP endpoints:
    GET  /v1/models
    POST /v1/completions        {"model", "prompt", "max_tokens"?=16, "temperature"?=1, "top_p"?, "seed"?, "stop"?,
                                 "n"?=1, "logprobs"?: k, "stream"?, "stream_options"?: {"include_usage"},
                                 "timeout"?: s}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens"?, ... as above but
                                 "logprobs"?: bool, "top_logprobs"?: k}   (logprobs: `serve.logprobs`)
    POST /v2/models/{name}/generate, /v2/models/{name}/generate_stream
                                {"text_input", "parameters"?: {"max_tokens", "temperature", "top_p", "seed", "stop",
                                 "timeout": µs}} (the KServe v2 generate extension, as Triton has it)
    GET  /v2/health/live, /v2/health/ready, /health, /metrics (Prometheus)

Streams are server-sent events (`data: {...}` lines, OpenAI's ending `data: [DONE]`). Errors are OpenAI's object
`{"error": {"message", "type", "param", "code"}}`: 400 a request that is malformed or cannot fit the context (before
it takes any KV block), 404 another model, 429 the waiting queue full (Retry-After), 503 draining. A client that
disconnects has its request cancelled and its blocks freed at once.

Deadlines: a request ends at most its timeout after it arrived (OpenAI's endpoints: `"timeout"` in seconds, an
extension, sent by the `openai` client as `extra_body`; KServe's: the `timeout` parameter in microseconds, 0 for none,
as Triton's; else the server's `request_timeout_s`, none by default). It ends between two decode steps with the tokens
it has and finish_reason "timeout", its blocks freed at once; one that had produced no token gets 504 (a stream: its
last chunk says "timeout"). A drain (SIGTERM) that runs out of `drain_timeout_s` ends the requests still running the
same way, with finish_reason "abort" (503 for one without a token). Chat prompts use the tokenizer's chat template,
or, without one, a plain template ("role: content" lines, then "assistant:"), said at start and in a response header.
Not built: `echo`, several prompts in one request. Beside encoders in one server: `serve.combined`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from overdrive.generate.continuous import ContinuousGenerator, TokenEvent
from overdrive.generate.engine import Completion, SamplingParams
from overdrive.serve.generation_engine import GenerationEngine, GenerationMetrics, QueueFull
from overdrive.serve.http_util import disconnected
from overdrive.serve.logprobs import chat_logprobs, completion_logprobs, requested
from overdrive.serve.openai_protocol import (CHAT_FIELDS, COMPLETION_FIELDS, BadRequest, Refusal, ended_empty,
                                             error_response, prompt_of, read_json, reseeded, sampling_params, sse)

PLAIN_CHAT = "plain (role: content lines, then 'assistant:')"
log = logging.getLogger("overdrive.serve")


class GenerationServer:
    """The app and its engine (the module docstring). `draining`/`drain()` as `runner.run_server` expects.

    Args:
        gen: the generator (built by `generate.plan.build_generator(..., continuous=True)`).
        name: the model's name in requests and URLs.
        max_waiting: requests that may wait for a row; more get 429.
        drain_timeout_s: how long requests in flight may take to finish on SIGTERM.
        request_timeout_s: a request's deadline when it sets none, seconds after it arrives (None: none).
    """

    def __init__(self, gen: ContinuousGenerator, name: str, *, max_waiting: int = 256, drain_timeout_s: float = 30.0,
                 request_timeout_s: float | None = None):
        if gen.tokenizer is None:
            raise ValueError("serving text needs the model's tokenizer")
        self.gen, self.name, self.drain_timeout_s = gen, name, drain_timeout_s
        self.request_timeout_s = request_timeout_s
        self.engine = GenerationEngine(gen, max_waiting=max_waiting)
        self.metrics = GenerationMetrics(gen)
        self.engine.on_step = lambda seconds, n: self.metrics.itl.observe(seconds)
        self.chat_template = "the tokenizer's" if getattr(gen.tokenizer, "chat_template", None) else PLAIN_CHAT
        self.draining, self.created = False, int(time.time())
        v2 = f"/v2/models/{name}"
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route(f"{v2}/generate", self.kserve_generate, methods=["POST"]),
            Route(f"{v2}/generate_stream", self.kserve_generate, methods=["POST"]),
            Route("/v2/models/{other}/generate", self.kserve_unknown, methods=["POST"]),
            Route("/v2/models/{other}/generate_stream", self.kserve_unknown, methods=["POST"]),
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/health", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])

    async def drain(self) -> None:
        """Readiness false, new requests 503, requests in flight finish; those still running after `drain_timeout_s`
        are ended between two steps with the tokens they have and finish_reason "abort" (a stream gets its last
        chunk and [DONE]; a request with no token yet, 503), so that no client sees its connection cut mid-answer."""
        self.draining = True
        deadline = time.monotonic() + self.drain_timeout_s
        while self.engine.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.in_flight:
            log.warning("drain: %d request(s) still running after %g s are ended now (finish_reason \"abort\")",
                        self.engine.in_flight, self.drain_timeout_s)
            self.engine.abort_all("abort")
            grace = time.monotonic() + 5.0
            while self.engine.in_flight and time.monotonic() < grace:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # the handlers write their last event before the server stops
        self.engine.stop()

    # --- endpoints --------------------------------------------------------------------------------------------

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        return JSONResponse({"ready": not self.draining}, status_code=503 if self.draining else 200)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                         "owned_by": "overdrive"}]})

    async def completions(self, request: Request) -> Response:
        return await self._openai(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._openai(request, chat=True)

    async def kserve_unknown(self, request: Request) -> Response:
        return error_response(404, f"no model {request.path_params['other']!r}; this server has {self.name!r}",
                      "model_not_found", "model")

    async def kserve_generate(self, request: Request) -> Response:
        stream = request.url.path.endswith("_stream")
        try:
            body = await read_json(request)
            text = body.get("text_input")
            if not isinstance(text, str) or not text:
                raise BadRequest("text_input must be a non-empty string", "text_input")
            parameters = body.get("parameters", {})
            if not isinstance(parameters, dict):
                raise BadRequest("parameters must be an object", "parameters")
            unknown = sorted(set(parameters) - {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                                                "timeout"})
            if unknown:
                raise BadRequest(f"unknown parameters {unknown}; known: max_tokens, temperature, top_p, top_k, seed, "
                                  "stop, timeout", "parameters")
            params = sampling_params(parameters, default_temperature=0.0, stop_token_ids=self.gen.defaults.stop_token_ids)
            timeout = parameters.get("timeout")
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0):
                raise BadRequest(f"timeout is in microseconds and must be an integer ≥ 0 (0: none), got {timeout!r}",
                                  "timeout")
            timeout_s = self.request_timeout_s if timeout is None else (timeout / 1e6 or None)
            requests = self._start([self.gen.encode(text)], params, timeout_s)
        except Refusal as exc:
            return exc.response()
        except (ValueError, TypeError) as exc:  # TypeError: text the tokenizer cannot take (a lone surrogate)
            return error_response(400, str(exc), "invalid_request_error", None)
        if stream:
            async def events():
                try:
                    async for delta, done, _ in _texts(self, requests[0], params):
                        yield sse({"model_name": self.name, "model_version": "1", "text_output": delta,
                                    **({"finish_reason": done.finish_reason} if done else {})})
                except Exception as exc:  # noqa: BLE001 — the engine's step failed: the stream ends with the error
                    yield sse({"error": f"generation failed: {exc}"})
            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            (done,) = await self._collect(request, requests)
        except Exception as exc:  # noqa: BLE001 — the engine's step failed (logged there)
            return error_response(500, f"generation failed: {exc}", "server_error", None)
        if done is None:
            return Response(status_code=499)
        if (empty := ended_empty([done], timeout_s)) is not None:
            return empty
        return JSONResponse({"model_name": self.name, "model_version": "1", "text_output": done.text,
                             "finish_reason": done.finish_reason})

    async def _openai(self, request: Request, *, chat: bool) -> Response:
        try:
            body = await read_json(request)
            if body.get("model") not in (None, self.name):
                raise Refusal(404, f"no model {body.get('model')!r}; this server has {self.name!r}", "model_not_found",
                               "model")
            unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
            if unknown:  # as OpenAI answers one: a typo must not pass for a setting
                raise BadRequest(f"unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
            for field in ("echo", "presence_penalty", "frequency_penalty", "logit_bias", "suffix", "tools",
                          "response_format"):
                if body.get(field) not in (None, False, 0, {}, []):  # asked for, not only sent at its default
                    raise BadRequest(f"{field} is not supported by this server", field)
            if body.get("best_of") not in (None, 1):
                raise BadRequest("best_of is not supported by this server", "best_of")
            if not isinstance(body.get("stream", False), bool):
                raise BadRequest(f"stream must be true or false, got {body['stream']!r}", "stream")
            n = 1 if body.get("n") is None else body["n"]
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
                raise BadRequest(f"n must be an integer from 1 to 16, got {n!r}", "n")
            prompt = self._chat_prompt(body.get("messages")) if chat else prompt_of(body.get("prompt"))
            params = sampling_params(body, default_temperature=1.0, stop_token_ids=self.gen.defaults.stop_token_ids)
            try:
                params = replace(params, logprobs=requested(body, chat=chat))
            except ValueError as exc:
                raise BadRequest(*exc.args) from None
            if chat and getattr(self.gen.tokenizer, "chat_template", None):
                # The template writes its own special tokens (a BOS among them): encoding adds none (as vLLM does).
                prompt = list(self.gen.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            ids = self.gen.encode(prompt)
            # n choices: the same prompt n times, each with its own seed (seed + i when the request gives one)
            per_choice = [params if params.seed is None or i == 0 else reseeded(params, params.seed + i)
                          for i in range(n)]
            timeout = body.get("timeout")
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or not 0 < timeout < float("inf")):
                raise BadRequest(f"timeout is in seconds and must be a number > 0, got {timeout!r}", "timeout")
            timeout_s = self.request_timeout_s if timeout is None else float(timeout)
            requests = self._start([ids] * n, per_choice, timeout_s)
        except Refusal as exc:
            return exc.response()
        except (ValueError, TypeError) as exc:  # TypeError: text the tokenizer cannot take (a lone surrogate)
            return error_response(400, str(exc), "invalid_request_error", None)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        kind = "chat.completion" if chat else "text_completion"
        headers = {"x-overdrive-chat-template": self.chat_template} if chat else None
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._openai_stream(requests, per_choice, ident, kind, chat, ids, include_usage),
                                     media_type="text/event-stream", headers=headers)
        try:
            done = await self._collect(request, requests)
        except Exception as exc:  # noqa: BLE001 — the engine's step failed (logged there)
            return error_response(500, f"generation failed: {exc}", "server_error", None)
        if any(c is None for c in done):
            return Response(status_code=499)
        if (empty := ended_empty(done, timeout_s)) is not None:
            return empty
        choices = [{"index": i, "finish_reason": c.finish_reason, "logprobs": self._logprobs(c.logprobs, chat, ids),
                    **({"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text})}
                   for i, c in enumerate(done)]
        completion_tokens = sum(c.completion_tokens for c in done)
        return JSONResponse({"id": ident, "object": kind, "created": int(time.time()), "model": self.name,
                             "choices": choices, "usage": {"prompt_tokens": len(ids),
                                                           "completion_tokens": completion_tokens,
                                                           "total_tokens": len(ids) + completion_tokens}},
                            headers=headers)

    async def _openai_stream(self, requests, params, ident, kind, chat, ids, include_usage):
        created, completion_tokens, prompt_tokens = int(time.time()), 0, len(ids)
        chunk = f"{kind}.chunk" if chat else kind
        offsets = [0] * len(requests)  # a completion's text_offset: the characters of each choice's tokens so far
        history = [list(ids) for _ in requests]  # each choice's tokens so far, its logprob strings' context

        def frame(i, delta, finish, entries=None):
            logprobs = self._logprobs(entries, chat, history[i], offsets[i]) if params[i].logprobs is not None else None
            if entries:
                history[i] += [e.token_id for e in entries]
            if logprobs and not chat:
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            choice = {"index": i, "finish_reason": finish, "logprobs": logprobs,
                      **({"delta": delta} if chat else {"text": delta})}
            return sse({"id": ident, "object": chunk, "created": created, "model": self.name, "choices": [choice]})

        if chat:
            for i in range(len(requests)):
                yield frame(i, {"role": "assistant", "content": ""}, None)
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i, request):
            try:
                async for delta, done, entries in _texts(self, request, params[i]):
                    await merged.put((i, delta, done, entries))
            except Exception as exc:  # noqa: BLE001 — the engine's step failed: the stream ends with the error
                await merged.put((i, exc, None, None))
            await merged.put((i, None, None, None))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
        try:
            remaining = len(requests)
            while remaining:
                i, delta, done, entries = await merged.get()
                if isinstance(delta, Exception):
                    yield sse({"error": {"message": f"generation failed: {delta}", "type": "server_error",
                                          "param": None, "code": None}})
                    return
                if delta is None and done is None:
                    remaining -= 1
                    continue
                if delta:  # the logprobs of the tokens this text came from (held-back text's come later)
                    yield frame(i, {"content": delta} if chat else delta, None, entries)
                if done is not None:
                    completion_tokens += done.completion_tokens
                    yield frame(i, {} if chat else "", done.finish_reason, None if delta else entries)
            if include_usage:
                yield sse({"id": ident, "object": chunk, "created": created, "model": self.name, "choices": [],
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                      "total_tokens": prompt_tokens + completion_tokens}})
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()

    # --- plumbing ---------------------------------------------------------------------------------------------

    def _logprobs(self, entries, chat: bool, context: list[int], offset: int = 0) -> dict | None:
        if entries is None:
            return None
        return chat_logprobs(entries, self.gen.tokenizer, context) if chat else \
            completion_logprobs(entries, self.gen.tokenizer, context, offset)

    def _chat_prompt(self, messages) -> str:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise BadRequest("messages must be a non-empty list of {\"role\": ..., \"content\": ...} with string "
                              "content", "messages")
        tok = self.gen.tokenizer
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"

    def _start(self, prompts: list[list[int]], params, timeout_s: float | None = None) -> list[_Request]:
        """Submits each prompt, each to end at most `timeout_s` from now (None: no deadline); all or none (a refusal
        cancels those already queued)."""
        if self.draining:
            raise Refusal(503, "the server is draining (shutting down)", "service_unavailable", None, retry=True)
        params = params if isinstance(params, list) else [params] * len(prompts)
        if 1 < len(prompts) > self.engine.max_waiting:  # its n choices could never all wait at once
            raise BadRequest(f"n is {len(prompts)}, more than this server's waiting queue holds "
                              f"({self.engine.max_waiting}, --max-queue-size)", "n")
        started: list[_Request] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            for ids, p in zip(prompts, params):
                started.append(_Request(self, ids, p, deadline))
        except QueueFull as exc:
            for r in started:
                r.cancel()
            raise Refusal(429, f"too many requests waiting ({exc}); retry later", "rate_limit_exceeded", None,
                           retry=True) from None
        except ValueError:
            for r in started:
                r.cancel()
            raise
        return started

    async def _collect(self, request: Request, requests: list[_Request]) -> list[Completion | None]:
        """Each request's completion; on a client's disconnect, every request is cancelled and None returned."""
        gone = asyncio.ensure_future(disconnected(request))
        try:
            results = asyncio.ensure_future(asyncio.gather(*(r.result() for r in requests)))
            results.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
            finished, _ = await asyncio.wait({gone, results}, return_when=asyncio.FIRST_COMPLETED)
            if results in finished:
                return results.result()
            results.cancel()
            for r in requests:
                r.cancel()
            return [None] * len(requests)
        finally:
            gone.cancel()


class _Request:
    """One submitted request's tokens as they come, on the event loop."""

    def __init__(self, server: GenerationServer, ids: list[int], params: SamplingParams, deadline: float | None):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.server, self.started, self.first = server, time.perf_counter(), None
        self.ticket = server.engine.submit(ids, params, lambda e: loop.call_soon_threadsafe(self.queue.put_nowait, e),
                                           deadline)
        self.ended = False
        server.metrics.prompt_tokens.inc(len(ids))

    async def events(self) -> AsyncIterator[TokenEvent]:
        try:
            while True:
                event = await self.queue.get()
                if isinstance(event, Exception):
                    raise event
                if event.token_id < 0:  # ended from outside (its deadline): no token
                    self.ended = True
                    self.server.metrics.requests.labels(event.finished.finish_reason).inc()
                    yield event
                    return
                if self.first is None:
                    self.first = time.perf_counter()
                    self.server.metrics.ttft.observe(self.first - self.started)
                self.server.metrics.tokens.inc()
                if event.finished is not None:  # ended before the consumer sees it: it may stop reading here
                    self.ended = True
                    self.server.metrics.requests.labels(event.finished.finish_reason).inc()
                    yield event
                    return
                yield event
        finally:
            if not self.ended:
                self.cancel()

    async def result(self) -> Completion:
        async for event in self.events():
            if event.finished is not None:
                return event.finished
        raise RuntimeError("the request ended without a completion")

    def cancel(self) -> None:
        if not self.ended:
            self.ended = True
            self.server.engine.cancel(self.ticket)
            self.server.metrics.requests.labels("cancelled").inc()


async def _texts(server: GenerationServer, request: _Request, params: SamplingParams):
    """(text delta, None, logprobs) as tokens come, then (the rest, completion, logprobs) at the end; logprobs: the
    `TokenLogprob`s of the tokens since the last yield (None when the request asked for none). Text that could still
    turn out to be the start of a stop string, or an unfinished UTF-8 character, is held back until it cannot."""
    tok, tokens, sent = server.gen.tokenizer, [], ""
    hold = max((len(s) for s in params.stop), default=1) - 1
    pending = [] if params.logprobs is not None else None
    async for event in request.events():
        if pending is not None and event.logprob is not None:
            pending.append(event.logprob)
        if event.finished is not None:
            final = event.finished.text or ""
            yield final[len(sent):], event.finished, pending
            return
        tokens.append(event.token_id)
        text = tok.decode(tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            continue
        ready = text[:len(text) - hold] if hold else text
        if len(ready) > len(sent) and ready.startswith(sent):
            yield ready[len(sent):], None, pending
            sent = ready
            pending = [] if pending is not None else None


@contextlib.contextmanager
def listening(app, *, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
    """Serves `app` on uvicorn in a daemon thread on a free port of `host` (no signal handling: for tests and
    benchmarks in one process); yields the base URL and stops the server on exit.

    Raises:
        RuntimeError: the server did not start within `start_timeout_s`."""
    import threading

    import uvicorn

    web = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not (web.started and web.servers) and time.time() < deadline:
        time.sleep(0.05)
    if not (web.started and web.servers):
        web.should_exit = True
        raise RuntimeError(f"the server did not start within {start_timeout_s:g} s")
    try:
        yield f"http://{host}:{web.servers[0].sockets[0].getsockname()[1]}"
    finally:
        web.should_exit = True
        thread.join(10)
