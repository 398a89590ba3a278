"""Training on a CPU, in one run: each `overdrive train` option against the plain fp32 baseline.

For minilm (distillation toward the frozen starting model, standard-library docstrings, batch
32) and digits-cnn (cross-entropy on the 1,437 training images, batch 256), each set-up runs
`overdrive train` in a fresh process for the same steps and global batch and reports samples/s
and memory as ratios to the baseline:

- fp32 baseline (one process, all cores);
- bf16 autocast;
- activation checkpointing per block (its step memory, what the steps add to the process's
  memory, must fall);
- torch.compile (the first 20% of steps, which hold the compilation, are not timed);
- DDP at world size 2 (two processes, one core each, half the batch each);
- pipeline parallelism at 2 stages, GPipe, 4 and 8 microbatches (minilm): the measured bubble
  fraction next to the (p − 1)/(m + p − 1) formula.

Throughput on this 2-core CPU is not what a GPU shows; the ratios say what each technique costs
or buys here, and the memory figures are the process RSS high-water marks.

    .venv/bin/python benchmarks/train_cpu.py [--only minilm|digits-cnn] [--steps N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
MODELS = {"minilm": {"batch": 32, "steps": 24}, "digits-cnn": {"batch": 256, "steps": 40}}


def setups(model: str, batch: int) -> list[tuple[str, list[str]]]:
    rows = [
        ("fp32 baseline", []),
        ("bf16 autocast", ["--precision", "bf16"]),
        ("activation checkpointing", ["--checkpoint-activations"]),
        ("torch.compile", ["--compile"]),
        ("DDP × 2", ["--nproc", "2", "--strategy", "ddp", "--batch-size", str(batch // 2)]),
    ]
    if model == "minilm":
        rows += [(f"pipeline × 2, GPipe, m={m}", ["--nproc", "2", "--strategy", "pipeline", "--microbatches", str(m)])
                 for m in (4, 8)]
    return rows


def train(model: str, batch: int, steps: int, extra: list[str], out: Path) -> dict:
    args = [sys.executable, "-m", "overdrive", "train", model, "--device", "cpu", "--batch-size", str(batch),
            "--steps", str(steps), "--out", str(out), *extra]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[2:])} failed:\n{done.stderr[-3000:]}")
    name = "digits-cnn" if model == "digits-cnn" else model
    return json.loads((out / name / "train" / "summary.json").read_text())


def mib(n: int | None) -> str:
    return f"{(n or 0) / 2**20:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(MODELS))
    parser.add_argument("--steps", type=int, help="steps per set-up (default: 24 minilm, 40 digits-cnn)")
    args = parser.parse_args()
    print(f"train_cpu: torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    for model, spec in MODELS.items():
        if args.only and model != args.only:
            continue
        steps = args.steps or spec["steps"]
        print(f"\n{model}: global batch {spec['batch']}, {steps} steps per set-up")
        print(f"  {'set-up':<30} {'samples/s':>10} {'ratio':>7} {'peak MiB':>9} {'step MiB':>9} {'step mem ratio':>15}"
              f" {'loss first → last':>22}")
        base = None
        for label, extra in setups(model, spec["batch"]):
            with tempfile.TemporaryDirectory() as tmp:
                s = train(model, spec["batch"], steps, extra, Path(tmp))
            base = base or s
            print(f"  {label:<30} {s['samples_per_s']:>10.1f} {s['samples_per_s'] / base['samples_per_s']:>6.2f}×"
                  f" {mib(s['peak_memory_bytes']):>9} {mib(s['step_memory_bytes']):>9}"
                  f" {s['step_memory_bytes'] / max(1, base['step_memory_bytes']):>14.2f}×"
                  f" {s['first_loss']:>10.4g} → {s['last_loss']:<10.4g}", flush=True)
            if s.get("pipeline"):
                p = s["pipeline"]
                print(f"  {'':<30} bubble measured {p['bubble_fraction']:.3f} (per rank "
                      f"{', '.join(f'{b:.3f}' for b in p['bubble_fraction_per_rank'])}), GPipe formula "
                      f"(p−1)/(m+p−1) = {p['gpipe_formula']:.3f}; split at block {p['split_points']}")


if __name__ == "__main__":
    main()
