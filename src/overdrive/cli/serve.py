"""`overdrive serve`: a workload, or the plan `optimize` wrote, behind an Open Inference Protocol
server with dynamic batching (`overdrive.serve.runner.serve`); a generation plan behind OpenAI-compatible
endpoints with continuous batching (`overdrive.serve.generation`)."""

from __future__ import annotations

import logging

from overdrive.cli.args import add_weights_arg, nonnegative, port, positive_int

FLAGS = {"model": "the plan"}  # the MODEL argument is named in errors only when it is a plan.json


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="serve a workload or a plan over the Open Inference Protocol (KServe v2) "
                                         "with dynamic batching")
    serve.add_argument("model", nargs="+", help="a workload (minilm, digits-cnn, ...) or a plan.json written by "
                                                "`overdrive optimize`; several: one server, a batcher per model")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: any free port)")
    serve.add_argument("--grpc-port", type=port, help="also serve KServe v2 gRPC (what tritonclient.grpc speaks) on this "
                                                      "port; HTTP and gRPC requests join the same batches (0: any free port)")
    serve.add_argument("--device", default="auto", help="cpu, cuda (every GPU, one instance each), cuda:N or auto")
    serve.add_argument("--model-name", help="name in the URLs (default: the workload's name)")
    serve.add_argument("--max-batch-size", type=positive_int, help="rows per model batch (default: the plan's batch size, "
                                                                    "else the workload's); 1 turns batching off")
    serve.add_argument("--batching", choices=["adaptive", "fixed"], default="adaptive",
                       help="adaptive (default): a batch waits only while the rows expected to arrive make it cheaper "
                            "per row, from the measured time per batch size and arrival rate, so a lone client never "
                            "waits; fixed: Triton's rule, up to --max-queue-delay-ms for a full batch")
    serve.add_argument("--max-queue-delay-ms", type=nonnegative,
                       help="the longest a request waits for others to join its batch, ms (default: a 10 ms cap for "
                            "adaptive, 2 for fixed; 0: run at once with whatever is queued)")
    serve.add_argument("--max-queue-size", type=positive_int, help="rows that may wait; more get 503 + Retry-After "
                                                                    "(default: 512, or 8 batches per instance if more); "
                                                                    "for a generation plan, requests that may wait for "
                                                                    "a row, more get 429 + Retry-After (default 256)")
    serve.add_argument("--instances", type=positive_int, help="model instances, each with its own thread (default: one "
                                                               "per GPU, 1 on CPU; on CPU the cores are split between them, "
                                                               "and as many instances as cores often serves the most)")
    serve.add_argument("--request-timeout-ms", type=nonnegative,
                       help="default timeout of a queued request, ms, when the request sets none (default 30000; 0: none); "
                            "for a generation plan, the deadline of a whole generation request (default: none)")
    serve.add_argument("--drain-timeout-s", type=nonnegative, default=30.0,
                       help="on SIGTERM/SIGINT, how long admitted requests may take to finish (default 30)")
    serve.add_argument("--warmup-s", type=nonnegative, default=30.0,
                       help="seconds to spend at start running each batch size once, so no request pays for a "
                            "kernel's first run at a new shape (default 30; 0: none)")
    add_weights_arg(serve)
    serve.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs throughput)")


def main(args, argv: list[str]) -> int:
    from overdrive.generate.plan import is_generation_plan
    from overdrive.serve.runner import serve

    logging.basicConfig(level=logging.INFO, format="overdrive serve: %(message)s")
    if any(spec.endswith(".json") and is_generation_plan(spec) for spec in args.model):
        return serve_generation(args)
    return serve(args.model, host=args.host, port=args.port, grpc_port=args.grpc_port, device=args.device,
                 model_name=args.model_name, max_batch_size=args.max_batch_size, batching=args.batching,
                 max_queue_delay_ms=args.max_queue_delay_ms,
                 max_queue_size=args.max_queue_size, instances=args.instances,
                 request_timeout_ms=30_000.0 if args.request_timeout_ms is None else args.request_timeout_ms,
                 drain_timeout_s=args.drain_timeout_s, warmup_s=args.warmup_s, access_log=args.access_log,
                 weights=args.weights)


def serve_generation(args) -> int:
    """`overdrive serve PLAN.json [ENCODER ...]` for a generation plan: continuous batching behind OpenAI-compatible
    and KServe v2 generate endpoints (`serve/generation.py`), beside any encoders given (`serve/combined.py`: the
    batching, gRPC and instance flags are then theirs)."""
    import sys
    import time

    from overdrive.core import devices
    from overdrive.core.errors import ConfigError, arg
    from overdrive.generate.engine import SamplingParams
    from overdrive.generate.plan import SPECULATIVE, GenerationPlan, build_generator, is_generation_plan
    from overdrive.serve.generation import GenerationServer
    from overdrive.serve.runner import bind, run_server
    from overdrive.workloads.generation import create_generation_workload

    generation = [m for m in args.model if m.endswith(".json") and is_generation_plan(m)]
    encoders = [m for m in args.model if m not in generation]
    if len(generation) > 1:
        raise ConfigError(f"{len(generation)} generation plans given; a server serves one causal LM (beside any "
                          "number of encoders): serve the others from servers of their own")
    if encoders and args.model_name is not None:
        raise ConfigError(f"{arg('model_name')} names one model, and {len(args.model)} are given; serve such a model "
                          "from a server of its own")
    unset = {"grpc_port": None, "batching": "adaptive", "max_queue_delay_ms": None, "instances": None, "weights": None}
    for name, default in unset.items():
        if getattr(args, name) != default and not encoders:
            raise ConfigError(f"{arg(name, getattr(args, name))}: not for a generation plan (it is batched "
                              "continuously, one instance, HTTP only)")
    bind(args.host, args.port).close()  # a port in use is said now, not after the model is built
    plan = GenerationPlan.load(generation[0])
    for step in set(SPECULATIVE) & set(plan.names):
        raise ConfigError(f"the plan uses {step}, which verifies one sequence at a time; a server batches "
                          f"continuously: optimize again with --techniques leaving {step} out")
    name = args.model_name or plan.workload
    device = devices.resolve_device(args.device if args.device != "auto" else plan.device)
    workload = create_generation_workload(plan.workload, log=lambda line: logging.getLogger("overdrive.serve").info(line))
    gen = build_generator(workload.model, workload.tokenizer, plan.steps, device=device,
                          max_batch_size=args.max_batch_size or plan.batch_size, continuous=True)
    started = time.perf_counter()
    if args.warmup_s:  # the compiled decode step's shapes: every batch size the scheduler rounds to
        sizes = sorted({1 << k for k in range(gen.max_batch_size.bit_length())} | {gen.max_batch_size})
        for size in sizes:
            if time.perf_counter() - started > args.warmup_s:
                break
            gen.generate([workload.prompts[0]] * size, SamplingParams(max_new_tokens=2))
    deadline_s = args.request_timeout_ms / 1e3 if args.request_timeout_ms else None
    server = gen_server = GenerationServer(gen, name, max_waiting=args.max_queue_size or 256,
                                           drain_timeout_s=args.drain_timeout_s, request_timeout_s=deadline_s)
    encoders_started = None
    if encoders:  # beside the encoders, in one app (`serve/combined.py`); the flags above are theirs
        from overdrive.serve.combined import CombinedServer
        from overdrive.serve.runner import build_server

        encoder_server, encoders_started = build_server(
            encoders, host=args.host, port=args.port, grpc_port=args.grpc_port, device=args.device,
            max_batch_size=args.max_batch_size, batching=args.batching, max_queue_delay_ms=args.max_queue_delay_ms,
            max_queue_size=args.max_queue_size, instances=args.instances,
            request_timeout_ms=30_000.0 if args.request_timeout_ms is None else args.request_timeout_ms,
            drain_timeout_s=args.drain_timeout_s, warmup_s=args.warmup_s, weights=args.weights, share_cores=1)
        try:
            server = CombinedServer(encoder_server, server)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def on_started(port: int) -> None:
        if encoders_started is not None:
            encoders_started(port)
        sys.stderr.write(f"overdrive serve: plan {generation[0]} ({' + '.join(plan.names) or 'baseline'}) as model "
                         f"{name!r} on http://{args.host}:{port}/v1/completions, /v1/chat/completions and "
                         f"/v2/models/{name}/generate; continuous batching of up to {gen.max_batch_size} sequences, "
                         f"{gen.pool.capacity} KV blocks of {gen.block_size} slots on {devices.describe(device)}; "
                         f"chat template: {gen_server.chat_template}\n")
        sys.stderr.flush()

    return run_server(server, host=args.host, port=args.port, access_log=args.access_log, on_started=on_started)
