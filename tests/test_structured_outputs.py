"""`result.model` and `overdrive.load(plan, model)` are called as the user's model: the same
arguments, the same output structure (`overdrive.workloads.structured`), while overdrive's own
model stays positional with one tensor out (issue 30)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
from torch import nn

import overdrive
from overdrive.techniques.compose import build
from overdrive.workloads.structured import UserFacingModel, user_facing
from overdrive.workloads.user import workload_from_model
from tests.fixtures import hf_models, hf_zoo

CPU = torch.device("cpu")


class Pair(NamedTuple):
    score: torch.Tensor
    embedding: torch.Tensor


@dataclasses.dataclass
class Result:
    score: torch.Tensor
    grid: torch.Tensor
    count: int = 0


class Shapes(nn.Module):
    """x [B, 6] -> the output kind asked for: a score [B, 3], a grid [B, 2, 3] and a non-tensor."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.linear = nn.Linear(6, 9)

    def forward(self, x, scale: float = 1.0):
        h = self.linear(x) * scale
        score, grid = h[:, :3], h[:, 3:].reshape(-1, 2, 3)
        if self.kind == "namedtuple":
            return Pair(score, grid)
        if self.kind == "dataclass":
            return Result(score=score, grid=grid, count=7)
        return {"score": score, "grid": grid, "note": "text"}


def quick_optimize(model, example, **kwargs):
    """optimize with two timing rounds per comparison: these tests are about what comes back, not speed."""
    from overdrive.tuning.tuner import Tuner

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("overdrive.tuning.api.Tuner", functools.partial(Tuner, min_rounds=2, max_rounds=2, max_compare_s=2))
        return overdrive.optimize(model, example, sweep_batch_sizes=[], device="cpu", **kwargs)


def test_result_model_returns_the_users_dict_and_load_too(tmp_path):
    model, example = hf_models.two_tower_dict()
    result = quick_optimize(model, example, techniques=["inference-mode"], min_gain=0)
    with torch.no_grad():
        expected = model(**example)
        got = result.model(**example)
        by_position = result.model(example["image"], example["meta"])  # as the user's forward binds them
        reloaded = overdrive.load(result.save_plan(tmp_path), hf_models.two_tower_dict()[0])(**example)
    for out in (got, by_position, reloaded):
        assert type(out) is dict and set(out) == {"score", "embedding"}
        torch.testing.assert_close(out["score"], expected["score"])
        torch.testing.assert_close(out["embedding"], expected["embedding"])
    inner = result.session.workload.model  # overdrive's own form: positional, one tensor [B, 3 + 8]
    assert inner(example["image"], example["meta"]).shape == (8, 11)


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass", "dict"])
def test_each_output_keeps_its_shape_and_container(kind):
    torch.manual_seed(0)
    model = Shapes(kind).eval()
    x = torch.randn(4, 6)
    workload = workload_from_model(kind, model, x)
    fast = user_facing(build(workload, [], CPU)[0], workload.model)
    with torch.no_grad():
        got, expected = fast(x), model(x)
    assert type(got) is type(expected)
    if kind == "dict":
        assert set(got) == {"score", "grid"}  # "note" is no tensor: not carried, so absent
    if kind == "dataclass":
        assert got.count is None  # a non-tensor value is not carried
    for a, b in zip(_parts(got), _parts(expected)):
        torch.testing.assert_close(a, b)  # the grid [B, 2, 3] again, not [B, 6]


def _parts(out) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(out, dict):
        return out["score"], out["grid"]
    return (out.score, out.embedding) if isinstance(out, Pair) else (out.score, out.grid)


def test_arguments_the_plan_did_not_measure_are_refused_not_dropped():
    model, example = hf_zoo.create("bert")
    workload = workload_from_model("bert", model, example)
    fast = user_facing(build(workload, [], CPU)[0], workload.model)
    assert isinstance(fast, UserFacingModel)
    with torch.no_grad():
        fast(**example, token_type_ids=None, return_dict=None)  # None: as if not given
        fast(example["input_ids"], example["attention_mask"])  # by position, in the forward's order
        with pytest.raises(TypeError, match="missing input.*attention_mask"):
            fast(input_ids=example["input_ids"])
        with pytest.raises(TypeError, match="token_type_ids.*runs as its plan was measured"):
            fast(**example, token_type_ids=torch.zeros_like(example["input_ids"]))
        with pytest.raises(TypeError):  # what the user's forward itself refuses
            fast(**example, not_an_argument=1)


def test_a_model_in_overdrives_own_form_comes_back_as_it_is():
    model = nn.Linear(4, 2).eval()
    workload = workload_from_model("linear", model, torch.randn(3, 4))
    built = build(workload, [], CPU)[0]
    assert user_facing(built, workload.model) is built
