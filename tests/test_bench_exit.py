"""`overdrive bench` exits 1, naming the failure, when the plan (or the baseline) fails at a
batch size: a table without the plan's row is not a measurement of the plan."""

from __future__ import annotations

import json

from overdrive import cli
from overdrive.techniques.precision.autocast import Bf16AutocastConfig
from overdrive.tuning.plan import Plan

SPEC = "tests.fixtures.run_models:refuses_autocast"


def test_bench_exits_1_when_the_plan_fails(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    Plan(workload=SPEC, device="cpu", batch_size=4, steps=[Bf16AutocastConfig()]).save(plan)
    code = cli.main(["bench", SPEC, "--plan", str(plan), "--device", "cpu", "--batch-sizes", "2,4", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1, captured
    assert "plan: bf16 at batch size 2 failed" in captured.err and "cannot run under autocast" in captured.err
    assert json.loads((tmp_path / "char-text" / "bench.json").read_text())["failures"]  # what did run is still written


def test_bench_exits_0_when_everything_ran(tmp_path):
    plan = tmp_path / "plan.json"
    Plan(workload="tests.fixtures.run_models:char_text", device="cpu", batch_size=4, steps=[Bf16AutocastConfig()]).save(plan)
    assert cli.main(["bench", "tests.fixtures.run_models:char_text", "--plan", str(plan), "--device", "cpu",
                     "--out", str(tmp_path)]) == 0
