"""prune-heads and prune-ffn on a torchvision ViT (random weights): parameters, FLOPs and speed.

Builds the `vit_b_16` workload (or another torchvision ViT) and measures, with the protocol of
`overdrive.core.measure` (a warm-up pass, then timed passes), eager fp32, each pruning step
alone and both composed (heads, then FFN), with no recovery fine-tune, interleaved over
`--rounds` rounds (each model once per round, so the machine's drift hits all alike). Prints
parameters, FLOPs per sample (torch.utils.flop_counter; it does not count the attention-score
matmuls inside CPU scaled_dot_product_attention, before or after) and the median samples/s
(with its min–max) and its ratio to eager fp32's median. Random weights: the figures are for
speed only (no fidelity figure is printed).

    .venv/bin/python benchmarks/prune_vit_cpu.py [--model vit_b_16] [--batch-size 8]
        [--num-samples 16] [--ratio 0.333] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from overdrive.core.flops import count_flops_per_sample
from overdrive.core.measure import measure
from overdrive.techniques.pruning.ffn import PruneFFNConfig
from overdrive.techniques.pruning.heads import PruneHeadsConfig
from overdrive.techniques.pruning.recovery import num_parameters
from overdrive.techniques.compose import build
from overdrive.workloads.vision import build_torchvision

CPU = torch.device("cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_b_16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=1 / 3, help="fraction of heads / FFN width removed")
    parser.add_argument("--timed-calls", type=int, default=4, help="at least this many timed calls per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the four models")
    args = parser.parse_args()
    workload = build_torchvision(args.model, num_samples=args.num_samples)
    indices = list(range(len(workload.samples)))
    print(f"prune_vit_cpu: {args.model}, {len(indices)} images, batch {args.batch_size}, ratio {args.ratio:.3f}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    heads = PruneHeadsConfig(ratio=args.ratio, finetune_steps=0)
    ffn = PruneFFNConfig(ratio=args.ratio, finetune_steps=0)
    models = {}
    for label, steps in (("eager fp32", []), ("prune-heads", [heads]), ("prune-ffn", [ffn]),
                         ("prune-heads + prune-ffn", [heads, ffn])):
        start = time.perf_counter()
        models[label] = build(workload, steps, CPU)
        print(f"  built {label} in {time.perf_counter() - start:.1f} s", flush=True)
    speeds: dict[str, list[float]] = {label: [] for label in models}
    for r in range(args.rounds):  # interleaved: every model once per round, so drift hits all alike
        for label, (model, policy) in models.items():
            m, _ = measure(model, workload, device=CPU, batch_size=args.batch_size, indices=indices, policy=policy,
                           min_timed_calls=args.timed_calls, max_timed_s=120)
            speeds[label].append(m.samples_per_s)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in speeds.items()) + " samples/s", flush=True)
    base = statistics.median(speeds["eager fp32"])
    params0 = num_parameters(models["eager fp32"][0])
    flops0 = count_flops_per_sample(models["eager fp32"][0], workload, device=CPU, indices=indices[:args.batch_size])
    print(f"\n{'model':<24} {'params':>12} {'GFLOP/sample':>13} {'samples/s median (min–max)':>28} {'vs eager fp32':>14}")
    for label, (model, _) in models.items():
        params = num_parameters(model)
        flops = count_flops_per_sample(model, workload, device=CPU, indices=indices[:args.batch_size])
        v = speeds[label]
        print(f"{label:<24} {params:>12,} {flops / 1e9:>13.2f} {statistics.median(v):>10.2f} ({min(v):.2f}–{max(v):.2f})"
              f"{statistics.median(v) / base:>14.2f}×   (params {params / params0:.2f}×, FLOPs {flops / flops0:.2f}×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
