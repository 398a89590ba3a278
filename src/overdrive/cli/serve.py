"""`overdrive serve`: a workload, or the plan `optimize` wrote, behind an Open Inference Protocol
server with dynamic batching (see `overdrive.serve.app` and `overdrive.serve.batcher`)."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from overdrive.core.devices import replica_devices, resolve_device, serial_main_thread
from overdrive.core.errors import UserError, one_line
from overdrive.optimize.plan import Plan, build_on_devices
from overdrive.serve.app import InferenceServer, ServerConfig, describe_config, run_server
from overdrive.serve.model import ServedModel
from overdrive.workloads import create_workload


def load_served_model(spec: str, *, device: str, instances: int | None, name: str | None = None,
                      ) -> tuple[ServedModel, Plan | None, int]:
    """Build the model to serve from a workload spec or a plan.json.

    Returns:
        (served model, the plan or None, instances: one per GPU when the device is `cuda`
        without an index and `instances` is None, else `instances` or 1).

    Raises:
        UserError: an unknown workload, an unreadable plan, a plan for another device type,
            or a model that cannot be served.
    """
    plan = Plan.load(Path(spec), label="the plan") if spec.endswith(".json") else None
    if plan:
        plan.check_checkpoints()
        if device == "auto":
            device = plan.device
    resolved = resolve_device(device)
    if plan and plan.device != resolved.type:
        raise UserError(f"{spec} was tuned on {plan.device!r} and holds only there; serve it with --device {plan.device} "
                        f"or run `overdrive optimize {plan.workload} --device {resolved.type}`")
    workload = create_workload(plan.workload if plan else spec)
    devices = replica_devices(resolved, device)
    instances = instances or len(devices)
    devices = devices[:instances]
    models = build_on_devices(workload, plan.steps if plan else [], devices)
    try:
        served = ServedModel(name or workload.name, workload, models, devices)
    except (ValueError, RuntimeError) as exc:
        raise UserError(f"cannot serve {spec}: {one_line(exc)}") from None
    return served, plan, instances


def cmd_serve(args) -> int:
    logging.basicConfig(level=logging.INFO, format="overdrive serve: %(message)s")
    if args.model_name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.model_name):
        raise UserError(f"--model-name {args.model_name!r} cannot be a URL path segment; use letters, digits, '_', '.' "
                        "and '-' (e.g. minilm-v2)")
    cores = serial_main_thread()  # the model runs in the instance threads (devices.serial_main_thread)
    served, plan, instances = load_served_model(args.model, device=args.device, instances=args.instances,
                                                name=args.model_name)
    # Instances on one CPU split its cores, or each batch's threads fight the others'. Measured on
    # 2 cores, MiniLM bf16, 32 clients, dynamic batching: 2 instances × 1 thread 229 requests/s,
    # 1 instance × 2 threads 197 (benchmarks/RESULTS.md, evening of 2026-12-01).
    served.threads_per_instance = max(1, cores // instances)
    max_batch_size = args.max_batch_size or served.fixed_batch_size or (plan.batch_size if plan else None) \
        or served.workload.default_batch_size
    if served.fixed_batch_size and max_batch_size > served.fixed_batch_size:
        raise UserError(f"{args.model} runs only at batch size {served.fixed_batch_size}; "
                        f"--max-batch-size must be ≤ {served.fixed_batch_size}")
    max_queue_size = args.max_queue_size or max(512, 8 * max_batch_size * instances)
    if max_queue_size < max_batch_size:
        raise UserError(f"--max-queue-size {max_queue_size} rows is less than one batch ({max_batch_size} rows)")
    config = ServerConfig(max_batch_size=max_batch_size, max_queue_delay_ms=args.max_queue_delay_ms,
                          max_queue_size=max_queue_size, instances=instances,
                          request_timeout_ms=args.request_timeout_ms or None, drain_timeout_s=args.drain_timeout_s,
                          warmup_s=args.warmup_s)
    server = InferenceServer(served, config)

    def started(port: int) -> None:
        source = f"plan {args.model} ({' + '.join(plan.names) or 'baseline'})" if plan else args.model
        sys.stderr.write(f"overdrive serve: {source} as model {served.name!r} on http://{args.host}:{port}/v2/models/"
                         f"{served.name}/infer  {describe_config(server)}"
                         + (f"; warming up (ready within {args.warmup_s:g} s)\n" if args.warmup_s else "\n"))
        sys.stderr.flush()

    return run_server(server, host=args.host, port=args.port, access_log=args.access_log, on_started=started)
