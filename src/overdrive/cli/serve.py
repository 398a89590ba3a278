"""`overdrive serve`: a workload, or the plan `optimize` wrote, behind an Open Inference Protocol
server with dynamic batching (`overdrive.serve.runner.serve`)."""

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
                                                                    "(default: 512, or 8 batches per instance if more)")
    serve.add_argument("--instances", type=positive_int, help="model instances, each with its own thread (default: one "
                                                               "per GPU, 1 on CPU; on CPU the cores are split between them, "
                                                               "and as many instances as cores often serves the most)")
    serve.add_argument("--request-timeout-ms", type=nonnegative, default=30_000.0,
                       help="default timeout of a queued request, ms, when the request sets none (default 30000; 0: none)")
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
        from overdrive.cli.generate import serve_main

        return serve_main(args)
    return serve(args.model, host=args.host, port=args.port, grpc_port=args.grpc_port, device=args.device,
                 model_name=args.model_name, max_batch_size=args.max_batch_size, batching=args.batching,
                 max_queue_delay_ms=args.max_queue_delay_ms,
                 max_queue_size=args.max_queue_size, instances=args.instances, request_timeout_ms=args.request_timeout_ms,
                 drain_timeout_s=args.drain_timeout_s, warmup_s=args.warmup_s, access_log=args.access_log,
                 weights=args.weights)
