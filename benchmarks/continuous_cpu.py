"""Continuous batching against static batching and one prompt at a time, side by side in one run (the CPU).

What `overdrive run` of a generation plan does with a file of prompts whose answers differ in length: the same
real prompts (the workload's held-out ones, recycled to `--requests`), greedy, each request with its own answer
length drawn once (seeded) from `--min-new`..`--max-new` and no stop token (so every entry produces exactly the
same tokens), the same maximum batch for the batched entries:

- one-at-a-time: `Generator(max_batch_size=1)`, each prompt alone;
- static: `Generator(max_batch_size=B)`, prompts in batches of B in input order, each batch decoding until its
  longest answer ends (rows that ended ride along);
- continuous: `ContinuousGenerator(max_batch_size=B)`, a paged KV cache in blocks of 16, a request joining as soon
  as one ends.

Every entry is built from the same decoder with the decode step compiled (or eager: `--eager`), warmed up, then
timed in `--repeats` interleaved rounds; the figure is new tokens / wall seconds, median and range; each entry's
tokens are checked against one-at-a-time's (greedy: they must be equal, batch-invariance). The continuous entry
also reports its KV waste (slots held but empty) and its peak running batch.

    .venv/bin/python benchmarks/continuous_cpu.py [--workload pydoc-lm|llama-125m-random] [--batch-size 8]
        [--requests 32] [--min-new 8] [--max-new 96] [--repeats 3] [--eager]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="pydoc-lm")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="leave the decode step eager")
    args = parser.parse_args()

    from overdrive.generate import Decoder, Generator, SamplingParams
    from overdrive.generate.continuous import ContinuousGenerator
    from overdrive.workloads.generation import create_generation_workload

    workload = create_generation_workload(args.workload, num_prompts=args.requests)
    decoder = Decoder.from_hf(workload.model)
    prompts = [workload.prompts[i % len(workload.prompts)] for i in range(args.requests)]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_new, args.max_new + 1, (args.requests,), generator=g).tolist()
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    compile_ = not args.eager
    b = args.batch_size
    entries = {
        "one-at-a-time": Generator(decoder, workload.tokenizer, max_batch_size=1, compile=compile_),
        "static": Generator(decoder, workload.tokenizer, max_batch_size=b, compile=compile_),
        "continuous": ContinuousGenerator(decoder, workload.tokenizer, max_batch_size=b, compile=compile_),
    }
    sizes = [len(entries["static"].encode(p)) for p in prompts]
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.workload} ({sum(p.numel() for p in decoder.parameters()) / 1e6:.1f} M "
          f"parameters), {args.requests} prompts of {min(sizes)}–{max(sizes)} tokens, answers of {min(lengths)}–{max(lengths)} "
          f"tokens ({sum(lengths)} in all), batch {b}, decode step {'eager' if args.eager else 'compiled'}", flush=True)
    for name, gen in entries.items():  # warm-up: every compiled shape a timed run will meet
        started = time.perf_counter()
        gen.generate(prompts, params)
        print(f"  warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in entries}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        for name, gen in entries.items():
            started = time.perf_counter()
            out = gen.generate(prompts, params)
            wall = time.perf_counter() - started
            rates[name].append(sum(len(c.token_ids) for c in out) / wall)
            tokens[name] = [c.token_ids for c in out]
    reference = tokens["one-at-a-time"]
    print(f"\n{'entry':<16}{'tokens/s (median)':>20}{'range':>20}{'vs one-at-a-time':>18}{'vs static':>12}  tokens")
    base, static = statistics.median(rates["one-at-a-time"]), statistics.median(rates["static"])
    for name, values in rates.items():
        m = statistics.median(values)
        same = sum(t == r for t, r in zip(tokens[name], reference))
        print(f"{name:<16}{m:>20.1f}{f'{min(values):.1f}–{max(values):.1f}':>20}{m / base:>17.2f}×{m / static:>11.2f}×"
              f"  {same}/{len(reference)} equal one-at-a-time's")
    stats = entries["continuous"].stats
    print(f"\ncontinuous: KV blocks {stats.kv_waste:.1%} empty (slots held but not filled, over its decode steps), "
          f"peak running {stats.peak_running}, {stats.preemptions} preemptions")


if __name__ == "__main__":
    main()
