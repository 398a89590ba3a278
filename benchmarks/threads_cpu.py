"""Why the main thread of `serve` and `run` keeps one intra-op thread (`devices.serial_main_thread`).

One MiniLM bf16 call on one real sentence, 2 intra-op threads, median of 200 calls, in three set-ups,
each in a fresh process (libgomp's thread teams live as long as the process):

- main: the main thread loads the model and calls it;
- worker, main had N: the main thread loads the model with N threads, a worker thread calls it with N;
- worker, main kept 1: `serial_main_thread()` first, then the same.

Repeated `--repeats` times, interleaved; prints each median (ms per call) and the ratio to "main".

    .venv/bin/python benchmarks/threads_cpu.py [--repeats 3] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, os, statistics, sys, threading, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from overdrive.core.devices import serial_main_thread
from overdrive.techniques.compose import build
from overdrive.techniques import default_config
from overdrive.workloads.minilm import build_minilm

mode, calls = sys.argv[1], int(sys.argv[2])
threads = torch.get_num_threads()
if mode == "worker-kept-1":
    serial_main_thread()
workload = build_minilm(num_sentences=8)
model, _ = build(workload, [default_config("bf16")], torch.device("cpu"))
inputs = workload.collate([workload.samples[0]])
times = []

def work():
    torch.set_num_threads(threads)
    with torch.inference_mode():
        for i in range(calls + 20):
            start = time.perf_counter()
            model(*inputs)
            if i >= 20:
                times.append(time.perf_counter() - start)

if mode == "main":
    work()
else:
    with torch.inference_mode():
        model(*inputs)  # the main thread runs parallel regions first, as the server's loading and warm-up did
    t = threading.Thread(target=work)
    t.start()
    t.join()
print(json.dumps({"mode": mode, "threads": threads, "median_ms": 1e3 * statistics.median(times)}))
"""

MODES = ("main", "worker-main-had-n", "worker-kept-1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved, so drift on a shared machine touches every set-up alike
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.calls)], capture_output=True, text=True,
                                 check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            record = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(record["median_ms"])
    base = statistics.median(results["main"])
    print(f"MiniLM bf16, one sentence per call, {record['threads']} intra-op threads, median of {args.calls} calls per run")
    print("| set-up | ms per call (each run) | median | vs main |")
    print("|---|---|---:|---:|")
    for mode in MODES:
        runs = ", ".join(f"{v:.1f}" for v in results[mode])
        print(f"| {mode} | {runs} | {statistics.median(results[mode]):.1f} | {statistics.median(results[mode]) / base:.2f}× |")


if __name__ == "__main__":
    main()
