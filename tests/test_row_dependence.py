"""Issue 30's silent wrong answers about rows: a text model whose answer depends on its padding
(never given rows whose answers would change, in run, serve and optimize's measurements, and
recorded in the plan), a non-finite output row (a failed record, never a success), and the guard's
all-padding edge row for plans with dynamic dimensions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from overdrive.core.measure import make_batches
from overdrive.run.job import RunConfig, run_offline
from overdrive.techniques import BatchingPolicy, default_config
from overdrive.tuning.guard import FidelityRule, Guard
from overdrive.tuning.plan import Plan
from overdrive.tuning.tuner import Tuner
from overdrive.workloads.user import build_from_import_path, workload_from_model
from tests.fixtures import row_models

CPU = torch.device("cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _alone(workload, texts: list[str]) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([workload.model(*workload.collate([t])) for t in texts]).numpy()


@pytest.fixture(scope="module", params=["maskless_mean", "last_token"])
def maskless(request):
    """A (model, tokenizer) factory whose encoder never receives the attention mask: mean pooling over
    every position, or the last position's state under right padding."""
    return build_from_import_path(f"tests.fixtures.row_models:{request.param}")


# -- 1. a text model whose answer depends on its padding -------------------------------------------


def test_run_gives_each_sentence_its_own_answer_when_the_model_ignores_the_mask(maskless, tmp_path):
    """Issue 30: 51 of 64 sentences below cosine 0.99 to the same sentence alone (last token: median
    0.415), and "0 failed". Batches now hold sentences of one token count only, and the run says so."""
    texts = list(maskless.samples[:48])
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    summary = run_offline(RunConfig(workload=None, input=tmp_path / "in.txt", output=tmp_path / "out.npy", device="cpu",
                                    batch_size=16), workload=maskless)
    cosines = _cosines(np.load(tmp_path / "out.npy"), _alone(maskless, texts))
    assert cosines.min() > 0.9999 and summary.failed == 0
    assert any("same token length" in w and "depends on its padding" in w for w in summary.warnings)
    assert maskless.batch_dependence.kind == "padding" and "cosine" in maskless.batch_dependence.detail
    assert any("depends on its padding" in note for note in maskless.notes)


def test_serve_gives_a_sentence_the_same_answer_alone_and_next_to_a_longer_one(maskless):
    """Issue 30: cosine 0.86 between a sentence served alone and next to a longer one, in one request
    or in one batch of several clients' requests."""
    import aiohttp

    from tests.fixtures.live_server import LiveServer

    short, long_ = "Return the value.", " ".join(maskless.samples[:6])
    texts = [short, long_, "A third sentence of some length.", short]
    expected = _alone(maskless, texts)

    def body(batch):
        return {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(batch)], "data": batch}]}

    async def post_all(url):
        async with aiohttp.ClientSession() as session:
            async def one(batch):
                async with session.post(url, json=body(batch)) as r:
                    assert r.status == 200, await r.text()
                    out = (await r.json())["outputs"][0]
                    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
            return await asyncio.gather(one(texts), *(one([t]) for t in texts))

    with LiveServer(maskless, max_batch_size=8, max_queue_delay_ms=50, batching="fixed") as live:
        together, *alone = asyncio.run(post_all(live.infer_url))
    assert _cosines(together, expected).min() > 0.9999
    assert _cosines(np.concatenate(alone), expected).min() > 0.9999
    assert live.served.dependence.kind == "padding"


def test_optimize_measures_one_length_per_batch_and_the_plan_records_it(tmp_path):
    workload = build_from_import_path("tests.fixtures.row_models:maskless_mean")
    batches = make_batches(workload, indices=list(range(32)), batch_size=8, policy=BatchingPolicy(), device=CPU)
    assert sum(b.num_rows for b in batches) == 32 and all(bool((b.inputs[0] != 0).all()) for b in batches)  # no pad id
    result = Tuner(workload=workload, device=CPU, batch_size=4, techniques=["inference-mode"], guard=Guard(min_gain=0),
                   num_samples=16, min_rounds=2, max_rounds=2).run()
    assert any("depend on their padding" in w and "the plan records it" in w for w in result.warnings)
    assert result.plan.batch_dependence["kind"] == "padding"
    result.plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").batch_dependence == workload.batch_dependence.to_dict()


def test_run_of_a_plan_batches_by_the_dependence_the_plan_records(tmp_path):
    """A text workload whose own check finds nothing (its answer ignores padding) is batched as the plan
    says, without measuring again."""
    from tests.fixtures.run_models import SENTENCES

    plan = tmp_path / "plan.json"
    recorded = Plan(workload="tests.fixtures.run_models:char_text", device="cpu", batch_size=4, steps=[])
    recorded.batch_dependence = {"kind": "padding", "detail": "recorded by optimize"}
    recorded.save(plan)
    texts = [s for s in SENTENCES if s] * 2
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n")
    summary = run_offline(RunConfig(workload=None, plan=plan, input=tmp_path / "in.txt", output=tmp_path / "o.npy",
                                    device="cpu"))
    assert any("recorded by optimize" in w for w in summary.warnings)
    assert summary.failed == 0 and np.load(tmp_path / "o.npy").shape == (len(texts), 3)


def test_a_model_whose_rows_depend_on_their_batch_mates_runs_rows_alone_or_is_refused(tmp_path):
    from overdrive.core.errors import ConfigError
    from overdrive.core.row_dependence import checked_dependence
    from tests.fixtures.run_models import char_text

    workload = char_text()
    checked_dependence(workload, {"kind": "batch-mates", "detail": "cosine 0.5 beside an outlier row"})
    (tmp_path / "in.txt").write_text("a\nbb\nccc\n")
    with pytest.raises(ConfigError, match=r"batch_size.*cosine 0\.5 beside an outlier row"):
        run_offline(RunConfig(workload=None, input=tmp_path / "in.txt", output=tmp_path / "o.npy", device="cpu",
                              batch_size=4), workload=workload)
    summary = run_offline(RunConfig(workload=None, input=tmp_path / "in.txt", output=tmp_path / "o.npy", device="cpu",
                                    overwrite=True), workload=workload)
    assert summary.batch_size == 1 and any("each row runs alone" in w for w in summary.warnings)


def test_a_model_that_takes_its_mask_is_not_flagged():
    from overdrive.core.workload import BatchDependence

    workload = build_from_import_path("tests.fixtures.hf_models:callable_tokenizer")
    assert workload.batch_dependence is None and not any("padding" in n for n in workload.notes)
    with pytest.raises(ValueError, match="kind"):
        BatchDependence(kind="other", detail="")


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


# -- 3. the guard holds candidates to a row that is all padding ------------------------------------


def test_the_edge_probe_finds_nan_for_a_row_that_is_all_padding():
    from overdrive.tuning.invariance import EdgeProbe

    model, example = row_models.pad_encoder()
    workload = workload_from_model("pad", model, example)
    assert workload.dynamic_dims  # ids vary in length: found by calling the model at two sizes
    probe = EdgeProbe(workload, workload.model, device=CPU, batch_size=4, indices=list(range(8)))
    rule = FidelityRule(key="min_cosine", floor=0.99)
    assert probe.check(workload.model, rule=rule) is None
    nan_model, _ = row_models.nan_on_all_padding()
    reason = probe.check(nan_model, rule=rule)
    assert reason and "non-finite" in reason and "all padding" in reason


@pytest.mark.slow
def test_compile_that_turns_an_all_padding_row_into_nan_is_not_kept(tmp_path):
    """Issue 30: compiled, an nn.TransformerEncoder with a key padding mask answers an all-padding row
    with NaN where eager answers 0. optimize no longer keeps it; and a plan that holds it anyway files
    such a record as failed in run."""
    import overdrive

    model, example = row_models.pad_encoder()
    result = overdrive.optimize(model, example, techniques=["compile"], min_gain=0, sweep_batch_sizes=[], device="cpu")
    row = next(r for r in result.rows if r.label == "compile")
    assert not row.kept and "non-finite" in row.reason and "all padding" in row.reason
    plan = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.row_models:pad_encoder", device="cpu", batch_size=8,
         steps=[default_config("compile")]).save(plan)
    np.save(tmp_path / "ids.npy", _ids_with_an_all_padding_record())
    summary = run_offline(RunConfig(workload=None, plan=plan, input=tmp_path / "ids.npy", output=tmp_path / "o.npy",
                                    device="cpu"))
    assert summary.failed == 1 and np.isnan(np.load(tmp_path / "o.npy")[5]).all()
