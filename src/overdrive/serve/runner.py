"""Running a server: build the model to serve from a workload or a plan, start the app on
uvicorn, and drain it on SIGTERM/SIGINT (`serve`, what `overdrive serve` calls)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import signal
import socket
import sys

import torch

from overdrive.core.devices import replica_devices, resolve_device, serial_main_thread, settle_host_allocator
from overdrive.core.errors import ConfigError, WorkloadError, arg, one_line
from overdrive.serve.app import InferenceServer, ServerConfig
from overdrive.serve.model import ServedModel
from overdrive.tuning.plan import Plan, load_plan
from overdrive.techniques.compose import build_on_devices
from overdrive.workloads import create_workload

log = logging.getLogger("overdrive.serve")
SWITCH_INTERVAL_S = 0.0005


def load_served_model(spec: str, *, device: str, instances: int | None, name: str | None = None,
                      weights: str | None = None) -> tuple[ServedModel, Plan | None, int]:
    """Build the model to serve from a workload spec or a plan.json.

    Returns:
        (served model, the plan or None, instances: one per GPU when the device is `cuda`
        without an index and `instances` is None, else `instances` or 1).

    Raises:
        WorkloadError: an unknown workload, or a model that cannot be served.
        PlanError: an unreadable plan, or a plan for another device type.
    """
    settle_host_allocator()  # eager activations from the heap, not fresh page faults every call
    plan = None
    if spec.endswith(".json"):
        plan, resolved, device = load_plan(spec, device=device, argument="model")
    else:
        resolved = resolve_device(device)
    workload = plan.create_workload() if plan else create_workload(spec)
    if weights is not None:  # a plan's own weights are loaded by create_workload; these replace them
        from overdrive.workloads.weights import load_weights

        load_weights(workload, weights)
    devices = replica_devices(resolved, device)
    instances = instances or len(devices)
    devices = devices[:instances]
    models = build_on_devices(workload, plan.steps if plan else [], devices)
    try:
        served = ServedModel(name or workload.name, workload, models, devices)
    except (ValueError, RuntimeError) as exc:
        raise WorkloadError(f"cannot serve {spec}: {one_line(exc)}") from None
    return served, plan, instances


def serve(specs: str | list[str], *, host: str = "127.0.0.1", port: int = 8000, access_log: bool = False,
          **settings) -> int:
    """Serve one or more workloads or plans `optimize` wrote until SIGTERM/SIGINT, then drain and return 0.
    host, port: where to listen for HTTP (port 0: any free port; the bound one is logged); access_log: log every
    request; `settings`: as `build_server`'s.

    Raises:
        as `build_server`.
    """
    server, started = build_server(specs, host=host, port=port, **settings)
    return run_server(server, host=host, port=port, access_log=access_log, on_started=started)


def build_server(specs: str | list[str], *, host: str = "127.0.0.1", port: int | None = None,
                 grpc_port: int | None = None,
                 device: str = "auto", model_name: str | None = None, max_batch_size: int | None = None,
                 batching: str = "adaptive", max_queue_delay_ms: float | None = None, max_queue_size: int | None = None,
                 instances: int | None = None, request_timeout_ms: float = 30_000.0, drain_timeout_s: float = 30.0,
                 warmup_s: float = 30.0, weights: str | None = None, share_cores: int = 0):
    """The server for one or more workloads or plans, and what to say once it listens: (InferenceServer,
    on_started(port)), for `run_server` (alone, or beside a generator: `serve.combined`).

    Args:
        specs: a workload (minilm, digits-cnn, ...) or a plan.json, or a list of them (one model each,
            each with its own batcher and queue; the CPU's cores are split between all their instances).
        host, port: the HTTP address `run_server` will bind (gRPC binds `host` here, on a port of its own).
        grpc_port: also serve KServe v2 gRPC on this port (0: any free one; None: HTTP only).
        device: "auto", "cpu", "cuda" (every GPU, one instance each) or "cuda:N".
        model_name: the name in the URLs (default: the workload's); one model only.
        max_batch_size: rows per model batch (default: each plan's batch size, else the workload's).
        batching: "adaptive" (a batch waits only while it is expected to pay) or "fixed" (Triton's rule:
            up to the delay for a full batch).
        max_queue_delay_ms: the longest a request waits for others to join its batch, ms (default: 2 for
            fixed, a 10 ms cap for adaptive).
        max_queue_size: rows that may wait before requests get 503 (default: 512, or 8 batches
            per instance if more), per model.
        instances: model instances per model, each in its own thread (default: one per GPU, 1 on CPU).
        request_timeout_ms: a queued request's timeout when it sets none, ms (0: none).
        drain_timeout_s: how long admitted requests may take to finish on SIGTERM/SIGINT.
        warmup_s: seconds per model at start spent running the batch sizes it warms (0: none).
        weights: a checkpoint loaded into the model (`overdrive.workloads.weights`); one model only; a plan
            loads its own.
        share_cores: other model instances (a generator's engine) that share the CPU's cores with these.

    Raises:
        ConfigError: a model name, batch size or queue size that cannot work, a port in use, two models
            with one name.
        WorkloadError, PlanError: as `load_served_model`.
    """
    specs = [specs] if isinstance(specs, str) else list(specs)
    for option, value in (("model_name", model_name), ("weights", weights)):
        if len(specs) > 1 and value is not None:
            raise ConfigError(f"{arg(option)} names one model, and {len(specs)} are given; serve such a model from a "
                              "server of its own")
    if model_name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", model_name):
        raise ConfigError(f"{arg('model_name', model_name)} cannot be a URL path segment; use letters, digits, '_', '.' "
                          "and '-' (e.g. minilm-v2)")
    if grpc_port is not None and grpc_port != 0:
        if grpc_port == port:
            raise ConfigError(f"{arg('grpc_port', grpc_port)} is the HTTP {arg('port')}; give gRPC a port of its own")
        bind(host, grpc_port, what="grpc_port").close()  # refused here with one line, not inside the server's start
    cores = serial_main_thread()  # the model runs in the instance threads (devices.serial_main_thread)
    models, plans, threads = [], {}, {}
    for spec in specs:
        served, plan, n = load_served_model(spec, device=device, instances=instances, name=model_name, weights=weights)
        if any(m[0].name == served.name for m in models):
            raise ConfigError(f"two of the models are named {served.name!r}; serve them from separate servers, or give "
                              "one a plan of another workload")
        config = _model_config(spec, served, plan, n, max_batch_size=max_batch_size, batching=batching,
                               max_queue_delay_ms=max_queue_delay_ms, max_queue_size=max_queue_size,
                               request_timeout_ms=request_timeout_ms, drain_timeout_s=drain_timeout_s, warmup_s=warmup_s)
        loader = (lambda spec=spec, n=n, name=served.name:  # what /v2/repository/models/<name>/load rebuilds
                  _with_threads(load_served_model(spec, device=device, instances=n, name=name)[0], threads.get("each")))
        models.append((served, config, loader))
        plans[served.name] = (spec, plan)
    # Instances on one CPU split its cores, or each batch's threads fight the others' (two
    # single-threaded instances served more than one two-threaded one on 2 cores: benchmarks/RESULTS.md,
    # serve_cpu 2026-12-01, "the same with two instances"). With several models, all their instances share them.
    # Leaving one core to the event loop was measured too (serve_cpu 2026-12-03): digits-cnn served the
    # same, MiniLM 15% less at 32 clients on 2 cores, so the instances keep every core.
    threads["each"] = max(1, cores // (sum(c.instances for _, c, _ in models) + share_cores))
    for served, _, _ in models:
        served.threads_per_instance = threads["each"]
    server = InferenceServer(models, grpc_port=grpc_port, host=host)
    del models, served  # the server holds them: an unloaded model's memory can go

    def started(port: int) -> None:
        for name, slot in server.slots.items():
            spec, plan = plans[name]
            source = f"plan {spec} ({' + '.join(plan.names) or 'baseline'})" if plan else spec
            sys.stderr.write(f"overdrive serve: {source} as model {name!r} on http://{host}:{port}/v2/models/{name}/infer"
                             + (f" and grpc {host}:{server.grpc_port}" if server.grpc_port is not None else "")
                             + f"  {describe_config(slot)}"
                             + (f"; warming up (ready within {warmup_s:g} s)\n" if warmup_s else "\n"))
            if slot.served.workload.extra.get("weights_differ_from_plan"):
                sys.stderr.write(f"overdrive serve: warning: {slot.served.workload.extra['weights_differ_from_plan']}\n")
            if slot.served.dependence is not None:  # how its batches are formed so that no row's answer changes
                sys.stderr.write(f"overdrive serve: {name}: {slot.served.dependence.describe()}\n")
        sys.stderr.flush()

    return server, started


def _with_threads(served: ServedModel, threads: int | None) -> ServedModel:
    served.threads_per_instance = threads
    return served


def _model_config(spec: str, served: ServedModel, plan: Plan | None, instances: int, *, max_batch_size: int | None,
                  max_queue_size: int | None, **settings) -> ServerConfig:
    max_batch_size = max_batch_size or served.fixed_batch_size or (plan.batch_size if plan else None) \
        or served.workload.default_batch_size
    if served.fixed_batch_size and max_batch_size > served.fixed_batch_size:
        raise ConfigError(f"{spec} runs only at batch size {served.fixed_batch_size}; "
                          f"{arg('max_batch_size')} must be ≤ {served.fixed_batch_size}")
    max_queue_size = max_queue_size or max(512, 8 * max_batch_size * instances)
    if max_queue_size < max_batch_size:
        raise ConfigError(f"{arg('max_queue_size', max_queue_size)} rows is less than one batch ({max_batch_size} rows)")
    request_timeout_ms = settings.pop("request_timeout_ms")
    return ServerConfig(max_batch_size=max_batch_size, max_queue_size=max_queue_size, instances=instances,
                        request_timeout_ms=request_timeout_ms or None, **settings)


def run_server(server: InferenceServer, *, host: str, port: int, access_log: bool = False, on_started=None) -> int:
    """Serve until SIGTERM/SIGINT, then drain and exit; a second signal exits at once.

    Args:
        on_started: called with the bound port once the server listens.

    Returns:
        0 after a clean drain.
    """
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if server.draining:  # a second signal: uvicorn's own (force) exit
                return super().handle_exit(sig, frame)
            log.info("received %s: draining (readiness false, new requests get 503)", signal.Signals(sig).name)
            server.draining = True
            self._loop.call_soon_threadsafe(self._begin_drain)

        def _begin_drain(self):
            self._drain_task = self._loop.create_task(self._drain_then_exit())  # referenced: not collected mid-drain

        async def _drain_then_exit(self):
            await server.drain()
            self.should_exit = True

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets)
            if on_started and self.servers:
                on_started(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(server.app, host=host, port=port, access_log=access_log, log_level="warning",
                            timeout_graceful_shutdown=5, lifespan="on")
    sock = bind(host, port)
    # The model and its libraries live as long as the server: move them out of the cyclic
    # collector's reach, or every gen-2 collection walks them all and stalls the event loop
    # (the p99 stalls it caused: benchmarks/RESULTS.md, serve_cpu 2026-12-01 morning, gc.freeze()).
    gc.collect()
    gc.freeze()
    # The instance threads reacquire the GIL after every torch op; while the event loop parses
    # requests it holds the GIL, and a waiting thread gets it only after the switch interval (5 ms
    # by default), so a small model's batch took 10-20 ms instead of 2. 0.5 ms lets the model's
    # thread back in quickly (benchmarks/RESULTS.md, serve_cpu 2026-12-03: "GIL switch interval").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    _Server(config).run(sockets=[sock])
    return 0


def bind(host: str, port: int, what: str = "port") -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6).

    Raises:
        ConfigError: the address is in use, not local, or not allowed (a port below 1024).
    """
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another {arg(what)} or "
                          f"{arg('host')}") from None
    sock.set_inheritable(True)
    return sock


def describe_config(slot) -> str:
    c, s = slot.config, slot.served
    return json.dumps({"model": s.name, "devices": [str(d) for d in s.devices], "max_batch_size": c.max_batch_size,
                       "batching": c.batching, "max_queue_delay_ms": c.max_queue_delay_ms,
                       "max_queue_size_rows": c.max_queue_size, "instances": c.instances,
                       "request_timeout_ms": c.request_timeout_ms,
                       **({"intra_op_threads_each": s.threads_per_instance or torch.get_num_threads()}
                          if s.devices[0].type == "cpu" else {})})
