"""`overdrive optimize`: the main job. Baseline, each technique alone, composition, plan, report."""

from __future__ import annotations

import shlex

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from overdrive.core import devices
from overdrive.core.errors import UserError
from overdrive.core.report import (
    compile_times,
    detail_lines,
    environment,
    make_console,
    plot_latency_vs_batch,
    rows_table,
    write_report_md,
    write_results,
)
from overdrive.optimize.plan import save_checkpoints
from overdrive.optimize.sweep import open_session, sweep
from overdrive.optimize.tuner import Guard, Tuner
from overdrive.techniques import get_technique, list_techniques


def default_sweep(batch_size: int) -> list[int]:
    return sorted({1, max(1, batch_size // 4), batch_size, 2 * batch_size})


def technique_configs(args) -> dict:
    """Configs built from --prune-ratio / --finetune-steps for the named pruning techniques.

    Raises:
        UserError: a pruning flag is given but no pruning technique is named in --techniques.
    """
    from overdrive.techniques.pruning.recovery import PruningTechnique

    overrides = {"ratio": args.prune_ratio, "finetune_steps": args.finetune_steps}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return {}
    pruning = [n for n in args.techniques or [] if isinstance(get_technique(n), PruningTechnique)]
    if not pruning:
        flags = [{"ratio": "--prune-ratio", "finetune_steps": "--finetune-steps"}[k] for k in overrides]
        known = ", ".join(t.name for t in list_techniques() if isinstance(t, PruningTechnique))
        raise UserError(f"{' and '.join(flags)} appl{'y' if len(flags) > 1 else 'ies'} to pruning techniques; "
                        f"name one in --techniques ({known})")
    configs = {}
    for name in pruning:
        config_cls = get_technique(name).config_cls
        fields = {k: v for k, v in overrides.items() if k in config_cls.__dataclass_fields__}
        configs[name] = config_cls(**fields)
    return configs


def cmd_optimize(args, argv: list[str]) -> int:
    console = make_console()
    for name in args.techniques or []:
        try:
            get_technique(name)
        except KeyError as exc:
            raise UserError(f"--techniques: {exc.args[0]}") from None
    configs = technique_configs(args)
    session = open_session(args)
    workload = session.workload
    if args.max_accuracy_drop is not None and not workload.has_task_metric:
        raise UserError(f"--max-accuracy-drop: workload {workload.name!r} has no task metric; use --min-fidelity")
    guard = Guard(min_fidelity=args.min_fidelity, max_accuracy_drop=args.max_accuracy_drop, min_gain=args.min_gain)
    sweep_sizes = args.sweep_batch_sizes or default_sweep(session.batch_size)
    device_name = devices.describe(session.device)
    console.print(f"[bold]overdrive optimize {workload.name}[/] on {device_name}, batch size {session.batch_size}, "
                  f"{session.describe_samples()}")
    if not workload.real_weights:
        console.print("[yellow]random weights: figures are for speed only, not accuracy claims[/]")
    if session.num_distinct_samples < session.batch_size:
        console.print(f"[yellow]batch size {session.batch_size} exceeds the {session.num_distinct_samples} samples: "
                      "samples are repeated to fill each batch[/]")
    sweep_sizes = session.sweep_sizes(sweep_sizes)
    sweep_warnings: list[str] = []

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        tuner = Tuner(workload=workload, device=session.device, batch_size=session.batch_size, techniques=args.techniques,
                      guard=guard, num_samples=session.num_distinct_samples, workload_spec=session.spec,
                      configs=configs)
        task = progress.add_task("baseline", total=2 + 2 * len(tuner.techniques) + len(configs) + 2 * len(sweep_sizes))

        def step(description: str) -> None:
            progress.update(task, description=f"measuring {description}", advance=1)
            if not console.is_terminal:  # logs and CI: a line per step instead of a live bar
                console.print(f"  measuring {description} ({progress.tasks[0].elapsed or 0:.0f} s)", highlight=False)

        tuner.progress = step
        result = tuner.run()
        out = session.out_dir
        result.plan.steps = save_checkpoints(result.plan.steps, workload, session.device, out)
        result.plan.save(out / "plan.json")  # before the sweep: the plan is the main result
        progress.update(task, total=progress.tasks[0].completed + 2 * len(sweep_sizes))
        curves = sweep(session, {"baseline (eager fp32)": [], "plan": result.plan.steps}, sweep_sizes,
                       progress=step, warn=sweep_warnings.append)

    table = rows_table(result, fidelity_key=workload.fidelity_key,
                       title=f"overdrive optimize {workload.name} — {device_name}, batch {session.batch_size}")
    console.print(table)
    for line in detail_lines(result, fidelity_key=workload.fidelity_key):
        console.print(line, highlight=False, soft_wrap=True)  # one line per report, for logs and grep
    compiled = compile_times(result)
    if compiled:
        console.print("warm-up beyond steady state (compilation, autotuning, lazy loading), apart from the figures "
                      "above: " + "; ".join(f"{label} {seconds:.1f} s" for label, seconds in compiled))
    if result.flops_per_sample:
        console.print(f"FLOPs per sample (eager fp32, torch.utils.flop_counter): {result.flops_per_sample / 1e9:.3f} GFLOP")
    for warning in sweep_warnings:
        console.print(f"[yellow]batch-size sweep: {warning}[/]")
    plot_name = "latency_vs_batch_size.png"
    plot_latency_vs_batch(out / plot_name, curves, title=f"{workload.name} on {device_name}")
    command = "overdrive " + shlex.join(argv)
    write_results(out / "results.json", {
        "command": command,
        "workload": workload.name,
        "real_weights": workload.real_weights,
        "device": device_name,
        "environment": environment(),
        "batch_size": session.batch_size,
        "num_samples": session.num_samples,
        "num_distinct_samples": session.num_distinct_samples,
        "sweep_warnings": sweep_warnings,
        "guard": {"min_fidelity": guard.min_fidelity, "max_accuracy_drop_pt": guard.max_accuracy_drop, "min_gain": guard.min_gain},
        "fidelity_key": workload.fidelity_key,
        "flops_per_sample": result.flops_per_sample,
        "units": {"latency_ms": "milliseconds per call", "samples_per_s": "rows per second",
                  "peak_memory_bytes": "bytes", "compile_s": "seconds", "warmup_s": "seconds",
                  "accuracy_pct": "percent", "flops_per_sample": "floating-point operations"},
        "rows": [r.to_dict() for r in result.rows],
        "sweep": {label: [{"batch_size": b, **m.to_dict()} for b, m in points] for label, points in curves.items()},
        "plan": result.plan.to_dict(),
    })
    write_report_md(out / "report.md", result=result, workload_name=workload.name, device_name=device_name,
                    fidelity_key=workload.fidelity_key, sweep=curves, plot_name=plot_name, command=command,
                    real_weights=workload.real_weights)
    console.print(f"plan: [bold]{' + '.join(result.plan.names) or 'baseline'}[/] "
                  f"({result.plan.measured['speedup_vs_baseline']:.2f}× baseline samples/s)")
    console.print(f"wrote {out / 'plan.json'}, {out / 'results.json'}, {out / 'report.md'}")
    return 0
