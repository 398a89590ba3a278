"""`overdrive bench`: the baseline and (optionally) a plan measured at several batch sizes."""

from __future__ import annotations

from rich.table import Table

from overdrive.core import devices
from overdrive.core.errors import UserError
from overdrive.core.report import environment, format_bytes, format_fidelity, make_console, plot_latency_vs_batch, write_results
from overdrive.optimize.plan import Plan
from overdrive.optimize.sweep import open_session, sweep
from overdrive.techniques.pruning.recovery import describe


def cmd_bench(args) -> int:
    console = make_console()
    plan = Plan.load(args.plan) if args.plan else None
    if plan and plan.workload != args.workload:
        raise UserError(f"--plan {args.plan} was made for workload {plan.workload!r}, not {args.workload!r}; "
                        f"run `overdrive bench {plan.workload} --plan {args.plan}`")
    if plan:
        plan.check_checkpoints()  # a missing or foreign checkpoint is an error now, not a failed row later
    if plan and args.device == "auto":
        args.device = plan.device  # a plan holds on the device type it was tuned on
    session = open_session(args, batch_size=plan.batch_size if plan and not args.batch_size else None)
    if plan and plan.device != session.device.type:
        raise UserError(f"--plan {args.plan} was tuned on {plan.device!r} and holds only there; run `overdrive optimize "
                        f"{args.workload} --device {session.device.type}` to make a plan for this device")
    batch_sizes = session.sweep_sizes(args.batch_sizes or [session.batch_size])
    configs = {"baseline (eager fp32)": []}
    if plan:
        configs["plan: " + (" + ".join(plan.names) or "baseline")] = plan.steps
    device_name = devices.describe(session.device)
    failures: list[str] = []
    reports: dict[str, list[dict]] = {}
    with console.status("measuring") as status:
        curves = sweep(session, configs, batch_sizes, progress=lambda d: status.update(f"measuring {d}"), warn=failures.append,
                       reports=reports)

    table = Table(title=f"overdrive bench {session.workload.name} — {device_name}")
    for col in ("configuration", "batch size", "latency p50/p90/p99 ms", "samples/s", "speedup", "peak memory", "fidelity"):
        table.add_column(col, justify="left" if col in ("configuration", "fidelity") else "right")
    base = dict(curves["baseline (eager fp32)"])
    key = session.workload.fidelity_key
    for label, points in curves.items():
        for b, m in points:
            table.add_row(label, str(b), f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f} / {m.latency_ms['p99']:.2f}",
                          f"{m.samples_per_s:,.1f}", f"{m.samples_per_s / base[b].samples_per_s:.2f}×" if b in base else "",
                          format_bytes(m.peak_memory_bytes), format_fidelity(m, key))
    console.print(table)
    console.print(f"{session.describe_samples()} per measurement")
    for report in (r for label_reports in reports.values() for r in label_reports):
        console.print(describe(report, key), highlight=False, soft_wrap=True)
    for failure in failures:
        console.print(f"[yellow]{failure}[/]")
    out = session.out_dir
    write_results(out / "bench.json", {
        "workload": session.workload.name, "device": device_name, "environment": environment(),
        "plan": plan.to_dict() if plan else None,
        "num_samples": session.num_samples, "num_distinct_samples": session.num_distinct_samples, "failures": failures,
        "units": {"latency_ms": "milliseconds per call", "samples_per_s": "rows per second", "peak_memory_bytes": "bytes"},
        "results": {label: [{"batch_size": b, **m.to_dict()} for b, m in points] for label, points in curves.items()},
    })
    if len(batch_sizes) > 1:
        plot_latency_vs_batch(out / "bench_latency_vs_batch_size.png", curves, title=f"{session.workload.name} on {device_name}")
    console.print(f"wrote {out / 'bench.json'}")
    return 0
