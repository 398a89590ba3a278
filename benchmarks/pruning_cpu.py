"""Pruning on a CPU, in one run: each pruned model against its unpruned self, side by side.

1. digits-cnn, 50% of the channels (prune-channels, L2 magnitude, widths rounded to 8), at
   batch 256 on the 360 held-out images: latency ratio, and test accuracy before, right after
   pruning and after the recovery fine-tune (cross-entropy on the 1,437 training images).
   Target (issue 3): ≥ 1.6× faster with accuracy within 1 point of the unpruned model.
2. minilm, a third of the attention heads (12 → 8 per layer) and of the FFN width
   (1536 → 1024), at batch 32 on the real evaluation sentences in input order: latency ratio,
   and min / mean cosine to the unpruned fp32 embeddings after distillation (toward the
   unpruned model, on standard-library docstring sentences, disjoint from the evaluation ones).
   Target: ≥ 1.3× faster with mean cosine ≥ 0.97.

Both sides run eager fp32 with the same measurement protocol (`overdrive.core.measure`); the unpruned
model is measured before and after the pruned one and the faster of its two runs is the one
compared with, so drift cannot flatter pruning.

    .venv/bin/python benchmarks/pruning_cpu.py [--only digits|minilm] [--finetune-steps N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.core.measure import Measurement, measure  # noqa: E402
from overdrive.techniques import (
    describe_report,  # noqa: E402
    get_technique,  # noqa: E402
)
from overdrive.techniques.compose import build
from overdrive.workloads import create_workload  # noqa: E402

CPU = torch.device("cpu")


def run(workload, steps, *, batch_size, indices, reference=None, reports=None) -> tuple[Measurement, torch.Tensor]:
    model, policy = build(workload, steps, CPU, reports)
    return measure(model, workload, device=CPU, batch_size=batch_size, indices=indices, policy=policy, reference=reference,
                   min_timed_calls=max(10, len(indices) // batch_size), min_timed_s=5.0, max_timed_s=90.0)


def compare(workload, steps, *, batch_size, indices) -> dict:
    """Unpruned, pruned, unpruned again; figures against the faster unpruned run."""
    first, reference = run(workload, [], batch_size=batch_size, indices=indices)
    reports: list[dict] = []
    t0 = time.perf_counter()
    pruned, _ = run(workload, steps, batch_size=batch_size, indices=indices, reference=reference, reports=reports)
    build_s = time.perf_counter() - t0
    second, _ = run(workload, [], batch_size=batch_size, indices=indices)
    base = first if first.samples_per_s >= second.samples_per_s else second
    return {"base": base, "pruned": pruned, "reports": reports, "seconds": build_s,
            "ratio": pruned.samples_per_s / base.samples_per_s}


def digits(finetune_steps: int) -> bool:
    workload = create_workload("digits-cnn")
    config = get_technique("prune-channels").config_cls(ratio=0.5, finetune_steps=finetune_steps)
    r = compare(workload, [config], batch_size=256,
                indices=list(range(len(workload.samples))))
    (report,) = r["reports"]
    before = report["before"]["accuracy_pct"]
    after = report["final"]["accuracy_pct"]  # the kept weights: after recovery, or before it when it hurt
    print("\n## digits-cnn, prune-channels 50%, batch 256, 360 held-out images")
    print(f"  unpruned: {r['base'].samples_per_s:,.0f} images/s (p50 {r['base'].latency_ms['p50']:.2f} ms)")
    print(f"  pruned:   {r['pruned'].samples_per_s:,.0f} images/s (p50 {r['pruned'].latency_ms['p50']:.2f} ms)")
    print(f"  {describe_report(report, workload.fidelity_key)}")
    met = r["ratio"] >= 1.6 and before - after <= 1.0
    print(f"  → {r['ratio']:.2f}× faster; accuracy {before:.2f}% → {report['after_pruning']['accuracy_pct']:.2f}% "
          f"(pruned) → {after:.2f}% (recovered); target ≥ 1.6× within 1 pt: {'met' if met else 'NOT met'}")
    return met


def minilm(finetune_steps: int, num_sentences: int) -> bool:
    workload = create_workload("minilm")
    steps = [get_technique(name).config_cls(finetune_steps=finetune_steps)
             for name in ("prune-heads", "prune-ffn")]
    indices = list(range(min(num_sentences, len(workload.samples))))
    r = compare(workload, steps, batch_size=32, indices=indices)
    fidelity = r["pruned"].fidelity
    print(f"\n## minilm, prune-heads 1/3 + prune-ffn 1/3, batch 32, {len(indices)} real sentences in input order")
    print(f"  unpruned: {r['base'].samples_per_s:,.1f} sentences/s (p50 {r['base'].latency_ms['p50']:.1f} ms)")
    print(f"  pruned:   {r['pruned'].samples_per_s:,.1f} sentences/s (p50 {r['pruned'].latency_ms['p50']:.1f} ms)")
    for report in r["reports"]:
        print(f"  {describe_report(report, workload.fidelity_key)}")
    met = r["ratio"] >= 1.3 and fidelity["mean_cosine"] >= 0.97
    print(f"  → {r['ratio']:.2f}× faster; on all {len(indices)} sentences: min cosine {fidelity['min_cosine']:.4f}, "
          f"mean cosine {fidelity['mean_cosine']:.4f}, top-10 neighbours {fidelity.get('top10_agreement', float('nan')):.3f}; "
          f"target ≥ 1.3× with mean cosine ≥ 0.97: {'met' if met else 'NOT met'}  (pruning + recovery took {r['seconds']:.0f} s)")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["digits", "minilm"])
    parser.add_argument("--finetune-steps", type=int, default=300)
    parser.add_argument("--num-sentences", type=int, default=2048)
    args = parser.parse_args()
    print(f"pruning_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    met = []
    if args.only in (None, "digits"):
        met.append(digits(args.finetune_steps))
    if args.only in (None, "minilm"):
        met.append(minilm(args.finetune_steps, args.num_sentences))
    return 0 if all(met) else 1


if __name__ == "__main__":
    raise SystemExit(main())
