"""Inputs are checked against what the model can take before they reach it: a token id past an
embedding's rows (or a NaN) gets a 400 from `serve`, a line in `run`'s errors file, a refusal
from `optimize(data=...)`; the process and the other requests go on. Under a compiled plan such
an id would abort the process from inside an Inductor kernel."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import overdrive
from overdrive.core.input_limits import derive_input_limits, workload_input_limits
from tests.fixtures.id_models import TEXT_VOCAB, VOCAB, char_bert, id_embedder
from tests.fixtures.live_server import LiveServer
from tests.fixtures.run_io import ENV, ROOT, run, write_lines
from tests.fixtures.serve_models import toy_workload

pytestmark = pytest.mark.timeout(300)


def ids_body(ids: np.ndarray) -> dict:
    return {"inputs": [{"name": "input", "datatype": "INT64", "shape": list(ids.shape), "data": ids.reshape(-1).tolist()}]}


def text_body(texts: list[str]) -> dict:
    return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}


def eager(workload, *inputs) -> np.ndarray:
    with torch.no_grad():
        return workload.model(*inputs).numpy()


# -- the limits ------------------------------------------------------------------------------------


def test_limits_come_from_the_embeddings_the_inputs_feed():
    limits = workload_input_limits(id_embedder())
    assert [(r.input, r.low, r.high) for r in limits.ranges] == [(0, 0, VOCAB)] and "embed.weight" in limits.ranges[0].table
    text = workload_input_limits(char_bert())
    assert [(r.input, r.high) for r in text.ranges] == [(0, TEXT_VOCAB)]  # ids; the attention mask feeds no embedding
    assert workload_input_limits(toy_workload()).finite == (0,)

    class Shifted(torch.nn.Module):  # ids the model computes from an input bound nothing
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 2)

        def forward(self, ids):
            return self.embed(ids.clamp(0, 9)).sum(1)

    assert not derive_input_limits(Shifted(), (torch.tensor([[1, 2, 30]]),)).ranges


def test_row_problems_name_the_input_the_value_and_the_range():
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, VOCAB, 4, 5, 6], [-1, 0, 0, 0, 0, 0], [0] * 6])
    problems = workload_input_limits(id_embedder()).row_problems((ids,), ["input 'input'"])
    assert set(problems) == {1, 2}
    assert problems[1].startswith(f"input 'input' holds {VOCAB}, outside [0, {VOCAB}): the model looks it up in embed.weight")
    assert "holds -1" in problems[2]


# -- serve ---------------------------------------------------------------------------------------------


def test_serve_answers_400_for_an_id_past_the_vocabulary_and_stays_up():
    workload = id_embedder()
    good = np.random.default_rng(0).integers(0, VOCAB, (3, 6))
    with LiveServer(workload, max_batch_size=8) as live:
        for bad_value, row in ((VOCAB, 1), (10 ** 6, 0), (-1, 2)):
            bad = good.copy()
            bad[row, 3] = bad_value
            r = httpx.post(live.infer_url, json=ids_body(bad))
            assert r.status_code == 400, r.text
            assert f"row {row}: input 'input' holds {bad_value}, outside [0, {VOCAB})" in r.json()["error"]
        r = httpx.post(live.infer_url, json=ids_body(good))
        assert r.status_code == 200
        out = r.json()["outputs"][0]
        np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), eager(workload, torch.from_numpy(good)),
                                   rtol=1e-5, atol=1e-6)


def test_serve_answers_400_for_nan_and_inf_inputs():
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    with LiveServer(toy_workload(), max_batch_size=8) as live:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{live.port}")
        for value in (np.nan, np.inf, -np.inf):  # JSON has no NaN: binary tensor data, as tritonclient sends it
            x = np.full((2, 4), 0.5, dtype=np.float32)
            x[1, 2] = value
            tensor = httpclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=True)
            with pytest.raises(InferenceServerException, match=rf"row 1: input 'input' holds {value}; the model takes finite"):
                client.infer("toy", [tensor])
        x = np.full((1, 4), 0.5, dtype=np.float32)
        tensor = httpclient.InferInput("input", [1, 4], "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        assert client.infer("toy", [tensor]).as_numpy("output").shape == (1, 3)


def test_serve_answers_400_for_text_whose_token_ids_the_model_has_no_rows_for():
    from tests.test_serve import gather_posts

    workload = char_bert()
    with LiveServer(workload, max_batch_size=8, max_queue_delay_ms=20, batching="fixed") as live:
        r = httpx.post(live.infer_url, json=text_body(["plain ascii", "héllo"]))
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith(f"input 'text' element 1: model input 0 (tokenized) holds 233, outside [0, {TEXT_VOCAB})")
        texts = [f"sentence number {i}" + (" café" if i % 3 == 0 else "") for i in range(12)]
        results = asyncio.run(gather_posts(live.infer_url, [text_body([t]) for t in texts]))  # bad ones among good
    for (status, doc, _, _), t in zip(results, texts):
        if "é" in t:
            assert status == 400
        else:
            assert status == 200
            out = doc["outputs"][0]
            np.testing.assert_allclose(np.reshape(out["data"], out["shape"]), eager(workload, *workload.collate([t])),
                                       rtol=1e-4, atol=1e-5)


# -- run -----------------------------------------------------------------------------------------------


def test_run_files_out_of_range_ids_as_errors_and_writes_the_rest(tmp_path):
    workload = id_embedder()
    ids = np.random.default_rng(1).integers(0, VOCAB, (40, 6))
    bad = {3: VOCAB, 17: -5, 18: 999, 39: VOCAB + 1}
    for i, v in bad.items():
        ids[i, i % 6] = v
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "out.npy"
    summary = run(tmp_path / "ids.npy", out, workload=workload, batch_size=8, chunk_size=16)
    assert summary.failed == len(bad)
    errors = [json.loads(line) for line in Path(summary.errors_path).read_text().splitlines()]
    assert [e["index"] for e in errors] == sorted(bad)
    assert errors[0]["reason"] == (f"not an input this model takes: input 'input' holds {VOCAB}, outside [0, {VOCAB}): "
                                   "the model looks it up in embed.weight (20 rows)")
    rows = np.load(out)
    good = [i for i in range(40) if i not in bad]
    np.testing.assert_allclose(rows[good], eager(workload, torch.from_numpy(ids[good])), rtol=1e-5, atol=1e-6)
    assert np.isnan(rows[sorted(bad)]).all()


def test_run_files_text_the_model_has_no_rows_for_and_embeds_the_rest(tmp_path):
    workload = char_bert()
    texts = [f"line {i}" + (" naïve" if i % 5 == 2 else "") for i in range(30)]
    out = tmp_path / "out.npy"
    summary = run(write_lines(tmp_path / "in.txt", texts), out, workload=workload, batch_size=4, chunk_size=8)
    bad = [i for i, t in enumerate(texts) if "ï" in t]
    errors = [json.loads(line) for line in Path(summary.errors_path).read_text().splitlines()]
    assert summary.failed == len(bad) and [e["index"] for e in errors] == bad
    assert "holds 239, outside [0, 128)" in errors[0]["reason"]
    rows = np.load(out)
    for i, t in enumerate(texts):
        if i not in bad:
            np.testing.assert_allclose(rows[i], eager(workload, *workload.collate([t]))[0], rtol=1e-4, atol=1e-5)


# -- optimize(data=...) ---------------------------------------------------------------------------------


def test_optimize_refuses_data_with_ids_past_the_vocabulary():
    model = id_embedder().model
    example = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(0))
    data = [example.clone(), example.clone()]
    data[1][2, 0] = VOCAB + 3
    with pytest.raises(overdrive.WorkloadError, match=rf"batch 1 of data, row 2: model input 0 holds {VOCAB + 3}, outside \[0, {VOCAB}\)"):
        overdrive.optimize(model, example, data=data, techniques=["bf16"], sweep_batch_sizes=[])


# -- under a compiled plan (the case that aborted the process) ------------------------------------------


@pytest.mark.slow
def test_run_with_a_compiled_plan_survives_an_out_of_range_id(tmp_path):
    """Batches of 256 on two threads: Inductor's kernel runs the lookup in an OpenMP region, where
    its bounds check throws std::runtime_error and the process aborts ("terminate called ...",
    exit 134) with its parts left behind. The record must be refused before it gets there."""
    from overdrive.techniques.runtime.torch_compile import CompileConfig
    from overdrive.tuning.plan import Plan

    spec = "tests.fixtures.id_models:id_embedder"
    plan = tmp_path / "plan.json"
    Plan(workload=spec, device="cpu", batch_size=256, steps=[CompileConfig()]).save(plan)
    ids = np.random.default_rng(2).integers(0, VOCAB, (1024, 6))
    ids[700, 2] = VOCAB + 100
    np.save(tmp_path / "ids.npy", ids)
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run([sys.executable, "-m", "overdrive", "run", spec, "--plan", str(plan), "--input",
                             str(tmp_path / "ids.npy"), "--output", str(tmp_path / "out.npy"), "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
                            start_new_session=True)  # its own process group, as a shell starts a command
    assert result.returncode == 0, result.stderr[-2000:]
    errors = [json.loads(line) for line in (tmp_path / "out.npy.errors.jsonl").read_text().splitlines()]
    assert [e["index"] for e in errors] == [700]
    rows = np.load(tmp_path / "out.npy")
    good = [i for i in range(1024) if i != 700]
    np.testing.assert_allclose(rows[good], eager(id_embedder(), torch.from_numpy(ids[good])), rtol=1e-4, atol=1e-5)
    assert not (tmp_path / "out.npy.parts").exists()


def test_run_files_npy_values_that_the_models_integer_dtype_cannot_hold(tmp_path):
    ids = np.random.default_rng(3).integers(0, VOCAB, (8, 6)).astype(np.float64)
    ids[2, 1] = 3.5  # would silently become id 3
    np.save(tmp_path / "ids.npy", ids)
    summary = run(tmp_path / "ids.npy", tmp_path / "out.npy", workload=id_embedder(), batch_size=4)
    errors = [json.loads(line) for line in Path(summary.errors_path).read_text().splitlines()]
    assert [(e["index"], e["reason"]) for e in errors] == [(2, "row holds 3.5, which the model's int64 input cannot hold exactly")]
    assert np.isfinite(np.load(tmp_path / "out.npy")[[0, 1, 3, 4, 5, 6, 7]]).all()


def test_run_whose_first_records_the_model_cannot_take_is_refused_before_it_starts(tmp_path):
    from overdrive.core.errors import DataError

    np.save(tmp_path / "ids.npy", np.full((5, 6), VOCAB, dtype=np.int64))
    with pytest.raises(DataError, match=rf"none of its first 5 readable records is an input this model takes .*holds {VOCAB}"):
        run(tmp_path / "ids.npy", tmp_path / "out.npy", workload=id_embedder())
    assert not (tmp_path / "out.npy.parts").exists()
