"""Sizes that vary from row to row (a sequence length): found or declared, kept only when padding
leaves the answers unchanged, padded in run and serve, refused where a row cannot be padded; and
the graphs torch.compile compiles for them after a warm-up (issue 16)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from overdrive.core.errors import ConfigError, WorkloadError
from overdrive.workloads.user import workload_from_model
from tests.fixtures import hf_models


class _MeanOfIds(nn.Module):
    """Mean of embedded ids with no mask: zero padding changes the answer."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 4)

    def forward(self, ids):
        return self.embedding(ids).mean(1)


def test_a_sequence_length_is_found_by_calling_the_model_at_two_sizes():
    model, example = hf_models.bert_keywords()
    workload = workload_from_model("bert", model, example)
    assert workload.dynamic_dims == {0: (1,), 1: (1,)}
    assert any("found by calling the model at two sizes" in n for n in workload.notes)
    short = tuple(t[:5] for t in workload.samples[1])
    ids, mask = workload.collate([workload.samples[0], short])
    assert ids.shape == (2, 16) and mask[1].tolist() == [1] * 5 + [0] * 11
    with torch.no_grad():  # a short row padded beside a long one answers as it does alone
        torch.testing.assert_close(workload.model(ids, mask)[1:], model(input_ids=short[0][None],
                                                                       attention_mask=short[1][None]).logits,
                                   rtol=1e-4, atol=1e-5)
    assert workload_from_model("bert", model, example, dynamic_dims={}).dynamic_dims == {}
    two, images = hf_models.two_tower()
    assert workload_from_model("two", two, images).dynamic_dims == {}  # floating inputs are never guessed


def test_declared_dimensions_are_checked_and_refused_when_padding_changes_answers():
    torch.manual_seed(0)
    ids = torch.randint(1, 50, (4, 10))
    guessed = workload_from_model("mean", _MeanOfIds(), ids)
    assert guessed.dynamic_dims == {}  # padding changes it: not guessed, and said
    assert any("could vary" in n and "rows must have size 10" in n for n in guessed.notes)
    with pytest.raises(WorkloadError, match="zero padding changes output"):
        workload_from_model("mean", _MeanOfIds(), ids, dynamic_dims={0: [1]})
    model, example = hf_models.bert_keywords()
    declared = workload_from_model("bert", model, example, dynamic_dims={"input_ids": {1: "seq"}, "attention_mask": [1]})
    assert declared.dynamic_dims == {0: (1,), 1: (1,)}
    with pytest.raises(ConfigError, match="has no input 'ids'"):
        workload_from_model("bert", model, example, dynamic_dims={"ids": [1]})
    with pytest.raises(ConfigError, match="dimension 0 cannot vary"):
        workload_from_model("bert", model, example, dynamic_dims={"input_ids": [0]})


def test_run_and_serve_take_rows_of_any_length(tmp_path):
    import httpx

    from overdrive.run.job import RunConfig, run_offline
    from tests.fixtures.live_server import LiveServer

    model, example = hf_models.bert_keywords()
    workload = workload_from_model("bert", model, example)
    lengths = (3, 9, 20, 5)
    with open(tmp_path / "rows.jsonl", "w") as f:
        for n in lengths:
            f.write(json.dumps({"input_ids": list(range(5, 5 + n)), "attention_mask": [1] * n}) + "\n")
        f.write(json.dumps({"input_ids": [5, 6, 7], "attention_mask": [1, 1]}) + "\n")  # a mask shorter than its ids
        f.write(json.dumps({"input_ids": list(range(5, 205)), "attention_mask": [1] * 200}) + "\n")  # > 128 positions
        f.write(json.dumps({"input_ids": [5, 6.5], "attention_mask": [1, 1]}) + "\n")  # not an id
    summary = run_offline(RunConfig(workload="bert", input=tmp_path / "rows.jsonl", output=tmp_path / "out.jsonl",
                                    device="cpu"), workload=workload)
    assert summary.records == 7 and summary.failed == 3  # filed, not padded into another answer or fatal
    reasons = (tmp_path / "out.jsonl.errors.jsonl").read_text()
    assert "must have one size at dimension 1" in reasons and "at most 128" in reasons and "6.5" in reasons
    written = [json.loads(line)["output"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    with torch.no_grad():
        alone = [model(input_ids=torch.arange(5, 5 + n)[None], attention_mask=torch.ones(1, n, dtype=torch.int64)).logits[0]
                 for n in lengths]
    for row, expected in zip(written, alone):
        np.testing.assert_allclose(row, expected.numpy(), rtol=1e-4, atol=1e-5)

    def body(ids, mask):
        return {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, len(ids)], "data": ids},
                           {"name": "attention_mask", "datatype": "INT64", "shape": [1, len(mask)], "data": mask}]}

    with LiveServer(workload, max_batch_size=8) as live:
        metadata = httpx.get(f"{live.url}/v2/models/bert").json()
        assert [i["shape"] for i in metadata["inputs"]] == [[-1, -1], [-1, -1]]
        answer = httpx.post(live.infer_url, json=body(list(range(5, 14)), [1] * 9))
        assert answer.status_code == 200, answer.text
        np.testing.assert_allclose(answer.json()["outputs"][0]["data"], alone[1].numpy(), rtol=1e-4, atol=1e-5)
        mismatch = httpx.post(live.infer_url, json=body(list(range(5, 14)), [1] * 4))
        assert mismatch.status_code == 400 and "must have one size at dimension 1" in mismatch.text
        too_long = httpx.post(live.infer_url, json=body(list(range(5, 205)), [1] * 200))  # past max_position_embeddings
        assert too_long.status_code == 400 and "at most 128" in too_long.text


def test_a_plan_records_the_varying_dimensions(tmp_path):
    from overdrive.cli.args import dynamic_dims, input_dim
    from overdrive.tuning.result import plan_dims
    from overdrive.tuning.plan import Plan

    model, example = hf_models.bert_keywords()
    workload = workload_from_model("bert", model, example)
    plan = Plan(workload="tests.fixtures.hf_models:bert_keywords", device="cpu", batch_size=4, steps=[],
                dynamic_dims=plan_dims(workload))
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["dynamic_dims"] == {"input_ids": [1], "attention_mask": [1]}
    assert Plan.load(tmp_path / "plan.json").create_workload().dynamic_dims == {0: (1,), 1: (1,)}
    assert dynamic_dims([input_dim("input_ids:1"), input_dim("attention_mask:1")]) == {"input_ids": [1],
                                                                                        "attention_mask": [1]}
    with pytest.raises(Exception, match="expected INPUT:DIM"):
        input_dim("input_ids")


def test_serve_counts_and_logs_graphs_compiled_after_its_warm_up(monkeypatch, caplog):
    import overdrive.serve.model as served_module
    from overdrive.serve.model import ServedModel

    model, example = hf_models.bert_keywords()
    workload = workload_from_model("bert", model, example)
    served = ServedModel("bert", workload, [workload.model], [torch.device("cpu")])
    graphs = iter([10, 10, 12])  # warm, then a batch that compiled nothing, then one that compiled two graphs
    monkeypatch.setattr(served_module, "compiled_graphs", lambda: next(graphs))
    served.watch_recompiles()
    rows = (example["input_ids"][:1, :5], example["attention_mask"][:1, :5])
    served.execute([rows], 0)
    assert served.recompiles == 0
    with caplog.at_level("WARNING", logger="overdrive.cli.serve"):
        served.execute([rows], 0)
    assert served.recompiles == 2 and "compiled a new graph for a batch of shape [1, 5]" in caplog.text
