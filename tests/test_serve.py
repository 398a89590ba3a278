"""`overdrive serve` against live servers on loopback: the Open Inference Protocol with a real
client (tritonclient) and raw HTTP, and the failure patterns servers are known to get wrong."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx as requests
import numpy as np
import pytest
import torch

from overdrive.serve.app import _timeout_s
from tests.fixtures.live_server import LiveServer, wait_ready
from tests.fixtures.serve_models import BLOCK, NAN_OUT, NEVER, RAISE, toy_text_workload, toy_workload

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def tensor_body(x: np.ndarray, **parameters) -> dict:
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}
    if parameters:
        body["parameters"] = parameters
    return body


def reference(workload, x: np.ndarray) -> np.ndarray:
    """Row-by-row outputs of the toy model, bypassing its batch log."""
    with torch.no_grad():
        return workload.model.linear(torch.from_numpy(x)).numpy()


def rows(n: int, seed: int, marker: float | None = None) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)
    if marker is not None:
        x[:, 0] = marker
    return x


async def post(session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float | None = None):
    """(status, JSON, seconds, headers); status None when the client gave up (disconnected)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, await r.json(content_type=None), time.perf_counter() - t0, r.headers
    except asyncio.TimeoutError:
        return None, None, time.perf_counter() - t0, {}


def output_of(doc: dict) -> np.ndarray:
    out = doc["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


async def gather_posts(url: str, bodies: list[dict], timeout_s: float | None = None, stagger_s: float = 0.0):
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i, body):
            await asyncio.sleep(i * stagger_s)
            return await post(session, url, body, timeout_s)
        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


# -- the protocol -------------------------------------------------------------------------------------


def test_tritonclient_binary_and_json_tensors():
    import tritonclient.http as httpclient

    workload = toy_workload()
    with LiveServer(workload, max_batch_size=8) as live:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{live.port}")
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("toy")
        meta = client.get_model_metadata("toy")
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 4]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 3]}]
        x = rows(5, 1)
        for binary in (True, False):
            tensor = httpclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            result = client.infer("toy", [tensor], outputs=[httpclient.InferRequestedOutput("output", binary_data=binary)],
                                  request_id="req-7")
            np.testing.assert_allclose(result.as_numpy("output"), reference(workload, x), rtol=1e-6, atol=1e-6)
            assert result.get_response()["id"] == "req-7"
        result = client.infer("toy", [tensor], request_compression_algorithm="gzip")  # no outputs named: binary
        np.testing.assert_allclose(result.as_numpy("output"), reference(workload, x), rtol=1e-6, atol=1e-6)
        assert client.get_model_config("toy")["max_batch_size"] == 8


def test_tritonclient_bytes_input_is_tokenized_on_the_server():
    import tritonclient.http as httpclient

    workload = toy_text_workload()
    sentences = ["hello", "a much longer sentence with many more bytes in it", "ünïcode ✓"]
    with LiveServer(workload, max_batch_size=8) as live:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{live.port}")
        assert client.get_model_metadata("toy-text")["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        tensor = httpclient.InferInput("text", [len(sentences)], "BYTES")
        tensor.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=object))
        out = client.infer("toy-text", [tensor]).as_numpy("output")
    with torch.no_grad():  # each sentence alone, unpadded
        alone = np.concatenate([workload.model(*workload.collate([s])).numpy() for s in sentences])
    np.testing.assert_allclose(out, alone, rtol=1e-5, atol=1e-6)


def test_raw_http_endpoints_and_errors_name_what_was_expected():
    with LiveServer(toy_workload(), max_batch_size=8) as live:
        base, infer = live.url, live.infer_url
        assert requests.get(f"{base}/v2/health/live").json() == {"live": True}
        assert requests.get(f"{base}/v2/health/ready").status_code == 200
        assert requests.get(f"{base}/v2").json()["extensions"] == ["binary_tensor_data", "model_repository"]
        assert requests.get(f"{base}/v2/models/toy/versions/1/ready").status_code == 200
        r = requests.get(f"{base}/v2/models/nope")
        assert r.status_code == 404 and "this server serves 'toy'" in r.json()["error"]
        assert requests.get(f"{base}/v2/models/toy/versions/2").status_code == 404
        x = rows(2, 3)
        good = requests.post(infer, json=tensor_body(x))
        assert good.status_code == 200
        np.testing.assert_allclose(output_of(good.json()), reference(live.workload, x), rtol=1e-6, atol=1e-6)
        nested = tensor_body(x)
        nested["inputs"][0]["data"] = x.tolist()  # nested lists are allowed too
        assert requests.post(infer, json=nested).status_code == 200
        gz = requests.post(infer, content=gzip.compress(json.dumps(tensor_body(x)).encode()), headers={"Content-Encoding": "gzip"})
        assert gz.status_code == 200
        bad = {
            "not json {": "not valid JSON",
            json.dumps({"inputs": []}): "non-empty \"inputs\"",
            json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 4], "data": [0] * 4}]}):
                "takes inputs input FP32 [-1, 4]",
            json.dumps({"inputs": [{"name": "input", "datatype": "INT64", "shape": [1, 4], "data": [0] * 4}]}):
                "must be FP32, got INT64",
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 5], "data": [0] * 5}]}):
                "must have shape [N, 4]",
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4], "data": [0] * 7}]}):
                "shape [2, 4] holds 8 elements but data has 7",
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": ["a"] * 4}]}):
                "FP32 data must be float values",
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [0, 4], "data": []}]}): "N ≥ 1",
            json.dumps({**tensor_body(x), "outputs": [{"name": "logits"}]}): "unknown requested outputs ['logits']",
            json.dumps({**tensor_body(x), "parameters": {"timeout": -5}}): "timeout",
            json.dumps({**tensor_body(x), "id": {"a": 1}}): '"id" must be a string',
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 4],
                                    "data": [[0.0] * 3, [0.0] * 5]}]}): "data[0] must be a list of 4 items",
            json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": "0000"}]}):
                '"data" must be a JSON list, got str',
            '{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [NaN, 0, 0, 0]}]}': "NaN is not JSON",
            '{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1e400, 0, 0, 0]}]}':
                "does not fit in a 64-bit float",
        }
        for body, expected in bad.items():
            r = requests.post(infer, content=body)
            assert r.status_code == 400, (body, r.text)
            assert expected in r.json()["error"], (expected, r.json())
        header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                         "parameters": {"binary_data_size": 16}}]}).encode()
        short = requests.post(infer, content=header + b"\0" * 12, headers={"Inference-Header-Content-Length": str(len(header))})
        assert short.status_code == 400 and "binary_data_size 16" in short.json()["error"]
        for method, path, status, expected in [("GET", "/v2/models/toy/infer", 405, "use POST"),
                                               ("POST", "/metrics", 405, "use GET, HEAD"),
                                               ("GET", "/nothing/here", 404, "no endpoint /nothing/here")]:
            r = requests.request(method, f"{base}{path}")
            assert r.status_code == status and expected in r.json()["error"], (path, r.text)
        metrics = requests.get(f"{base}/metrics").text
        for name in ("overdrive_requests_total", "overdrive_queue_duration_seconds", "overdrive_compute_duration_seconds",
                     "overdrive_batch_size", "overdrive_queue_depth", "overdrive_rejections_total"):
            assert name in metrics
        assert live.metric("overdrive_rejections_total", reason="invalid") == len(bad) + 1


# -- failure patterns -------------------------------------------------------------------------------------


def test_a_malformed_request_among_good_ones_fails_alone():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=16, max_queue_delay_ms=300, batching="fixed") as live:
        xs = [rows(2, i) for i in range(5)]
        bodies = [tensor_body(x) for x in xs]
        bodies.insert(2, {"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 3], "data": [0.0] * 6}]})
        results = asyncio.run(gather_posts(live.infer_url, bodies))
    statuses = [r[0] for r in results]
    assert statuses == [200, 200, 400, 200, 200, 200]
    good = [r for r in results if r[0] == 200]
    for (_, doc, _, _), x in zip(good, xs):
        np.testing.assert_allclose(output_of(doc), reference(workload, x), rtol=1e-6, atol=1e-6)
    assert [n for n, _ in workload.model.seen[1:]] == [10]  # [0] is the warm-up probe; the good ones shared one batch


def test_a_request_that_makes_the_model_raise_gets_the_error_alone():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=16, max_queue_delay_ms=300, batching="fixed") as live:
        xs = [rows(1, i) for i in range(6)]
        xs[3] = rows(1, 3, marker=RAISE)
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))
        assert [r[0] for r in results] == [200, 200, 200, 500, 200, 200]
        assert "makes the model raise" in results[3][1]["error"]
        for i in (0, 1, 2, 4, 5):
            np.testing.assert_allclose(output_of(results[i][1]), reference(workload, xs[i]), rtol=1e-6, atol=1e-6)
        after = requests.post(live.infer_url, json=tensor_body(rows(3, 9)))
        assert after.status_code == 200  # the batcher keeps serving
        assert live.metric("overdrive_rejections_total", reason="model_error") == 1


def test_non_finite_outputs_are_an_error_not_invalid_json():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=16, max_queue_delay_ms=300, batching="fixed") as live:
        xs = [rows(1, i) for i in range(4)]
        xs[1] = rows(1, 1, marker=NAN_OUT)
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))
        assert [r[0] for r in results] == [200, 500, 200, 200]
        assert "non-finite output value(s)" in results[1][1]["error"]
        for i in (0, 2, 3):
            np.testing.assert_allclose(output_of(results[i][1]), reference(workload, xs[i]), rtol=1e-6, atol=1e-6)


def test_large_small_large_requests_match_the_single_request_reference():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=8, max_queue_delay_ms=5, batching="fixed") as live:
        xs = [rows(n, n) for n in (21, 1, 13, 8, 2, 30)]
        for x in xs:  # in sequence
            r = requests.post(live.infer_url, json=tensor_body(x))
            np.testing.assert_allclose(output_of(r.json()), reference(workload, x), rtol=1e-6, atol=1e-6)
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))  # and all at once
        for (status, doc, _, _), x in zip(results, xs):
            assert status == 200
            np.testing.assert_allclose(output_of(doc), reference(workload, x), rtol=1e-6, atol=1e-6)
    assert max(n for n, _ in workload.model.seen) <= 8


def test_text_of_mixed_lengths_is_bucketed_and_unpadded_per_request():
    workload = toy_text_workload()
    words = "the quick brown fox jumps over the lazy dog and keeps running far away".split()
    sentences = [" ".join(words[: 1 + (i * 7) % len(words)]) * (1 + i % 3) for i in range(24)]
    with LiveServer(workload, max_batch_size=8, max_queue_delay_ms=50, batching="fixed") as live:
        bodies = [{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [s]}]} for s in sentences]
        results = asyncio.run(gather_posts(live.infer_url, bodies))
    with torch.no_grad():
        for (status, doc, _, _), s in zip(results, sentences):
            assert status == 200
            np.testing.assert_allclose(output_of(doc), workload.model(*workload.collate([s])).numpy(), rtol=1e-5, atol=1e-6)
    batches = workload.model.seen[1:]
    assert all(rows_ <= 8 for rows_, _ in batches)
    longest = max(len(s.encode()) + 2 for s in sentences)
    assert min(length for _, length in batches) < longest  # short sentences were not padded to the longest


def test_batch_sizes_grow_with_load_up_to_the_maximum():
    workload = toy_workload(delay_s=0.02)
    means = {}
    with LiveServer(workload, max_batch_size=16, max_queue_delay_ms=5, batching="fixed", max_queue_size=256) as live:
        for n in (20, 40, 80):
            start = len(workload.model.seen)
            results = asyncio.run(gather_posts(live.infer_url, [tensor_body(rows(1, i)) for i in range(n)]))
            assert all(r[0] == 200 for r in results)
            sizes = [rows_ for rows_, _ in workload.model.seen[start:]]
            assert sum(sizes) == n and max(sizes) <= 16
            means[n], biggest = n / len(sizes), max(sizes)
    assert means[20] < means[80] and means[40] <= means[80], means  # batches grow with load ...
    assert biggest == 16 and means[80] >= 8, means  # ... up to the maximum


def test_requests_of_max_batch_size_rows_never_make_a_bigger_batch():
    workload = toy_workload(delay_s=0.01)
    with LiveServer(workload, max_batch_size=8, max_queue_delay_ms=20, batching="fixed", max_queue_size=1024) as live:
        xs = [rows(8, i) for i in range(24)] + [rows(5, 100 + i) for i in range(8)]
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))
    for (status, doc, _, _), x in zip(results, xs):
        assert status == 200
        np.testing.assert_allclose(output_of(doc), reference(workload, x), rtol=1e-6, atol=1e-6)
    assert max(n for n, _ in workload.model.seen) == 8


def test_clients_that_disconnect_mid_wait_have_their_rows_dropped_then_traffic_succeeds():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=4, max_queue_delay_ms=1, batching="fixed") as live:
        for round_ in range(3):  # a steady stream: each round holds the instance, then 9 clients wait
            async def one_round():
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                    blocker = asyncio.ensure_future(post(session, live.infer_url, tensor_body(rows(1, 0, marker=BLOCK))))
                    await asyncio.sleep(0.1)  # the blocking batch is running
                    waiting = [asyncio.ensure_future(post(session, live.infer_url, tensor_body(rows(1, i, marker=NEVER if i % 3 == 0 else None)),
                                    timeout_s=0.2 if i % 3 == 0 else None)) for i in range(9)]
                    return await blocker, await asyncio.gather(*waiting)
            blocker, results = asyncio.run(one_round())
            assert blocker[0] == 200
            assert [r[0] for r in results] == [None if i % 3 == 0 else 200 for i in range(9)], round_
        assert live.metric("overdrive_rejections_total", reason="client_disconnected") == 9
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(rows(2, i)) for i in range(12)]))
        assert all(r[0] == 200 for r in results)
    assert not any(NEVER in markers for _, markers in workload.model.seen)


def test_a_burst_over_the_queue_bound_is_shed_fast_and_admitted_requests_complete():
    workload = toy_workload(delay_s=0.1)
    with LiveServer(workload, max_batch_size=4, max_queue_delay_ms=1, batching="fixed", max_queue_size=8) as live:
        xs = [rows(1, i) for i in range(64)]  # 8× the queue bound
        results = asyncio.run(gather_posts(live.infer_url, [tensor_body(x) for x in xs]))
        shed = [r for r in results if r[0] == 503]
        done = [(r, x) for r, x in zip(results, xs) if r[0] == 200]
        assert len(shed) + len(done) == 64 and len(shed) >= 32 and len(done) >= 8
        assert all(r[3].get("Retry-After") == "1" and "queue is full" in r[1]["error"] for r in shed)
        assert max(r[2] for r in shed) < 1.0  # shed at once, not after waiting
        for (_, doc, _, _), x in done:
            np.testing.assert_allclose(output_of(doc), reference(workload, x), rtol=1e-6, atol=1e-6)
        assert requests.get(f"{live.url}/v2/health/ready").status_code == 200
        assert requests.post(live.infer_url, json=tensor_body(rows(1, 1))).status_code == 200
        assert live.metric("overdrive_rejections_total", reason="queue_full") == len(shed)


def test_json_bytes_that_are_not_utf8_get_400():
    with LiveServer(toy_text_workload(), max_batch_size=8) as live:
        body = '{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["\\ud800"]}]}'
        r = requests.post(live.infer_url, content=body)
        assert r.status_code == 400 and "not valid UTF-8" in r.json()["error"]
        nested = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [3], "data": [["a", "b"], ["c"]]}]}
        assert requests.post(live.infer_url, json=nested).status_code == 400


def test_a_request_whose_timeout_passes_while_queued_gets_504_and_never_runs():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=4, max_queue_delay_ms=1, batching="fixed") as live:
        async def scenario():
            async with aiohttp.ClientSession() as session:
                blocker = asyncio.ensure_future(post(session, live.infer_url, tensor_body(rows(1, 0, marker=BLOCK))))
                await asyncio.sleep(0.1)
                late = await post(session, live.infer_url, tensor_body(rows(1, 1, marker=NEVER), timeout=100_000))  # µs
                return await blocker, late
        blocker, late = asyncio.run(scenario())
    assert blocker[0] == 200
    assert late[0] == 504 and "timed out while queued" in late[1]["error"] and late[2] < 0.5
    assert not any(NEVER in markers for _, markers in workload.model.seen)
    assert _timeout_s(0, 30_000.0) is None and _timeout_s(None, 30_000.0) == 30.0  # 0 means none, as in Triton


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "SERVE_TOY_DELAY_S": "0.3"}
    proc = subprocess.Popen([sys.executable, "-m", "overdrive", "serve", "tests.fixtures.serve_models:slow_toy", "--port", "0",
                             "--max-batch-size", "2", "--max-queue-delay-ms", "1"], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        while line and "http://" not in line:
            line = proc.stderr.readline()
        url = line.split(" on ")[1].split()[0]
        base = url.split("/v2/")[0]
        wait_ready(base)

        async def scenario():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                in_flight = [asyncio.ensure_future(post(session, url, tensor_body(rows(1, i)))) for i in range(10)]
                await asyncio.sleep(0.4)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
                async with session.get(f"{base}/v2/health/ready") as r:
                    ready = r.status
                late = await post(session, url, tensor_body(rows(1, 99)))
                return await asyncio.gather(*in_flight), ready, late
        results, ready, late = asyncio.run(scenario())
        assert ready == 503
        assert late[0] == 503 and "shutting down" in late[1]["error"]
        assert [r[0] for r in results] == [200] * 10  # every accepted request completed; none lost
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()


def test_bodies_over_the_limit_get_413_also_when_compressed_or_chunked():
    with LiveServer(toy_workload(), max_batch_size=8, max_request_bytes=4096) as live:
        x = rows(200, 1)  # ~16 kB of JSON
        assert requests.post(live.infer_url, json=tensor_body(x)).status_code == 413
        bomb = gzip.compress(json.dumps(tensor_body(np.zeros((1000, 4), dtype=np.float32))).encode())
        assert len(bomb) < 4096
        r = requests.post(live.infer_url, content=bomb, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 413 and "decompresses to more than 4096 bytes" in r.json()["error"]
        chunked = requests.post(live.infer_url, content=iter([json.dumps(tensor_body(x)).encode()]))  # no Content-Length
        assert chunked.status_code == 413
        assert requests.post(live.infer_url, json=tensor_body(rows(2, 3))).status_code == 200
        assert live.metric("overdrive_rejections_total", reason="too_large") == 3
