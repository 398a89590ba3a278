"""The load generator and server processes for the serving benchmarks (serve_cpu.py, serve_gpu.py).

A closed loop: C clients each send one request, wait for the answer, and send the next, for a
measured time after a warm-up. It runs in its own process (`python benchmarks/serve_load.py
drive ...`), so its event loop never shares a GIL with the parent; where the machine has more
than 2 cores, the server is pinned to the first half of them and the load generator to the rest.

HTTP requests are sent as prepared bodies (JSON, or the binary tensor extension with its header
length); gRPC requests as serialized `ModelInferRequest`s with `raw_input_contents`, through a
generic channel call (no client-side message building in the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER_ENV: dict[str, str] = {}  # extra environment for server processes (experiments)
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_split() -> tuple[set[int] | None, set[int] | None]:
    """(server cores, load-generator cores): halves of this process's cores, or (None, None) on ≤ 2 cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= 2:
        return None, None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def http_body(inputs: list[tuple[str, "object"]], binary: bool) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol request body for numpy arrays [(name, array)], and its headers."""
    import numpy as np

    if not binary:
        doc = {"inputs": [{"name": n, "datatype": _dt(a), "shape": list(a.shape), "data": a.reshape(-1).tolist()}
                          for n, a in inputs]}
        return json.dumps(doc).encode(), {"Content-Type": "application/json"}
    raws = [np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<"), copy=False).tobytes() for _, a in inputs]
    doc = {"inputs": [{"name": n, "datatype": _dt(a), "shape": list(a.shape), "parameters": {"binary_data_size": len(r)}}
                      for (n, a), r in zip(inputs, raws)], "parameters": {"binary_data_output": True}}
    header = json.dumps(doc).encode()
    return header + b"".join(raws), {"Inference-Header-Content-Length": str(len(header)),
                                     "Content-Type": "application/octet-stream"}


def text_http_body(text: str) -> tuple[bytes, dict[str, str]]:
    doc = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
    return json.dumps(doc).encode(), {"Content-Type": "application/json"}


def grpc_body(model: str, inputs: list[tuple[str, "object"]]) -> bytes:
    """A serialized ModelInferRequest: numpy arrays, or lists of bytes for BYTES."""
    import numpy as np
    from tritonclient.grpc import service_pb2 as pb

    request = pb.ModelInferRequest(model_name=model)
    for name, a in inputs:
        if isinstance(a, list):  # BYTES
            request.inputs.add(name=name, datatype="BYTES", shape=[len(a)])
            request.raw_input_contents.append(b"".join(len(b).to_bytes(4, "little") + b for b in a))
        else:
            request.inputs.add(name=name, datatype=_dt(a), shape=list(a.shape))
            request.raw_input_contents.append(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes())
    return request.SerializeToString()


def _dt(a) -> str:
    from overdrive.serve.protocol import datatype_of

    return datatype_of(a.dtype)


class Server:
    """A server subprocess (overdrive serve, or the LitServe anchor); `url` is where to send one
    request, `ready` where to poll, `grpc` the gRPC address when it serves gRPC."""

    def __init__(self, kind: str, spec: str, model: str, *, flags: list[str], device: str = "cpu", grpc: bool = False,
                 litserve_args: list[str] | None = None, cores: set[int] | None = None):
        self.port = free_port()
        base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **SERVER_ENV,
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
        self.grpc = None
        if kind == "litserve":
            cmd = [sys.executable, str(ROOT / "benchmarks" / "litserve_app.py"), spec, "--port", str(self.port),
                   *(litserve_args or [])]
            self.url, self.ready = f"{base}/predict", f"{base}/health"
        else:
            cmd = [sys.executable, "-m", "overdrive", "serve", spec, "--device", device, "--port", str(self.port), *flags]
            if grpc:
                gport = free_port()
                cmd += ["--grpc-port", str(gport)]
                self.grpc = f"127.0.0.1:{gport}"
            self.url, self.ready = f"{base}/v2/models/{model}/infer", f"{base}/v2/health/ready"
        self.metrics = f"{base}/metrics" if kind == "overdrive" else None
        self.log = open(f"/tmp/serve_bench_{kind}_{self.port}.log", "w")  # noqa: SIM115 — closed in stop()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def wait_ready(self, timeout_s: float = 240) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.ready, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout_s} s; see {self.log.name}")

    def batch_stats(self) -> tuple[float, float]:
        """(sum, count) of overdrive's batch-size histogram, for the mean rows per batch."""
        if self.metrics is None:
            return 0.0, 0.0
        import httpx

        text = httpx.get(self.metrics, timeout=10).text
        get = lambda name: sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))  # noqa: E731
        return get("overdrive_batch_size_sum"), get("overdrive_batch_size_count")

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


def measure(server: Server, bodies: list, *, protocol: str, concurrency: int, seconds: float, warmup_s: float = 1.5,
            cores: set[int] | None = None) -> dict:
    """One closed-loop run in a load-generator process. `bodies`: [(bytes, headers)] for HTTP,
    [bytes] for gRPC. Returns requests/s, p50/p99 ms, errors, completed, mean batch rows."""
    with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
        pickle.dump(bodies, f)
    target = server.grpc if protocol == "grpc" else server.url
    cmd = [sys.executable, str(Path(__file__)), "drive", "--target", target, "--protocol", protocol, "--bodies", f.name,
           "--concurrency", str(concurrency), "--seconds", str(seconds), "--warmup-s", str(warmup_s)]
    before = server.batch_stats()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + warmup_s + 120,
                              preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        raise RuntimeError(f"the load generator failed: {done.stderr[-2000:]}")
    after = server.batch_stats()
    result = json.loads(done.stdout.strip().splitlines()[-1])
    batches = after[1] - before[1]
    result["mean_batch_rows"] = (after[0] - before[0]) / batches if batches else None
    return result


# -- the load-generator process ---------------------------------------------------------------------------


async def _drive_http(target: str, bodies: list, concurrency: int, seconds: float, warmup_s: float) -> dict:
    import aiohttp

    latencies, errors, counter = [], [0], iter(range(10**12))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(i):
            body, headers = bodies[i % len(bodies)]
            async with session.post(target, data=body, headers=headers) as r:
                await r.read()
                return r.status == 200

        for i in range(4):
            if not await send(i):
                raise RuntimeError("a warm-up request failed")
        return await _loop(send, latencies, errors, counter, concurrency, seconds, warmup_s)


async def _drive_grpc(target: str, bodies: list, concurrency: int, seconds: float, warmup_s: float) -> dict:
    import grpc

    latencies, errors, counter = [], [0], iter(range(10**12))
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as channel:
        call = channel.unary_unary(MODEL_INFER, request_serializer=None, response_deserializer=None)

        async def send(i):
            try:
                await call(bodies[i % len(bodies)])
                return True
            except grpc.aio.AioRpcError:
                return False

        for i in range(4):
            if not await send(i):
                raise RuntimeError("a warm-up request failed")
        return await _loop(send, latencies, errors, counter, concurrency, seconds, warmup_s)


async def _loop(send, latencies, errors, counter, concurrency, seconds, warmup_s) -> dict:
    start = time.monotonic()
    measure_from, end = start + warmup_s, start + warmup_s + seconds

    async def client():
        while (now := time.monotonic()) < end:
            try:
                ok = await send(next(counter))
            except Exception:  # noqa: BLE001 — a refused connection counts as an error
                ok = False
            done = time.monotonic()
            if now >= measure_from and done <= end:
                if ok:
                    latencies.append(done - now)
                else:
                    errors[0] += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    latencies.sort()
    pick = lambda q: 1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")  # noqa: E731
    return {"concurrency": concurrency, "requests_per_s": len(latencies) / seconds, "p50_ms": pick(0.50),
            "p90_ms": pick(0.90), "p99_ms": pick(0.99), "max_ms": pick(1.0), "errors": errors[0], "completed": len(latencies),
            "histogram_ms": _histogram(latencies)}


def _histogram(latencies: list[float]) -> dict[str, int]:
    """Counts per 10 ms bin (ms lower bound → count), for reading a tail's shape."""
    counts: dict[str, int] = {}
    for t in latencies:
        key = str(int(t * 100) * 10)
        counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description="the closed-loop load generator (run by the serving benchmarks)")
    parser.add_argument("command", choices=["drive"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--protocol", choices=["http", "grpc"], required=True)
    parser.add_argument("--bodies", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--warmup-s", type=float, default=1.5)
    args = parser.parse_args()
    with open(args.bodies, "rb") as f:
        bodies = pickle.load(f)  # noqa: S301 — written by the parent benchmark a moment ago
    drive = _drive_grpc if args.protocol == "grpc" else _drive_http
    result = asyncio.run(drive(args.target, bodies, args.concurrency, args.seconds, args.warmup_s))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
