"""Serving on a CPU, in one run: overdrive's dynamic batching against batching off and LitServe.

Each server runs in its own process on loopback and is driven by a closed-loop load generator
(this process, aiohttp): C clients each send one request (one real sentence, or one digits
image), wait for the answer, and send the next, at C = 1, 8, 32 and 64. Three set-ups on the
same model with the same batch settings:

1. overdrive serve, dynamic batching (`--max-batch-size B --max-queue-delay-ms D`);
2. overdrive serve, batching off (`--max-batch-size 1`);
3. LitServe 0.2 with its own batching (`max_batch_size=B, batch_timeout=D`), `litserve_app.py`.

Requests are JSON on every set-up (Open Inference Protocol JSON tensors for overdrive, LitServe's
own JSON for LitServe). Targets (issue 4), at C = 32: dynamic batching ≥ 3× the requests/s of
batching off at a lower p99, and ≥ LitServe's requests/s at no worse p99.

After each model's three set-ups it prints the compute ceiling: model time per row alone
against per row in batches of the size the batcher formed at C = 32 (same length buckets, same
threads per instance, no server): no batcher can beat that ratio by more than what it also saves
in per-request server work.

The models are the workloads' eager fp32 ones; MiniLM is also measured served from a plan with
bf16 autocast (what `optimize` keeps on a CPU with AVX512-BF16), the three set-ups again on that
same model (LitServe builds it from the same plan.json).

    .venv/bin/python benchmarks/serve_cpu.py [--only minilm|digits-cnn] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import torch

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 8, 32, 64)
SETTINGS = {"minilm": {"batch": 32, "delay_ms": 2.0}, "digits-cnn": {"batch": 64, "delay_ms": 2.0}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_bodies(workload: str) -> tuple[list[bytes], list[bytes]]:
    """(overdrive bodies, LitServe bodies), one per real sample."""
    if workload == "minilm":
        from overdrive.workloads.sentences import python_doc_sentences

        texts = list(python_doc_sentences()[:2048])
        oip = [{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [t]}]} for t in texts]
        lit = [{"text": t} for t in texts]
    else:
        from overdrive.workloads import create_workload

        images = create_workload(workload).samples
        oip = [{"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, *x.shape], "data": x.reshape(-1).tolist()}]}
               for x in images]
        lit = [{"input": x.tolist()} for x in images]
    return [json.dumps(b).encode() for b in oip], [json.dumps(b).encode() for b in lit]


class Server:
    """A server subprocess; `url` is where to POST one request, `ready` where to poll."""

    def __init__(self, kind: str, workload: str, batch: int, delay_ms: float, plan: Path | None = None,
                 instances: int = 1):
        self.port = free_port()
        base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "src")}
        if kind == "litserve":
            cmd = [sys.executable, str(ROOT / "benchmarks" / "litserve_app.py"), workload, "--port", str(self.port),
                   "--max-batch-size", str(batch), "--batch-timeout-ms", str(delay_ms), "--workers", str(instances)] \
                + (["--plan", str(plan)] if plan else [])
            self.url, self.ready = f"{base}/predict", f"{base}/health"
        else:
            cmd = [sys.executable, "-m", "overdrive", "serve", str(plan or workload), "--device", "cpu", "--port", str(self.port),
                   "--max-batch-size", str(batch), "--max-queue-delay-ms", str(delay_ms), "--max-queue-size", "4096",
                   "--instances", str(instances)]
            self.url, self.ready = f"{base}/v2/models/{workload}/infer", f"{base}/v2/health/ready"
        self.metrics = f"{base}/metrics" if kind == "overdrive" else None
        self.log = open(f"/tmp/serve_cpu_{kind}_{self.port}.log", "w")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    async def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
                try:
                    async with session.get(self.ready) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s} s; see {self.log.name}")

    def stop(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, sig)  # the group: LitServe runs its workers as child processes
                self.proc.wait(timeout=wait_s)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


async def batch_stats(session: aiohttp.ClientSession, url: str | None) -> tuple[float, float]:
    """(sum, count) of overdrive's batch-size histogram, for the mean rows per batch."""
    if url is None:
        return 0.0, 0.0
    async with session.get(url) as r:
        text = await r.text()
    get = lambda name: sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))  # noqa: E731
    return get("overdrive_batch_size_sum"), get("overdrive_batch_size_count")


async def closed_loop(server: Server, bodies: list[bytes], concurrency: int, seconds: float, warmup_s: float) -> dict:
    latencies: list[float] = []
    errors = 0
    counter = iter(range(10**9))
    start = time.monotonic()
    measure_from, end = start + warmup_s, start + warmup_s + seconds
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client():
            nonlocal errors
            while (now := time.monotonic()) < end:
                body = bodies[next(counter) % len(bodies)]
                try:
                    async with session.post(server.url, data=body, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                done = time.monotonic()
                if now >= measure_from and done <= end:
                    if ok:
                        latencies.append(done - now)
                    else:
                        errors += 1

        await client_warm(session, server, bodies)
        before = await batch_stats(session, server.metrics)
        await asyncio.gather(*(client() for _ in range(concurrency)))
        after = await batch_stats(session, server.metrics)
    latencies.sort()
    pick = lambda q: 1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")  # noqa: E731
    batches = after[1] - before[1]
    return {"concurrency": concurrency, "requests_per_s": len(latencies) / seconds, "p50_ms": pick(0.50),
            "p99_ms": pick(0.99), "errors": errors, "completed": len(latencies),
            "mean_batch_rows": (after[0] - before[0]) / batches if batches else None}


async def client_warm(session, server: Server, bodies: list[bytes]) -> None:
    for body in bodies[:4]:
        async with session.post(server.url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                raise RuntimeError(f"warm-up request failed with {r.status}: {await r.text()}")


def bf16_plan(workload: str) -> Path:
    from overdrive.techniques import default_config
    from overdrive.tuning.plan import Plan

    path = ROOT / "out" / "serve_cpu" / f"{workload}-bf16" / "plan.json"
    Plan(workload=workload, device="cpu", batch_size=SETTINGS[workload]["batch"], steps=[default_config("bf16")]).save(path)
    return path


def bench_workload(workload: str, seconds: float, plan: Path | None = None, instances: int = 1) -> dict:
    settings = SETTINGS[workload]
    oip, lit = request_bodies(workload)
    setups = [("overdrive, dynamic batching", "overdrive", settings["batch"], oip),
              ("overdrive, batching off", "overdrive", 1, oip),
              ("LitServe, its batching", "litserve", settings["batch"], lit)]
    results = {}
    for label, kind, batch, bodies in setups:
        server = Server(kind, workload, batch, settings["delay_ms"], plan, instances)
        try:
            asyncio.run(server.wait_ready())
            results[label] = [asyncio.run(closed_loop(server, bodies, c, seconds, warmup_s=1.5)) for c in CONCURRENCY]
        finally:
            server.stop()
        for r in results[label]:
            print(f"  {workload + (' bf16' if plan else ''):15s} {label:28s} C={r['concurrency']:3d}  {r['requests_per_s']:8.1f} req/s  "
                  f"p50 {r['p50_ms']:8.1f} ms  p99 {r['p99_ms']:8.1f} ms  errors {r['errors']}"
                  + (f"  mean batch {r['mean_batch_rows']:.1f} rows" if r["mean_batch_rows"] else ""), flush=True)
    return results


def compute_ceiling(workload: str, plan: Path | None, instances: int, rows: int, samples: int = 128) -> dict:
    """The most any batcher can buy on this model and machine: model time per row at batch 1
    against per row in batches of `rows` rows cut within the batcher's length buckets, timed in
    this process with the threads one server instance gets (no HTTP, no queue).

    Returns {"rows", "single_ms_per_row", "batched_ms_per_row", "ceiling"}.
    """
    import random

    from overdrive.serve.batcher import length_bucket
    from overdrive.tuning.plan import Plan, build
    from overdrive.workloads import create_workload

    w = create_workload(workload)
    model = Plan.load(plan).build(w, torch.device("cpu"))[0] if plan else build(w, [], torch.device("cpu"))[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // instances))
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


def verdict(workload: str, results: dict) -> bool:
    at = {label: next(r for r in rows if r["concurrency"] == 32) for label, rows in results.items()}
    dyn, off, lit = at["overdrive, dynamic batching"], at["overdrive, batching off"], at["LitServe, its batching"]
    vs_off = dyn["requests_per_s"] / off["requests_per_s"]
    vs_lit = dyn["requests_per_s"] / lit["requests_per_s"]
    ok_off = vs_off >= 3.0 and dyn["p99_ms"] < off["p99_ms"]
    ok_lit = vs_lit >= 1.0 and dyn["p99_ms"] <= lit["p99_ms"]
    print(f"{workload} at C=32: dynamic batching {vs_off:.2f}× batching off (p99 {dyn['p99_ms']:.1f} vs {off['p99_ms']:.1f} ms) "
          f"→ {'met' if ok_off else 'NOT met'}; {vs_lit:.2f}× LitServe (p99 {dyn['p99_ms']:.1f} vs {lit['p99_ms']:.1f} ms) "
          f"→ {'met' if ok_lit else 'NOT met'}")
    return ok_off and ok_lit


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(SETTINGS))
    parser.add_argument("--instances", type=int, default=1,
                        help="model instances (overdrive --instances; LitServe workers per device), cores split evenly")
    parser.add_argument("--fp32-only", action="store_true", help="skip MiniLM served from the bf16 plan")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per concurrency level (default 8)")
    args = parser.parse_args()
    print(f"serve_cpu: torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    met = True
    all_results = {}
    runs = [(w, None) for w in ([args.only] if args.only else list(SETTINGS))]
    if "minilm" in dict(runs) and not args.fp32_only:
        runs.append(("minilm", bf16_plan("minilm")))
    for workload, plan in runs:
        key = workload + (" (bf16 plan)" if plan else " (eager fp32)")
        all_results[key] = results = bench_workload(workload, args.seconds, plan, args.instances)
        met &= verdict(key, results)
        dynamic = next(r for r in results["overdrive, dynamic batching"] if r["concurrency"] == 32)
        results["compute ceiling"] = c = compute_ceiling(workload, plan, args.instances, round(dynamic["mean_batch_rows"]))
        print(f"{key} compute ceiling: {c['single_ms_per_row']:.2f} ms per row alone, {c['batched_ms_per_row']:.2f} ms per row "
              f"in batches of {c['rows']} (one length bucket) → batching can buy at most {c['ceiling']:.2f}× here", flush=True)
    out = ROOT / "out" / ("serve_cpu.json" if args.instances == 1 else f"serve_cpu_instances{args.instances}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(all_results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
