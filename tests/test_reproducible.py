"""Every headline survives a second look: `overdrive bench` of a saved plan, in a fresh process, lands
inside the interval `optimize` printed for it (issue 30).

Both run as a user runs them, each in a process of its own: optimized inside the test process, after
hundreds of other tests, the eager baseline of `tiny_block` timed 1.45× and 1.83× in two full runs
against 1.86× and 1.46× from bench (it passes alone): a long-lived process's state (its allocator, its
thread pools, oneDNN's primitive cache) is not what a user's `overdrive optimize` starts with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def optimize_plan(spec: str, out: Path) -> dict:
    """`overdrive.optimize` of `spec` with ONNX Runtime, in a new process; its results.json."""
    code = (f"import overdrive; overdrive.optimize({spec!r}, techniques=['onnxruntime'], sweep_batch_sizes=[], "
            f"out={str(out)!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(out.glob("*/results.json")).read_text())


def bench_gain(spec: str, plan: Path, out: Path) -> dict:
    """The plan's gain over the baseline as `overdrive bench` measures it in a new process."""
    done = subprocess.run([sys.executable, "-m", "overdrive", "bench", spec, "--plan", str(plan), "--out", str(out)],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(next(out.glob("*/bench.json")).read_text())["results"]
    (point,) = [p for label, points in results.items() if label.startswith("plan") for p in points]
    return point["gain"]


def _outside(measured: dict, gain: dict) -> str | None:
    """Why bench's figure lies outside the interval optimize printed, or None when inside."""
    low, high = measured["speedup_interval99"]
    if low <= gain["ratio"] <= high:
        return None
    return (f"optimize printed {measured['speedup_point']:.2f}× [{low:.2f}, {high:.2f}], bench in a fresh process "
            f"measured {gain['ratio']:.2f}× [{gain['low']:.2f}, {gain['high']:.2f}]")


@pytest.mark.slow
@pytest.mark.parametrize("factory", ["many_small_ops", "conv_bn", "tiny_block"])
def test_bench_in_a_fresh_process_lands_inside_the_printed_interval(factory, tmp_path):
    """The printed interval is a 99% prediction interval: one second look in a hundred lands outside it by
    design, so three models checked once each would fail a correct interval about one run in thirty (CI did,
    tiny_block 1.53× [1.27, 1.84] against bench's 1.90×). A miss is looked at once more, in another fresh
    process, and the test fails when that lands outside too: a correct interval then fails one run in ten
    thousand, one that holds only 80% of second looks fails one model in twenty-five."""
    spec = f"tests.fixtures.slow_eager:{factory}"
    results = optimize_plan(spec, tmp_path / "opt")
    measured = results["plan"]["measured"]
    reasons = [r["reason"] for r in results["rows"]]
    if any("uncertain (busy)" in r for r in reasons) and not results["plan"]["techniques"]:
        pytest.skip(f"the machine was busy while optimize timed the candidate ({reasons}): it said uncertain, and kept "
                    "nothing to check")  # as a busy bench below skips; a full two-worker run with other work beside it
    assert [s["name"] for s in results["plan"]["techniques"]] == ["onnxruntime"], reasons  # what makes eager slow, removed
    misses = []
    for look in range(2):
        gain = bench_gain(spec, tmp_path / "opt" / factory / "plan.json", tmp_path / f"bench{look}")
        if measured["speedup_uncertain"] and "busy" in measured["speedup_uncertain"] or gain["busy"]:
            pytest.skip(f"the machine was busy (optimize: {measured['speedup_uncertain']}; bench: {gain['uncertain']}): "
                        "no figure to check")
        miss = _outside(measured, gain)
        if miss is None:
            return
        misses.append(miss)
    pytest.fail(f"{factory}: both second looks landed outside the printed interval: " + "; ".join(misses))
