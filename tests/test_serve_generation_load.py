"""Serving a causal LM under load and faults (issue 33): a bounded waiting queue (429) and a draining server (503),
a drain that runs out of time, interleaved seeded streams each getting the tokens they get alone, clients that
disconnect mid-stream giving their blocks back, and per-request deadlines."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from overdrive.generate import Decoder, SamplingParams
from overdrive.generate.continuous import ContinuousGenerator
from overdrive.serve.generation import GenerationServer, listening
from tests.test_serve_generation import _alone, _events, _server, lm  # noqa: F401 - lm: the module's fixture


def test_a_full_queue_gets_429_with_retry_after_and_a_draining_server_503(lm):
    from starlette.testclient import TestClient

    server = _server(lm, max_waiting=0)
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"prompt": "A list", "max_tokens": 4})
        assert r.status_code == 429 and r.headers["Retry-After"] == "1" and r.json()["error"]["type"]
        several = _server(lm, max_waiting=2)
        with TestClient(several.app) as other:  # n choices the queue could never hold at once: 400, not "retry"
            r = other.post("/v1/completions", json={"prompt": "A list", "max_tokens": 4, "n": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "Retry-After" not in r.headers
            assert other.post("/v1/completions", json={"prompt": "A list", "max_tokens": 4, "n": 2}).status_code == 200
        server.draining = True
        assert client.post("/v1/completions", json={"prompt": "A list"}).status_code == 503
        assert client.get("/v2/health/ready").status_code == 503


def test_a_drain_that_runs_out_of_time_ends_each_request_with_what_it_has(lm, monkeypatch):
    """SIGTERM's drain waits `drain_timeout_s` for requests in flight; those still running are then ended between two
    steps with finish_reason "abort": a stream gets its last chunk and [DONE] (it was cut with no end, and uvicorn
    logged a CancelledError, before), a plain request its tokens so far, one that had none a 503; every block back."""
    gen = ContinuousGenerator(Decoder.from_hf(lm.model), lm.tokenizer, max_batch_size=2, block_size=4)
    server = GenerationServer(gen, "pydoc-lm", drain_timeout_s=0.3)
    step = gen.step
    monkeypatch.setattr(gen, "step", lambda: (time.sleep(0.02), step())[1])  # ~50 tokens a second
    long = {"prompt": "A list is", "max_tokens": 300, "temperature": 0}

    async def main():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            async def drain_soon():
                await asyncio.sleep(0.3)
                await server.drain()
            return await asyncio.gather(client.post("/v1/completions", json={**long, "stream": True}),
                                        client.post("/v1/completions", json=long),
                                        client.post("/v1/completions", json={**long, "max_tokens": 2}),  # never a row
                                        drain_soon())

    stream, plain, waiting, _ = asyncio.run(main())
    chunks = [c["choices"][0] for c in _events(stream.text) if c["choices"]]  # ends with [DONE]
    assert chunks[-1]["finish_reason"] == "abort" and len("".join(c["text"] for c in chunks)) > 0
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "abort"
    assert 0 < plain.json()["usage"]["completion_tokens"] < 300
    assert waiting.status_code == 503 and waiting.headers["Retry-After"] == "1"
    assert gen.pool.num_free == gen.pool.capacity and not gen.has_unfinished and server.engine.in_flight == 0
    assert server.metrics.requests.labels("abort")._value.get() == 3


def test_interleaved_seeded_streams_each_get_the_tokens_they_get_alone(lm):
    """200 streams at once (greedy and sampled, with and without logprobs) through 8 rows and a KV pool small enough
    that sequences are preempted and recomputed: each stream's text and logprobs are those the request gets alone."""
    gen = ContinuousGenerator(Decoder.from_hf(lm.model), lm.tokenizer, max_batch_size=8, block_size=4, num_blocks=17)
    server = GenerationServer(gen, "pydoc-lm")
    prompts = ["A list is", "The dictionary", "Return the", "An iterator", "When the", "A module", "If the value",
               "The following example shows how", "Raise", "This function returns the number of"]
    requests = [{"prompt": prompts[i % len(prompts)], "max_tokens": 1 + i % 17, "temperature": (0.0, 0.9, 1.3)[i % 3],
                 "seed": i, "stream": True, **({"logprobs": 2} if i % 4 == 0 else {})} for i in range(200)]

    async def main():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            async def one(body):
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                chunks = [c["choices"][0] for c in _events(r.text) if c["choices"]]
                logprobs = [t for c in chunks if c.get("logprobs") for t in c["logprobs"]["token_logprobs"]]
                return "".join(c["text"] for c in chunks), logprobs
            return await asyncio.gather(*(one(b) for b in requests))

    answers = asyncio.run(main())
    eos = (lm.tokenizer.eos_token_id,)
    for body, (text, logprobs) in zip(requests, answers):
        alone = _alone(server, body["prompt"], SamplingParams(
            max_new_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"],
            stop_token_ids=eos, logprobs=body.get("logprobs")))
        assert text == alone.text, body
        if "logprobs" in body:
            assert logprobs == pytest.approx([t.logprob for t in alone.logprobs], abs=1e-4), body
    assert server.gen.stats.peak_running == 8 and server.gen.stats.preemptions > 0
    assert server.gen.pool.num_free == server.gen.pool.capacity
    assert len({text for text, _ in answers}) > 50


def test_clients_that_disconnect_mid_stream_give_their_blocks_back(lm):
    """100 clients at once each hang up after their first token (or while still queued): every block comes back."""
    server = _server(lm)
    free_before = server.gen.pool.num_free

    async def hang_up_after_the_first_token(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": "A list is", "max_tokens": 200, "temperature": 1.0, "seed": i, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # the first token came: the request holds its blocks; closing the stream hangs up

    async def main(url: str) -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(hang_up_after_the_first_token(client, i) for i in range(100))), 60)

    with listening(server.app) as url:
        asyncio.run(main(url))
        deadline = time.time() + 20
        while server.gen.has_unfinished and time.time() < deadline:
            time.sleep(0.05)
        assert not server.gen.has_unfinished
        assert server.gen.pool.num_free == server.gen.pool.capacity == free_before
        assert server.metrics.requests.labels("cancelled")._value.get() == 100
        assert server.engine.in_flight == 0


def test_a_request_ends_at_its_deadline_with_the_tokens_it_had_and_frees_its_blocks(lm, monkeypatch):
    """Deadlines: OpenAI's `timeout` (s), KServe's `timeout` parameter (µs), the server's default. A request past its
    deadline ends with the first tokens of the answer it would have had and finish_reason "timeout"; one that never got
    a row gets 504; every block comes back."""
    gen = ContinuousGenerator(Decoder.from_hf(lm.model), lm.tokenizer, max_batch_size=1, block_size=4)
    server = GenerationServer(gen, "pydoc-lm")
    step = gen.step
    monkeypatch.setattr(gen, "step", lambda: (time.sleep(0.02), step())[1])  # ~50 tokens a second
    greedy = {"prompt": "A list is", "max_tokens": 200, "temperature": 0}
    alone = _alone(server, "A list is", SamplingParams(max_new_tokens=200, stop_token_ids=(lm.tokenizer.eos_token_id,)))

    async def main():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            long, queued = await asyncio.gather(
                client.post("/v1/completions", json={**greedy, "timeout": 0.6}),
                client.post("/v1/completions", json={**greedy, "max_tokens": 2, "timeout": 0.3}))  # never gets the row
            stream = await client.post("/v1/completions", json={**greedy, "timeout": 0.6, "stream": True})
            kserve = await client.post("/v2/models/pydoc-lm/generate",
                                       json={"text_input": "A list is", "parameters": {"max_tokens": 200,
                                                                                      "timeout": 600_000}})
            bad = await client.post("/v2/models/pydoc-lm/generate",
                                    json={"text_input": "A list is", "parameters": {"timeout": 0.5}})
            return long, queued, stream, kserve, bad

    long, queued, stream, kserve, bad = asyncio.run(main())
    assert alone.finish_reason == "length" and len(alone.token_ids) == 200  # the model would have gone on
    choice = long.json()["choices"][0]
    assert long.status_code == 200 and choice["finish_reason"] == "timeout"
    assert 0 < long.json()["usage"]["completion_tokens"] < 200 and alone.text.startswith(choice["text"])
    assert queued.status_code == 504 and queued.json()["error"]["type"] == "timeout"
    chunks = [c["choices"][0] for c in _events(stream.text) if c["choices"]]
    assert chunks[-1]["finish_reason"] == "timeout" and alone.text.startswith("".join(c["text"] for c in chunks))
    assert kserve.json()["finish_reason"] == "timeout" and alone.text.startswith(kserve.json()["text_output"])
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout"
    assert server.metrics.requests.labels("timeout")._value.get() == 4
    assert gen.pool.num_free == gen.pool.capacity and not gen.has_unfinished and server.engine.in_flight == 0

    server.engine.stop()
    from starlette.testclient import TestClient

    gen = ContinuousGenerator(gen.model, lm.tokenizer, max_batch_size=1, block_size=4)
    step2 = gen.step
    monkeypatch.setattr(gen, "step", lambda: (time.sleep(0.02), step2())[1])
    default = GenerationServer(gen, "pydoc-lm", request_timeout_s=0.3)  # the server's deadline when none is sent

    with TestClient(default.app) as client:
        r = client.post("/v1/completions", json=greedy)
        assert r.json()["choices"][0]["finish_reason"] == "timeout"
        r = client.post("/v1/completions", json={**greedy, "max_tokens": 3, "timeout": 30})
        assert r.json()["choices"][0]["finish_reason"] == "length"
