"""Issue 30's silent wrong answers about rows: a non-finite output row is a failed record, never a success."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from overdrive.run.job import RunConfig, run_offline
from overdrive.tuning.plan import Plan
from overdrive.workloads.user import workload_from_model
from tests.fixtures import row_models


# -- 2. a non-finite output row is a failed record -------------------------------------------------


def _ids_with_an_all_padding_record() -> np.ndarray:
    _, example = row_models.pad_encoder()
    ids = example.numpy().copy()
    ids[5] = 0  # record 5 is all padding
    return ids


def test_run_files_a_record_the_model_answers_with_nan_as_failed(tmp_path):
    """Issue 30: a compiled TransformerEncoder wrote an all-padding record as NaN, "8 of 8 records; 0 failed",
    no errors file. (Here the eager model gives the NaN: the same row, without the compile.)"""
    model, example = row_models.nan_on_all_padding()
    workload = workload_from_model("nan-pad", model, example)
    ids = _ids_with_an_all_padding_record()
    np.save(tmp_path / "ids.npy", ids)
    for out in ("o.npy", "o.jsonl"):
        summary = run_offline(RunConfig(workload=None, input=tmp_path / "ids.npy", output=tmp_path / out, device="cpu",
                                        batch_size=4), workload=workload)
        assert summary.records == 8 and summary.failed == 1
        errors = [json.loads(line) for line in Path(summary.errors_path).read_text().splitlines()]
        assert [e["index"] for e in errors] == [5] and "non-finite" in errors[0]["reason"]
    rows = np.load(tmp_path / "o.npy")
    assert np.isnan(rows[5]).all() and np.isfinite(np.delete(rows, 5, axis=0)).all()
    assert [json.loads(line)["index"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4, 6, 7]


def test_the_ray_predictor_files_a_nan_row_as_failed(tmp_path):
    import overdrive.ray

    plan = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.row_models:nan_on_all_padding", device="cpu", batch_size=4, steps=[]).save(plan)
    result = overdrive.ray.Predictor(str(plan), device="cpu")({"input": _ids_with_an_all_padding_record()})
    assert [bool(e) for e in result["error"]] == [i == 5 for i in range(8)] and "non-finite" in result["error"][5]
    assert np.isnan(result["output"][5]).all() and np.isfinite(np.delete(result["output"], 5, axis=0)).all()
