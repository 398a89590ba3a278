"""`overdrive` command line: optimize, bench, serve, run, train, list.

User mistakes (unknown workload, bad path, batch size ≤ 0, absent device) print one line
`overdrive: error: ...` on stderr and exit with code 2; no traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from overdrive.core.errors import UserError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse prints usage too by default)
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def int_list(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()] or positive_int("")


def name_list(text: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))  # dedupe, keep order
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated technique names (see `overdrive list`), got none")
    return names


def shape(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _number(text: str, accept, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not accept(value):  # NaN fails every comparison, so it is refused too
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def fraction(text: str) -> float:
    return _number(text, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def nonnegative(text: str) -> float:
    return _number(text, lambda v: 0.0 <= v < math.inf, "a finite number ≥ 0")


def open_fraction(text: str) -> float:
    return _number(text, lambda v: 0.0 < v < 1.0, "a fraction strictly between 0 and 1 (e.g. 0.5)")


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {value}")
    return value


def port(text: str) -> int:
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {value}")
    return value


def batch_size_arg(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def ratio(text: str) -> float:
    return _number(text, lambda v: 0.0 < v < math.inf, "a finite ratio > 0 (e.g. 1.02)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("workload", help="minilm, digits-cnn, a torchvision name (resnet50), package.module:factory, or a .pt/.pt2 file")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when present)")
    p.add_argument("--batch-size", type=positive_int, help="rows per call (default: the workload's)")
    p.add_argument("--num-samples", type=positive_int, help="evaluation samples (default: 512 for text, all otherwise)")
    p.add_argument("--out", default="out", help="output folder; results go to OUT/<workload>/ (default: out)")
    p.add_argument("--input-shape", type=shape, help="input shape B,C,H,W... for TorchScript files, which store none")
    p.add_argument("--input-dtype", default="float32", help="dtype of generated inputs for model files (default float32)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="overdrive", description="Make a PyTorch model run as fast as the hardware allows, and prove it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    opt = sub.add_parser("optimize", help="measure baseline and techniques, compose the winners, write a plan")
    _add_workload_args(opt)
    opt.add_argument("--techniques", type=name_list, help="comma-separated names to try (default: all; see `overdrive list`)")
    opt.add_argument("--max-accuracy-drop", type=nonnegative, help="task-metric points a technique may lose (workloads with labels)")
    opt.add_argument("--min-fidelity", type=fraction, default=0.99, help="floor on cosine / agreement with fp32 (default 0.99)")
    opt.add_argument("--min-gain", type=ratio, default=1.02, help="throughput ratio a step needs to be kept (default 1.02)")
    opt.add_argument("--prune-ratio", type=open_fraction,
                     help="fraction of channels / heads / FFN width the named pruning techniques remove (default: "
                          "0.5 for prune-channels, 1/3 for prune-heads and prune-ffn)")
    opt.add_argument("--finetune-steps", type=nonnegative_int,
                     help="recovery fine-tune steps after pruning (default 300; 0: none)")
    opt.add_argument("--sweep-batch-sizes", type=int_list, help="batch sizes for the report's plot (default: 1, B/4, B, 2B)")

    bench = sub.add_parser("bench", help="measure the baseline and a plan at several batch sizes")
    _add_workload_args(bench)
    bench.add_argument("--plan", help="plan.json written by `overdrive optimize` (default: baseline only)")
    bench.add_argument("--batch-sizes", type=int_list, help="comma-separated batch sizes (default: the plan's)")

    serve = sub.add_parser("serve", help="serve a workload or a plan over the Open Inference Protocol (KServe v2) "
                                         "with dynamic batching")
    serve.add_argument("model", help="a workload (minilm, digits-cnn, ...) or a plan.json written by `overdrive optimize`")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=port, default=8000, help="TCP port (default 8000; 0: any free port)")
    serve.add_argument("--device", default="auto", help="cpu, cuda (every GPU, one instance each), cuda:N or auto")
    serve.add_argument("--model-name", help="name in the URLs (default: the workload's name)")
    serve.add_argument("--max-batch-size", type=positive_int, help="rows per model batch (default: the plan's batch size, "
                                                                    "else the workload's); 1 turns batching off")
    serve.add_argument("--max-queue-delay-ms", type=nonnegative, default=2.0,
                       help="longest a request waits for others to join its batch, ms (default 2; 0: run at once with "
                            "whatever is queued, the lowest latency at light load)")
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
    serve.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs throughput)")

    train = sub.add_parser("train", help="train or fine-tune with mixed precision, activation checkpointing, compile, "
                                         "and DDP / FSDP / tensor parallelism on torch.distributed")
    train.add_argument("workload", help="minilm, digits-cnn, or package.module:factory returning a Workload with train_samples")
    train.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when present); one GPU per process")
    train.add_argument("--batch-size", type=positive_int, help="rows per forward pass on each process (default: the "
                                                                "workload's, at most 32)")
    train.add_argument("--steps", type=positive_int, help="optimizer steps (default: from --epochs)")
    train.add_argument("--epochs", type=ratio, help="passes over the training samples (default 1; ignored with --steps)")
    train.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step (default 1)")
    train.add_argument("--lr", type=ratio, default=1e-4, help="peak AdamW learning rate (default 1e-4)")
    train.add_argument("--precision", choices=("fp32", "bf16", "fp16", "auto"), default="fp32",
                       help="autocast precision (default fp32; fp16 needs CUDA and uses a gradient scaler)")
    train.add_argument("--checkpoint-activations", action="store_true", help="recompute each block's activations in "
                                                                             "backward: less memory, more compute")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--nproc", type=positive_int, help="processes to launch with torchrun on this machine (default 1; "
                                                          "omit under your own torchrun)")
    train.add_argument("--strategy", choices=("none", "ddp", "fsdp", "pipeline", "tensor-parallel"), default=None,
                       help="how processes share the work (default: none for 1 process, ddp for more)")
    train.add_argument("--microbatches", type=positive_int, help="pipeline: microbatches per step, ≥ stages (default "
                                                                 "2 × stages); they must divide --batch-size")
    train.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe", help="pipeline schedule (default gpipe)")
    train.add_argument("--split-points", type=int_list, help="pipeline: first block index of each stage after the "
                                                             "first, e.g. 3 (default: balance measured block times)")
    train.add_argument("--seed", type=nonnegative_int, default=0, help="data order and initial RNG state (default 0)")
    train.add_argument("--collective-timeout-s", type=ratio, default=600.0,
                       help="a collective waiting longer than this fails with an error naming the rank (default 600)")
    train.add_argument("--save", help="checkpoint folder, written at the end (torch.distributed.checkpoint; loads at "
                                      "any world size)")
    train.add_argument("--save-every", type=nonnegative_int, default=0, help="also save every N steps (default 0: end only)")
    train.add_argument("--resume", help="checkpoint folder to continue from (model, optimizer, data position)")
    train.add_argument("--compare", action="store_true", help="also run the plain fp32 single-process baseline for the "
                                                              "same steps and print both side by side")
    train.add_argument("--out", default="out", help="output folder; the summary goes to OUT/<workload>/train/ (default: out)")

    run = sub.add_parser("run", help="offline batch inference over a dataset: every record through the model (or a "
                                     "plan) into one output file, resumable")
    run.add_argument("workload", nargs="?", help="minilm, digits-cnn, a torchvision name (resnet50), package.module:factory "
                                                  "(optional with --plan)")
    run.add_argument("--input", required=True, help="a .txt file (one sentence per line), .jsonl, .csv, a folder of "
                                                    "images, or a .npy array [N, *row]")
    run.add_argument("--output", required=True, help="a .npy, .parquet, .csv or .jsonl file (rows in input order, keyed "
                                                     "by input index)")
    run.add_argument("--plan", help="plan.json written by `overdrive optimize`: its techniques and batch size")
    run.add_argument("--device", default="auto", help="cpu, cuda (every GPU, one replica each), cuda:N or auto")
    run.add_argument("--batch-size", type=batch_size_arg, help="rows per batch, or auto (measured: the largest batch "
                                                               "that still raises items/s by ≥ 5%%); default: the plan's, "
                                                               "else the workload's")
    run.add_argument("--text-field", help="JSONL field or CSV column holding the text (default: text)")
    run.add_argument("--num-workers", type=nonnegative_int, help="DataLoader processes reading and decoding (default: 0 "
                                                                 "on a CPU run with ≤ 2 cores, else up to 8)")
    run.add_argument("--chunk-size", type=positive_int, default=4096, help="records per resumable chunk, also the length-"
                                                                           "bucketing window (default 4096)")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run where it stopped (same output bytes "
                                                           "as an uninterrupted run)")
    run.add_argument("--overwrite", action="store_true", help="replace an existing output")
    run.add_argument("--max-errors", type=nonnegative_int, help="stop once more records than this fail to read or decode "
                                                                "(default: no limit; they go to OUTPUT.errors.jsonl)")

    sub.add_parser("list", help="workloads and techniques, with the devices each supports")
    return parser


def cmd_list() -> int:
    from rich.console import Console
    from rich.table import Table

    from overdrive.techniques import list_techniques
    from overdrive.workloads import list_workloads

    console = Console()
    workloads = Table(title="workloads")
    workloads.add_column("name")
    workloads.add_column("what it is")
    for name, desc in list_workloads().items():
        workloads.add_row(name, desc)
    console.print(workloads)
    techniques = Table(title="techniques (composed in stage order)")
    for col in ("name", "stage", "devices", "lossless", "what it does"):
        techniques.add_column(col)
    for t in list_techniques():
        techniques.add_row(t.name, t.stage.name.lower(), ", ".join(t.devices), "yes" if t.lossless else "no", t.description)
    console.print(techniques)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # torch.compile on a CUDA build without a GPU logs "No CUDA runtime is found" once; it is not ours to act on.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    try:
        if args.command == "list":
            return cmd_list()
        if args.command == "optimize":
            from overdrive.cli.optimize import cmd_optimize

            return cmd_optimize(args, argv if argv is not None else sys.argv[1:])
        if args.command == "bench":
            from overdrive.cli.bench import cmd_bench

            return cmd_bench(args)
        if args.command == "train":
            from overdrive.train.loop import cmd_train

            if args.strategy is None:
                args.strategy = "ddp" if (args.nproc or 1) > 1 or "WORLD_SIZE" in __import__("os").environ else "none"
            return cmd_train(args, argv if argv is not None else sys.argv[1:])
        if args.command == "serve":
            from overdrive.cli.serve import cmd_serve

            return cmd_serve(args)
        if args.command == "run":
            from overdrive.run.job import cmd_run

            return cmd_run(args)
    except UserError as exc:
        sys.stderr.write(f"overdrive: error: {' '.join(str(exc).split())}\n")  # always one line
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("overdrive: interrupted\n")
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
