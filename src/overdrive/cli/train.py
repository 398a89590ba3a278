"""`overdrive train`: train or fine-tune a workload (`overdrive.train.loop.run_training`), in this
process or, with --nproc N, in N processes started by torchrun, and print the run's table."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from overdrive.cli.args import int_list, nonnegative_int, positive_float, positive_int
from overdrive.core.errors import ConfigError, OverdriveError, arg, one_line

if TYPE_CHECKING:
    from overdrive.train.config import TrainConfig, TrainSummary
    from overdrive.train.launch import DistEnv

SUMMARY_ENV = "OVERDRIVE_TRAIN_SUMMARY"  # rank 0 of a job this command launched writes its summary there
ERRORS_ENV = "OVERDRIVE_TRAIN_ERRORS"  # ... and each rank that fails with a library error, its one line, as FILE.RANK


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train or fine-tune with mixed precision, activation checkpointing, compile, "
                                         "and DDP / FSDP / tensor parallelism on torch.distributed")
    train.add_argument("workload", help="minilm, digits-cnn, or package.module:factory returning a Workload with train_samples")
    train.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when present); one GPU per process")
    train.add_argument("--batch-size", type=positive_int, help="rows per forward pass on each process (default: the "
                                                                "workload's, at most 32)")
    train.add_argument("--steps", type=positive_int, help="optimizer steps (default: from --epochs)")
    train.add_argument("--epochs", type=positive_float, help="passes over the training samples (default 1; ignored with --steps)")
    train.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step (default 1)")
    train.add_argument("--lr", type=positive_float, default=1e-4, help="peak AdamW learning rate (default 1e-4)")
    train.add_argument("--precision", choices=("fp32", "bf16", "fp16", "auto"), default="fp32",
                       help="autocast precision (default fp32; fp16 needs CUDA and uses a gradient scaler, not with "
                            "fsdp or pipeline)")
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
    train.add_argument("--find-unused-parameters", action="store_true", default=None,
                       help="ddp / fsdp: reduce a zero gradient for parameters a rank's forward did not reach, every "
                            "step, and freeze none (default: on when a probe of the first batches sees use vary)")
    train.add_argument("--seed", type=nonnegative_int, default=0, help="data order and initial RNG state (default 0)")
    train.add_argument("--collective-timeout-s", type=positive_float, default=600.0,
                       help="a collective waiting longer than this fails with an error naming the rank (default 600)")
    train.add_argument("--save", help="checkpoint folder, written at the end (torch.distributed.checkpoint; loads at "
                                      "any world size)")
    train.add_argument("--save-every", type=nonnegative_int, default=0, help="also save every N steps (default 0: end only)")
    train.add_argument("--resume", help="checkpoint folder to continue from (model, optimizer, data position)")
    train.add_argument("--compare", action="store_true", help="also run the plain fp32 single-process baseline for the "
                                                              "same steps and print both side by side")
    train.add_argument("--out", default="out", help="output folder; the summary goes to OUT/<workload>/train/ (default: out)")


def config_from_args(args, world_size: int) -> TrainConfig:
    """The TrainConfig for parsed `overdrive train` arguments at `world_size` processes.

    Raises:
        ConfigError: degrees, microbatches, split points, or any combination of flags that cannot
            work whatever the model (`TrainConfig` checks them), before any launch.
    """
    from overdrive.train.config import TrainConfig
    from overdrive.train.parallel import ParallelDims

    dims = ParallelDims(strategy=args.strategy, world_size=world_size, microbatches=args.microbatches,
                        schedule=args.schedule, split_points=tuple(args.split_points) if args.split_points else None)
    return TrainConfig(
        workload=args.workload, device=args.device, batch_size=args.batch_size, steps=args.steps, epochs=args.epochs,
        grad_accum=args.grad_accum, learning_rate=args.lr, precision=args.precision,
        checkpoint_activations=args.checkpoint_activations, compile=args.compile, dims=dims, seed=args.seed,
        collective_timeout_s=args.collective_timeout_s,
        save_dir=args.save, save_every=args.save_every, resume_dir=args.resume,
        find_unused_parameters=args.find_unused_parameters,
    )


def _out_dir(args, workload_name: str) -> Path:
    from overdrive.tuning.sweep import writable_folder

    return writable_folder(args.out, workload_name) / "train"  # beside what `optimize` writes for the workload


def main(args, argv: list[str]) -> int:
    """`overdrive train`: launch with torchrun when --nproc > 1, else train in this process."""
    import torch

    from overdrive.core.devices import resolve_device
    from overdrive.train._torchrun import FAILURES_ENV
    from overdrive.train.config import TrainSummary, check_runnable
    from overdrive.train.launch import DistEnv, launch, launched_by_torchrun

    if args.strategy is None:
        args.strategy = "ddp" if (args.nproc or 1) > 1 or "WORLD_SIZE" in os.environ else "none"
    if launched_by_torchrun():
        return _rank_main(args)
    nproc = args.nproc or 1
    config = config_from_args(args, nproc)  # refuses flag errors (TrainConfig checks them) before launching anything
    device = resolve_device(config.device)
    check_runnable(config, device)  # and what depends on the device or the file system
    if config.dims.world_size > 1 or config.dims.strategy != "none":  # a strategy needs a process group, even of 1
        if device.type == "cuda" and torch.cuda.device_count() < nproc:
            raise ConfigError(f"{arg('nproc', nproc)} needs {nproc} GPUs; this machine has {torch.cuda.device_count()}")
        with tempfile.TemporaryDirectory(prefix="overdrive-train-") as tmp:
            summary_file = Path(tmp) / "summary.json"  # rank 0 hands its summary back through it
            env = {SUMMARY_ENV: str(summary_file), ERRORS_ENV: str(Path(tmp) / "error"),
                   FAILURES_ENV: str(Path(tmp) / "failures.json")}
            code = launch(_without_nproc(argv), nproc, env=env)
            if code != 0:
                return _launch_failed(code, Path(tmp))
            summary = TrainSummary(**json.loads(summary_file.read_text()))
    else:
        summary = _train_here(config, DistEnv(0, 0, 1, resolve_device(config.device)), args)
    _finish(args, config, summary)
    return 0


def _launch_failed(code: int, tmp: Path) -> int:
    """One line for a launched job that failed: the ranks' library error (exit 2), else the
    failed ranks' exit codes, their own errors being above (exit 1)."""
    errors = dict.fromkeys(p.read_text().strip() for p in sorted(tmp.glob("error.*")))  # each distinct line once
    if errors:
        sys.stderr.write("".join(f"overdrive: error: {line}\n" for line in errors))
        return 2
    failures = tmp / "failures.json"
    ranks = json.loads(failures.read_text()) if failures.exists() else []
    which = ", ".join(f"rank {r} exit code {c}" for r, c in ranks) or f"torchrun exit code {code}"
    sys.stderr.write(f"overdrive: error: training failed ({which}; the failing rank's error is above)\n")
    return 1


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
            continue
        if word == "--nproc":
            skip = True
            continue
        if word.startswith("--nproc="):
            continue
        out.append(word)
    return out


def _rank_main(args) -> int:
    from overdrive.core.devices import resolve_device
    from overdrive.train.launch import init_distributed, shutdown_distributed

    world = int(os.environ["WORLD_SIZE"])
    if args.nproc and args.nproc != world:
        raise ConfigError(f"{arg('nproc', args.nproc)} differs from torchrun's world size {world}; drop {arg('nproc')} under torchrun")
    config = config_from_args(args, world)
    env = init_distributed(resolve_device(config.device), timeout_s=config.collective_timeout_s)
    try:
        summary = _train_here(config, env, args)
    except Exception as exc:
        shutdown_distributed(barrier=False)
        if isinstance(exc, OverdriveError):
            if os.environ.get(ERRORS_ENV):  # launched by `overdrive train`: it prints the line, once for all ranks
                from overdrive.cli import error_line

                Path(f"{os.environ[ERRORS_ENV]}.{env.rank}").write_text(error_line(exc, "train"))
                return 2
            raise
        raise RuntimeError(f"rank {env.rank} of {env.world_size} failed: {one_line(exc)}") from exc
    shutdown_distributed()
    if env.is_main and SUMMARY_ENV not in os.environ:  # under the user's own torchrun, rank 0 prints the table
        _finish(args, config, summary)
    return 0


def _train_here(config: TrainConfig, env: DistEnv, args) -> TrainSummary:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from overdrive.core.report import format_bytes
    from overdrive.train.loop import run_training

    columns = (TextColumn("train"), BarColumn(), TextColumn("{task.fields[count]}"),
               TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
    with Progress(*columns, disable=not env.is_main, transient=False) as bar:
        task = bar.add_task("train", total=None, count="building the model", stats="")

        def progress(step, total, loss, rate, peak):
            bar.update(task, completed=step, total=total, count=f"{step}/{total} steps",
                       stats=f"loss {loss:.4g} · {rate:,.0f} samples/s · peak {format_bytes(peak)}")

        summary = run_training(config, env, progress=progress)
    if env.is_main:
        out = _out_dir(args, summary.workload)
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(summary.to_dict(), indent=1)
        (out / "summary.json").write_text(text)
        if os.environ.get(SUMMARY_ENV):
            Path(os.environ[SUMMARY_ENV]).write_text(text)
    return summary


def _finish(args, config: TrainConfig, summary: TrainSummary) -> None:
    """Print the run's table, with the fp32 single-process baseline when --compare."""
    import torch
    from rich.table import Table

    from overdrive.core.devices import resolve_device
    from overdrive.core.report import format_bytes, make_console, print_table
    from overdrive.train.launch import DistEnv
    from overdrive.train.loop import run_training
    from overdrive.train.parallel import ParallelDims

    console = make_console()
    rows = [("this run", summary)]
    if args.compare:
        base_config = replace(config, dims=ParallelDims(strategy="none", world_size=1), precision="fp32",
                              checkpoint_activations=False, compile=False, save_dir=None, save_every=0, resume_dir=None,
                              batch_size=summary.global_batch_size // config.grad_accum, steps=summary.steps,
                              find_unused_parameters=None)
        with console.status("measuring the baseline: fp32, one process, same global batch and steps"):
            device = resolve_device(config.device)
            base = run_training(base_config, DistEnv(0, 0, 1, torch.device(device.type, 0) if device.type == "cuda" else device))
        rows.insert(0, ("baseline: fp32, 1 process", base))
    table = Table(title=f"overdrive train {summary.workload} — {summary.objective}")
    for col in ("run", "strategy × processes", "precision", "samples/s", "speedup", "peak memory", "step memory",
                "step memory ratio", "loss first → last"):
        table.add_column(col, justify="left" if col in ("run", "strategy × processes", "precision") else "right",
                         no_wrap=col == "run")
    first = rows[0][1]
    for label, s in rows:
        extras = [x for x, on in (("checkpointing", s.checkpoint_activations), ("compile", s.compile)) if on]
        table.add_row(label, f"{s.strategy} × {s.world_size}", " + ".join([s.precision, *extras]), f"{s.samples_per_s:,.1f}",
                      f"{s.samples_per_s / first.samples_per_s:.2f}×", format_bytes(s.peak_memory_bytes),
                      format_bytes(s.step_memory_bytes), f"{s.step_memory_bytes / max(1, first.step_memory_bytes):.2f}×",
                      f"{s.first_loss:.4g} → {s.last_loss:.4g}")
    print_table(console, table)
    console.print(f"global batch {summary.global_batch_size} rows, steps {summary.start_step}→{summary.steps}; "
                  f"peak memory is {summary.peak_memory_kind} (largest rank); step memory is what the steps added to it", highlight=False)
    if summary.pipeline:
        p = summary.pipeline
        console.print(f"pipeline: {p['stages']} stages split at block {p['split_points']}, {p['schedule']}, "
                      f"{p['microbatches']} microbatches; idle (bubble) fraction measured {p['bubble_fraction']:.3f} "
                      f"(per rank {', '.join(f'{b:.3f}' for b in p['bubble_fraction_per_rank'])}); GPipe's "
                      f"(p−1)/(m+p−1) = {p['gpipe_formula']:.3f}", highlight=False)
    if summary.frozen_parameters:
        names = summary.frozen_parameters
        console.print(f"frozen (reached by no probe batch): {', '.join(names[:12])}"
                      f"{f' and {len(names) - 12} more' if len(names) > 12 else ''}", highlight=False)
    for note in summary.notes:
        console.print(note, highlight=False)
    if config.save_dir:
        import shlex

        console.print(f"checkpoints: {config.save_dir}/step-N", highlight=False)
        spec, weights = shlex.quote(config.workload), shlex.quote(str(config.save_dir))
        console.print(f"next: overdrive optimize {spec} --weights {weights}   (then serve or run the plan it writes; "
                      f"or directly: overdrive serve {spec} --weights {weights})", highlight=False, soft_wrap=True)
