"""The guard against silent wrong numbers (issue 15): fidelity on real rows, batch invariance, a
deterministic baseline, a zero budget, damaged files, and a speed gate that decides beyond the noise.
Each test is a case a user was hurt by; each failed before the guard handled it."""

from __future__ import annotations

import dataclasses
import json
import zipfile
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import overdrive
from overdrive.core.errors import WorkloadError
from overdrive.core.workload import Workload, logits_fidelity
from overdrive.techniques import Stage, Technique, TechniqueConfig
from overdrive.techniques.registry import register, unregister
from overdrive.tuning.sweep import open_session
from overdrive.tuning.guard import Guard
from overdrive.tuning.tuner import Tuner
from overdrive.workloads import create_workload
from overdrive.workloads.user import workload_from_model
from tests.fixtures import guard_models
from tests.fixtures.cli import cli_in_process
from tests.test_cli import run_cli

CPU = torch.device("cpu")
QUICK = {"sweep_batch_sizes": [], "device": "cpu"}


def _row(table, label):
    return next(r for r in table if r["technique"] == label)


# -- 1. fidelity on the user's rows, not on random ones -------------------------------------------


def test_a_factory_is_judged_on_its_example_rows_not_on_random_rows():
    model, example = guard_models.raw_feature()
    workload = workload_from_model("raw", model, example)
    assert workload.rows_source == "example" and len(workload.samples) == 32
    assert torch.equal(workload.samples[5][0], example[5])
    result = overdrive.optimize(model, example, techniques=["int8-dynamic"], **QUICK)
    row = _row(result.table, "int8-dynamic")
    assert not row["kept"] and row["reason"].startswith("min_cosine") and row["fidelity"]["min_cosine"] < 0.5
    assert "rows of your example input" in result.rows_description


def test_a_result_without_a_sweep_saves_everything_but_the_plot(tmp_path):
    model, example = guard_models.plain()
    result = overdrive.optimize(model, example, techniques=["inference-mode"], **QUICK)
    result.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} >= {"plan.json", "results.json", "report.md"}
    assert not (tmp_path / "latency_vs_batch_size.png").exists()


def test_random_rows_are_used_only_for_a_placeholder_example_and_say_so():
    workload = workload_from_model("zeros", guard_models.mlp(), torch.zeros(4, 16))
    assert workload.rows_source == "random"
    assert "random inputs: shape only" in workload.describe_rows()


def test_random_rows_of_token_ids_cover_the_vocabulary_the_model_takes():
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(12, 8), torch.nn.Linear(8, 4)

        def forward(self, ids):
            return self.head(self.embed(ids).mean(1))

    workload = workload_from_model("tokens", Tokens().eval(), torch.zeros(8, 10, dtype=torch.int64))  # a shape only
    ids = torch.stack([row[0] for row in workload.samples])
    assert workload.rows_source == "random" and ids.min() == 0 and ids.max() == 11  # not 64 rows of zeros
    assert len({tuple(r) for r in ids.tolist()}) == len(ids)


def test_data_file_on_the_command_line_is_what_is_judged(tmp_path):
    rows = tmp_path / "rows.npy"
    np.save(rows, guard_models.raw_feature_rows(40, seed=3).numpy())
    result = cli_in_process("optimize", "tests.fixtures.guard_models:plain", "--data", str(rows), "--techniques",
                            "int8-dynamic", "--sweep-batch-sizes", "4", "--device", "cpu", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "fidelity on your data (40 rows)" in result.stdout
    results = json.loads((tmp_path / "out" / "plain" / "results.json").read_text())
    assert results["rows_source"] == "data"
    int8 = next(r for r in results["rows"] if r["label"] == "int8-dynamic")
    assert not int8["kept"] and int8["measurement"]["fidelity"]["min_cosine"] < 0.5  # the raw feature hurts it


def test_data_file_of_the_wrong_shape_is_one_line_exit_2(tmp_path):
    rows = tmp_path / "rows.npy"
    np.save(rows, np.zeros((5, 3), dtype=np.float32))
    result = cli_in_process("optimize", "tests.fixtures.guard_models:plain", "--data", str(rows), "--device", "cpu",
                            "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "rows.npy: array of shape [5, 3]" in result.stderr and "rows of shape [16]" in result.stderr


def test_a_built_in_workload_can_be_judged_on_your_rows():
    digits = create_workload("digits-cnn")
    images = torch.stack(list(digits.samples[:20]))
    workload = open_session("digits-cnn", device="cpu", data=[images]).workload
    assert workload.rows_source == "data" and len(workload.samples) == 20 and workload.labels is None
    assert any("labels" in note for note in workload.notes)


def test_asking_for_more_rows_than_there_are_says_how_many_were_used():
    digits = create_workload("digits-cnn")
    images = torch.stack(list(digits.samples[:20]))
    session = open_session("digits-cnn", device="cpu", data=[images], num_samples=50)
    assert session.num_distinct_samples == 20
    assert any("50 evaluation rows asked for, the workload holds 20" in note for note in session.workload.notes)


# -- 2. a row's answer does not depend on its batch-mates -----------------------------------------


def test_a_technique_whose_rows_depend_on_their_batch_mates_is_rejected_for_serving():
    model, example = guard_models.plain()
    result = overdrive.optimize(model, example, techniques=["int8-dynamic"], **QUICK)
    row = next(r for r in result.rows if r.label == "int8-dynamic")
    assert row.invariance.alone["min_cosine"] >= 0.99  # faithful for rows alone ...
    assert row.invariance.mixed["min_cosine"] < 0.9  # ... and not next to an outlier row
    assert not row.kept and row.reason.startswith("batch-dependent") and "one scale for the whole batch" in row.reason


def test_a_lossless_technique_is_not_probed_and_a_faithful_lossy_one_passes(conv_workload):
    result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["bf16", "channels-last"],
                   guard=Guard(min_gain=0), min_rounds=2, max_rounds=2).run()
    bf16 = next(r for r in result.rows if r.label == "bf16")
    channels_last = next(r for r in result.rows if r.label == "channels-last")
    assert bf16.invariance is not None and bf16.invariance.mixed["min_cosine"] >= 0.99 and bf16.kept
    assert channels_last.invariance is None


@pytest.mark.parametrize("factory", ["scalar_regressor", "offset_classifier"])
def test_errors_hidden_by_an_offset_all_rows_share_are_seen(factory):
    """bf16 turns every row of a 1000 + small-score regressor into 1000.0, and flips the argmax of logits on an
    offset of 500; cosine per row stays 1.0 for the logits, and a one-value row's cosine is only its sign. R²
    (against the rows' spread) sees both."""
    model, example = getattr(guard_models, factory)()
    result = overdrive.optimize(model, example, techniques=["bf16"], min_gain=0, **QUICK)
    row = _row(result.table, "bf16")
    assert row["fidelity"]["r2"] < 0.5
    if factory == "offset_classifier":
        assert row["fidelity"]["min_cosine"] > 0.9999
    else:  # one value per row: judged by R², no cosine figure
        assert "min_cosine" not in row["fidelity"] and result.rule.key == "r2"
    assert not row["kept"] and row["reason"].startswith("r2 ") and "floor" in row["reason"]


def test_one_value_per_row_is_judged_by_r2_not_by_a_cosine_of_its_sign():
    """A [B] score centred on zero: bf16 moves a row near zero across it, and a one-number row's cosine is its
    sign, so the guard read min_cosine -1.0000 and rejected a faithful bf16 (a fresh user's trial)."""
    model, example = guard_models.centred_score()
    with torch.no_grad():
        reference = model(example)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lowered = model(example).float()
    assert float(reference[0]) * float(lowered[0]) < 0  # the first row crossed zero (its per-row cosine: -1)
    figures = logits_fidelity(lowered, reference)
    assert "min_cosine" not in figures and "top1_agreement" not in figures and figures["r2"] > 0.999
    result = overdrive.optimize(model, example, techniques=["bf16"], min_gain=0, **QUICK)
    assert result.rule.key == "r2"
    row = _row(result.table, "bf16")
    assert row["kept"], row["reason"]
    assert row["fidelity"]["r2"] > 0.99 and "min_cosine" not in row["fidelity"]


class _Tiny(torch.nn.Module):
    """The scalar regressor's outputs times 1e-10: every output within 1e-6 of zero, yet varying from row to row."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) * 1e-10


def test_outputs_near_zero_that_vary_and_a_single_value_are_not_waved_through():
    """From a new user's trial: outputs all within 1e-6 of zero were judged by max |error| ≤ 1e-5 alone, so bf16 was
    kept at R² −21; and one row of one value was judged at 1e-3 of its size, so bf16 turning 1000 + score into 1000
    was kept. Now R² judges the first (it is scale-free), and the second must agree as a lossless technique does."""
    model, example = guard_models.scalar_regressor()
    tiny = overdrive.optimize(_Tiny(model).eval(), example, techniques=["bf16"], min_gain=0, **QUICK)
    row = _row(tiny.table, "bf16")
    assert tiny.rule.degenerate and tiny.rule.r2_floor == 0.99
    assert not row["kept"] and row["reason"].startswith("r2 ") and row["fidelity"]["r2"] < 0.5, row
    one = overdrive.optimize(model, example[:1], techniques=["bf16"], min_gain=0, **QUICK)
    row = _row(one.table, "bf16")
    assert "one evaluation row of one value" in one.rule.degenerate
    assert not row["kept"] and row["reason"].startswith("max_abs_error"), row
    assert any("one evaluation row of one value" in w for w in one.warnings)  # said where a user reads


def test_a_spike_row_finds_batch_dependence_that_a_leading_layer_norm_hides_from_a_scaled_row():
    model, example = guard_models.layer_norm_first()
    result = overdrive.optimize(model, example, techniques=["int8-dynamic"], min_gain=0, **QUICK)
    row = next(r for r in result.rows if r.label == "int8-dynamic")
    assert row.invariance.outlier == "a one-spike row" and row.invariance.alone["min_cosine"] >= 0.99
    assert not row.kept and row.reason.startswith("batch-dependent")


def test_a_model_whose_own_rows_depend_on_the_batch_is_named():
    model, example = guard_models.batch_standardised()
    result = overdrive.optimize(model, example, techniques=["inference-mode"], min_gain=0, **QUICK)
    assert any("the eager fp32 model's own rows depend on their batch-mates" in w for w in result.warnings)


# -- 4. a baseline that moves is refused or fixed, never blamed on lossless techniques ------------


def test_a_program_exported_in_training_mode_is_switched_to_eval_and_says_so(tmp_path):
    model = guard_models.conv_bn_dropout().train()
    example = torch.randn(8, 3, 12, 12)
    path = tmp_path / "trained.pt2"
    torch.export.save(torch.export.export(model, (example,)), str(path))
    workload = create_workload(str(path))
    assert any("training mode" in note and "dropout" in note for note in workload.notes)
    result = overdrive.optimize(str(path), techniques=["inference-mode"], min_gain=0, **QUICK)
    for label in ("inference-mode",):
        row = _row(result.table, label)
        assert row["kept"] and row["fidelity"]["min_cosine"] > 0.9999, row
    with torch.no_grad():  # and the program now computes what the model computes in eval mode
        built = overdrive.load(result.save_plan(tmp_path / "plan"), workload)
        assert torch.allclose(built(example), model.eval()(example), atol=1e-5)


def test_a_module_in_training_mode_is_measured_in_eval_mode_and_left_as_it_was():
    model = guard_models.conv_bn_dropout().train()
    workload = workload_from_model("conv", model, torch.randn(4, 3, 12, 12))
    assert model.training and model.drop.training  # the user's module is not changed
    assert any("training mode" in note for note in workload.notes)


def test_a_model_that_draws_random_numbers_is_refused_with_the_cause():
    model, example = guard_models.random_forward()
    with pytest.raises(WorkloadError, match="different outputs for the same rows on two runs.*draws random numbers"):
        overdrive.optimize(model, example, techniques=["inference-mode"], **QUICK)


def test_a_fidelity_metric_that_fails_against_itself_is_reported_as_broken(conv_workload):
    broken = dataclasses.replace(conv_workload, fidelity=lambda out, ref: {"min_cosine": 0.0})
    with pytest.raises(WorkloadError, match="broken fidelity metric.*min_cosine 0, below the 0.99 floor"):
        Tuner(workload=broken, device=CPU, batch_size=8, techniques=["channels-last"]).run()


def test_a_reference_with_every_row_the_same_is_named_degenerate(conv_workload):
    with torch.no_grad():
        conv_workload.model.head.weight.zero_()  # the bias alone: one output for every input
    result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["channels-last"],
                   guard=Guard(min_gain=0), min_rounds=2, max_rounds=2).run()
    assert "every row's output is the same" in result.rule.degenerate


# -- 9. a zero budget keeps lossless techniques only ------------------------------------------------


@pytest.mark.parametrize("guard", [Guard(max_accuracy_drop=0.0, min_gain=0), Guard(lossless=True, min_gain=0),
                                   Guard(min_fidelity=1.0, min_gain=0)], ids=["zero-budget", "lossless", "floor-1"])
def test_a_zero_budget_keeps_lossless_techniques_only(conv_workload, guard):
    result = Tuner(workload=conv_workload, device=CPU, batch_size=8, techniques=["int8-dynamic", "bf16", "channels-last"],
                   guard=guard, min_rounds=2, max_rounds=2).run()
    rows = {r.label: r for r in result.rows}
    for lossy in ("int8-dynamic", "bf16"):
        assert not rows[lossy].kept and rows[lossy].reason.startswith("skipped: lossy")
    assert rows["channels-last"].kept and result.plan.names == ["channels-last"]


def test_lossless_on_the_command_line(tmp_path):
    result = cli_in_process("optimize", "tests.fixtures.guard_models:plain", "--lossless", "--techniques",
                            "int8-dynamic,bf16", "--sweep-batch-sizes", "4", "--device", "cpu", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "plain" / "plan.json").read_text())
    assert plan["techniques"] == []
    why_not = [line for line in result.stdout.splitlines() if line.startswith("  why not, ")]  # one line per row
    assert sum("skipped: lossy" in line for line in why_not) == 2


# -- 10. damaged files are refused -------------------------------------------------------------------


def test_a_pt2_with_a_corrupted_weight_is_refused(tmp_path):
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(guard_models.mlp(), (torch.randn(4, 16),)), str(path))
    with zipfile.ZipFile(path) as archive:
        member = max(archive.infolist(), key=lambda info: info.compress_size)  # the largest: weights
    data = bytearray(path.read_bytes())
    position = member.header_offset + 30 + len(member.filename.encode()) + len(member.extra) + member.compress_size // 2
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(WorkloadError, match="damaged.*CRC"):
        create_workload(str(path))
    result = cli_in_process("optimize", str(path), "--device", "cpu", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "CRC" in result.stderr and len(result.stderr.strip().splitlines()) == 1


# -- 8. the speed gate decides beyond the noise ------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _SpeedConfig(TechniqueConfig):
    pass


def _speed_technique(name: str, seconds_per_call: float):
    config = dataclass(frozen=True, kw_only=True)(type(f"{name}-config", (_SpeedConfig,), {"name": name}))

    def apply(self, model, config, **_):
        return guard_models.Sleeper(seconds_per_call)

    register(type(name, (Technique,), {"config_cls": config, "stage": Stage.GRAPH, "lossless": True, "description": "",
                                       "apply": apply}))


@pytest.fixture
def sleep_workload():
    rows = guard_models.normal_rows(20)
    workload = Workload(name="sleepy", model=guard_models.Sleeper(0.004), samples=list(rows),
                        collate=lambda s: (torch.stack(s),), fidelity=logits_fidelity, fidelity_key="min_cosine",
                        default_batch_size=8)
    _speed_technique("t-twice-as-fast", 0.002)
    _speed_technique("t-as-fast", 0.004)
    yield workload
    unregister("t-twice-as-fast"), unregister("t-as-fast")


def test_the_speed_gate_keeps_a_real_gain_and_rejects_none_every_time(sleep_workload):
    for _ in range(3):
        result = Tuner(workload=sleep_workload, device=CPU, batch_size=8, techniques=["t-twice-as-fast", "t-as-fast"],
                       max_compare_s=2.5).run()
        rows = {r.label: r for r in result.rows}
        fast, same = rows["t-twice-as-fast"], rows["t-as-fast"]
        assert fast.kept and fast.gain.low >= 1.02 and 1.2 < fast.gain.ratio < 2.5, fast.gain
        assert not same.kept and same.reason.startswith("not faster beyond the noise"), same.reason
        assert result.plan.names == ["t-twice-as-fast"]
        assert result.plan.measured["speedup_ci99"][0] >= 1.02


def test_every_row_of_a_pass_is_timed_the_partial_batch_too(sleep_workload):
    result = Tuner(workload=sleep_workload, device=CPU, batch_size=8, techniques=["t-twice-as-fast"],
                   min_rounds=2, max_rounds=2).run()
    baseline = result.rows[0].measurement
    assert baseline.num_timed_calls == 3 * baseline.num_passes  # 20 rows at batch 8: 8 + 8 + 4


class _Fades(torch.nn.Module):
    """Twice as fast as the baseline until `slow` is set (by the test, once the plan is timed), then half as fast."""

    slow = False

    def forward(self, x):
        guard_models.time.sleep(0.008 if _Fades.slow else 0.002)
        return x[:, :4] * 2


def test_a_plan_that_is_not_faster_than_the_baseline_is_backed_off(sleep_workload):
    config = dataclass(frozen=True, kw_only=True)(type("t-fades-config", (_SpeedConfig,), {"name": "t-fades"}))
    register(type("t-fades", (Technique,), {"config_cls": config, "stage": Stage.GRAPH, "lossless": True,
                                             "description": "", "apply": lambda self, model, config, **_: _Fades()}))

    def progress(label: str) -> None:
        _Fades.slow = label.startswith("plan:")

    try:
        result = Tuner(workload=sleep_workload, device=CPU, batch_size=8, techniques=["t-fades"], max_compare_s=5,
                       progress=progress).run()
    finally:
        unregister("t-fades")
        _Fades.slow = False
    rows = {r.label: r for r in result.rows}
    assert rows["t-fades"].kept  # alone, it was faster
    backed = rows["plan: t-fades"]
    assert not backed.kept and "not faster than the baseline beyond the noise" in backed.reason
    assert result.plan.names == [] and result.rows[-1].label == "plan: baseline"


@pytest.mark.parametrize("factory", ["images_0_255", "images_uint8"])
def test_a_folder_of_images_is_read_in_the_range_and_dtype_of_the_models_rows(tmp_path, factory):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    pixels = np.full((16, 16, 3), 200, dtype=np.uint8)
    Image.fromarray(pixels).save(folder / "a.png")
    out = tmp_path / "stats.npy"
    result = run_cli("run", f"tests.fixtures.guard_models:{factory}", "--input", str(folder), "--output", str(out),
                     "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert np.load(out)[0].tolist() == [200.0, 200.0]  # not 0.78: the model's rows are 0..255


def test_a_folder_of_images_for_a_model_of_normalised_rows_is_refused(tmp_path):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(folder / "a.png")
    result = cli_in_process("run", "tests.fixtures.guard_models:images_normalised", "--input", str(folder), "--output",
                            str(tmp_path / "o.npy"), "--device", "cpu")
    assert result.returncode == 2 and "normalised images" in result.stderr, result.stderr


def test_figures_count_each_sample_once_when_samples_repeat_to_fill_a_batch():
    from overdrive.core.measure import measure

    workload = Workload(name="three", model=torch.nn.Identity(), samples=[torch.eye(3)[i] for i in range(3)],
                        collate=lambda s: (torch.stack(s),), fidelity=logits_fidelity, fidelity_key="min_cosine",
                        default_batch_size=8)
    indices = [i % 3 for i in range(8)]  # samples 0, 1 repeat three times, sample 2 twice
    reference = torch.stack([torch.eye(3)[i] for i in [0, 1, 0, 0, 1, 0, 0, 1]])  # sample 2's argmax disagrees
    m, _ = measure(workload.model, workload, device=CPU, batch_size=8, indices=indices, reference=reference,
                   min_timed_calls=1, min_timed_s=0)
    assert m.fidelity["top1_agreement"] == pytest.approx(2 / 3)  # not 6/8
