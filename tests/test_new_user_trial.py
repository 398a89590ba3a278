"""What a new user's trial (issue 30's last step) found, each fixed and kept fixed: a NaN metric
judged as within budget, a plan loaded onto other weights without a word, an empty data file as a
traceback, a runtime's raw errors for inputs the model takes, impossible interval ends."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import overdrive
from overdrive.core.errors import DataError, WorkloadError
from overdrive.core.gain import Gain
from overdrive.techniques import default_config
from overdrive.techniques.compose import build
from overdrive.tuning.reuse import PlanWeightsWarning
from tests.conftest import make_conv_workload, make_text_workload

QUICK = {"sweep_batch_sizes": [], "device": "cpu"}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_a_metric_that_gives_nan_cannot_judge_an_accuracy_budget():
    example = torch.randn(8, 16)
    with pytest.raises(WorkloadError, match="task metric gives .*nan"):
        overdrive.optimize(_mlp(), example, data=[example], metric=lambda outputs: float("nan"), max_accuracy_drop=0.5,
                           min_gain=0, techniques=["bf16"], **QUICK)


def test_a_candidate_whose_metric_is_nan_breaks_the_budget():
    from types import SimpleNamespace

    from overdrive.tuning.guard import Guard

    m = SimpleNamespace(nonfinite_outputs=0, fidelity={"min_cosine": 1.0}, task_metric={"metric": math.nan})
    rule = SimpleNamespace(violation=lambda fidelity: None)  # fidelity within the floor
    assert "not a number" in Guard(max_accuracy_drop=1.0).violation(m, {"metric": 90.0}, rule)


def test_load_warns_when_the_model_is_not_the_one_the_plan_was_measured_on(tmp_path):
    example = torch.randn(8, 16)
    result = overdrive.optimize(_mlp(), example, techniques=["inference-mode"], min_gain=0, **QUICK)
    result.save(tmp_path / "p")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanWeightsWarning)
        same = overdrive.load(tmp_path / "p" / "plan.json", _mlp())  # the same weights: no warning
    with pytest.warns(PlanWeightsWarning, match="weights differ"):
        other = overdrive.load(tmp_path / "p" / "plan.json", _mlp(seed=1))
    with torch.no_grad():  # it still computes with the model it was given
        torch.testing.assert_close(other(example), _mlp(seed=1)(example))
        torch.testing.assert_close(same(example), _mlp()(example))


def test_an_empty_data_file_is_a_data_error(tmp_path):
    (tmp_path / "empty.npy").write_bytes(b"")
    with pytest.raises(DataError, match="the file is empty"):
        overdrive.optimize(_mlp(), torch.randn(8, 16), data=str(tmp_path / "empty.npy"), **QUICK)


def test_techniques_as_one_string_are_names_not_letters():
    result = overdrive.optimize(_mlp(), torch.randn(8, 16), techniques="inference-mode", min_gain=0, time_budget_s=0,
                                **QUICK)
    assert [r.label for r in result.rows if r.phase == "alone"] == ["inference-mode"]


def test_a_runtime_names_the_shape_it_takes_and_widens_integer_ids():
    conv = make_conv_workload()
    model, _ = build(conv, [default_config("onnxruntime")], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"input 'input' has shape \[2, 3, 12, 12\].*\[\*, 3, 16, 16\]"):
        model(torch.randn(2, 3, 12, 12))
    text = make_text_workload()
    model, _ = build(text, [default_config("onnxruntime")], torch.device("cpu"))
    inputs = text.collate(text.samples[:4])
    narrow = tuple(t.int() if not t.is_floating_point() else t for t in inputs)
    with torch.no_grad():
        np.testing.assert_array_equal(model(*narrow).numpy(), model(*inputs).numpy())
    with pytest.raises(TypeError, match="takes 2 inputs"):
        model(inputs[0])


def test_an_interval_end_beyond_a_thousand_is_not_printed_as_a_number():
    gain = Gain(ratio=2.0, low=0.0, high=6e39, rounds=2, log_sd=40.0)
    assert "> 1000" in gain.describe() and "e+" not in gain.describe()


class _WithIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 4)

    def forward(self, x):
        y = self.linear(x)
        return y, {"sq": y * y, "idx": y.argmax(-1)}


def test_an_integer_output_left_out_is_named():
    from overdrive.tuning.api import as_workload

    workload = as_workload(_WithIndices().eval(), torch.randn(8, 16))
    assert any("1.idx (torch.int64)" in note and "not floating point" in note for note in workload.notes), workload.notes
