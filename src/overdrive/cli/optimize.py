"""`overdrive optimize`: the main job (`overdrive.optimize`): baseline, each technique alone,
composition, plan, report; the table and what was written."""

from __future__ import annotations

import shlex
from pathlib import Path

from overdrive.core.errors import ConfigError, arg

from overdrive.cli.args import (
    add_workload_args,
    dynamic_dims,
    fraction,
    int_list,
    positive_int,
    name_list,
    nonnegative,
    nonnegative_int,
    open_fraction,
    ratio,
)


from overdrive.tuning.budget import DEFAULT_TIME_BUDGET_S


def add_parser(sub) -> None:
    opt = sub.add_parser("optimize", help="measure baseline and techniques, compose the winners, write a plan")
    add_workload_args(opt)
    opt.add_argument("--techniques", type=name_list, help="comma-separated names to try (default: all; see `overdrive list`)")
    opt.add_argument("--max-accuracy-drop", type=nonnegative, help="task-metric points a technique may lose (workloads with labels)")
    opt.add_argument("--min-fidelity", type=fraction, default=0.99, help="floor on cosine / agreement with fp32 (default 0.99)")
    opt.add_argument("--min-gain", type=ratio, default=1.02,
                     help="throughput ratio a step needs over what it is added to, at the low end of its 99%% confidence "
                          "interval (default 1.02; 0 keeps every step within budget whatever its speed)")
    opt.add_argument("--lossless", action="store_true", help="keep lossless techniques only (as --max-accuracy-drop 0)")
    opt.add_argument("--prune-ratio", type=open_fraction,
                     help="fraction of channels / heads / FFN width the named pruning techniques remove (default: "
                          "0.5 for prune-channels, 1/3 for prune-heads and prune-ffn)")
    opt.add_argument("--finetune-steps", type=nonnegative_int,
                     help="recovery fine-tune steps after pruning (default 300; 0: none)")
    opt.add_argument("--overwrite", action="store_true", help="replace the plan already in OUT/<workload>/")
    opt.add_argument("--sweep-batch-sizes", type=int_list, help="batch sizes for the report's plot (default: 1, B/4, B, 2B)")
    opt.add_argument("--max-new-tokens", type=positive_int, help="a causal LM (pydoc-lm, a factory of one): new tokens per sequence in "
                                                                  "the timings (default 32)")
    opt.add_argument("--time-budget", type=nonnegative, default=None, metavar="SECONDS",
                     help=f"seconds optimize may take: candidates are tried by predicted gain per second and those "
                          f"that would not finish are reported untried (default {DEFAULT_TIME_BUDGET_S:.0f}; 0: no limit, "
                          f"try everything)")


def main(args, argv: list[str]) -> int:
    from overdrive.workloads.generation import is_generation_workload

    if is_generation_workload(args.workload):
        from overdrive.cli.generate import optimize_main

        args.max_new_tokens = args.max_new_tokens or 32
        return optimize_main(args, argv)
    if args.max_new_tokens is not None:
        raise ConfigError(f"{arg('max_new_tokens', args.max_new_tokens)}: only for a causal LM (pydoc-lm, or a factory that returns a Hugging Face causal LM and its tokenizer)")
    return _main(args, argv)


def _main(args, argv: list[str]) -> int:
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from overdrive.core import devices
    from overdrive.core.report import make_console, print_table
    from overdrive.tuning.api import OptimizeJob
    from overdrive.tuning.report import (compile_times, detail_lines, figure_lines, headline, reasons_in_full, rows_table,
                                         table_note)

    console = make_console()
    job = OptimizeJob.prepare(
        args.workload, device=args.device, max_accuracy_drop=args.max_accuracy_drop, min_fidelity=args.min_fidelity,
        min_gain=args.min_gain, lossless=args.lossless, techniques=args.techniques, batch_size=args.batch_size,
        num_samples=args.num_samples, prune_ratio=args.prune_ratio, finetune_steps=args.finetune_steps,
        sweep_batch_sizes=args.sweep_batch_sizes, out=args.out, input_shape=args.input_shape, input_dtype=args.input_dtype,
        data=args.data, text_field=args.text_field, weights=args.weights, dynamic_dims=dynamic_dims(args.dynamic_dim),
        time_budget_s=args.time_budget,
        command="overdrive " + shlex.join(argv))
    session, workload = job.session, job.session.workload
    existing = session.out_dir / "plan.json"
    if existing.exists() and not args.overwrite:
        raise ConfigError(f"{existing} exists (a plan optimize wrote before); pass {arg('overwrite')} to replace it, or "
                          f"{arg('out')} for another folder")
    device_name = devices.describe(session.device)
    console.print(f"[bold]overdrive optimize {workload.name}[/] on {device_name}, batch size {session.batch_size}, "
                  f"{session.describe_samples()}")
    if not workload.real_weights:
        console.print("[yellow]random weights: figures are for speed only, not accuracy claims[/]")
    console.print(("[yellow]" if workload.rows_source == "random" else "") + session.workload.describe_rows(
        session.num_distinct_samples) + ("[/]" if workload.rows_source == "random" else ""), highlight=False)
    for note in workload.notes:
        console.print(f"[yellow]note: {note}[/]", highlight=False, soft_wrap=True)
    if session.num_distinct_samples < session.batch_size:
        console.print(f"[yellow]batch size {session.batch_size} exceeds the {session.num_distinct_samples} samples: "
                      "samples are repeated to fill each batch[/]")

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task("baseline", total=None)

        def step(description: str, done: int, total: int) -> None:
            bar.update(task, description=f"measuring {description}", completed=done + 1, total=total)
            if not console.is_terminal:  # logs and CI: a line per step instead of a live bar
                elapsed = bar.tasks[0].elapsed or 0
                eta = job.eta_s()  # the estimates of what is left, within the time budget
                left = f", about {eta / 60:.0f} min left" if eta is not None and eta >= 60 else \
                    (", under a minute left" if eta is not None else "")
                console.print(f"  measuring {description} ({elapsed:.0f} s{left})", highlight=False)

        result = job.run(step)

    key = workload.fidelity_key
    table = rows_table(result, fidelity_key=key, rows_description=result.rows_description,
                       title=f"overdrive optimize {workload.name} — {device_name}, batch {session.batch_size}")
    print_table(console, table)
    console.print(table_note(result, result.rows_description), style="dim", highlight=False, soft_wrap=True)
    for line in reasons_in_full(result):
        console.print(f"  why not, {line}", highlight=False, soft_wrap=True)
    for line in detail_lines(result, fidelity_key=key):
        console.print(line, highlight=False, soft_wrap=True)  # one line per report, for logs and grep
    compiled = compile_times(result)
    if compiled:
        console.print("warm-up beyond steady state (compilation, autotuning, lazy loading), apart from the figures "
                      "above: " + "; ".join(f"{label} {seconds:.1f} s" for label, seconds in compiled))
    if result.flops_per_sample:
        console.print(f"FLOPs per sample (eager fp32, torch.utils.flop_counter; text: real tokens, no padding): {result.flops_per_sample / 1e9:.3f} GFLOP")
    for line in figure_lines(result):
        console.print(line, highlight=False, soft_wrap=True)
    for warning in result.sweep_warnings:
        console.print(f"[yellow]batch-size sweep: {warning}[/]")
    for warning in result.warnings:
        console.print(f"[yellow]warning: {warning}[/]", highlight=False, soft_wrap=True)
    out = session.out_dir
    console.print(f"plan: [bold]{' + '.join(result.plan.names) or 'baseline'}[/] "
                  f"({headline(result.plan.measured) if result.plan.names else 'nothing beat the baseline'})",
                  highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'plan.json'}, {out / 'results.json'}, {out / 'report.md'}")
    console.print(next_steps(args.workload, out / "plan.json", session.batch_size), highlight=False, soft_wrap=True)
    return 0


def next_steps(workload: str, plan_path: Path, batch_size: int) -> str:
    """The commands to try the plan with: bench at batch 1 and the plan's size (once each), serve, run."""
    plan = shlex.quote(str(plan_path))
    sizes = ",".join(str(b) for b in dict.fromkeys((1, batch_size)))
    return (f"next: overdrive bench {shlex.quote(workload)} --plan {plan} --batch-sizes {sizes}  ·  "
            f"overdrive serve {plan}  ·  overdrive run {plan} --input FILE --output OUT.parquet")
