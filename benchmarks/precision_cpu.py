"""Precision on the CPU: searched mixed-int8 plans against the bf16 plans and whole-model int8, in one run per workload.

MiniLM entries, all on the same real sentences at the same batch size, length-bucketed (the plans'
batching), timed in interleaved rounds (each round one pass of every entry, in a shuffled order):
  eager fp32 · bf16 plan (length-bucketing + bf16) · bf16 + compile plan · whole-model int8 dynamic
  (torch.ao, per-tensor activations) · whole-model ONNX Runtime int8 (dynamic, per channel) ·
  whole-model per-row int8 (every Linear, compiled) · the mixed-int8 plan (length-bucketing +
  mixed-int8, searched on 128 training sentences, or the one in --plan).
Min cosine is against eager fp32 on every evaluation sentence. The per-layer table is the search's.

digits-cnn entries (the 360 held-out digits, batch 256): eager fp32 · the bf16 plan optimize keeps there
(bf16 + channels-last + compile) · mixed-int8-static (PT2E, searched on 128 training digits).

Targets (issue 18): the MiniLM mixed-int8 plan keeps min cosine ≥ 0.99 and is ≥ 1.2× the samples/s of
the faster bf16 plan; the digits-cnn mixed plan loses ≤ 0.5 accuracy points and is faster than its bf16 plan.

    .venv/bin/python benchmarks/precision_cpu.py [--plan out/minilm/plan.json] [--num-sentences 1024] [--rounds 5]
        [--workloads minilm,digits-cnn]
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
from overdrive.tuning.plan import Plan  # noqa: E402
from overdrive.techniques.compose import build
from overdrive.workloads.minilm import build_minilm  # noqa: E402

FLOOR = 0.99
TARGET_RATIO = 1.2
CPU = torch.device("cpu")


def measure_entries(workload, entries: dict[str, list], *, batch_size: int, rounds: int, search_label: str):
    """Build every entry, warm it up (outputs judged against the first entry's), then `rounds` interleaved rounds of
    one timed pass each in a shuffled order. Returns ({label: [rows/s per pass]}, {label: fidelity}, the search report)."""
    indices = list(range(len(workload.samples)))
    runners, fidelity, search_report = {}, {}, None
    reference = None
    for label, steps in entries.items():
        start = time.perf_counter()
        reports: list[dict] = []
        model, policy = build(workload, steps, CPU, reports)
        runner = Runner(model, workload, device=CPU, batch_size=batch_size, indices=indices, policy=policy)
        out = runner.warm_up()
        if reference is None:
            reference = out
        figures = workload.fidelity(out, reference)
        if workload.has_task_metric:
            figures.update(workload.task_metric(out, indices))
        fidelity[label] = figures
        runners[label] = runner
        if label == search_label and reports:
            search_report = reports[-1]
        shown = ", ".join(f"{k} {v:.5f}" for k, v in figures.items() if k in (workload.fidelity_key, "accuracy_pct"))
        print(f"  built {label} in {time.perf_counter() - start:.0f} s (warm-up {runner.warmup_s:.1f} s), {shown}", flush=True)
    order = list(runners)
    rng = random.Random(0)
    for r in range(rounds):
        rng.shuffle(order)
        for label in order:
            runners[label].timed_pass()
        print(f"  round {r + 1}/{rounds} done", flush=True)
    rate = {k: [len(indices) / s for s in r.pass_s] for k, r in runners.items()}
    return rate, fidelity, search_report


def table(entries, rate, fidelity, key: str, extra: str | None = None) -> dict[str, float]:
    median = {k: statistics.median(v) for k, v in rate.items()}
    base = median[next(iter(entries))]
    head = f"| entry | samples/s median [min, max] | vs eager fp32 | {key} |" + (f" {extra} |" if extra else "")
    print("\n" + head)
    print("|---|---:|---:|---:|" + ("---:|" if extra else ""))
    for label in entries:
        cells = f"| {label} | {median[label]:,.1f} [{min(rate[label]):,.1f}, {max(rate[label]):,.1f}] | " \
                f"{median[label] / base:.2f}× | {fidelity[label][key]:.5f} |"
        if extra:
            cells += f" {fidelity[label][extra]:.2f} |"
        print(cells)
    return median


def verdict(label: str, bf16: list[str], rate, median, fidelity, *, key: str, floor: float, ratio_target: float,
            accuracy_drop: float | None = None) -> None:
    best = max(bf16, key=median.get)
    ratio = median[label] / median[best]
    worst = min(rate[label]) / max(rate[best])
    ok = fidelity[label][key] >= floor and ratio >= ratio_target
    if accuracy_drop is not None:
        drop = fidelity[next(iter(median))]["accuracy_pct"] - fidelity[label]["accuracy_pct"]
        ok = ok and drop <= accuracy_drop
    print(f"\n{label} vs the faster bf16 plan ({best}): {ratio:.2f}× median (its slowest pass vs the bf16 plan's fastest: "
          f"{worst:.2f}×), {key} {fidelity[label][key]:.5f} (targets ≥ {ratio_target}× and ≥ {floor}"
          + (f", accuracy drop ≤ {accuracy_drop} points" if accuracy_drop is not None else "") + f"): {'MET' if ok else 'NOT MET'}")


def minilm(args) -> None:
    workload = build_minilm(num_sentences=args.num_sentences)
    print(f"\n## minilm: {len(workload.samples)} real sentences, batch {args.batch_size}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}", flush=True)
    bucket = default_config("length-bucketing")
    mixed = dataclasses.replace(default_config("mixed-int8"), min_fidelity=FLOOR)
    if args.plan:
        mixed = next(s for s in Plan.load(args.plan).steps if s.name == "mixed-int8")
    every_linear = dataclasses.replace(mixed, layers=tuple(
        n for n, m in workload.model.named_modules() if type(m) is torch.nn.Linear and n))
    label = "mixed-int8 plan (length-bucketing + mixed-int8)"
    entries = {
        "eager fp32": [],
        "bf16 plan (length-bucketing + bf16)": [bucket, default_config("bf16")],
        "bf16 + compile plan": [bucket, default_config("bf16"), default_config("compile")],
        "int8 dynamic, whole model (torch.ao)": [bucket, default_config("int8-dynamic")],
        "ONNX Runtime int8, whole model": [bucket, default_config("onnxruntime-int8")],
        "per-row int8, whole model (compiled)": [bucket, every_linear],
        label: [bucket, mixed],
    }
    rate, fidelity, report = measure_entries(workload, entries, batch_size=args.batch_size, rounds=args.rounds,
                                             search_label=label)
    median = table(entries, rate, fidelity, "min_cosine")
    if report:
        print("\n" + get_technique("mixed-int8").describe_report(report, "min_cosine").replace("\n    ", "\n"))
    verdict(label, [k for k in entries if k.startswith("bf16")], rate, median, fidelity, key="min_cosine", floor=FLOOR,
            ratio_target=TARGET_RATIO)


def digits(args) -> None:
    from overdrive.workloads import create_workload

    workload = create_workload("digits-cnn")
    batch = 256
    print(f"\n## digits-cnn: {len(workload.samples)} held-out digits, batch {batch}, torch {torch.__version__}", flush=True)
    label = "mixed-int8-static plan"
    entries = {
        "eager fp32": [],
        "bf16 plan (bf16 + channels-last + compile)": [default_config("bf16"), default_config("channels-last"),
                                                       default_config("compile")],
        label: [dataclasses.replace(default_config("mixed-int8-static"), min_fidelity=FLOOR)],
    }
    rate, fidelity, report = measure_entries(workload, entries, batch_size=batch, rounds=args.rounds * 4,
                                             search_label=label)
    median = table(entries, rate, fidelity, "top1_agreement", extra="accuracy_pct")
    if report:
        print("\n" + get_technique("mixed-int8-static").describe_report(report, "top1_agreement").replace("\n    ", "\n"))
    verdict(label, [k for k in entries if k.startswith("bf16")], rate, median, fidelity, key="top1_agreement",
            floor=FLOOR, ratio_target=1.0, accuracy_drop=0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", type=Path, help="a minilm plan.json with a mixed-int8 step (default: search here)")
    parser.add_argument("--num-sentences", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default="minilm,digits-cnn")
    args = parser.parse_args()
    for name in args.workloads.split(","):
        {"minilm": minilm, "digits-cnn": digits}[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
