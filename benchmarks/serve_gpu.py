"""Serving on a CUDA GPU (`make gpu-check ONLY=serve`): resnet50 from a bf16 plan, dynamic
(adaptive) batching against batching off, at 1, 32 and 128 closed-loop clients.

Requests are HTTP with the binary tensor data extension (one 3×224×224 FP32 image each, 602 KB;
JSON would measure the parser), answers binary too; the load generator is its own process on
half the cores, the server on the other half (`serve_load.py`). Target (issue 20): at 32
clients, adaptive batching ≥ 3× the requests/s of batching off. Weights are random (speed only).

    python3 benchmarks/serve_gpu.py [--seconds S] [--out DIR]
    .venv/bin/python benchmarks/serve_gpu.py --device cpu --workload resnet18 --fp32 --batch 8 --seconds 1  # a smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Server, core_split, http_body, measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 32, 128)
BATCH = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per level (default 5)")
    parser.add_argument("--out", default=str(ROOT / "out"), help="where serve_gpu.json goes")
    parser.add_argument("--device", default="cuda", help="cuda (the check), or cpu for a smoke run of the script")
    parser.add_argument("--workload", default="resnet50")
    parser.add_argument("--fp32", action="store_true", help="serve the model without the bf16 step (smoke runs)")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"max batch size (default {BATCH})")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("serve_gpu: no CUDA GPU here; nothing measured")
        return 2
    from overdrive.techniques import default_config
    from overdrive.tuning.plan import Plan

    out = Path(args.out)
    plan = out / "serve_gpu" / f"{args.workload}-{'fp32' if args.fp32 else 'bf16'}" / "plan.json"
    Plan(workload=args.workload, device=args.device, batch_size=args.batch,
         steps=[] if args.fp32 else [default_config("bf16")]).save(plan)
    rng = np.random.default_rng(0)
    bodies = [http_body([("input", rng.standard_normal((1, 3, 224, 224), dtype=np.float32))], binary=True)
              for _ in range(16)]
    server_cores, load_cores = core_split()
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"serve_gpu: torch {torch.__version__}, {device_name}, server cores {sorted(server_cores or [])}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results = {}
    for label, flags in [("adaptive batching", ["--max-batch-size", str(args.batch)]),
                         ("batching off", ["--max-batch-size", "1"])]:
        server = Server("overdrive", str(plan), args.workload, device=args.device, cores=server_cores,
                        flags=[*flags, "--max-queue-size", "4096", "--warmup-s", "60"])
        try:
            server.wait_ready(timeout_s=180)
            results[label] = []
            for c in CONCURRENCY:
                r = measure(server, bodies, protocol="http", concurrency=c, seconds=args.seconds, cores=load_cores)
                results[label].append(r)
                print(f"  {args.workload} {'fp32' if args.fp32 else 'bf16'}  {label:18s} C={c:3d}  {r['requests_per_s']:8.1f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                      f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}"
                      + (f"  mean batch {r['mean_batch_rows']:.1f} rows" if r["mean_batch_rows"] else ""), flush=True)
        finally:
            server.stop()
    at = lambda label: next(r for r in results[label] if r["concurrency"] == 32)  # noqa: E731
    off = at("batching off")["requests_per_s"]
    gain = at("adaptive batching")["requests_per_s"] / off if off else float("nan")  # nothing answered in the window
    met = gain >= 3.0
    print(f"{args.workload} {'fp32' if args.fp32 else 'bf16'} at C=32: adaptive batching {gain:.2f}× batching off → {'met' if met else 'NOT met'} (target ≥ 3×)")
    (out / "serve_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
