"""`overdrive run --engine ray` and `overdrive.ray.Predictor` on a local Ray instance (2 CPUs) started
by the test: the output file equals `overdrive run`'s on the same input, a record the model cannot
take is filed (NaN row, OUTPUT.errors.jsonl) and the rows around it keep their own answers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from overdrive import cli
from overdrive.techniques import default_config
from overdrive.tuning.plan import Plan

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def local_ray():
    import os

    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"  # actors import tests.fixtures
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_run_on_ray_equals_run_on_text_with_a_bad_record(local_ray, tmp_path):
    from tests.fixtures.run_models import SENTENCES

    texts = [SENTENCES[i % len(SENTENCES)] * (1 + i % 3) for i in range(150)]
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    lines[7] = "{not json\n"  # filed by both engines, a NaN row in both files
    (tmp_path / "in.jsonl").write_text("".join(lines))
    plan = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.run_models:char_text", device="cpu", batch_size=8,
         steps=[default_config("length-bucketing")]).save(plan)
    local, on_ray = tmp_path / "local.npy", tmp_path / "ray.npy"
    assert cli.main(["run", str(plan), "--input", str(tmp_path / "in.jsonl"), "--output", str(local)]) == 0
    assert cli.main(["run", str(plan), "--input", str(tmp_path / "in.jsonl"), "--output", str(on_ray), "--engine", "ray",
                     "--concurrency", "2"]) == 0
    a, b = np.load(local), np.load(on_ray)
    assert a.shape == b.shape == (150, a.shape[1])
    np.testing.assert_array_equal(np.isnan(a).any(axis=1), np.isnan(b).any(axis=1))
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)  # row i is record i's answer on both engines
    local_errors = [json.loads(line)["index"] for line in (tmp_path / "local.npy.errors.jsonl").read_text().splitlines()]
    ray_errors = [json.loads(line)["index"] for line in (tmp_path / "ray.npy.errors.jsonl").read_text().splitlines()]
    assert local_errors == ray_errors == [7] and np.isnan(b[7]).all() and not np.isnan(b[6]).any()


def test_predictor_in_map_batches_on_tensor_rows(local_ray, tmp_path):
    from sklearn.datasets import load_digits

    import overdrive.ray
    from overdrive.workloads import create_workload

    images = (load_digits().images[:40, None] / 16.0).astype(np.float32)
    plan = tmp_path / "plan.json"
    Plan(workload="digits-cnn", device="cpu", batch_size=16, steps=[default_config("bn-fold")]).save(plan)
    ds = ray.data.from_items([{"index": i, "input": images[i]} for i in range(40)], override_num_blocks=3)
    rows = ds.map_batches(overdrive.ray.Predictor, fn_constructor_kwargs={"plan": str(plan), "device": "cpu"}, concurrency=1,
                          batch_size=16, batch_format="numpy").take_all()
    rows.sort(key=lambda r: r["index"])
    got = np.stack([r["output"] for r in rows])
    import torch

    with torch.no_grad():
        expected = create_workload("digits-cnn").model(torch.from_numpy(images)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert [int(r["prediction"]) for r in rows] == expected.argmax(1).tolist() and all(r["error"] == "" for r in rows)


def test_engine_ray_needs_a_plan(tmp_path, capsys):
    (tmp_path / "in.txt").write_text("a\n")
    assert cli.main(["run", "minilm", "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "o.npy"),
                     "--engine", "ray"]) == 2
    assert "give --plan" in capsys.readouterr().err


def test_a_record_the_model_answers_with_nan_is_filed_as_failed_on_ray(local_ray, tmp_path):
    """As `overdrive run` files it (issue 30): a NaN row in the .npy, a line in the errors file, counted as failed."""
    from overdrive.run.ray_engine import run_on_ray
    from tests.fixtures.row_models import pad_encoder

    _, example = pad_encoder()
    ids = example.numpy().copy()
    ids[5] = 0  # all padding: the model's pooling gives 0 / 0
    np.save(tmp_path / "ids.npy", ids)
    plan = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.row_models:nan_on_all_padding", device="cpu", batch_size=4, steps=[]).save(plan)
    summary = run_on_ray(plan=plan, input=tmp_path / "ids.npy", output=tmp_path / "o.npy", concurrency=1)
    errors = [json.loads(line) for line in (tmp_path / "o.npy.errors.jsonl").read_text().splitlines()]
    assert summary["failed"] == 1 and [e["index"] for e in errors] == [5] and "non-finite" in errors[0]["reason"]
    rows = np.load(tmp_path / "o.npy")
    assert np.isnan(rows[5]).all() and np.isfinite(np.delete(rows, 5, axis=0)).all()
