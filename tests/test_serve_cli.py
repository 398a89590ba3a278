"""`overdrive serve` from the command line: bad input gets one line and exit code 2; a plan
written for a workload is served with its techniques applied."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from overdrive.serve.runner import load_served_model
from overdrive.techniques import default_config
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build
from overdrive.workloads import create_workload
from tests.fixtures.cli import cli_in_process
from tests.fixtures.live_server import wait_ready

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    Plan(workload="tests.fixtures.user_models:build", device="cpu", batch_size=4,
         steps=[default_config("bf16")]).save(path)
    return path


def test_bad_input_gets_one_line_and_exit_code_2(tmp_path, plan_file):
    cuda_plan = tmp_path / "cuda.json"
    cuda_plan.write_text(plan_file.read_text().replace('"device": "cpu"', '"device": "cuda"'))
    (tmp_path / "junk.json").write_text("{not json")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [
        (["no-such-model"], "unknown workload 'no-such-model'"),
        ([str(tmp_path / "missing.json")], "the plan " + str(tmp_path / "missing.json") + ": no such file"),
        ([str(tmp_path / "junk.json")], "is not an overdrive plan"),
        ([str(plan_file), "--max-batch-size", "8", "--max-queue-size", "4"], "less than one batch"),
        (["tests.fixtures.user_models:build", "--port", str(busy.getsockname()[1])], "cannot listen on"),
        (["tests.fixtures.user_models:build", "--max-batch-size", "0"], "expected a positive integer"),
        (["tests.fixtures.user_models:build", "--port", "70000"], "expected a TCP port 0..65535"),
        (["tests.fixtures.user_models:build", "--model-name", "a/b"], "cannot be a URL path segment"),
        (["tests.fixtures.user_models:build", "--model-name", ""], "cannot be a URL path segment"),
        (["tests.fixtures.user_models:build", "--max-queue-delay-ms", "-1"], "expected a finite number ≥ 0"),
        (["tests.fixtures.user_models:scalar_output"], "the model must return a tensor"),
        (["tests.fixtures.user_models:build", "digits-cnn", "--model-name", "m"], "--model-name names one model, and 2 are given"),
        (["tests.fixtures.user_models:build", "tests.fixtures.user_models:build"], "two of the models are named 'user_models'"),
        (["tests.fixtures.user_models:build", "--grpc-port", str(busy.getsockname()[1])], "choose another --grpc-port"),
        (["tests.fixtures.user_models:build", "--batching", "eager"], "invalid choice: 'eager'"),
        (["tests.fixtures.user_models:build", "--port", "8123", "--grpc-port", "8123"], "give gRPC a port of its own"),
    ]
    if not torch.cuda.is_available():
        cases.append(([str(cuda_plan)], "no CUDA GPU is present"))
    threads = set(threading.enumerate())
    for args, message in cases:
        result = cli_in_process("serve", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    busy.close()
    assert set(threading.enumerate()) <= threads  # a refused start leaves no server thread behind


def test_a_plan_is_served_with_its_techniques(plan_file):
    served, plan, instances = load_served_model(str(plan_file), device="auto", instances=None)
    assert plan.names == ["bf16"] and instances == 1
    workload = create_workload("tests.fixtures.user_models:build")
    model, _ = build(workload, plan.steps, torch.device("cpu"))
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(x).float().numpy()
    np.testing.assert_array_equal(served.execute([(x,)], 0)[0], expected)  # the bf16 model, not the fp32 one

    proc = subprocess.Popen([sys.executable, "-m", "overdrive", "serve", str(plan_file), "--port", "0", "--instances", "2"],
                            cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        assert "(bf16)" in line and "'user_models'" in line, line
        threads = max(1, torch.get_num_threads() // 2)  # two CPU instances split the cores
        assert '"instances": 2' in line and f'"intra_op_threads_each": {threads}' in line, line
        url = line.split(" on ")[1].split()[0]
        wait_ready(url.split("/v2/")[0])
        body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [3, 16], "data": x.reshape(-1).tolist()}]}
        doc = httpx.post(url, json=body).json()
        np.testing.assert_array_equal(np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(3, 4), expected)
        config = httpx.get(url.removesuffix("/infer") + "/config").json()
        assert config["max_batch_size"] == 4  # the plan's batch size
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert json.loads(plan_file.read_text())["techniques"][0]["name"] == "bf16"


def test_a_model_with_a_static_batch_is_padded_to_it_and_unpadded_per_request():
    served, _, _ = load_served_model("tests.fixtures.user_models:fixed_batch", device="cpu", instances=None)
    assert served.fixed_batch_size == 4
    x = torch.randn(3, 16)
    out = served.execute([(x[:1],), (x[1:],)], 0)  # 3 rows padded to 4, cut back to 1 + 2
    assert [o.shape for o in out] == [(1, 1), (2, 1)]
    np.testing.assert_allclose(np.concatenate(out)[:, 0], x.sum(-1).numpy(), rtol=1e-5)
    result = cli_in_process("serve", "tests.fixtures.user_models:fixed_batch", "--max-batch-size", "8")
    assert result.returncode == 2 and "--max-batch-size must be ≤ 4" in result.stderr


def test_warmup_runs_powers_of_two_and_the_cap_and_times_each():
    from overdrive.serve.model import ServedModel
    from tests.fixtures.serve_models import toy_text_workload, toy_workload

    workload = toy_workload()
    served = ServedModel("toy", workload, [workload.model], [torch.device("cpu")])
    sizes, _, timings = served.warmup(6, budget_s=60)
    assert sizes == [1, 2, 4, 6] and [t[0] for t in timings] == [1, 2, 4, 6] and all(t[1] > 0 for t in timings)
    assert [n for n, _ in workload.model.seen[1:]] == [1, 1, 2, 2, 4, 4, 6, 6]  # a set-up run, then a timed one
    assert served.warmup(6, budget_s=0)[0] == []
    text = toy_text_workload()
    served = ServedModel("toy-text", text, [text.model], [torch.device("cpu")])
    loaded = len(text.model.seen)
    assert served.warmup(12, budget_s=60)[0] == [1, 2, 4, 8, 12]
    # [0]: the input-limits probe (its ids feed an embedding: core/input_limits.py), then the padding check
    # (core/row_dependence.py) and the start-up probe
    assert text.model.seen[0][0] == len(text.samples)
    # Each size ≥ 2 also runs its rows unpadded and padded (a compiled model's two paths), then the timed run.
    warm = text.model.seen[loaded:]
    assert [rows for rows, _ in warm] == [1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8, 12, 12, 12]
    lengths = [length for _, length in warm]
    assert lengths[2] == lengths[4] != lengths[3]  # one sentence repeated, then different sentences padded to the longest


def test_a_batch_size_the_warm_up_skipped_is_counted_cold_once():
    from overdrive.serve.model import ServedModel
    from tests.fixtures.serve_models import toy_workload

    workload = toy_workload()
    served = ServedModel("toy", workload, [workload.model], [torch.device("cpu")])
    cold = []
    served.on_cold_batch = lambda: cold.append(1)
    served.warmup(8, budget_s=60)
    served.watch_recompiles()  # the server calls it once warm
    x = torch.randn(3, 4)
    for rows in (1, 3, 3, 8, 5):
        served.execute([(x[:1].expand(rows, 4),)], 0)
    assert len(cold) == 2  # 3 and 5, each once


def test_instance_threads_set_their_own_intra_op_threads_and_warm_only_their_model():
    from concurrent.futures import ThreadPoolExecutor

    from overdrive.serve.model import ServedModel
    from tests.fixtures.serve_models import toy_workload

    first, second = toy_workload(), toy_workload()
    served = ServedModel("toy", first, [first.model, second.model], [torch.device("cpu")] * 2)
    served.threads_per_instance = 1
    probed = len(first.model.seen)  # the constructor runs model 0 once for the output shape
    with ThreadPoolExecutor(1, initializer=served.start_instance, initargs=(1,)) as thread:
        assert thread.submit(torch.get_num_threads).result() == 1
        assert thread.submit(served.warmup, 3, 60, 1).result()[0] == [1, 2, 3]
    assert len(first.model.seen) == probed and [n for n, _ in second.model.seen[1:]] == [1, 1, 2, 2, 3, 3]


def test_a_huge_text_is_counted_from_its_start_only_in_the_request_handler():
    """The length-bucket hint tokenizes at most 128 × max_seq_length characters of a text: a
    10 MB string must not block the event loop for seconds (found by a user trial: 8.7 s)."""
    from overdrive.serve.model import ServedModel
    from overdrive.serve.protocol import InferRequest, Tensor
    from tests.fixtures.serve_models import toy_text_workload

    seen: list[int] = []

    def tokenizer(texts, **options):
        seen.extend(len(t) for t in texts)
        return {"input_ids": [[0] * min(len(t.split()), options["max_length"]) for t in texts]}

    workload = toy_text_workload()
    workload.extra.update(tokenizer=tokenizer, max_seq_length=8)
    served = ServedModel("toy-text", workload, [workload.model], [torch.device("cpu")])
    huge = "word " * 2_000_000
    payload = served.validate(InferRequest(inputs={"text": Tensor("text", "BYTES", [1], np.array([huge.encode()], dtype=object))},
                                           outputs={}, parameters={}, id=None, binary_outputs=False))
    assert payload.lengths == [8] and max(seen) <= 128 * 8
