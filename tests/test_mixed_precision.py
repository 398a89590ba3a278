"""mixed-int8 / mixed-fp8: the per-layer search, the per-row int8 layer, plans that rebuild without searching.

How it could be silently wrong, and the test that says it is not:
- the search quantises the layer that carries the error: a planted outlier layer must stay fp32;
- a row's answer depends on its batch-mates: per-row int8 is bit-identical alone and in any batch;
- `bench`/`serve`/`run` rebuild another model than the one judged: the plan names the layers, and
  the rebuilt model's outputs are bit-identical;
- a fake win on a model with nothing to quantise: not applicable, with the reason;
- compile applied twice, or a plan that claims both: refused.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive.core.workload import Workload, embedding_fidelity, logits_fidelity
from overdrive.techniques import config_from_dict, config_to_dict, conflict, default_config, get_technique
from overdrive.techniques.precision.mixed import MixedInt8Config
from overdrive.techniques.precision.quantized_layers import RowInt8Linear
from overdrive.tuning.guard import Guard
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build, resolve_steps
from overdrive.tuning.tuner import Tuner
from tests.conftest import requires_cuda

CPU = torch.device("cpu")
EAGER = MixedInt8Config(compile=False)  # the search and the math, without Inductor's compile time


class Mlp(nn.Module):
    """4 Linear layers, 32 wide: [B, 32] -> [B, 8]."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64),
                                    nn.GELU(), nn.Linear(64, 8))

    def forward(self, x):
        return self.layers(x)


def mlp_workload(*, outlier: bool, train: int = 96) -> Workload:
    """`Mlp` on seeded rows. With `outlier`, input feature 0 is 1000× larger and layer 0's weights on it
    1000× smaller: the fp32 function is unchanged, but one int8 scale per row crushes every other feature
    of layer 0's input, so layer 0 alone breaks any sensible floor."""
    torch.manual_seed(0)
    model = Mlp().eval()
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(48 + train, 32, generator=g)
    if outlier:
        rows[:, 0] *= 1000.0
        with torch.no_grad():
            model.layers[0].weight[:, 0] /= 1000.0
    return Workload(name="mlp-outlier" if outlier else "mlp", model=model, samples=list(rows[:48]),
                    train_samples=list(rows[48:]), collate=lambda s: (torch.stack(s),), fidelity=embedding_fidelity,
                    fidelity_key="min_cosine", default_batch_size=8, real_weights=False)


def outputs(model, workload, rows=None):
    rows = workload.samples if rows is None else rows
    with torch.no_grad():
        return model(*workload.collate(list(rows))).float()


def test_the_search_keeps_exactly_the_planted_outlier_layer_in_fp32_and_meets_the_floor():
    workload = mlp_workload(outlier=True)
    reports = []
    model, _ = build(workload, [dataclasses.replace(EAGER, min_fidelity=0.99)], CPU, reports)
    report = reports[0]
    layers = {c["name"]: c for c in report["layers"]}
    assert set(layers) == {"layers.0", "layers.2", "layers.4", "layers.6"}
    assert report["chosen"] and "layers.0" not in report["chosen"]
    assert sorted(report["chosen"]) == ["layers.2", "layers.4", "layers.6"]
    assert layers["layers.0"]["precision"] == "fp32" and "would lower min_cosine" in layers["layers.0"]["note"]
    assert layers["layers.0"]["drop"] > 100 * max(layers[n]["drop"] for n in report["chosen"])
    assert report["search_fidelity"] >= report["target"] == pytest.approx(0.9975)
    assert isinstance(model.layers[0], nn.Linear) and all(isinstance(model.layers[i], RowInt8Linear) for i in (2, 4, 6))
    # and on the evaluation rows, which the search never saw
    fidelity = embedding_fidelity(outputs(model, workload), outputs(workload.model, workload))
    assert fidelity["min_cosine"] >= 0.99
    line = get_technique("mixed-int8").describe_report(report, "min_cosine")
    assert "3 of 4 layers in int8" in line and "layers.0 | 32→64" in line


def test_whole_model_int8_of_the_outlier_model_is_what_the_search_avoids():
    workload = mlp_workload(outlier=True)
    everything, _ = build(workload, [dataclasses.replace(EAGER, layers=("layers.0", "layers.2", "layers.4", "layers.6"))],
                          CPU)
    fidelity = embedding_fidelity(outputs(everything, workload), outputs(workload.model, workload))
    assert fidelity["min_cosine"] < 0.98  # the planted outlier is real: whole-model int8 breaks the floor


def test_per_row_int8_gives_a_row_the_same_output_alone_and_in_any_batch():
    torch.manual_seed(0)
    layer = RowInt8Linear(nn.Linear(48, 24))
    rows = torch.randn(9, 5, 48)
    rows[3] *= 1e4  # an outlier batch-mate: one scale per batch would crush the others
    batched = layer(rows)
    for i in range(rows.shape[0]):
        assert torch.equal(layer(rows[i:i + 1]), batched[i:i + 1])
        assert torch.equal(layer(rows[i]), batched[i])  # no batch dimension at all
    reordered = layer(rows.flip(0))
    assert torch.equal(reordered.flip(0), batched)
    assert layer(torch.zeros(0, 48)).shape == (0, 24)
    assert torch.isfinite(layer(torch.zeros(2, 48))).all()  # an all-zero row has no scale to divide by


def test_per_row_int8_is_close_to_fp32_and_keeps_the_input_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = RowInt8Linear(linear)
    x = torch.randn(16, 64)
    cos = nn.functional.cosine_similarity(layer(x), linear(x).detach(), dim=-1)
    assert cos.min() > 0.999
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_a_plan_reloads_the_searched_layers_and_rebuilds_bit_identical_outputs(tmp_path):
    workload = mlp_workload(outlier=True)
    step = dataclasses.replace(EAGER, min_fidelity=0.99)
    searched, _ = build(workload, [step], CPU)
    steps = resolve_steps([step], workload, CPU, tmp_path)
    assert steps[0].layers is not None and "layers.0" not in steps[0].layers
    plan = Plan(workload="mlp", device="cpu", batch_size=8, steps=steps)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.steps == steps
    get_technique("mixed-int8").searched = None  # a rebuild that searched again would fail here
    try:
        rebuilt, _ = build(workload, loaded.steps, CPU)
    finally:
        del get_technique("mixed-int8").searched
    assert torch.equal(outputs(rebuilt, workload), outputs(searched, workload))
    # a plan that names its layers needs no training rows
    no_rows = dataclasses.replace(workload, train_samples=None)
    assert get_technique("mixed-int8").unsupported_reason(no_rows, CPU, loaded.steps[0]) is None
    assert "training rows" in get_technique("mixed-int8").unsupported_reason(no_rows, CPU, step)


def conv_workload_with_rows(train: int = 64) -> Workload:
    from tests.conftest import make_conv_workload

    workload = make_conv_workload()
    g = torch.Generator().manual_seed(2)
    workload.train_samples = list(torch.randn(train, 3, 16, 16, generator=g))
    return workload


def test_static_int8_of_a_cnn_searches_calibrates_and_rebuilds_the_same_model(tmp_path):
    pytest.importorskip("torchao")
    workload = conv_workload_with_rows()
    step = dataclasses.replace(default_config("mixed-int8-static"), compile=False, min_fidelity=0.99)
    reports = []
    model, _ = build(workload, [step], CPU, reports)
    report = reports[0]
    assert {c["name"] for c in report["layers"]} == {"conv1", "conv2", "head"}
    assert report["chosen"] and report["search_fidelity"] >= report["target"]
    from overdrive.techniques.precision.pt2e_static import quantized_layer_count

    assert quantized_layer_count(model) == len(report["chosen"])  # the graph really runs them in int8
    reference = outputs(workload.model, workload)
    out = outputs(model, workload)
    assert logits_fidelity(out, reference)["min_cosine"] >= 0.99
    alone = torch.cat([outputs(model, workload, [r]) for r in workload.samples[:4]])
    torch.testing.assert_close(alone, out[:4], rtol=1e-4, atol=1e-4)  # static scales: batch-mates change nothing
    (resolved,) = resolve_steps([step], workload, CPU, tmp_path)
    assert resolved.checkpoint == str(tmp_path / "mixed-int8-static.pt2") and resolved.layers
    # the plan carries its program: rebuilt without training rows, or with other ones, it is the measured model
    other_rows = dataclasses.replace(workload, train_samples=[t * 0.01 for t in workload.train_samples])
    no_rows = dataclasses.replace(workload, train_samples=None)
    technique = get_technique("mixed-int8-static")
    assert technique.unsupported_reason(no_rows, CPU, resolved) is None
    for w in (workload, other_rows, no_rows):
        rebuilt, _ = build(w, [resolved], CPU)
        assert torch.equal(outputs(rebuilt, workload), out)
    # a fresh process (bench, serve, run) loads the program before anything imported PT2E
    import subprocess
    import sys

    code = ("import torch; from overdrive.techniques.precision.pt2e_static import load_program, quantized_layer_count; "
            f"print(quantized_layer_count(load_program({resolved.checkpoint!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.split()[-1] == str(len(resolved.layers)), loaded.stderr[-2000:]
    recalibrated, _ = build(other_rows, [dataclasses.replace(resolved, checkpoint=None)], CPU)
    assert not torch.equal(outputs(recalibrated, workload), out)  # what the program in the plan protects against
    assert "training rows" in technique.unsupported_reason(no_rows, CPU, dataclasses.replace(resolved, checkpoint=None))
    with pytest.raises(RuntimeError, match="no plain nn.Conv2d / nn.Linear layer 'nothere'"):
        build(workload, [dataclasses.replace(step, layers=("conv1", "nothere"))], CPU)
    compiled, _ = build(workload, [dataclasses.replace(resolved, compile=True)], CPU)
    for n in (8, 1, 3):  # a graph per batch size: Inductor's int8 convolution fails on a symbolic one
        torch.testing.assert_close(outputs(compiled, workload, workload.samples[:n]), out[:n], rtol=0.05, atol=0.05)
    (tmp_path / "mixed-int8-static.pt2").write_bytes(b"junk")
    with pytest.raises(RuntimeError, match="cannot be read as a torch.export program"):
        technique.check_files(resolved)


class ConvHead(nn.Module):
    """A conv and a Linear head with ≥ 8 outputs (Inductor's int8 linear lowering warns there): [B, 3, 8, 8] -> [B, 16]."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 16)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean(dim=(2, 3)))  # [B, 8] -> [B, 16]


def test_static_int8_search_and_compile_print_no_raw_warnings(tmp_path):
    """PT2E, torchao and Inductor warn about their own internals while quantising and compiling; the user sees
    the report, not those lines (a warning that matters becomes a report note)."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    rows = torch.randn(48, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    workload = Workload(name="conv-head", model=ConvHead().eval(), samples=list(rows[:16]), train_samples=list(rows[16:]),
                        collate=lambda s: (torch.stack(s),), fidelity=logits_fidelity, fidelity_key="min_cosine",
                        default_batch_size=8, real_weights=False)
    step = dataclasses.replace(default_config("mixed-int8-static"), min_fidelity=0.9)
    reports, logged = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = logged.append
    exporter = logging.getLogger("torch.export")  # torch's loggers print themselves (not to the root logger)
    exporter.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, _ = build(workload, [step], CPU, reports)  # the search: a PT2E export and calibration per candidate
            (resolved,) = resolve_steps([step], workload, CPU, tmp_path)  # the program saved next to the plan
            out = outputs(model, workload)  # Inductor compiles with freezing: oneDNN int8 kernels
            outputs(model, workload, workload.samples[:3])  # a graph per batch size: compiled again
    finally:
        exporter.removeHandler(handler)
    assert set(reports[0]["chosen"]) == {"conv", "head"} and resolved.checkpoint
    assert logits_fidelity(out, outputs(workload.model, workload))["min_cosine"] >= 0.9
    assert not caught, [f"{w.filename}:{w.lineno}: {w.message}" for w in caught]
    assert not logged, [r.getMessage() for r in logged]
    assert "notes" not in reports[0]  # nothing worth saying here


def test_pt2e_warnings_become_report_notes_noise_goes_and_the_users_own_pass():
    from overdrive.techniques.precision import pt2e_static

    torch_file = str(Path(torch.__file__).parent / "_inductor" / "mkldnn_lowerings.py")
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pt2e_static.said(notes):
            warnings.warn_explicit("To copy construct from a tensor, use clone()", UserWarning, torch_file, 1)  # noise
            warnings.warn_explicit("must run observer before calling calculate_qparams", UserWarning, torch_file, 2)
            warnings.warn_explicit("an internal API is deprecated", DeprecationWarning, torch_file, 3)
            warnings.warn("the user's model says this", UserWarning)
    assert notes == ["torch._inductor.mkldnn_lowerings: must run observer before calling calculate_qparams"]
    assert [str(w.message) for w in caught] == ["the user's model says this"]
    report = {"chosen": ["conv"], "total": 1, "scheme": "int8", "notes": notes}
    assert "PT2E said while quantising: torch._inductor" in get_technique("mixed-int8-static").describe_report(
        report, "min_cosine")


def test_static_int8_leaves_text_models_to_the_per_row_form():
    pytest.importorskip("torchao")
    from tests.conftest import make_text_workload

    assert "mixed-int8" in get_technique("mixed-int8-static").unsupported_reason(make_text_workload(), CPU)
    assert "nn.Conv2d" in get_technique("mixed-int8-static").unsupported_reason(mlp_workload(outlier=False), CPU)


def test_a_model_without_linear_layers_is_not_applicable():
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Flatten()).eval()
    images = list(torch.randn(8, 3, 6))
    workload = Workload(name="norms", model=model, samples=images, train_samples=images, collate=lambda s: (torch.stack(s),),
                        fidelity=logits_fidelity, fidelity_key="min_cosine", default_batch_size=4)
    reason = get_technique("mixed-int8").unsupported_reason(workload, CPU)
    assert reason.startswith("not applicable") and "nn.Linear" in reason


def test_plan_names_a_layer_the_model_lacks():
    workload = mlp_workload(outlier=False)
    with pytest.raises(RuntimeError, match="no layer 'encoder.dense'"):
        build(workload, [dataclasses.replace(EAGER, layers=("encoder.dense",))], CPU)


class Tied(nn.Module):
    """One Linear reached under two names (`shared`, `alias`), and a Linear subclass."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(32, 32)
        self.alias = self.shared
        self.scaled = Tied.Scaled(32, 8)

    def forward(self, x):
        return self.scaled(self.alias(torch.relu(self.shared(x))))


def test_a_layer_reached_under_two_names_is_switched_under_both_and_subclasses_are_listed_in_fp32():
    torch.manual_seed(0)
    workload = mlp_workload(outlier=False)
    workload.model = Tied().eval()
    reports = []
    model, _ = build(workload, [dataclasses.replace(EAGER, min_fidelity=0.9)], CPU, reports)
    assert isinstance(model.shared, RowInt8Linear) and model.alias is model.shared
    assert type(model.scaled) is Tied.Scaled
    layers = {c["name"]: c for c in reports[0]["layers"]}
    assert layers["scaled"]["precision"] == "fp32" and "subclass" in layers["scaled"]["note"]
    assert reports[0]["chosen"] == ["shared"] and reports[0]["total"] == 2


def test_config_round_trip_and_validation():
    step = MixedInt8Config(layers=["a.b", "c"], min_fidelity=0.995)
    data = config_to_dict(step)
    assert data["config"]["layers"] == ["a.b", "c"]
    assert config_from_dict(data) == step and config_from_dict(data).layers == ("a.b", "c")
    for bad in ({"layers": "a.b"}, {"layers": [""]}, {"layers": []}, {"layers": ["a", "a"]}, {"min_fidelity": 1.5},
                {"calibration_rows": 0}, {"compile": "yes"}):
        with pytest.raises(ValueError):
            MixedInt8Config(**bad)


def test_compile_cannot_follow_a_step_that_compiles_its_model():
    compiled = default_config("mixed-int8")
    assert "already includes compile" in conflict([compiled], default_config("compile"))
    assert "includes compile" in conflict([default_config("compile")], compiled)
    assert conflict([EAGER], default_config("compile")) is None
    assert "alternative to bf16" in conflict([default_config("bf16")], compiled)


def test_the_tuner_searches_under_its_guard_and_reports_the_layer_table():
    workload = mlp_workload(outlier=True)
    tuner = Tuner(workload=workload, device=CPU, batch_size=8, techniques=["mixed-int8"],
                  guard=Guard(min_fidelity=0.98, min_gain=0.0), configs={"mixed-int8": EAGER}, min_rounds=1, max_rounds=2)
    assert tuner._step("mixed-int8").min_fidelity == 0.98
    result = tuner.run()
    alone = next(r for r in result.rows if r.phase == "alone")
    assert alone.kept, alone.reason
    assert alone.invariance is not None  # lossy: its rows were checked alone and batched with an outlier
    assert alone.details and alone.details[0]["target"] == pytest.approx(0.995)
    assert result.plan.names == ["mixed-int8"]


@requires_cuda
@pytest.mark.parametrize("name", ["mixed-int8", "mixed-fp8"])
def test_mixed_precision_on_cuda(name):
    device = torch.device("cuda")
    technique = get_technique(name)
    workload = mlp_workload(outlier=True)
    reason = technique.unsupported_reason(workload, device)
    if reason:
        pytest.skip(reason)
    reports = []
    model, _ = build(workload, [dataclasses.replace(default_config(name), min_fidelity=0.99)], device, reports)
    assert "layers.0" not in reports[0]["chosen"]
    x = torch.stack(list(workload.samples)).to(device)
    with torch.no_grad():
        out, ref = model(x).float().cpu(), workload.model(x.cpu()).float()
        alone = torch.cat([model(x[i:i + 1]).float().cpu() for i in range(4)])
    assert embedding_fidelity(out, ref)["min_cosine"] >= 0.99
    torch.testing.assert_close(alone, out[:4], rtol=1e-3, atol=1e-3)


def test_compiled_mixed_int8_on_a_bert_matches_its_eager_form_and_keeps_rows_independent():
    """The default config (Inductor, dynamic shapes for text) on a tiny BERT with training rows."""
    from tests.conftest import make_text_workload

    workload = make_text_workload()
    g = torch.Generator().manual_seed(1)
    workload.train_samples = [torch.randint(1, 50, (int(n),), generator=g).tolist() for n in torch.randint(2, 30, (64,), generator=g)]
    step = dataclasses.replace(default_config("mixed-int8"), min_fidelity=0.99)
    reports = []
    compiled, _ = build(workload, [step], CPU, reports)
    eager, _ = build(workload, [dataclasses.replace(step, compile=False)], CPU)
    rows = workload.samples[:12]
    out = outputs(compiled, workload, rows)
    torch.testing.assert_close(out, outputs(eager, workload, rows), rtol=1e-4, atol=1e-4)
    assert embedding_fidelity(out, outputs(workload.model, workload, rows))["min_cosine"] >= 0.99
    alone = torch.cat([outputs(compiled, workload, [r]) for r in rows[:4]])
    torch.testing.assert_close(alone, out[:4], rtol=1e-4, atol=1e-4)  # padding and batch-mates change nothing
    assert reports[0]["chosen"]
