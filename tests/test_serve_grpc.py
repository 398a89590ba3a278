"""KServe v2 gRPC with a real client (tritonclient.grpc), several models in one server with the
repository extension, the metrics Triton users read, and the defects a new user found: a body
cut short, a huge JSON body, a binary body without its header length."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx as requests
import numpy as np
import pytest
import torch

from overdrive.serve.app import ServerConfig
from overdrive.serve.model import ServedModel
from tests.fixtures.live_server import LiveServer
from tests.fixtures.serve_models import NEVER, toy_text_workload, toy_workload
from tests.test_serve import gather_posts, output_of, reference, rows, tensor_body

pytestmark = pytest.mark.timeout(180)


def grpc_input(x: np.ndarray, name: str = "input"):
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput(name, list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return tensor


# -- gRPC ---------------------------------------------------------------------------------------------


@pytest.mark.own_process  # a gRPC server leaves gRPC's threads running for good
def test_tritonclient_grpc_health_metadata_config_and_infer():
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    workload = toy_workload()
    with LiveServer(workload, grpc_port=0, max_batch_size=8) as live:
        client = grpcclient.InferenceServerClient(live.grpc)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("toy")
        meta = client.get_model_metadata("toy", as_json=True)
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "4"]}]
        assert client.get_model_config("toy", as_json=True)["config"]["max_batch_size"] == 8
        x = rows(5, 1)
        result = client.infer("toy", [grpc_input(x)], request_id="g-1")
        np.testing.assert_allclose(result.as_numpy("output"), reference(workload, x), rtol=1e-6, atol=1e-6)
        assert result.get_response().id == "g-1"
        for call, code, message in [
            (lambda: client.infer("nope", [grpc_input(x)]), "StatusCode.NOT_FOUND", "this server serves 'toy'"),
            (lambda: client.infer("toy", [grpc_input(rows(2, 1)[:, :3])]), "StatusCode.INVALID_ARGUMENT",
             "must have shape [N, 4]"),
            (lambda: client.infer("toy", [grpc_input(x, "image")]), "StatusCode.INVALID_ARGUMENT", "takes inputs input"),
        ]:
            with pytest.raises(InferenceServerException) as info:
                call()
            assert info.value.status() == code and message in info.value.message(), info.value
        assert live.metric("overdrive_requests_total", status="200") == 1
        assert live.metric("overdrive_requests_total", status="400") == 2


@pytest.mark.own_process  # a gRPC server leaves gRPC's threads running for good
def test_grpc_typed_contents_and_bytes_inputs():
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    workload = toy_workload()
    text = toy_text_workload()
    models = [(ServedModel("toy", workload, [workload.model], [torch.device("cpu")]), ServerConfig(max_batch_size=8)),
              (ServedModel("toy-text", text, [text.model], [torch.device("cpu")]), ServerConfig(max_batch_size=8))]
    with LiveServer(workload, grpc_port=0, models=models) as live, grpc.insecure_channel(live.grpc) as channel:
        stub = pbg.GRPCInferenceServiceStub(channel)
        x = rows(2, 4)
        request = pb.ModelInferRequest(model_name="toy")
        request.inputs.add(name="input", datatype="FP32", shape=[2, 4]).contents.fp32_contents.extend(x.reshape(-1).tolist())
        response = stub.ModelInfer(request)
        out = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(response.outputs[0].shape))
        np.testing.assert_allclose(out, reference(workload, x), rtol=1e-6, atol=1e-6)
        request = pb.ModelInferRequest(model_name="toy-text")
        request.inputs.add(name="text", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"hello", "ünï".encode()])
        response = stub.ModelInfer(request)
        out = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(list(response.outputs[0].shape))
        with torch.no_grad():
            alone = np.concatenate([text.model(*text.collate([s])).numpy() for s in ["hello", "ünï"]])
        np.testing.assert_allclose(out, alone, rtol=1e-5, atol=1e-6)
        request = pb.ModelInferRequest(model_name="toy")  # raw bytes that do not fill the shape
        request.inputs.add(name="input", datatype="FP32", shape=[2, 4])
        request.raw_input_contents.append(b"\0" * 12)
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "need 32 bytes, got 12" in info.value.details()


@pytest.mark.own_process  # a gRPC server leaves gRPC's threads running for good
def test_http_and_grpc_requests_join_the_same_batches():
    import tritonclient.grpc as grpcclient

    workload = toy_workload()
    with LiveServer(workload, grpc_port=0, max_batch_size=16, batching="fixed", max_queue_delay_ms=400) as live:
        xs = [rows(1, i) for i in range(4)]
        grpc_out = {}

        def grpc_call(i):
            client = grpcclient.InferenceServerClient(live.grpc)
            grpc_out[i] = client.infer("toy", [grpc_input(xs[i])]).as_numpy("output")

        threads = [threading.Thread(target=grpc_call, args=(i,)) for i in (2, 3)]
        for t in threads:
            t.start()
        http = asyncio.run(gather_posts(live.infer_url, [tensor_body(xs[0]), tensor_body(xs[1])]))
        for t in threads:
            t.join(30)
    assert [n for n, _ in workload.model.seen[1:]] == [4]  # one batch of all four rows
    for i in (0, 1):
        np.testing.assert_allclose(output_of(http[i][1]), reference(workload, xs[i]), rtol=1e-6, atol=1e-6)
    for i in (2, 3):
        np.testing.assert_allclose(grpc_out[i], reference(workload, xs[i]), rtol=1e-6, atol=1e-6)


@pytest.mark.own_process  # a gRPC server leaves gRPC's threads running for good
def test_a_grpc_call_cancelled_while_queued_never_runs():
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    workload = toy_workload()
    with LiveServer(workload, grpc_port=0, max_batch_size=4, batching="fixed", max_queue_delay_ms=1000) as live:
        client = grpcclient.InferenceServerClient(live.grpc)
        with pytest.raises(InferenceServerException, match="(?i)deadline"):  # the client's, or the server's from it
            client.infer("toy", [grpc_input(rows(1, 0, marker=NEVER))], client_timeout=0.2)
        time.sleep(1.2)
        assert live.metric("overdrive_rejections_total", reason="client_disconnected") \
            + live.metric("overdrive_rejections_total", reason="timeout") == 1
    assert not any(NEVER in markers for _, markers in workload.model.seen)


# -- several models, the repository ----------------------------------------------------------------------


def test_two_models_have_their_own_batchers_and_the_repository_loads_and_unloads():
    a, b = toy_workload(), toy_text_workload()
    models = [(ServedModel("toy", a, [a.model], [torch.device("cpu")]), ServerConfig(max_batch_size=8, max_queue_size=8)),
              (ServedModel("toy-text", b, [b.model], [torch.device("cpu")]), ServerConfig(max_batch_size=4))]
    with LiveServer(a, models=models) as live:
        base = live.url
        index = requests.get(f"{base}/v2/repository/index").json()
        assert index == [{"name": "toy", "version": "1", "state": "READY", "reason": ""},
                         {"name": "toy-text", "version": "1", "state": "READY", "reason": ""}]
        assert requests.post(f"{base}/v2/repository/index").json() == index
        x = rows(3, 2)
        assert requests.post(live.infer_url, json=tensor_body(x)).status_code == 200
        text = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
        assert requests.post(f"{base}/v2/models/toy-text/infer", json=text).status_code == 200
        big = requests.post(live.infer_url, json=tensor_body(rows(9, 1)))  # over toy's own queue bound
        assert big.status_code == 413 and "8 rows" in big.json()["error"]
        assert requests.get(f"{base}/v2/models/toy-text/config").json()["max_batch_size"] == 4

        assert requests.post(f"{base}/v2/repository/models/toy/unload").status_code == 200
        assert requests.get(f"{base}/v2/repository/index").json()[0]["state"] == "UNAVAILABLE"
        gone = requests.post(live.infer_url, json=tensor_body(x))
        assert gone.status_code == 503 and "repository/models/toy/load" in gone.json()["error"]
        assert requests.get(f"{base}/v2/health/ready").status_code == 200  # unloaded on purpose: not counted
        assert requests.get(f"{base}/v2/models/toy/ready").status_code == 503
        assert requests.post(f"{base}/v2/models/toy-text/infer", json=text).status_code == 200  # the other one serves
        assert requests.post(f"{base}/v2/repository/models/toy/load", timeout=60).status_code == 200
        again = requests.post(live.infer_url, json=tensor_body(x))
        assert again.status_code == 200
        np.testing.assert_allclose(output_of(again.json()), reference(a, x), rtol=1e-6, atol=1e-6)
        assert requests.post(f"{base}/v2/repository/models/nope/load").status_code == 404
        metrics = requests.get(f"{base}/metrics").text
        assert 'overdrive_requests_total{model="toy-text",status="200"} 2.0' in metrics
        assert 'nv_inference_request_success{model="toy",version="1"} 2.0' in metrics


def test_a_model_that_fails_to_load_says_why_in_the_index():
    a = toy_workload()
    served = ServedModel("toy", a, [a.model], [torch.device("cpu")])

    def broken():
        raise RuntimeError("the plan's checkpoint is gone")

    with LiveServer(a, models=[(served, ServerConfig(max_batch_size=8), broken)]) as live:
        assert requests.post(f"{live.url}/v2/repository/models/toy/unload").status_code == 200
        r = requests.post(f"{live.url}/v2/repository/models/toy/load")
        assert r.status_code == 500 and "checkpoint is gone" in r.json()["error"]
        entry = requests.get(f"{live.url}/v2/repository/index").json()[0]
        assert entry["state"] == "UNAVAILABLE" and "checkpoint is gone" in entry["reason"]


# -- metrics -------------------------------------------------------------------------------------------


def test_metrics_exist_at_zero_from_the_start_with_triton_names():
    with LiveServer(toy_workload(), max_batch_size=8) as live:
        metrics = requests.get(f"{live.url}/metrics").text
        for line in ['overdrive_requests_total{model="toy",status="200"} 0.0',
                     'overdrive_rejections_total{model="toy",reason="queue_full"} 0.0',
                     'overdrive_request_duration_seconds_count{model="toy"} 0.0',
                     'overdrive_inflight_requests{model="toy"} 0.0',
                     'overdrive_instance_busy_seconds_total{instance="0",model="toy"} 0.0',
                     'overdrive_client_disconnects_total{model="toy"} 0.0',
                     'nv_inference_request_success{model="toy",version="1"} 0.0',
                     'nv_inference_queue_duration_us{model="toy",version="1"} 0.0',
                     'nv_inference_pending_request_count{model="toy",version="1"} 0.0']:
            assert line in metrics, line
        assert "# TYPE nv_inference_request_success unknown" in metrics or \
            "# TYPE nv_inference_request_success untyped" in metrics
        requests.post(live.infer_url, json=tensor_body(rows(3, 1)))
        assert live.metric("overdrive_request_duration_seconds_count") == 1
        assert live.metric("nv_inference_count", version="1") == 3
        assert live.metric("nv_inference_exec_count", version="1") == 1
        assert live.metric("overdrive_instance_busy_seconds_total", instance="0") > 0


# -- defects a new user found ---------------------------------------------------------------------------


def test_a_body_cut_short_is_counted_and_logged_in_one_line(caplog):
    with LiveServer(toy_workload(), max_batch_size=8) as live, caplog.at_level(logging.WARNING):
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            sock.sendall(b"POST /v2/models/toy/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n" + b'{"inputs": [')
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while live.metric("overdrive_client_disconnects_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert live.metric("overdrive_client_disconnects_total") == 1
        assert live.metric("overdrive_rejections_total", reason="client_disconnected") == 1
        assert requests.post(live.infer_url, json=tensor_body(rows(1, 1))).status_code == 200
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("disconnected while sending its request body (12 of 1000 bytes came)" in r.getMessage() for r in records)
    assert not any(r.exc_info or "Traceback" in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert live.metric("overdrive_requests_total", status="499") == 0  # not a response sent


def test_a_huge_json_body_does_not_stall_a_small_concurrent_request():
    workload = toy_workload()
    with LiveServer(workload, max_batch_size=8, max_queue_size=64, max_request_bytes=256 << 20) as live:
        n = 400_000  # 1.6 M floats, ~30 MB of JSON: seconds of json.loads
        big = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [n, 4],
                                      "data": np.random.default_rng(0).random(n * 4).round(6).tolist()}]}).encode()
        small = tensor_body(rows(1, 1))

        async def scenario():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                async def timed(body, delay):
                    await asyncio.sleep(delay)
                    t0 = time.perf_counter()
                    async with session.post(live.infer_url, data=body if isinstance(body, bytes) else json.dumps(body),
                                            headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        return r.status, time.perf_counter() - t0, (await r.json())
                return await asyncio.gather(timed(big, 0), timed(small, 0.5))

        (big_status, big_s, big_doc), (small_status, small_s, _) = asyncio.run(scenario())
    assert big_status == 413 and "400000 rows" in big_doc["error"]  # refused: more rows than the queue holds
    assert small_status == 200
    assert small_s < max(0.5, big_s / 3), (small_s, big_s)  # it did not wait for the big body's parse


def test_a_binary_body_without_its_header_length_names_the_header():
    with LiveServer(toy_workload(), max_batch_size=8) as live:
        header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4],
                                         "parameters": {"binary_data_size": 16}}]}).encode()
        r = requests.post(live.infer_url, content=header + np.ones(4, "<f4").tobytes())
        assert r.status_code == 400 and "Inference-Header-Content-Length header" in r.json()["error"], r.text


# -- what a second new-user trial found ----------------------------------------------------------------------


def _two_toys():
    a, b = toy_workload(), toy_text_workload()
    return a, [(ServedModel("toy", a, [a.model], [torch.device("cpu")]), ServerConfig(max_batch_size=8)),
               (ServedModel("toy-text", b, [b.model], [torch.device("cpu")]), ServerConfig(max_batch_size=4))]


def test_an_unload_while_a_body_arrives_answers_503_not_a_crash():
    a, models = _two_toys()
    with LiveServer(a, models=models) as live:
        body = json.dumps(tensor_body(rows(2, 1))).encode()
        with socket.create_connection(("127.0.0.1", live.port)) as sock:
            sock.sendall(b"POST /v2/models/toy/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:20])
            time.sleep(0.2)
            assert requests.post(f"{live.url}/v2/repository/models/toy/unload").status_code == 200
            sock.sendall(body[20:])
            reply = b""
            while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 20:  # headers and body may come apart
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 503"), reply
        assert "model 'toy' is unloaded" in reply
        assert live.metric("overdrive_requests_total", status="503") == 1


def test_repository_calls_check_their_bodies_filter_ready_and_run_one_at_a_time():
    a, models = _two_toys()
    with LiveServer(a, models=models) as live:
        base = live.url
        assert requests.post(f"{base}/v2/repository/models/toy/unload", content=b"garbage{").status_code == 400
        r = requests.post(f"{base}/v2/repository/models/toy/load", json={"parameters": {"config": "{}"}})
        assert r.status_code == 400 and "no config parameter" in r.json()["error"]
        assert requests.get(f"{base}/v2/repository/index").json()[0]["state"] == "READY"  # neither acted
        with socket.create_connection(("127.0.0.1", live.port)) as sock:  # a body cut short: nothing is done
            sock.sendall(b"POST /v2/repository/models/toy/unload HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{")
        time.sleep(0.3)
        assert requests.get(f"{base}/v2/repository/index").json()[0]["state"] == "READY"
        assert requests.post(f"{base}/v2/repository/models/toy-text/unload").status_code == 200
        assert [m["name"] for m in requests.post(f"{base}/v2/repository/index", json={"ready": True}).json()] == ["toy"]

        async def twice():
            import aiohttp

            async with aiohttp.ClientSession() as session:
                async def call(action):
                    async with session.post(f"{base}/v2/repository/models/toy-text/{action}") as r:
                        return r.status
                return await asyncio.gather(call("load"), call("load"), call("unload"))

        assert asyncio.run(twice()) == [200, 200, 200]  # queued behind each other, not refused
        assert requests.get(f"{base}/v2/repository/index").json()[1]["state"] == "UNAVAILABLE"


@pytest.mark.own_process  # a gRPC server leaves gRPC's threads running for good
def test_unimplemented_grpc_methods_say_so_without_a_traceback(caplog):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with LiveServer(toy_workload(), grpc_port=0, max_batch_size=8) as live, caplog.at_level(logging.WARNING):
        client = grpcclient.InferenceServerClient(live.grpc)
        with pytest.raises(InferenceServerException) as info:
            client.get_inference_statistics("toy")
        assert info.value.status() == "StatusCode.UNIMPLEMENTED" and "does not implement ModelStatistics" in info.value.message()
    assert not any(r.exc_info for r in caplog.records)


def test_every_common_status_is_counted_from_zero():
    with LiveServer(toy_workload(), max_batch_size=8) as live:
        metrics = requests.get(f"{live.url}/metrics").text
        for status in ("200", "400", "404", "413", "500", "503", "504"):
            assert f'overdrive_requests_total{{model="toy",status="{status}"}} 0.0' in metrics
