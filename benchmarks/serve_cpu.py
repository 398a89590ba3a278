"""Serving on a CPU, in one run: overdrive's adaptive batching against batching off, the fixed
queue delay, and LitServe; and gRPC against HTTP.

Each server runs in its own process on loopback and is driven by a closed-loop load generator
in another process (`serve_load.py`; on a machine with more than 2 cores the two are pinned to
separate halves of the cores): C clients each send one request (one real sentence, or one
digits image), wait for the answer, and send the next, at C = 1, 8, 32 and 64. Set-ups on the
same model with the same batch size:

1. overdrive serve, adaptive batching (the default; `--max-batch-size B`), also serving gRPC;
2. overdrive serve, the fixed delay (`--batching fixed --max-queue-delay-ms 2`, Triton's rule);
3. overdrive serve, batching off (`--max-batch-size 1`);
4. LitServe 0.2 with its own batching (`max_batch_size=B, batch_timeout=2 ms`), `litserve_app.py`;
5. gRPC (KServe v2, raw tensor contents) at C = 32 on set-up 1's server, right after its HTTP runs.

HTTP requests are JSON on every set-up (Open Inference Protocol JSON tensors for overdrive, LitServe's
own JSON for LitServe). After each model it prints the compute ceiling: model time per row alone
against per row in batches of the size the batcher formed at C = 32 (same length buckets, same
threads per instance, no server), and the server's share of it: (adaptive ÷ batching off at C = 32)
÷ ceiling. Targets (issue 20): at C = 1, adaptive ≥ 0.9× batching off's requests/s with p50 ≤ 1.2×;
at C = 32, ≥ 0.9 of the ceiling's gain, ≥ 1.5× LitServe, p99 below both; gRPC within 10% of HTTP.

Models: digits-cnn eager fp32 and MiniLM served from a plan with bf16 autocast (what `optimize`
keeps on a CPU with AVX512-BF16; LitServe builds it from the same plan.json); on a CPU without
native bf16 (emulated bf16 ran MiniLM 2.8× slower than fp32 on such a machine), MiniLM eager fp32
instead, as `optimize` would keep it there. `--minilm-fp32` adds MiniLM eager fp32 anyway.

    .venv/bin/python benchmarks/serve_cpu.py [--only minilm|digits-cnn] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Server, core_split, grpc_body, measure, text_http_body  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32, 64)
SETTINGS = {"minilm": {"batch": 32, "delay_ms": 2.0}, "digits-cnn": {"batch": 64, "delay_ms": 2.0}}
ADAPTIVE, FIXED, OFF, LIT, GRPC = ("overdrive, adaptive batching", "overdrive, fixed 2 ms delay", "overdrive, batching off",
                                   "LitServe, its batching", "overdrive, adaptive, gRPC")


def request_bodies(workload: str) -> tuple[list, list, list]:
    """(overdrive HTTP bodies with headers, LitServe bodies with headers, gRPC bodies), one per real sample."""
    import numpy as np

    from serve_load import http_body

    if workload == "minilm":
        from overdrive.files.sentences import python_doc_sentences

        texts = list(python_doc_sentences()[:2048])
        oip = [text_http_body(t) for t in texts]
        lit = [(json.dumps({"text": t}).encode(), {"Content-Type": "application/json"}) for t in texts]
        grpc = [grpc_body(workload, [("text", [t.encode()])]) for t in texts]
    else:
        from overdrive.workloads import create_workload

        images = [x.numpy()[None].astype(np.float32) for x in create_workload(workload).samples]
        oip = [http_body([("input", x)], binary=False) for x in images]
        lit = [(json.dumps({"input": x[0].tolist()}).encode(), {"Content-Type": "application/json"}) for x in images]
        grpc = [grpc_body(workload, [("input", x)]) for x in images]
    return oip, lit, grpc


def bf16_plan(workload: str) -> Path:
    from overdrive.techniques import default_config
    from overdrive.tuning.plan import Plan

    path = ROOT / "out" / "serve_cpu" / f"{workload}-bf16" / "plan.json"
    Plan(workload=workload, device="cpu", batch_size=SETTINGS[workload]["batch"], steps=[default_config("bf16")]).save(path)
    return path


def bench_workload(workload: str, seconds: float, plan: Path | None = None, instances: int = 1) -> dict:
    settings = SETTINGS[workload]
    batch, delay = settings["batch"], settings["delay_ms"]
    oip, lit, grpc = request_bodies(workload)
    server_cores, load_cores = core_split()
    spec = str(plan or workload)
    base = ["--max-queue-size", "4096", "--instances", str(instances)]
    setups = [(ADAPTIVE, "overdrive", ["--max-batch-size", str(batch), *base], oip),
              (FIXED, "overdrive", ["--max-batch-size", str(batch), "--batching", "fixed", "--max-queue-delay-ms", str(delay),
                                    *base], oip),
              (OFF, "overdrive", ["--max-batch-size", "1", *base], oip),
              (LIT, "litserve", [], lit)]
    results = {}
    for label, kind, flags, bodies in setups:
        lit_args = ["--max-batch-size", str(batch), "--batch-timeout-ms", str(delay), "--workers", str(instances)] \
            + (["--plan", str(plan)] if plan else [])
        server = Server(kind, spec, workload, flags=flags, grpc=label == ADAPTIVE, litserve_args=lit_args,
                        cores=server_cores)
        try:
            server.wait_ready()
            results[label] = [measure(server, bodies, protocol="http", concurrency=c, seconds=seconds, cores=load_cores)
                              for c in CONCURRENCY]
            if label == ADAPTIVE:
                results[GRPC] = [measure(server, grpc, protocol="grpc", concurrency=32, seconds=seconds, cores=load_cores)]
        finally:
            server.stop()
        for key in (label, GRPC) if label == ADAPTIVE else (label,):
            for r in results[key]:
                print(f"  {workload + (' bf16' if plan else ''):15s} {key:30s} C={r['concurrency']:3d}  "
                      f"{r['requests_per_s']:8.1f} req/s  p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  "
                      f"errors {r['errors']}" + (f"  mean batch {r['mean_batch_rows']:.1f} rows" if r["mean_batch_rows"] else ""),
                      flush=True)
    return results


def compute_ceiling(workload: str, plan: Path | None, instances: int, rows: int, samples: int = 128) -> dict:
    """The most any batcher can buy on this model and machine: model time per row at batch 1
    against per row in batches of `rows` rows cut within the batcher's length buckets, timed in
    this process with the threads one server instance gets (no HTTP, no queue).

    Returns {"rows", "single_ms_per_row", "batched_ms_per_row", "ceiling"}.
    """
    import random

    from overdrive.serve.batcher import length_bucket
    from overdrive.tuning.plan import Plan
    from overdrive.techniques.compose import build
    from overdrive.workloads import create_workload

    w = create_workload(workload)
    model = Plan.load(plan).build(w, torch.device("cpu"))[0] if plan else build(w, [], torch.device("cpu"))[0]
    threads = torch.get_num_threads()
    # what each server instance has (serve.runner): its cores split between instances
    torch.set_num_threads(max(1, len(core_split()[0] or os.sched_getaffinity(0)) // instances))
    picked = random.Random(0).sample(list(w.samples), samples)
    buckets: dict[int, list] = {}
    for sample in picked:
        buckets.setdefault(length_bucket(w.sample_length(sample)) if w.sample_length else 0, []).append(sample)
    batches = [group[i:i + rows] for group in buckets.values() for i in range(0, len(group), rows)]

    def per_row_ms(groups: list[list]) -> float:
        inputs = [w.collate(g) for g in groups]
        with torch.inference_mode():
            for x in inputs[:2]:
                model(*x)
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for x in inputs:
                    model(*x)
                best = min(best, time.perf_counter() - start)
        return 1e3 * best / samples

    try:
        single, batched = per_row_ms([[x] for x in picked]), per_row_ms(batches)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "single_ms_per_row": single, "batched_ms_per_row": batched, "ceiling": single / batched}


def verdict(workload: str, results: dict, ceiling: float) -> bool:
    """The issue-20 targets, printed with their figures; True when all are met."""
    at = lambda label, c: next(r for r in results[label] if r["concurrency"] == c)  # noqa: E731
    one_a, one_off = at(ADAPTIVE, 1), at(OFF, 1)
    dyn, off, lit, grpc = at(ADAPTIVE, 32), at(OFF, 32), at(LIT, 32), at(GRPC, 32)
    checks = [
        ("C=1 adaptive ≥ 0.9× batching off", one_a["requests_per_s"] / one_off["requests_per_s"], 0.9, True),
        ("C=1 adaptive p50 ≤ 1.2× batching off's", one_a["p50_ms"] / one_off["p50_ms"], 1.2, False),
        ("C=32 gain over batching off ≥ 0.9 of the compute ceiling",
         dyn["requests_per_s"] / off["requests_per_s"] / ceiling, 0.9, True),
        ("C=32 adaptive ≥ 1.5× LitServe", dyn["requests_per_s"] / lit["requests_per_s"], 1.5, True),
        ("C=32 p99 below batching off's", dyn["p99_ms"] / off["p99_ms"], 1.0, False),
        ("C=32 p99 below LitServe's", dyn["p99_ms"] / lit["p99_ms"], 1.0, False),
        ("C=32 gRPC within 10% of HTTP", grpc["requests_per_s"] / dyn["requests_per_s"], 0.9, True),
    ]
    met = True
    for name, value, bar, at_least in checks:
        ok = value >= bar if at_least else value <= bar
        met &= ok
        print(f"{workload}: {name}: {value:.2f} → {'met' if ok else 'NOT met'}")
    print(f"{workload} at C=32: adaptive {dyn['requests_per_s']:.1f} req/s (p99 {dyn['p99_ms']:.1f} ms), batching off "
          f"{off['requests_per_s']:.1f} (p99 {off['p99_ms']:.1f}), fixed delay {at(FIXED, 32)['requests_per_s']:.1f} "
          f"(p99 {at(FIXED, 32)['p99_ms']:.1f}), LitServe {lit['requests_per_s']:.1f} (p99 {lit['p99_ms']:.1f}), gRPC "
          f"{grpc['requests_per_s']:.1f} (p99 {grpc['p99_ms']:.1f})")
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(SETTINGS))
    parser.add_argument("--instances", type=int, default=1,
                        help="model instances (overdrive --instances; LitServe workers per device), cores split evenly")
    parser.add_argument("--minilm-fp32", action="store_true", help="also MiniLM eager fp32")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per concurrency level (default 8)")
    args = parser.parse_args()
    print(f"serve_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    met = True
    all_results = {}
    workloads = [args.only] if args.only else ["digits-cnn", "minilm"]
    from overdrive.core.devices import cpu_has_native_bf16

    bf16 = cpu_has_native_bf16()
    runs = [(w, None) for w in workloads if w != "minilm" or args.minilm_fp32 or not bf16]
    if "minilm" in workloads and bf16:
        runs.append(("minilm", bf16_plan("minilm")))
    elif "minilm" in workloads:
        print("serve_cpu: this CPU has no native bf16 (AVX512-BF16 or AMX): MiniLM is served eager fp32, not from the "
              "bf16 plan, which would run it slower here", flush=True)
    for workload, plan in runs:
        key = workload + (" (bf16 plan)" if plan else " (eager fp32)")
        all_results[key] = results = bench_workload(workload, args.seconds, plan, args.instances)
        dynamic = next(r for r in results[ADAPTIVE] if r["concurrency"] == 32)
        results["compute ceiling"] = c = compute_ceiling(workload, plan, args.instances, round(dynamic["mean_batch_rows"]))
        print(f"{key} compute ceiling: {c['single_ms_per_row']:.2f} ms per row alone, {c['batched_ms_per_row']:.2f} ms per row "
              f"in batches of {c['rows']} (one length bucket) → batching can buy at most {c['ceiling']:.2f}× here", flush=True)
        met &= verdict(key, results, c["ceiling"])
    out = ROOT / "out" / ("serve_cpu.json" if args.instances == 1 else f"serve_cpu_instances{args.instances}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(all_results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
