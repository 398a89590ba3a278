"""Does a headline survive a second look? `optimize` in this process, then `overdrive bench` of the saved plan
in --processes fresh processes, for three small models whose eager call is slow in ways ONNX Runtime removes
(`tests/fixtures/slow_eager.py`: many small ops, conv-BN-ReLU, transformer blocks written out in ops).

Prints, per model: optimize's headline (the point, and the 99% interval a re-measurement lands in), each
bench process's figure with its own interval and whether it ran busy, whether every bench figure lies inside
the headline's interval, and the log-ratio standard deviation of the bench figures between processes (what
`gain.BETWEEN_PROCESSES_SD` stands for).

    .venv/bin/python benchmarks/reproducible_cpu.py [--processes 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import overdrive  # noqa: E402

MODELS = ["many_small_ops", "conv_bn", "tiny_block"]


def bench(spec: str, plan: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    subprocess.run([sys.executable, "-m", "overdrive", "bench", spec, "--plan", str(plan), "--out", str(out)],
                   check=True, capture_output=True, env=env, cwd=ROOT)
    results = json.loads(next(out.glob("*/bench.json")).read_text())["results"]
    return next(p for label, points in results.items() if label.startswith("plan") for p in points)["gain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args()
    print(f"reproducible_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            spec = f"tests.fixtures.slow_eager:{name}"
            result = overdrive.optimize(spec, techniques=["onnxruntime"], sweep_batch_sizes=[], out=Path(tmp) / "opt")
            measured = result.plan.measured
            if not result.plan.names:
                print(f"  {name}: the plan kept nothing ({result.table[-1]['reason'] or 'baseline'})", flush=True)
                continue
            low, high = measured["speedup_interval99"]
            gains = [bench(spec, Path(tmp) / "opt" / name / "plan.json", Path(tmp) / f"bench-{name}-{i}")
                     for i in range(args.processes)]
            inside = [low <= g["ratio"] <= high for g in gains]
            spread = statistics.stdev(math.log(g["ratio"]) for g in gains) if len(gains) > 1 else math.nan
            print(f"  {name}: optimize {measured['speedup_point']:.2f}× [{low:.2f}, {high:.2f}] "
                  f"({measured['speedup_uncertain'] or 'certain'}); bench " +
                  ", ".join(f"{g['ratio']:.2f}×{' busy' if g['busy'] else ''}" for g in gains), flush=True)
            rows.append((name, measured, gains, inside, spread))
    print("\n| model | optimize: point [interval a re-measurement lands in] | bench in fresh processes | inside | "
          "log sd between processes |\n|---|---:|---|---:|---:|")
    for name, measured, gains, inside, spread in rows:
        low, high = measured["speedup_interval99"]
        figures = ", ".join(f"{g['ratio']:.2f}×" for g in gains)
        print(f"| {name} | {measured['speedup_point']:.2f}× [{low:.2f}, {high:.2f}] | {figures} | "
              f"{sum(inside)} of {len(inside)} | {spread:.3f} |")


if __name__ == "__main__":
    main()
