"""remove-padding on MiniLM, 2,048 real sentences at batch 32: with and without it, side by side.

Four batching/precision set-ups, each measured with and without `remove-padding`, in one run
(same sentences, same protocol as `overdrive.core.measure`: a warm-up pass, then a timed pass):
input order (batches pad to their longest sentence) and length-bucketed (sorted, little
padding left), in fp32 and bf16 autocast. Prints sentences/s, the ratio that remove-padding
bought, the padding fraction of the batches, and the min cosine against eager fp32.

    .venv/bin/python benchmarks/remove_padding_cpu.py [--num-sentences 2048] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from overdrive.core.measure import measure  # noqa: E402
from overdrive.techniques import default_config  # noqa: E402
from overdrive.techniques.compose import build
from overdrive.workloads.minilm import build_minilm  # noqa: E402

CPU = torch.device("cpu")


def padding_fraction(workload, indices: list[int], batch_size: int, policy) -> float:
    """Pad tokens / all tokens over the batches `measure` cuts with `policy`."""
    order = [indices[p] for p in policy.order(workload, indices)]
    pads = total = 0
    for start in range(0, len(order), batch_size):
        lengths = [workload.sample_length(workload.samples[i]) for i in order[start:start + batch_size]]
        pads += len(lengths) * max(lengths) - sum(lengths)
        total += len(lengths) * max(lengths)
    return pads / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-sentences", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    workload = build_minilm(num_sentences=args.num_sentences)
    indices = list(range(len(workload.samples)))
    bs = args.batch_size
    print(f"remove_padding_cpu: {len(indices)} real sentences, batch {bs}, {torch.get_num_threads()} threads, torch {torch.__version__}")

    reference = None
    rows = []
    for base in ([], ["bf16"], ["length-bucketing"], ["length-bucketing", "bf16"]):
        pair = []
        for steps in (base, [*base, "remove-padding"]):
            model, policy = build(workload, [default_config(s) for s in steps], CPU)
            m, out = measure(model, workload, device=CPU, batch_size=bs, indices=indices, policy=policy,
                             reference=reference, min_timed_calls=len(indices) // bs, max_timed_s=120)
            if reference is None:
                reference, m.fidelity = out, workload.fidelity(out, out)
            label = " + ".join(steps) or "eager fp32"
            pair.append(m)
            print(f"  {label}: {m.samples_per_s:.1f} sentences/s, min cosine {m.fidelity['min_cosine']:.5f}", flush=True)
        rows.append((" + ".join(base) or "eager fp32", padding_fraction(workload, indices, bs, policy), *pair))

    print("\n| set-up | pad tokens | without, sentences/s | with remove-padding | ratio | min cosine with |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, pad, without, with_ in rows:
        print(f"| {label} | {pad:.0%} | {without.samples_per_s:.1f} | {with_.samples_per_s:.1f} "
              f"| {with_.samples_per_s / without.samples_per_s:.2f}× | {with_.fidelity['min_cosine']:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
