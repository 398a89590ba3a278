"""The command line as a user runs it: bad input gets one line and exit code 2; real runs write
the plan, results and report."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.cli import cli_in_process

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}  # this checkout's code
    return subprocess.run([sys.executable, "-m", "overdrive", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def not_a_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("files") / "weights.pt"
    path.write_text("this is not a model")
    return path


BAD_INPUT = [
    (["optimize", "no-such-model"], "unknown workload 'no-such-model'"),
    (["optimize", "nonexistent_pkg_xyz.mod:build"], "cannot import 'nonexistent_pkg_xyz.mod'"),
    (["optimize", "tests.fixtures.user_models:missing"], "has no callable 'missing'"),
    (["optimize", "tests.fixtures.user_models:returns_junk"], "expected an overdrive Workload"),
    (["optimize", "tests.fixtures.user_models:raises"], "factory exploded"),
    (["optimize", "digits-cnn", "--batch-size", "0"], "expected a positive integer, got 0"),
    (["optimize", "digits-cnn", "--batch-size", "-3"], "expected a positive integer, got -3"),
    (["bench", "digits-cnn", "--batch-sizes", "8,0"], "expected a positive integer, got 0"),
    (["optimize", "digits-cnn", "--device", "tpu"], "is not a device; expected 'cpu'"),
    (["optimize", "digits-cnn", "--techniques", "warp-drive"], "unknown technique 'warp-drive'"),
    (["optimize", "digits-cnn", "--min-fidelity", "2"], "expected a number in [0, 1]"),
    (["bench", "digits-cnn", "--plan", "missing-plan.json"], "no such file"),
    (["optimize", "missing-file.pt2"], "no such file"),
]


@pytest.mark.parametrize("args,expected", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_clear_line_and_exit_2(args, expected):
    result = cli_in_process(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert expected in lines[0]


@pytest.mark.parametrize("args,expected", [
    (["optimize", "no-such-model"], "unknown workload 'no-such-model'"),
    (["optimize", "tests.fixtures.exits_on_import:build"], "SystemExit"),  # a module that exits as it is imported
], ids=["unknown", "exits-on-import"])
def test_the_installed_command_prints_one_line_and_no_traceback(args, expected):
    """The same refusals from `python -m overdrive` in a process of its own, as a user meets them."""
    result = run_cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr


def test_file_that_is_not_a_model(not_a_model):
    result = cli_in_process("optimize", str(not_a_model))
    assert result.returncode == 2 and "is not a model file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_absent_cuda_device():
    result = cli_in_process("optimize", "digits-cnn", "--device", "cuda")
    assert result.returncode == 2 and "no CUDA GPU is present" in result.stderr


def test_list_shows_workloads_and_techniques():
    result = run_cli("list")
    assert result.returncode == 0
    for name in ("minilm", "digits-cnn", "bf16", "int8-dynamic", "length-bucketing", "compile", "bn-fold"):
        assert name in result.stdout


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """One `optimize digits-cnn` (pruning among the techniques) and one `bench` of its plan, from the command line,
    for the tests that read what they print and write: (OUT/digits-cnn, optimize's result, bench's result)."""
    tmp_path = tmp_path_factory.mktemp("digits")
    # --min-gain 0.5: the tests are about the files and the checkpoint flow, so a loaded CI machine that blurs the
    # speed figures must not decide whether pruning is kept (benchmarks/pruning_cpu.py measures speed)
    result = run_cli("optimize", "digits-cnn", "--techniques", "prune-channels,bf16,channels-last,bn-fold,int8-dynamic",
                     "--prune-ratio", "0.5", "--finetune-steps", "200", "--max-accuracy-drop", "1.5", "--min-gain", "0.5",
                     "--out", str(tmp_path), "--sweep-batch-sizes", "16,256")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "digits-cnn"
    bench = run_cli("bench", "digits-cnn", "--plan", str(out / "plan.json"), "--batch-sizes", "16,64", "--out", str(tmp_path),
                    "--audit")
    assert bench.returncode == 0, bench.stderr
    return out, result, bench


def test_optimize_then_bench_digits(digits_run):
    out, result, bench = digits_run
    assert "kept?" in result.stdout and "speedup" in result.stdout and "samples/s" in result.stdout
    assert all(len(line) <= 100 for line in result.stdout.splitlines() if line[:1] in "│┃┏┡├└")  # the table fits 100 columns
    results = json.loads((out / "results.json").read_text())
    measured = [r for r in results["rows"] if r["measurement"]]
    assert len(measured) >= 5
    for row in measured:  # every measured entry carries the real test accuracy
        assert 90.0 <= row["measurement"]["task_metric"]["accuracy_pct"] <= 100.0
        assert row["measurement"]["latency_ms"]["p50"] > 0 and row["measurement"]["samples_per_s"] > 0
    for row in results["rows"]:
        assert row["kept"] or row["reason"] or row["phase"] == "plan"
    assert (out / "latency_vs_batch_size.png").stat().st_size > 1000
    assert "![latency vs batch size]" in (out / "report.md").read_text()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["batch_size"] == 256 and plan["device"] == "cpu"
    # The roofline (against peaks measured in this run) and the audit of the baseline and the plan.
    assert "measured peaks: " in result.stdout and "float32 GEMM" in result.stdout
    assert "roofline, baseline: " in result.stdout and "audit, baseline: batch 256: " in result.stdout
    assert "## Roofline and the copy and sync audit" in (out / "report.md").read_text()
    assert all(0 < row["measurement"]["roofline"]["fraction"] for row in measured)
    assert results["rows"][0]["measurement"]["audit"]["num_syncs"] == 0

    data = json.loads((out / "bench.json").read_text())
    assert len(data["results"]) == 2 and all(len(points) == 2 for points in data["results"].values())
    points = [p for points in data["results"].values() for p in points]
    assert all(p["audit"]["batch_size"] == p["batch_size"] and p["roofline"]["fraction"] > 0 for p in points)
    assert bench.stdout.count("audit, ") == 4 and "measured peaks: float32 GEMM" in bench.stdout


def test_optimize_prune_then_bench_reuses_the_pruned_weights(digits_run, tmp_path):
    """Pruning through the tuner: its report line, the checkpoint beside the plan, and `bench`
    reloading that checkpoint (no second pruning) with the pruned model's speed and accuracy."""
    out, result, bench = digits_run
    assert "prune-channels: l2 importance; params 94,186 → 24,058" in result.stdout and "after recovery: accuracy" in result.stdout
    results = json.loads((out / "results.json").read_text())
    alone = next(r for r in results["rows"] if r["phase"] == "alone" and r["label"] == "prune-channels")
    (report,) = alone["details"]
    assert report["fine_tune"]["steps"] == 200 and report["after_recovery"]["accuracy_pct"] > 97
    assert "## Technique reports (pruning: structure, metric and recovery; precision: the per-layer search)" in (out / "report.md").read_text()
    plan = json.loads((out / "plan.json").read_text())
    steps = {s["name"]: s["config"] for s in plan["techniques"]}
    # kept; its weights are saved beside the plan
    assert steps["prune-channels"]["checkpoint"] == "prune-channels.pt" and (out / "prune-channels.pt").exists()
    assert steps["prune-channels"]["ratio"] == 0.5
    assert "prune-channels: weights loaded from checkpoint" in bench.stdout  # not pruned and fine-tuned again
    plan_points = next(points for label, points in json.loads((out / "bench.json").read_text())["results"].items()
                       if label.startswith("plan"))
    assert plan_points and all(point["task_metric"]["accuracy_pct"] > 97 for point in plan_points)

    damaged = tmp_path / "digits-cnn"  # a damaged checkpoint: one line, exit 2, nothing measured
    shutil.copytree(out, damaged)
    (damaged / "prune-channels.pt").write_bytes(b"corrupt")
    refused = cli_in_process("bench", "digits-cnn", "--plan", str(damaged / "plan.json"), "--out", str(tmp_path))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "prune-channels.pt cannot be read as a torch file" in refused.stderr


def test_optimize_user_factory(tmp_path):
    result = cli_in_process("optimize", "tests.fixtures.user_models:build", "--batch-size", "16",
                            "--techniques", "inference-mode,bf16", "--out", str(tmp_path), "--sweep-batch-sizes", "16")
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "user_models" / "plan.json").read_text())["batch_size"] == 16


def test_optimize_saved_files(tmp_path):
    from tests.fixtures.user_models import build

    model, example = build()
    program = torch.export.export(model, (example,))
    torch.export.save(program, tmp_path / "mlp.pt2")
    result = cli_in_process("optimize", str(tmp_path / "mlp.pt2"), "--techniques", "bf16", "--out", str(tmp_path),
                            "--sweep-batch-sizes", "4")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "mlp" / "plan.json").exists()

    torch.jit.save(torch.jit.trace(model, example), tmp_path / "mlp_ts.pt")
    missing_shape = cli_in_process("optimize", str(tmp_path / "mlp_ts.pt"))
    assert missing_shape.returncode == 2 and "--input-shape" in missing_shape.stderr
    result = cli_in_process("optimize", str(tmp_path / "mlp_ts.pt"), "--input-shape", "4,16", "--techniques", "bf16",
                            "--out", str(tmp_path), "--sweep-batch-sizes", "4")
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_optimize_minilm_real_sentences(tmp_path):
    """The demo path, shortened: real weights, real sentences, bf16 measured; the baseline batches the
    sentences by length as `run` and `serve` do, so length bucketing has nothing left to buy and is not tried."""
    result = run_cli("optimize", "minilm", "--techniques", "length-bucketing,bf16,int8-dynamic", "--num-samples", "32",
                     "--out", str(tmp_path), "--sweep-batch-sizes", "32")
    assert result.returncode == 0, result.stderr
    rows = {r["label"]: r for r in json.loads((tmp_path / "minilm" / "results.json").read_text())["rows"]}
    assert "already batched by length" in rows["length-bucketing"]["reason"] and not rows["length-bucketing"]["kept"]
    assert rows["bf16"]["measurement"]["fidelity"]["min_cosine"] > 0.99
    int8 = rows["int8-dynamic"]
    assert int8["kept"] or int8["reason"]  # int8 on MiniLM usually breaks the 0.99 floor; it must say so


def test_unwritable_out_fails_before_measuring(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = cli_in_process("optimize", "digits-cnn", "--out", str(blocker / "sub"))
    assert result.returncode == 2 and "cannot write results" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bench_refuses_a_plan_for_another_workload(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "workload": "minilm", "device": "cpu", "batch_size": 8,
                                "techniques": [{"name": "bf16", "config": {"version": 1}}]}))
    result = cli_in_process("bench", "digits-cnn", "--plan", str(plan), "--out", str(tmp_path))
    assert result.returncode == 2 and "was made for workload 'minilm'" in result.stderr


MORE_BAD_INPUT = [
    (["optimize", "digits-cnn", "--min-gain", "nan"], "expected a finite ratio ≥ 0"),
    (["optimize", "digits-cnn", "--min-gain", "-1"], "expected a finite ratio ≥ 0"),
    (["optimize", "digits-cnn", "--max-accuracy-drop", "nan"], "expected a finite number ≥ 0"),
    (["optimize", "digits-cnn", "--techniques", ","], "got none"),
    (["optimize", ""], "the workload is empty"),
    (["optimize", "tests"], "is a folder"),
    (["optimize", "tests.fixtures.user_models:scalar_output"], "returned shape ()"),
    (["optimize", "tests.fixtures.user_models:fixed_batch", "--batch-size", "8"], "accepts only batch size 4"),
    (["optimize", "digits-cnn", "--prune-ratio", "1.0"], "a fraction strictly between 0 and 1"),
    (["optimize", "digits-cnn", "--finetune-steps", "-5"], "expected an integer ≥ 0, got -5"),
    (["optimize", "digits-cnn", "--prune-ratio", "0.5"], "--prune-ratio applies to pruning techniques; name one"),
    (["optimize", "digits-cnn", "--techniques", "bf16", "--prune-ratio", "0.5", "--finetune-steps", "3"],
     "--prune-ratio and --finetune-steps apply to pruning techniques"),
    (["optimize", "digits-cnn", "--techniques", "bf16", "--finetune-steps", "10"], "name one in --techniques"),
]


@pytest.mark.parametrize("args,expected", MORE_BAD_INPUT, ids=[" ".join(a) for a, _ in MORE_BAD_INPUT])
def test_more_bad_input(args, expected):
    result = cli_in_process(*args)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr, result.stderr


def test_min_gain_zero_is_accepted_as_documented():
    """README and `optimize(min_gain=0)`: 0 keeps every step within the budget whatever its speed."""
    from overdrive.cli import build_parser
    from overdrive.tuning.guard import Guard

    args = build_parser().parse_args(["optimize", "digits-cnn", "--min-gain", "0"])
    assert args.min_gain == 0.0 and Guard(min_gain=args.min_gain).min_gain == 0.0


@pytest.mark.parametrize("batch_size,expected", [(1, "--batch-sizes 1 "), (8, "--batch-sizes 1,8 ")])
def test_next_step_hint_names_each_batch_size_once(batch_size, expected):
    from overdrive.cli.optimize import next_steps

    line = next_steps("tests.fixtures.user_models:build", Path("out/user_models/plan.json"), batch_size)
    assert expected in line and "1,1" not in line
    assert line.startswith("next: overdrive bench tests.fixtures.user_models:build --plan out/user_models/plan.json")


@pytest.mark.parametrize("content", ["[1, 2, 3]", '{"version": 1, "workload": "digits-cnn", "device": "cpu", "batch_size": -3, "techniques": []}'])
def test_malformed_plans(tmp_path, content):
    plan = tmp_path / "plan.json"
    plan.write_text(content)
    for target in (plan, tmp_path):  # a bad plan, and a folder given as the plan
        result = cli_in_process("bench", "digits-cnn", "--plan", str(target), "--out", str(tmp_path))
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_torch_save_checkpoint_is_named_for_what_it_is(tmp_path):
    from tests.fixtures.user_models import build

    torch.save(build()[0], tmp_path / "pickled.pt")
    result = cli_in_process("optimize", str(tmp_path / "pickled.pt"))
    assert result.returncode == 2 and "torch.save checkpoint" in result.stderr and "Traceback" not in result.stderr


def test_static_batch_export_runs_at_its_batch_size_only(tmp_path):
    from tests.fixtures.user_models import build

    model, example = build()
    torch.export.save(torch.export.export(model, (example,)), tmp_path / "static.pt2")  # batch 4, static
    result = cli_in_process("optimize", str(tmp_path / "static.pt2"), "--techniques", "bf16", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    sweep = json.loads((tmp_path / "static" / "results.json").read_text())["sweep"]
    assert {p["batch_size"] for points in sweep.values() for p in points} == {4}
    wrong = cli_in_process("optimize", str(tmp_path / "static.pt2"), "--batch-size", "8")
    assert wrong.returncode == 2 and "accepts only batch size 4" in wrong.stderr


def test_fixed_batch_model_runs_at_its_own_batch_size(tmp_path):
    """A model that runs only at its example's batch size: optimize holds itself (and the sweep) to it."""
    result = cli_in_process("optimize", "tests.fixtures.user_models:fixed_batch", "--techniques", "bf16,onnxruntime", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    sweep = json.loads((tmp_path / "fixed_batch" / "results.json").read_text())["sweep"]
    assert {p["batch_size"] for points in sweep.values() for p in points} == {4}


def test_model_failing_during_the_baseline_is_one_line(tmp_path):
    result = cli_in_process("optimize", "tests.fixtures.user_models:fails_later", "--out", str(tmp_path))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "eager fp32 model failed at batch size 4" in result.stderr and "device-side assert" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_nan_under_low_precision_is_rejected(tmp_path):
    result = cli_in_process("optimize", "tests.fixtures.user_models:nan_when_low_precision", "--techniques", "bf16",
                            "--min-gain", "0.01", "--out", str(tmp_path), "--sweep-batch-sizes", "4")
    assert result.returncode == 0, result.stderr
    rows = {r["label"]: r for r in json.loads((tmp_path / "nan_when_low_precision" / "results.json").read_text())["rows"]}
    assert not rows["bf16"]["kept"] and "non-finite" in rows["bf16"]["reason"]
    assert json.loads((tmp_path / "nan_when_low_precision" / "plan.json").read_text())["techniques"] == []


def test_a_table_whose_columns_have_minimum_widths_is_drawn_within_100_columns():
    """rich drew this table (a technique name of 14 letters, words that do not wrap) 101 columns wide when given 99."""
    import io

    from rich.console import Console
    from rich.table import Table

    from overdrive.core.report import print_table

    table = Table(title="overdrive optimize digits-cnn")
    for col in ("technique", "kept?", "p50/p90 ms", "speedup", "samples/s\n% roof", "peak mem", "fidelity"):
        table.add_column(col, min_width={"technique": 14, "p50/p90 ms": 7}.get(col),
                         no_wrap=col in ("samples/s\n% roof", "peak mem"))
    table.add_row("prune-channels", "yes", "9.66 / 10.66", "2.42× [2.06,\n2.85]", "184,931.7\n26% comp", "884.6 MiB",
                  "acc 100.00%, top-1 agree 0.9944")
    table.add_row("+ int8-dynamic", "no: alternative to bf16, already kept", "", "", "", "", "")
    out = io.StringIO()
    print_table(Console(file=out, width=100, soft_wrap=True), table)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) == 100 and "prune-channels" in out.getvalue()
