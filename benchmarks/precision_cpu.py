"""Precision on MiniLM (CPU): the searched mixed-int8 plan against the bf16 plans and whole-model int8, in one run.

Entries, all on the same real sentences at the same batch size, length-bucketed (the plans'
batching), timed in interleaved rounds (each round one pass of every entry, in a shuffled order):
  eager fp32 · bf16 plan (length-bucketing + bf16) · bf16 + compile plan · whole-model int8 dynamic
  (torch.ao, per-tensor activations) · whole-model ONNX Runtime int8 (dynamic, per channel) ·
  whole-model per-row int8 (every Linear, compiled) · the mixed-int8 plan (length-bucketing +
  mixed-int8, searched on 128 training sentences, or the one in --plan).
Min cosine is against eager fp32 on every evaluation sentence. The per-layer table is the search's.

Target (issue 18): the mixed-int8 plan keeps min cosine ≥ 0.99 and is ≥ 1.2× the samples/s of the
faster bf16 plan.

    .venv/bin/python benchmarks/precision_cpu.py [--plan out/minilm/plan.json] [--num-sentences 1024] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.core.measure import Runner  # noqa: E402
from overdrive.techniques import default_config, get_technique  # noqa: E402
from overdrive.tuning.plan import Plan, build  # noqa: E402
from overdrive.workloads.minilm import build_minilm  # noqa: E402

FLOOR = 0.99
TARGET_RATIO = 1.2
CPU = torch.device("cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, help="a plan.json with a mixed-int8 step (default: search here)")
    parser.add_argument("--num-sentences", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    workload = build_minilm(num_sentences=args.num_sentences)
    indices = list(range(len(workload.samples)))
    print(f"minilm: {len(indices)} real sentences, batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}", flush=True)
    bucket = default_config("length-bucketing")
    mixed = dataclasses.replace(default_config("mixed-int8"), min_fidelity=FLOOR)
    if args.plan:
        mixed = next(s for s in Plan.load(args.plan).steps if s.name == "mixed-int8")
    every_linear = dataclasses.replace(mixed, layers=tuple(
        n for n, m in workload.model.named_modules() if type(m) is torch.nn.Linear and n))
    entries = {
        "eager fp32": [],
        "bf16 plan (length-bucketing + bf16)": [bucket, default_config("bf16")],
        "bf16 + compile plan": [bucket, default_config("bf16"), default_config("compile")],
        "int8 dynamic, whole model (torch.ao)": [bucket, default_config("int8-dynamic")],
        "ONNX Runtime int8, whole model": [bucket, default_config("onnxruntime-int8")],
        "per-row int8, whole model (compiled)": [bucket, every_linear],
        "mixed-int8 plan (length-bucketing + mixed-int8)": [bucket, mixed],
    }
    runners, fidelity, reports = {}, {}, []
    reference = None
    for label, steps in entries.items():
        start = time.perf_counter()
        report: list[dict] = []
        model, policy = build(workload, steps, CPU, report)
        runner = Runner(model, workload, device=CPU, batch_size=args.batch_size, indices=indices, policy=policy)
        out = runner.warm_up()
        if reference is None:
            reference = out
        fidelity[label] = workload.fidelity(out, reference)["min_cosine"]
        runners[label] = runner
        if label.startswith("mixed"):
            reports = report
        print(f"  built {label} in {time.perf_counter() - start:.0f} s (warm-up {runner.warmup_s:.1f} s), "
              f"min cosine {fidelity[label]:.5f}", flush=True)

    order = list(runners)
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        for label in order:
            runners[label].timed_pass()
        print(f"  round {r + 1}/{args.rounds} done", flush=True)

    rate = {k: [len(indices) / s for s in r.pass_s] for k, r in runners.items()}
    median = {k: statistics.median(v) for k, v in rate.items()}
    base = median["eager fp32"]
    print("\n| entry | sentences/s median [min, max] | vs eager fp32 | min cosine |")
    print("|---|---:|---:|---:|")
    for label in entries:
        print(f"| {label} | {median[label]:.1f} [{min(rate[label]):.1f}, {max(rate[label]):.1f}] | "
              f"{median[label] / base:.2f}× | {fidelity[label]:.5f} |")
    if reports:
        print("\n" + get_technique("mixed-int8").describe_report(reports[0], "min_cosine").replace("\n    ", "\n"))
    bf16 = max((k for k in entries if k.startswith("bf16")), key=median.get)
    label = "mixed-int8 plan (length-bucketing + mixed-int8)"
    ratio = median[label] / median[bf16]
    low = min(rate[label]) / max(rate[bf16])
    met = fidelity[label] >= FLOOR and ratio >= TARGET_RATIO
    print(f"\nmixed-int8 plan vs the faster bf16 plan ({bf16}): {ratio:.2f}× median (worst pass vs best: {low:.2f}×), "
          f"min cosine {fidelity[label]:.5f} (targets ≥ {TARGET_RATIO}× and ≥ {FLOOR}): {'MET' if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
