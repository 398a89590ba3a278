"""`overdrive run`: offline batch inference over a dataset (`overdrive.run.job.run_offline`), with a
progress bar (items/s, ETA, device busy %) and the summary of where the time went."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from overdrive.cli.args import add_weights_arg, batch_size_arg, nonnegative_int, positive_int
from overdrive.core.errors import ConfigError, arg


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="offline batch inference over a dataset: every record through the model (or a "
                                     "plan) into one output file, resumable")
    run.add_argument("workload", nargs="?", help="minilm, digits-cnn, a torchvision name (resnet50), package.module:factory, "
                                                  "or a plan.json (optional with --plan)")
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
    add_weights_arg(run)
    run.add_argument("--engine", choices=("local", "ray"), default="local",
                     help="local (default), or ray: Ray Data actors, one model each (needs --plan; ray[data] installed)")
    run.add_argument("--concurrency", type=positive_int, default=1, help="--engine ray: the number of actors (default 1)")
    run.add_argument("--max-new-tokens", type=positive_int, help="a generation plan: new tokens per prompt unless a record "
                                                                 "sets max_tokens (default: the plan's)")
    run.add_argument("--max-errors", type=nonnegative_int, help="stop once more records than this fail to read or decode "
                                                                "(default: no limit; they go to OUTPUT.errors.jsonl)")


def main(args, argv: list[str]) -> int:
    """`overdrive run`: progress bar with items/s, ETA and device busy %, then the summary table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from overdrive.core.report import make_console
    from overdrive.run.job import RunConfig, run_offline
    from overdrive.run.resume import Parts

    if args.workload and args.workload.endswith(".json") and not args.plan:  # `run PLAN.json`, as `serve PLAN.json`
        args.plan, args.workload = args.workload, None
    config = RunConfig(workload=args.workload, input=Path(args.input), output=Path(args.output),
                       plan=Path(args.plan) if args.plan else None, device=args.device, batch_size=args.batch_size,
                       text_field=args.text_field, num_workers=args.num_workers, chunk_size=args.chunk_size,
                       resume=args.resume, overwrite=args.overwrite, max_errors=args.max_errors,
                       weights=Path(args.weights) if args.weights else None)
    from overdrive.generate.plan import is_generation_plan

    if args.plan and is_generation_plan(args.plan):
        from overdrive.cli.generate_run import run_main

        return run_main(args)
    if args.max_new_tokens is not None:
        raise ConfigError(f"{arg('max_new_tokens', args.max_new_tokens)}: only for a generation plan")
    if config.workload is None and config.plan is None:
        raise ConfigError(f"name a workload (e.g. minilm) or give {arg('plan')}")
    console = make_console()
    if args.engine == "ray":
        return _run_on_ray(args, config, console)
    columns = (TextColumn("run"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
               TimeRemainingColumn())
    state = {"start": None, "first": 0, "shown": False}
    bar = Progress(*columns, console=console, transient=False)  # shown from the first batch, not before errors
    task = bar.add_task("run", total=None, stats="")

    def progress(done, failed, busy):
        now = time.perf_counter()
        if done is None:  # (None, total) before the first batch
            bar.start()
            state["shown"] = True
            bar.update(task, total=failed)
            return
        if state["start"] is None:
            state["start"], state["first"] = now, done
        rate = (done - state["first"]) / max(now - state["start"], 1e-9)
        bar.update(task, completed=done, stats=f"{rate:,.0f} items/s · device busy {100 * busy:.0f}% · {failed} failed")

    try:
        summary = run_offline(config, progress=progress, status=lambda text: console.print(f"[dim]{text}[/dim]"))
    except KeyboardInterrupt:
        parts = Parts(config.output)
        if parts.dir.exists():
            sys.stderr.write(f"overdrive run: interrupted; {len(parts.done())} finished chunks are in {parts.dir}; "
                             "rerun with --resume to continue\n")
        raise
    finally:
        if state["shown"]:
            bar.stop()
    print_summary(console, summary)
    return 0


def _run_on_ray(args, config, console) -> int:
    from overdrive.run.ray_engine import run_on_ray

    if config.plan is None:
        raise ConfigError(f"{arg('engine', 'ray')} runs a plan's model on each actor; give {arg('plan')} (or run PLAN.json)")
    if args.resume or args.max_errors is not None or args.batch_size is not None or config.workload:
        raise ConfigError(f"{arg('engine', 'ray')} takes the plan's model and batch size, and runs whole; leave out "
                          f"{arg('resume', True)}, {arg('max_errors')}, {arg('batch_size')} and WORKLOAD")
    with console.status(f"running on Ray Data with {args.concurrency} actor(s)"):
        s = run_on_ray(plan=config.plan, input=config.input, output=config.output, concurrency=args.concurrency,
                       text_field=config.text_field, overwrite=config.overwrite)
    console.print(f"{s['records'] - s['failed']:,} of {s['records']:,} records → {config.output}; {s['failed']:,} failed; "
                  f"{s['items_per_s']:,.1f} items/s over {s['wall_s']:.1f} s on {s['concurrency']} Ray actor(s) "
                  "(actor start-up included)", highlight=False)
    return 0


def print_summary(console, s) -> None:
    """Items done and failed, time, items/s, and where the time went (`s`: a RunSummary)."""
    from rich.table import Table

    from overdrive.run.resume import Parts

    if s.nothing_to_resume:
        console.print(f"{s.output} exists and no interrupted run is recorded for it ({Parts(Path(s.output)).dir} is "
                      "absent): nothing to resume; pass --overwrite to run it again", highlight=False)
        return
    resumed = f" ({s.done_before:,} done before the resume)" if s.done_before else ""
    console.print(f"{s.records - s.failed:,} of {s.records:,} records → {s.output}{resumed}; "
                  f"{s.failed:,} failed" + (f" (see {s.errors_path})" if s.errors_path else ""), highlight=False)
    console.print(f"{s.processed:,} records in {s.wall_s:.2f} s = {s.items_per_s:,.1f} items/s on {s.device} "
                  f"({s.replicas} replica{'s' if s.replicas > 1 else ''}, {s.num_workers} reader processes), batch size "
                  f"{s.batch_size} from {s.batch_size_source}; device busy {100 * s.device_busy_fraction:.0f}% of the "
                  f"time; set-up before that {s.setup_s:.1f} s (model, warm-up{', auto batch size' if s.auto_batch else ''})",
                  highlight=False)
    if s.auto_batch:
        console.print("auto batch size: " + ", ".join(f"{int(t['batch_size'])} → {t['items_per_s']:,.0f}/s"
                                                      for t in s.auto_batch), highlight=False)
    table = Table(title="where the time went")
    for col in ("phase", "seconds", "of wall time", "runs on"):
        table.add_column(col, justify="left" if col in ("phase", "runs on") else "right")
    labels = {"read_decode": ("reading / decoding", "reader processes (summed)" if s.num_workers else "main thread"),
              "wait_input": ("replica waiting for input", "replica threads"),
              "h2d_copy": ("host → device copy", "copy stream" if s.device.startswith("cuda") else "none on CPU"),
              "compute": ("compute", "device"), "d2h_copy": ("device → host copy", "device"),
              "write": ("writing chunks", "writer thread"), "assemble": ("assembling the output", "main thread")}
    for key, (label, where) in labels.items():
        seconds = s.phases_s.get(key, 0.0)
        table.add_row(label, f"{seconds:.3f}", f"{100 * seconds / max(s.wall_s, 1e-9):.0f}%", where)
    console.print(table)
    console.print("phases overlap (readers, copies, compute and the writer run at once), so their sum can exceed the "
                  "wall time", style="dim")
    for warning in s.warnings:
        console.print(f"[yellow]warning: {warning}[/]", highlight=False, soft_wrap=True)
