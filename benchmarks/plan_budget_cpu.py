"""Does the time budget find the plan the full search finds? `overdrive optimize` of each workload twice
in one run, each in a fresh process with an empty cache (no export and no history of the other to lean
on): with the default budget, and with no budget (`--time-budget 0`, every candidate tried).

Prints, per workload and search: the wall time of the whole command (model load and report included,
as `make demo` pays it), the plan, its headline with the 99% interval a re-measurement lands in, its
fidelity, what the budget left untried; then whether the budgeted plan's interval overlaps the full
search's and its fidelity is as good (within 0.002 of the floor's figure).

    .venv/bin/python benchmarks/plan_budget_cpu.py [--workloads minilm,digits-cnn] [--order budget-first] [--logs DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIDELITY_SLACK = 0.002


def search(workload: str, budget: str | None, folder: Path) -> dict:
    """One `overdrive optimize` in a fresh process with an empty cache; its figures from results.json."""
    cache = folder / "cache"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OVERDRIVE_CACHE": str(cache), "COLUMNS": "100",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "overdrive", "optimize", workload, "--out", str(folder / "out"), "--overwrite"]
    if budget is not None:
        command += ["--time-budget", budget]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    results = json.loads(next((folder / "out").glob("*/results.json")).read_text())
    plan = results["plan"]
    measured = plan["measured"]
    rows = results["rows"]
    untried = [r["label"] for r in rows if r["reason"].startswith("untried")]
    key = next(iter(measured["fidelity"] or {}), None)
    (folder / "optimize.log").write_text(done.stdout)
    return {"wall_s": wall, "steps": [s["name"] for s in plan["techniques"]], "point": measured["speedup_point"],
            "interval": measured["speedup_interval99"], "quoted": measured["speedup_vs_baseline"],
            "uncertain": measured["speedup_uncertain"], "fidelity": measured["fidelity"], "untried": untried,
            "tried": sum(1 for r in rows if r["phase"] == "alone" and r["measurement"] is not None),
            "fidelity_key": key, "log": done.stdout}


def describe(name: str, r: dict) -> str:
    low, high = r["interval"]
    fid = r["fidelity"] or {}
    figure = ", ".join(f"{k} {v:.4f}" for k, v in list(fid.items())[:2])
    return (f"  {name:<12} {r['wall_s'] / 60:5.1f} min  {' + '.join(r['steps']) or 'baseline':<48} "
            f"{r['point']:.2f}× [{low:.2f}, {high:.2f}]  {figure}  tried {r['tried']}, untried {len(r['untried'])}"
            + (f" ({', '.join(r['untried'])})" if r["untried"] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="minilm,digits-cnn")
    parser.add_argument("--order", choices=["budget-first", "full-first"], default="budget-first")
    parser.add_argument("--logs", help="a folder to keep each optimize's output in")
    parser.add_argument("--budget-only", action="store_true", help="only the default budget's search (no comparison)")
    args = parser.parse_args()
    import torch

    print(f"plan_budget_cpu: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    searches = [("default budget", None), ("full search", "0")]
    if args.order == "full-first":
        searches.reverse()
    if args.budget_only:
        searches = [("default budget", None)]
    for workload in args.workloads.split(","):
        print(f"{workload}:", flush=True)
        found = {}
        for name, budget in searches:
            with tempfile.TemporaryDirectory(prefix="plan-budget-") as tmp:
                found[name] = search(workload, budget, Path(tmp))
            print(describe(name, found[name]), flush=True)
            if args.logs:  # the whole optimize output, table included
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                (Path(args.logs) / f"{workload}-{budget or 'default'}.log").write_text(found[name]["log"])
        if args.budget_only:
            continue
        quick, full = found["default budget"], found["full search"]
        overlap = quick["interval"][0] <= full["interval"][1] and full["interval"][0] <= quick["interval"][1]
        key = full["fidelity_key"]
        same_fidelity = key is None or (quick["fidelity"] or {}).get(key, -1) >= (full["fidelity"] or {}).get(key, 0) - FIDELITY_SLACK
        print(f"  intervals overlap: {'yes' if overlap else 'NO'}; fidelity as good ({key}): "
              f"{'yes' if same_fidelity else 'NO'}; time {quick['wall_s'] / full['wall_s']:.2f}× the full search's",
              flush=True)


if __name__ == "__main__":
    main()
