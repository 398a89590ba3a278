"""The Python API: overdrive.optimize / load / bench on a module, its errors, and how the CLI names them."""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

import overdrive
from overdrive.cli import error_line
from overdrive.core.errors import ConfigError, PlanError, arg
from tests.conftest import TinyConvNet, _randomise_bn


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return _randomise_bn(TinyConvNet()), torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def optimized(tiny, tmp_path_factory):
    model, example = tiny
    batches = [torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    labels = torch.arange(12) % 5
    result = overdrive.optimize(model, example, data=batches, metric=lambda out: 100.0 * (out.argmax(-1) == labels).float().mean().item(),
                                max_accuracy_drop=50.0, techniques=["channels-last", "bn-fold"], sweep_batch_sizes=[2])
    folder = tmp_path_factory.mktemp("api")
    return result, result.save(folder), batches


def test_optimize_a_module_gives_the_table_the_model_and_the_files(optimized, tiny):
    result, plan_path, batches = optimized
    rows = {r["technique"]: r for r in result.table}
    assert {"baseline (eager fp32)", "channels-last", "bn-fold"} <= set(rows)
    baseline = rows["baseline (eager fp32)"]
    assert baseline["kept"] and baseline["speedup_vs_baseline"] == 1.0 and baseline["samples_per_s"] > 0
    assert set(baseline["task_metric"]) == {"metric"}  # the user's metric, on the user's rows
    with torch.no_grad():
        expected = torch.cat([tiny[0](b) for b in batches])
    labels = torch.arange(12) % 5
    assert baseline["task_metric"]["metric"] == pytest.approx(100.0 * (expected.argmax(-1) == labels).float().mean().item())
    with torch.no_grad():
        assert_close(result.model(batches[0]), tiny[0](batches[0]), rtol=1e-4, atol=1e-5)  # both techniques are lossless
    saved = json.loads(plan_path.read_text())
    assert saved["workload"].startswith("<python ") and saved["inputs"] == [{"shape": [3, 16, 16], "dtype": "float32"}]
    for name in ("results.json", "report.md", "latency_vs_batch_size.png"):
        assert (plan_path.parent / name).exists()
    assert "| technique |" in result._repr_markdown_()


def test_load_rebuilds_the_plan_on_a_fresh_copy_and_bench_measures_it(optimized, tiny):
    result, plan_path, batches = optimized
    model, example = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = overdrive.load(plan_path, model)  # no example_inputs: seeded rows of the recorded input shapes
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model is not changed
    with torch.no_grad():
        assert_close(fast(batches[1]), result.model(batches[1]))
    figures = overdrive.bench(fast, example, batch_sizes=[1, 4])
    assert list(figures) == [1, 4]
    assert all(m.batch_size == b and m.samples_per_s > 0 and m.latency_ms["p50"] > 0 for b, m in figures.items())


def test_a_plan_of_a_python_module_needs_the_module(optimized):
    _, plan_path, _ = optimized
    with pytest.raises(ConfigError, match="made from a Python module"):
        overdrive.load(plan_path)


@pytest.mark.parametrize("kwargs, message", [
    (dict(example_inputs=None), "example_inputs is needed with a module"),
    (dict(batch_size=0), "batch_size=0: expected a positive integer"),
    (dict(techniques=["no-such"]), "techniques: unknown technique 'no-such'"),
    (dict(techniques=[]), "techniques is empty"),
    (dict(metric=lambda out: 0.0), "metric scores the outputs on data"),
    (dict(max_accuracy_drop=1.0), "max_accuracy_drop: workload 'TinyConvNet' has no task metric; use min_fidelity"),
    (dict(min_fidelity=2.0), "min_fidelity=2.0: expected a number in [0, 1]"),
    (dict(prune_ratio=0.5, techniques=["bf16"]), "prune_ratio applies to pruning techniques; name one in techniques"),
    (dict(device="tpu"), "device='tpu' is not a device; expected 'cpu', 'cuda' or 'cuda:N'"),
])
def test_mistakes_are_typed_errors_naming_the_argument(tiny, kwargs, message):
    model, example = tiny
    kwargs = {"example_inputs": example, **kwargs}
    with pytest.raises(overdrive.OverdriveError) as info:
        overdrive.optimize(model, **kwargs)
    assert message in str(info.value)


def test_the_command_line_spells_the_same_error_in_its_flags():
    error = ConfigError(f"{arg('batch_size', 0)} is not a batch size; with {arg('resume', True)} pass {arg('learning_rate', 1e-3)}")
    assert str(error) == "batch_size=0 is not a batch size; with resume=True pass learning_rate=0.001"
    assert repr(error) == f"ConfigError({str(error)!r})"  # tracebacks show no reference markers
    assert error_line(error, "train") == "--batch-size 0 is not a batch size; with --resume pass --lr 0.001"
    plan_error = PlanError(f"{arg('model', 'p.json')}: no such file")
    assert error_line(plan_error, "serve") == "the plan p.json: no such file"
    assert error_line(plan_error, "optimize") == "p.json: no such file"  # a positional argument: its value


def test_a_workload_by_name_goes_through_the_same_calls(tmp_path):
    with pytest.raises(ConfigError, match="metric goes with a module"):
        overdrive.optimize("digits-cnn", metric=lambda outputs: 1.0)
    with pytest.raises(overdrive.DataError, match=r"rows are torch.float32 \[3, 8, 8\]; 'digits-cnn' takes rows of"):
        overdrive.optimize("digits-cnn", data=[torch.zeros(2, 3, 8, 8)])
    figures = overdrive.bench("digits-cnn", batch_sizes=[16], device="cpu", num_samples=64)
    assert list(figures) == [16] and figures[16].fidelity["top1_agreement"] == 1.0  # the baseline against itself
