"""Bring your own model: keyword inputs, structured outputs, a tokenizer, several inputs, model
files, trained weights, and plans that carry over (issue 16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from overdrive.core.errors import ConfigError, DataError, WorkloadError
from overdrive.workloads.signature import SignatureModel, outputs_fidelity
from overdrive.workloads.user import archive_kind, build_from_file, build_from_import_path, workload_from_model
from tests.fixtures import hf_models
from tests.fixtures.cli import cli_in_process
from tests.test_cli import run_cli


def test_a_torchscript_torchvision_model_is_taken_for_torchscript(tmp_path):
    """Its code/__torch__/torchvision/models/ path once made it look like a torch.export archive."""
    import torchvision

    model = torchvision.models.squeezenet1_1().eval()
    example = torch.randn(2, 3, 64, 64)
    torch.jit.save(torch.jit.trace(model, example), tmp_path / "sq.pt")
    torch.export.save(torch.export.export(model, (example,)), tmp_path / "sq.pt2")
    assert archive_kind(tmp_path / "sq.pt") == "torchscript"
    assert archive_kind(tmp_path / "sq.pt2") == "export"
    workload = build_from_file(tmp_path / "sq.pt", input_shape=(2, 3, 64, 64), input_dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(workload.model(example), model(example), rtol=1e-4, atol=1e-4)


def test_keyword_inputs_and_a_model_output_are_taken_as_they_come():
    model, example = hf_models.bert_keywords()
    workload = workload_from_model("bert", model, example)
    assert workload.input_names == ["input_ids", "attention_mask"] and workload.output_names == ["logits"]
    assert isinstance(workload.model, SignatureModel) and workload.rows_source == "example"
    inputs = workload.collate(list(workload.samples))
    with torch.no_grad():
        expected = model(**example).logits
        torch.testing.assert_close(workload.model(*inputs), expected)
        torch.testing.assert_close(workload.model(**example), expected)  # result.model takes what the original took
    assert workload.extra["classifier"] is True


def test_several_outputs_are_each_judged_and_the_worst_counts():
    """A 1-wide output gone wrong next to a 1000-wide one that is right: concatenated, the cosine
    would hide it; judged apart, it fails, by R² (a one-value output has no cosine of its own: a
    row's cosine there is only its sign), which the guard judges beside the cosine."""
    reference = torch.cat([torch.randn(8, 1000), torch.randn(8, 1)], dim=1)
    output = reference.clone()
    output[:, -1] = -output[:, -1]  # the small output's sign flipped
    fidelity = outputs_fidelity([1000, 1])
    assert nn.functional.cosine_similarity(output, reference).min() > 0.99
    figures = fidelity(output, reference)
    assert figures["min_cosine"] > 0.99 and figures["r2"] < -1  # the wide output's cosine; the worst R², the small one's
    assert fidelity(reference, reference)["min_cosine"] == pytest.approx(1.0)
    assert fidelity(reference, reference)["r2"] == pytest.approx(1.0)


def test_a_two_input_model_with_a_tuple_of_outputs():
    model, example = hf_models.two_tower()
    workload = workload_from_model("two", model, example)
    assert workload.input_names == ["image", "meta"] and workload.output_names == ["0", "1"]
    with torch.no_grad():
        out = workload.model(example["image"], example["meta"])
        score, embedding = model(**example)
    assert out.shape == (8, 3 + 8)
    torch.testing.assert_close(out, torch.cat([score, embedding], dim=1))


def test_named_output_and_outputs_that_cannot_be_judged():
    model, example = hf_models.two_tower()
    assert workload_from_model("two", model, example, output="1").output_names == ["1"]
    with pytest.raises(WorkloadError, match="output 'logits' is not a floating tensor"):
        workload_from_model("two", model, example, output="logits")

    class IntsOnly(nn.Module):
        def forward(self, x):
            return {"ids": x.argmax(-1), "note": "text"}

    with pytest.raises(WorkloadError, match="no floating tensor"):
        workload_from_model("ints", IntsOnly(), torch.randn(4, 5))


def test_a_factory_with_a_tokenizer_is_a_text_workload_whose_rows_ignore_their_batch_mates():
    workload = build_from_import_path("tests.fixtures.hf_models:bert_classifier")
    assert workload.is_text and workload.input_names == ["input_ids", "attention_mask"]
    assert workload.output_names == ["logits"] and workload.rows_source == "samples"
    short, long_ = "A short line.", " ".join(workload.samples[:3])
    with torch.no_grad():
        alone = workload.model(*workload.collate([short]))
        padded = workload.model(*workload.collate([short, long_]))[:1]
    assert workload.sample_length(long_) > workload.sample_length(short)
    torch.testing.assert_close(alone, padded, rtol=1e-4, atol=1e-5)  # the mask reaches the model


def test_token_level_outputs_are_left_out_with_a_note():
    workload = build_from_import_path("tests.fixtures.hf_models:bert_encoder_outputs")
    assert workload.output_names == ["pooler_output"]
    assert any("last_hidden_state follow the input length" in n for n in workload.notes)


def test_a_plain_callable_tokenizer():
    workload = build_from_import_path("tests.fixtures.hf_models:callable_tokenizer")
    assert workload.is_text and workload.extra["tokenizer"] is None
    ids, mask = workload.collate(list(workload.samples[:4]))
    assert ids.shape == mask.shape and ids.shape[1] <= 64


def test_run_reads_npz_and_jsonl_with_an_array_per_input(tmp_path):
    from overdrive.run.job import RunConfig, run_offline

    model, example = hf_models.two_tower()
    workload = workload_from_model("two", model, example)
    rng = np.random.default_rng(0)
    image, meta = rng.standard_normal((40, 16)).astype("float32"), rng.standard_normal((40, 4)).astype("float32")
    np.savez(tmp_path / "x.npz", image=image, meta=meta)
    with open(tmp_path / "x.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"image": image[i].tolist(), "meta": meta[i].tolist()}) + "\n")
        f.write(json.dumps({"image": [1.0, 2.0], "meta": meta[0].tolist()}) + "\n")
    with torch.no_grad():
        expected = workload.model(torch.from_numpy(image), torch.from_numpy(meta)).numpy()
    summary = run_offline(RunConfig(workload="two", input=tmp_path / "x.npz", output=tmp_path / "y.npy", device="cpu"),
                          workload=workload)
    assert summary.records == 40 and summary.failed == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-5, atol=1e-6)
    summary = run_offline(RunConfig(workload="two", input=tmp_path / "x.jsonl", output=tmp_path / "y.jsonl", device="cpu"),
                          workload=workload)
    assert summary.records == 7 and summary.failed == 1
    rows = [json.loads(line) for line in (tmp_path / "y.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(np.array([r["output"] for r in rows]), expected[:6], rtol=1e-5, atol=1e-6)
    assert "field 'image' has shape [2]" in (tmp_path / "y.jsonl.errors.jsonl").read_text()

    np.savez(tmp_path / "missing.npz", image=image)
    with pytest.raises(DataError, match="no array 'meta'"):
        run_offline(RunConfig(workload="two", input=tmp_path / "missing.npz", output=tmp_path / "z.npy", device="cpu"),
                    workload=workload)
    np.savez(tmp_path / "ragged.npz", image=image, meta=meta[:30])
    with pytest.raises(DataError, match="different numbers of rows"):
        run_offline(RunConfig(workload="two", input=tmp_path / "ragged.npz", output=tmp_path / "z.npy", device="cpu"),
                    workload=workload)


def test_serve_names_inputs_as_the_model_does():
    import httpx

    from tests.fixtures.live_server import LiveServer

    model, example = hf_models.two_tower()
    workload = workload_from_model("two", model, example)
    with LiveServer(workload, max_batch_size=8) as live:
        metadata = httpx.get(f"{live.url}/v2/models/two").json()
        assert [i["name"] for i in metadata["inputs"]] == ["image", "meta"]
        body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 16], "data": example["image"][:2].flatten().tolist()},
                           {"name": "meta", "datatype": "FP32", "shape": [2, 4], "data": example["meta"][:2].flatten().tolist()}]}
        assert [(o["name"], o["shape"]) for o in metadata["outputs"]] == [("0", [-1, 3]), ("1", [-1, 8])]
        answer = httpx.post(live.infer_url, json=body).json()
        only = httpx.post(live.infer_url, json={**body, "outputs": [{"name": "1"}]}).json()
        unknown = httpx.post(live.infer_url, json={**body, "outputs": [{"name": "output"}]})
    with torch.no_grad():
        score, embedding = model(example["image"][:2], example["meta"][:2])
    outputs = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in answer["outputs"]}
    np.testing.assert_allclose(outputs["0"], score.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs["1"], embedding.numpy(), rtol=1e-5, atol=1e-6)
    assert [o["name"] for o in only["outputs"]] == ["1"]
    assert unknown.status_code == 400 and "unknown requested outputs ['output']" in unknown.text


def test_weights_from_torch_save_and_from_a_dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp

    from overdrive.workloads.weights import load_weights

    def workload():
        return build_from_import_path("tests.fixtures.user_models:build")

    trained = workload()
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.5)
    (x,) = trained.collate(list(trained.samples))
    with torch.no_grad():
        expected = trained.model(x)
    torch.save({"model": trained.model.state_dict()}, tmp_path / "trained.pt")
    loaded = load_weights(workload(), tmp_path / "trained.pt")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), expected)
    assert any("weights from" in n for n in loaded.notes)

    dcp.save({"model": trained.model.state_dict()}, checkpoint_id=str(tmp_path / "save" / "step-20"))
    loaded = load_weights(workload(), tmp_path / "save")  # the --save folder: its newest step
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), expected)

    torch.save(nn.Linear(3, 3).state_dict(), tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="does not fit .* missing"):
        load_weights(workload(), tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="no such file"):
        load_weights(workload(), tmp_path / "nowhere")


def test_a_plan_finds_its_model_file_and_weights_from_anywhere(tmp_path, monkeypatch):
    from overdrive.tuning.plan import Plan
    from tests.fixtures.user_models import build

    model, example = build()
    (tmp_path / "models").mkdir()
    torch.jit.save(torch.jit.trace(model, example), tmp_path / "models" / "mlp.pt")
    torch.save(model.state_dict(), tmp_path / "models" / "w.pt")
    monkeypatch.chdir(tmp_path)
    plan = Plan(workload="models/mlp.pt", device="cpu", batch_size=4, steps=[],
                inputs=[{"shape": [16], "dtype": "float32"}], weights="models/w.pt")
    plan.save(tmp_path / "out" / "plan.json")
    shutil.copytree(tmp_path, tmp_path.parent / (tmp_path.name + "-moved"))
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    monkeypatch.chdir(moved / "out")  # another folder, another working directory
    loaded = Plan.load(moved / "out" / "plan.json")
    assert Path(loaded.workload).resolve() == (moved / "models" / "mlp.pt").resolve()
    workload = loaded.create_workload()  # TorchScript: the input shape comes from the plan
    with torch.no_grad():
        torch.testing.assert_close(workload.model(example), model(example))


def test_the_bert_classifier_with_its_tokenizer_end_to_end_from_a_fresh_folder(tmp_path, monkeypatch):
    """optimize, bench, run and serve, from a folder holding only the user's module."""
    import httpx

    from overdrive.serve.runner import load_served_model
    from tests.fixtures.live_server import LiveServer

    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "__init__.py").write_text("")
    shutil.copy(Path(hf_models.__file__), tmp_path / "mymodels" / "text.py")
    optimize = run_cli("optimize", "mymodels.text:bert_classifier", "--techniques", "length-bucketing,bf16",
                       "--num-samples", "32", "--sweep-batch-sizes", "8", "--out", "out", cwd=tmp_path)
    assert optimize.returncode == 0, optimize.stderr
    assert "next: overdrive bench" in optimize.stdout
    plan = tmp_path / "out" / "bert_classifier" / "plan.json"
    again = run_cli("optimize", "mymodels.text:bert_classifier", "--out", "out", cwd=tmp_path)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    bench = run_cli("bench", "mymodels.text:bert_classifier", "--plan", str(plan), "--num-samples", "32", "--out", "out",
                    cwd=tmp_path)
    assert bench.returncode == 0, bench.stderr
    (tmp_path / "in.txt").write_text("A short sentence.\nA much longer sentence that the tokenizer splits into many "
                                     "more word pieces than the first.\nThird.\n")
    run = run_cli("run", str(plan), "--input", "in.txt", "--output", "preds.jsonl", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in (tmp_path / "preds.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["output"]) == 3 and "prediction" in r for r in rows)

    monkeypatch.chdir(tmp_path)  # as `overdrive serve` started there: its module imports from the current folder
    monkeypatch.syspath_prepend(str(tmp_path))
    served, _, _ = load_served_model(str(plan), device="cpu", instances=1)
    with LiveServer(served.workload, served=served, max_batch_size=8) as live:
        metadata = httpx.get(f"{live.url}/v2/models/{served.name}").json()
        assert metadata["inputs"][0]["name"] == "text"
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["A short sentence."]}]}
        answer = httpx.post(live.infer_url, json=body)
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(answer.json()["outputs"][0]["data"], rows[0]["output"], rtol=0.05, atol=0.02)


def test_cli_habits(tmp_path):
    typo = cli_in_process("optimize", "tests.fixtures.user_models:build", "--technique", "compile")
    assert typo.returncode == 2 and "unrecognized arguments: --technique" in typo.stderr

    from tests.fixtures.user_models import build

    model, example = build()
    torch.export.save(torch.export.export(model, (example,)), tmp_path / "static.pt2")  # batch 4, static
    bench = cli_in_process("bench", str(tmp_path / "static.pt2"), "--batch-sizes", "1,4", "--out", str(tmp_path))
    assert bench.returncode == 1 and "batch size 1: " in bench.stderr and "takes only batch size 4" in bench.stderr
    failures = json.loads((tmp_path / "static" / "bench.json").read_text())["failures"]
    assert failures and "batch size 1" in failures[0]


def test_a_per_row_scalar_output_beside_another_is_taken_as_one_column():
    class Pair(nn.Module):
        def forward(self, x):
            h = x * 2
            return h, h.sum(-1)  # [B, 4] and [B]

    workload = workload_from_model("pair", Pair(), torch.randn(8, 4))
    assert workload.output_names == ["0", "1"]
    with torch.no_grad():
        assert workload.model(torch.ones(3, 4)).shape == (3, 5)


def test_a_rebuild_with_other_weights_is_said(tmp_path):
    from overdrive.core.digest import weights_fingerprint
    from overdrive.tuning.plan import Plan

    workload = build_from_import_path("tests.fixtures.user_models:build")  # seeded: the same weights every time
    plan = Plan(workload="tests.fixtures.user_models:build", device="cpu", batch_size=4, steps=[],
                model_sha256=weights_fingerprint(workload.model))
    assert "weights_differ_from_plan" not in plan.create_workload().extra
    plan.model_sha256 = "0" * 64
    rebuilt = plan.create_workload()
    assert "differ from those optimize measured" in rebuilt.extra["weights_differ_from_plan"]


def test_a_plan_whose_model_file_is_gone_names_where_it_looked(tmp_path):
    from overdrive.core.errors import PlanError
    from overdrive.tuning.plan import Plan
    from tests.fixtures.user_models import build

    model, example = build()
    torch.export.save(torch.export.export(model, (example,)), tmp_path / "m.pt2")
    Plan(workload=str(tmp_path / "m.pt2"), device="cpu", batch_size=4, steps=[]).save(tmp_path / "out" / "plan.json")
    (tmp_path / "m.pt2").unlink()
    with pytest.raises(PlanError, match="which is at neither .*m.pt2 nor .*m.pt2"):
        Plan.load(tmp_path / "out" / "plan.json")


def test_your_data_keeps_a_held_out_fifth_for_calibration(tmp_path):
    from overdrive.tuning.sweep import open_session

    rows = np.random.default_rng(0).standard_normal((120, 16)).astype("float32")
    np.save(tmp_path / "rows.npy", rows)
    workload = open_session("tests.fixtures.user_models:build", device="cpu", data=tmp_path / "rows.npy").workload
    assert len(workload.samples) == 96 and len(workload.train_samples) == 24
    evaluated = {tuple(s[0].tolist()) for s in workload.samples}
    assert not evaluated & {tuple(s[0].tolist()) for s in workload.train_samples}  # never judged on what it trains on
    assert any("held out for calibration" in n for n in workload.notes)
    few = open_session("tests.fixtures.user_models:build", device="cpu", data=[torch.from_numpy(rows[:40])]).workload
    assert len(few.samples) == 40 and few.train_samples is None


def test_an_example_of_100_rows_or_more_keeps_a_held_out_fifth_as_data_does(tmp_path):
    """A (model, example) pair with 120 rows serves mixed-int8 without data: 96 judged, 24 for calibration only;
    given data, the data's own fifth replaces them (the example's rows are not used then)."""
    from overdrive.techniques import get_technique
    from overdrive.tuning.sweep import open_session
    from overdrive.workloads.user import workload_from_model
    from tests.fixtures.user_models import build

    model, _ = build()
    example = torch.randn(120, 16, generator=torch.Generator().manual_seed(0))
    workload = workload_from_model("mlp", model, example)
    assert workload.rows_source == "example" and len(workload.samples) == 96 and len(workload.train_samples) == 24
    assert torch.equal(torch.stack([s[0] for s in workload.train_samples]), example[96:])  # the last fifth, never judged
    assert torch.equal(torch.stack([s[0] for s in workload.samples]), example[:96])
    assert any("the last 24 of your example's 120 rows are held out" in n for n in workload.notes), workload.notes
    assert workload.default_batch_size == 120  # the example's batch size stays the default
    assert get_technique("mixed-int8").unsupported_reason(workload, torch.device("cpu")) is None
    session = open_session(workload, device="cpu", batch_size=8)
    assert session.num_distinct_samples == 96  # the held-out rows are not among the evaluation rows

    rows = np.random.default_rng(1).standard_normal((150, 16)).astype("float32")
    np.save(tmp_path / "rows.npy", rows)
    on_data = open_session(workload, device="cpu", data=tmp_path / "rows.npy").workload
    assert len(on_data.samples) == 120 and len(on_data.train_samples) == 30
    assert np.array_equal(torch.stack([s[0] for s in on_data.train_samples]).numpy(), rows[120:])
    held = [n for n in on_data.notes if "held out" in n]
    assert len(held) == 1 and "of your 150 rows" in held[0], held
    batches = workload_from_model("mlp", model, example[:8], data=[torch.from_numpy(rows)])  # batches, from Python
    assert len(batches.samples) == 120 and len(batches.train_samples) == 30
    small = workload_from_model("mlp", model, example[:99])
    assert small.train_samples is None and len(small.samples) == 99
    scored = workload_from_model("mlp", model, example[:8], data=[torch.from_numpy(rows)], metric=lambda out: 0.0)
    assert scored.train_samples is None and len(scored.samples) == 150  # a metric scores every row of data, in order




def test_user_files_end_to_end_from_a_fresh_folder(tmp_path, monkeypatch):
    """A two-input model fed from .npz, a TorchScript model used from another folder, and trained
    weights (--weights) carried by the plan into run — each through optimize, bench, run and serve."""
    import httpx
    import torchvision

    from overdrive.serve.runner import load_served_model
    from tests.fixtures.live_server import LiveServer

    shutil.copy(Path(hf_models.__file__), tmp_path / "mine.py")
    quick = ("--techniques", "bf16", "--sweep-batch-sizes", "4", "--out", "out")
    assert run_cli("optimize", "mine:two_tower_dict", *quick, cwd=tmp_path).returncode == 0
    plan = tmp_path / "out" / "two_tower_dict" / "plan.json"
    assert run_cli("bench", "mine:two_tower_dict", "--plan", str(plan), "--out", "out", cwd=tmp_path).returncode == 0
    rng = np.random.default_rng(0)
    image, meta = rng.standard_normal((20, 16)).astype("float32"), rng.standard_normal((20, 4)).astype("float32")
    np.savez(tmp_path / "x.npz", image=image, meta=meta)
    run = run_cli("run", str(plan), "--input", "x.npz", "--output", "y.npy", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    served, _, _ = load_served_model(str(plan), device="cpu", instances=1)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 16], "data": image[0].tolist()},
                       {"name": "meta", "datatype": "FP32", "shape": [1, 4], "data": meta[0].tolist()}]}
    with LiveServer(served.workload, served=served, max_batch_size=8) as live:
        answer = {o["name"]: o["data"] for o in httpx.post(live.infer_url, json=body).json()["outputs"]}
    written = np.load(tmp_path / "y.npy")
    assert written.shape == (20, 3 + 8)  # run writes the outputs side by side, in the model's order
    np.testing.assert_allclose(answer["score"], written[0, :3], rtol=0.05, atol=0.02)  # bf16 plan both ways

    model = torchvision.models.squeezenet1_1(num_classes=10).eval()
    (tmp_path / "models").mkdir()
    torch.jit.save(torch.jit.trace(model, torch.randn(2, 3, 64, 64)), tmp_path / "models" / "sq.pt")
    ts = run_cli("optimize", "models/sq.pt", "--input-shape", "2,3,64,64", *quick, cwd=tmp_path)
    assert ts.returncode == 0, ts.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    np.save(elsewhere / "images.npy", rng.standard_normal((6, 3, 64, 64)).astype("float32"))
    run = run_cli("run", str(tmp_path / "out" / "sq" / "plan.json"), "--input", "images.npy", "--output", "p.npy",
                  cwd=elsewhere)  # the plan finds models/sq.pt and its input shape
    assert run.returncode == 0, run.stderr
    assert np.load(elsewhere / "p.npy").shape == (6, 10)

    from tests.fixtures.user_models import build

    trained, _ = build()
    with torch.no_grad():
        for p in trained.parameters():
            p.mul_(2.0)
    torch.save(trained.state_dict(), tmp_path / "trained.pt")
    weighted = run_cli("optimize", "tests.fixtures.user_models:build", "--weights", "trained.pt", *quick, cwd=tmp_path)
    assert weighted.returncode == 0, weighted.stderr
    rows = rng.standard_normal((8, 16)).astype("float32")
    np.save(tmp_path / "rows.npy", rows)
    run = run_cli("run", str(tmp_path / "out" / "user_models" / "plan.json"), "--input", str(tmp_path / "rows.npy"),
                  "--output", "w.npy", cwd=elsewhere)
    assert run.returncode == 0, run.stderr
    with torch.no_grad():
        expected = trained(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(np.load(elsewhere / "w.npy"), expected, rtol=0.05, atol=0.05)  # the trained weights
