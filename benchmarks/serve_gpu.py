"""Serving on a CUDA GPU (`make gpu-check ONLY=serve`): resnet50 from a bf16 plan, dynamic
(adaptive) batching against batching off, at 1, 32 and 128 closed-loop clients.

Requests are HTTP with the binary tensor data extension (one 3×224×224 FP32 image each, 602 KB;
JSON would measure the parser), answers binary too; the load generator is its own process on
half the cores, the server on the other half (`serve_load.py`). Target (issue 20): at 32
clients, adaptive batching ≥ 3× the requests/s of batching off. Weights are random (speed only).

    python3 benchmarks/serve_gpu.py [--seconds S] [--out DIR]
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("serve_gpu: no CUDA GPU here; nothing measured")
        return 2
    from overdrive.techniques import default_config
    from overdrive.tuning.plan import Plan

    out = Path(args.out)
    plan = out / "serve_gpu" / "resnet50-bf16" / "plan.json"
    Plan(workload="resnet50", device="cuda", batch_size=BATCH, steps=[default_config("bf16")]).save(plan)
    rng = np.random.default_rng(0)
    bodies = [http_body([("input", rng.standard_normal((1, 3, 224, 224), dtype=np.float32))], binary=True)
              for _ in range(16)]
    server_cores, load_cores = core_split()
    print(f"serve_gpu: torch {torch.__version__}, {torch.cuda.get_device_name(0)}, server cores {sorted(server_cores or [])}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    results = {}
    for label, flags in [("adaptive batching", ["--max-batch-size", str(BATCH)]), ("batching off", ["--max-batch-size", "1"])]:
        server = Server("overdrive", str(plan), "resnet50", device="cuda", cores=server_cores,
                        flags=[*flags, "--max-queue-size", "4096", "--warmup-s", "60"])
        try:
            server.wait_ready(timeout_s=180)
            results[label] = []
            for c in CONCURRENCY:
                r = measure(server, bodies, protocol="http", concurrency=c, seconds=args.seconds, cores=load_cores)
                results[label].append(r)
                print(f"  resnet50 bf16  {label:18s} C={c:3d}  {r['requests_per_s']:8.1f} req/s  p50 {r['p50_ms']:7.1f} ms  "
                      f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}"
                      + (f"  mean batch {r['mean_batch_rows']:.1f} rows" if r["mean_batch_rows"] else ""), flush=True)
        finally:
            server.stop()
    at = lambda label: next(r for r in results[label] if r["concurrency"] == 32)  # noqa: E731
    gain = at("adaptive batching")["requests_per_s"] / at("batching off")["requests_per_s"]
    met = gain >= 3.0
    print(f"resnet50 bf16 at C=32: adaptive batching {gain:.2f}× batching off → {'met' if met else 'NOT met'} (target ≥ 3×)")
    (out / "serve_gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
