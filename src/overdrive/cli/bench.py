"""`overdrive bench`: the baseline and (optionally) a plan measured at several batch sizes
(`overdrive.tuning.sweep.compare_plan`), as a table, bench.json and a plot. A configuration that
fails at a batch size is named on stderr and the exit code is 1."""

from __future__ import annotations

import sys

from overdrive.cli.args import add_workload_args, dynamic_dims, int_list, positive_int
from overdrive.core.errors import ConfigError, arg


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="measure the baseline and a plan at several batch sizes")
    add_workload_args(bench)
    bench.add_argument("--plan", help="plan.json written by `overdrive optimize` (default: the baseline only; a "
                       "causal LM needs its plan)")
    bench.add_argument("--batch-sizes", type=int_list, help="comma-separated batch sizes (default: the plan's)")
    bench.add_argument("--audit", action="store_true",
                       help="also count one forward's host↔device copies, syncs and launches (PyTorch profiler on CUDA)")
    bench.add_argument("--new-tokens", type=positive_int, help="a generation plan: new tokens per sequence (default: the "
                                                               "plan's)")
    bench.add_argument("--prompt-tokens", type=positive_int, help="a generation plan: prompts of this many tokens of "
                                                                  "held-out text (default: the first six words of each)")


def main(args, argv: list[str]) -> int:
    from overdrive.generate.plan import is_generation_plan
    from overdrive.workloads.generation import is_generation_workload

    if is_generation_workload(args.workload):
        if not args.plan or not is_generation_plan(args.plan):
            raise ConfigError(f"{args.workload} is a causal LM: bench it with the plan `overdrive optimize "
                              f"{args.workload}` wrote ({arg('plan')})")
        from overdrive.cli.generate import bench_main

        return bench_main(args, args.plan)
    if args.new_tokens is not None or args.prompt_tokens is not None:
        raise ConfigError(f"{arg('new_tokens')} and {arg('prompt_tokens')}: only for a causal LM (pydoc-lm, or a factory that returns a Hugging Face causal LM and its tokenizer)")
    return _main(args, argv)


def _main(args, argv: list[str]) -> int:
    from rich.table import Table

    from overdrive.core import devices
    from overdrive.core.audit import Audit
    from overdrive.core.roofline import ABOVE_ROOF, above_roof, describe_peaks, measure_peaks, roofline_cell
    from overdrive.core.report import (
        environment,
        format_fidelity,
        make_console,
        plot_latency_vs_batch,
        print_table,
        write_results,
    )
    from overdrive.techniques import describe_report
    from overdrive.techniques.registry import compute_dtype
    from overdrive.tuning.report import ROOFLINE_NOTE, format_memory
    from overdrive.tuning.plan import load_plan
    from overdrive.tuning.sweep import compare_plan, open_session

    console = make_console()
    plan, device = None, args.device
    if args.plan:
        plan, device, _ = load_plan(args.plan, device=args.device, workload=args.workload)
    # The plan knows its model file (wherever it was made from) and a TorchScript file's input shape.
    workload = plan.create_workload() if plan and args.input_shape is None else args.workload
    session = open_session(workload, device=device, batch_size=args.batch_size or (plan.batch_size if plan else None),
                           num_samples=args.num_samples, out=args.out, input_shape=args.input_shape,
                           input_dtype=args.input_dtype, data=args.data, text_field=args.text_field,
                           weights=args.weights, dynamic_dims=None if plan else dynamic_dims(args.dynamic_dim))
    batch_sizes = session.sweep_sizes(args.batch_sizes or [session.batch_size])
    refused = session.refused_sizes(args.batch_sizes or [])
    device_name = devices.describe(session.device)
    measure_peaks(session.device, [compute_dtype(plan.steps)] if plan else [])  # before any model loads the machine
    with console.status("measuring") as status:
        notices: list[str] = []
        curves, failures, reports = compare_plan(session, plan, batch_sizes, audit=args.audit, notice=notices.append,
                                                 progress=lambda d: status.update(f"measuring {d}"))
    failures = [*refused, *failures]

    table = Table(title=f"overdrive bench {session.workload.name} — {device_name}")
    for col in ("configuration", "batch size", "latency p50/p90/p99 ms", "samples/s\n% roof", "speedup [99% interval]",
                "peak memory", "fidelity"):
        table.add_column(col, justify="left" if col in ("configuration", "fidelity") else "right")
    first = next(iter(curves))
    key = session.workload.fidelity_key
    for label, points in curves.items():
        for b, m in points:
            table.add_row(label, str(b), f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f} / {m.latency_ms['p99']:.2f}",
                          "\n".join(c for c in (f"{m.samples_per_s:,.1f}", roofline_cell(m.roofline, compact=True)) if c),
                          m.gain.describe() if m.gain else ("1.00×" if label == first else ""),
                          format_memory(m), format_fidelity(m, key))
    print_table(console, table)
    console.print(f"{session.describe_samples()} per measurement; {session.workload.describe_rows(session.num_distinct_samples)}; "
                  "speedup over the baseline at the same batch size, timed interleaved with it", highlight=False)
    for report in (r for label_reports in reports.values() for r in label_reports):
        console.print(describe_report(report, key), highlight=False, soft_wrap=True)
    console.print(f"{ROOFLINE_NOTE}; measured peaks: {describe_peaks(session.device) or 'none'}", style="dim",
                  highlight=False, soft_wrap=True)
    if above_roof(m.roofline for points in curves.values() for _, m in points):
        console.print(f"[yellow]warning: a roofline share is {ABOVE_ROOF}[/]", highlight=False, soft_wrap=True)
    for line in notices:
        console.print(f"[yellow]note: {line}[/]", highlight=False, soft_wrap=True)
    for label, points in curves.items():
        for b, m in points:
            if m.audit:
                audit = Audit.from_dict(m.audit)
                console.print(f"audit, {label}: {audit.describe()}", highlight=False, soft_wrap=True)
    out = session.out_dir
    write_results(out / "bench.json", {
        "workload": session.workload.name, "device": device_name, "environment": environment(),
        "plan": plan.to_dict() if plan else None,
        "num_samples": session.num_samples, "num_distinct_samples": session.num_distinct_samples, "failures": failures,
        "units": {"latency_ms": "milliseconds per call", "samples_per_s": "rows per second", "peak_memory_bytes": "bytes",
                  "roofline": "flops_per_s: FLOP/s; bytes_per_s: bytes/s; intensity: FLOP/byte; fraction: of the binding roof",
                  "audit": "counts and bytes per forward of one batch"},
        "measured_peaks": describe_peaks(session.device),
        "results": {label: [{"batch_size": b, **m.to_dict()} for b, m in points] for label, points in curves.items()},
    })
    if len(batch_sizes) > 1:
        plot_latency_vs_batch(out / "bench_latency_vs_batch_size.png", curves, title=f"{session.workload.name} on {device_name}")
    console.print(f"wrote {out / 'bench.json'}")
    for failure in failures:  # a table without the plan's row is not a measurement of it: exit 1
        sys.stderr.write(f"overdrive: bench: {failure}\n")
    return 1 if failures else 0
