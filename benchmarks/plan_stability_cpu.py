"""Does `overdrive optimize` choose the same plan every time? Runs the optimize flow on `minilm` and
`digits-cnn` several times each, alternating, each run in a fresh process (no warm compile caches
or allocator state carried over), and prints the plan each run chose, the plan's speedup over the
baseline with its 99% interval, and the spread of each kept step's gain across runs.

Usage: .venv/bin/python benchmarks/plan_stability_cpu.py [--runs 5] [--workloads minilm,digits-cnn]

The report's batch-size sweep is left out (`sweep_batch_sizes=[]`): it does not choose the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ONE_RUN = """
import json, sys
import overdrive
r = overdrive.optimize(sys.argv[1], device="cpu", sweep_batch_sizes=[])
rows = [{"label": row.label, "phase": row.phase, "kept": row.kept, "reason": row.reason,
         "gain": row.gain.to_dict() if row.gain else None} for row in r.rows]
print("RESULT " + json.dumps({"plan": r.plan.names, "speedup": r.plan.measured["speedup_vs_baseline"],
                              "ci": r.plan.measured.get("speedup_ci99"), "rows": rows, "warnings": r.warnings}))
"""


def one_run(workload: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", ONE_RUN, workload], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{workload}: {done.stderr.strip().splitlines()[-1:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workloads", default="minilm,digits-cnn")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    results: dict[str, list[dict]] = {w: [] for w in workloads}
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    for i in range(args.runs):
        for w in workloads:  # alternate, so drift over the hour lands on both
            r = one_run(w)
            results[w].append(r)
            low, high = r["ci"] or (None, None)
            print(f"{w} run {i + 1}: {' + '.join(r['plan']) or 'baseline'}  {r['speedup']:.2f}× [{low:.2f}, {high:.2f}]  "
                  f"({r['wall_s']:.0f} s, {len(r['warnings'])} warnings)", flush=True)
    for w, runs in results.items():
        plans = Counter(" + ".join(r["plan"]) or "baseline" for r in runs)
        print(f"\n## {w}: {plans.most_common(1)[0][1]} of {len(runs)} runs chose {plans.most_common(1)[0][0]}")
        for plan, n in plans.most_common()[1:]:
            print(f"   {n} chose {plan}")
        print("| step | kept in | gain over what it was added to: min – max of the runs (its 99% intervals' span) |")
        print("|---|---:|---|")
        labels = [row["label"] for row in runs[0]["rows"] if row["phase"] in ("alone", "compose", "plan")]
        for label in dict.fromkeys(labels):
            rows = [row for r in runs for row in r["rows"] if row["label"] == label and row["gain"]]
            if not rows:
                continue
            kept = sum(row["kept"] for row in rows if row["phase"] != "plan")
            ratios = [row["gain"]["ratio"] for row in rows]
            lows, highs = [row["gain"]["low"] for row in rows], [row["gain"]["high"] for row in rows]
            kept_text = "—" if label.startswith("plan") else f"{kept}/{len(rows)}"
            print(f"| {label} | {kept_text} | {min(ratios):.2f}× – {max(ratios):.2f}× ([{min(lows):.2f}, {max(highs):.2f}]) |")
        print(f"wall per run: {min(r['wall_s'] for r in runs):.0f}–{max(r['wall_s'] for r in runs):.0f} s")


if __name__ == "__main__":
    main()
