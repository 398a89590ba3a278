"""What `optimize` prints and writes: the per-technique table (terminal and Markdown), the
techniques' report lines, compile times, and report.md.

Each takes the tuner's result: anything with `rows`, `baseline`, `plan` and `flops_per_sample`
(a `TuneResult`, or the `OptimizeResult` the API returns)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from overdrive.core.measure import Measurement
from overdrive.core.report import environment, format_bytes, format_fidelity, sweep_markdown
from overdrive.core.audit import Audit
from overdrive.core.roofline import Roofline, roofline_cell
from overdrive.techniques import describe_report
from overdrive.tuning.rows import Row, TuneResult


def short_reason(reason: str, width: int = 40) -> str:
    """A reason as the terminal table shows it: up to its first parenthesis or semicolon, at most
    `width` characters (the whole reason is in report.md, results.json and the lines after the table)."""
    import textwrap

    cut = min([i for i in (reason.find(" ("), reason.find("; ")) if i > 0], default=len(reason))
    return textwrap.shorten(reason[:cut], width, placeholder="…")


def _kept(row: Row, short: bool = False) -> str:
    if row.phase in ("baseline", "plan"):
        return "—"
    if row.phase == "without":
        return (short_reason(row.reason) if short else row.reason) if row.reason else "—"
    if row.kept and row.phase == "compose" and row.gain is not None and row.versus != "the baseline":
        return f"yes: {row.gain.describe()}{'' if short else ' over the steps before it'}"
    return "yes" if row.kept else f"no: {short_reason(row.reason) if short else row.reason}"


def reasons_in_full(result: TuneResult) -> list[str]:
    """"label: reason" for each row not kept, one line each (the table shows them shortened)."""
    return [f"{row.label}: {row.reason}" for row in result.rows if row.reason and not row.kept]


def _speedup(row: Row) -> str:
    """The speedup vs the baseline, with its 99% interval where it was measured against the baseline directly."""
    if row.gain is not None and row.versus == "the baseline":
        return row.gain.describe()
    if row.speedup is None:
        return ""
    return f"{row.speedup:.2f}×"


def headline(measured: dict) -> str:
    """The plan's speedup as a user may quote it (`gain.Gain.quoted`): "2.31× [2.20, 2.43] the baseline's
    samples/s"; the interval's low end when it is wide; "uncertain" and why, when the machine was busy."""
    low, high = measured.get("speedup_interval99") or measured.get("speedup_ci99") or [None, None]
    interval = f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None and (low, high) != (1.0, 1.0) else ""
    quoted, why = measured.get("speedup_vs_baseline"), measured.get("speedup_uncertain")
    if quoted is None:
        return f"speedup uncertain: {why}; 99% interval{interval}, not a figure to quote"
    if why:
        return f"at least {quoted:.2f}× the baseline's samples/s ({why}:{interval})"
    return f"{quoted:.2f}×{interval} the baseline's samples/s"


def caption(result: TuneResult, rows_description: str) -> str:
    """What the fidelity column is judged on and by: the rows, and the rule."""
    rule = f"; {result.rule.describe()}" if result.rule is not None else ""
    return (f"fidelity against eager fp32 outputs, {rows_description}{rule}; speedup [99% interval] from passes interleaved "
            "with the baseline's (a step's own gain over the steps before it is in its row); samples/s: each row's median "
            "pass, timed at different moments")


def rows_table(result: TuneResult, *, fidelity_key: str, title: str, rows_description: str = "") -> Table:
    """The per-technique table for a terminal of 100 columns: technique | kept? | p50/p90 ms |
    speedup [99% interval] | samples/s over % of the roofline | peak mem | fidelity, reasons shortened (`reasons_in_full`
    gives them whole); what it shows is said by `table_note`, printed after it."""
    table = Table(title=title, show_lines=False)
    longest_word = max((len(w) for row in result.rows for w in row.label.split()), default=9)
    for col, justify in [("technique", "left"), ("kept?", "left"), ("p50/p90 ms", "right"), ("speedup", "right"),
                         ("samples/s\n% roof", "right"), ("peak mem", "right"), ("fidelity", "left")]:
        table.add_column(col, justify=justify, min_width={"technique": longest_word, "p50/p90 ms": 7}.get(col),
                         no_wrap=col in ("samples/s\n% roof", "peak mem"))
    previous_phase = None
    for row in result.rows:
        if previous_phase is not None and row.phase != previous_phase:
            table.add_section()
        previous_phase = row.phase
        m = row.measurement
        busy = BUSY_MARK if m is not None and _busy(m) else ""
        table.add_row(
            row.label,
            _kept(row, short=True),
            f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f}{busy}" if m else "",
            _speedup(row),
            "\n".join(c for c in (f"{m.samples_per_s:,.1f}{busy}", roofline_cell(m.roofline, compact=True)) if c) if m else "",
            format_memory(m) if m else "",
            format_fidelity(m, _key(result, fidelity_key), compact=True),
        )
    return table


BUSY_MARK = "†"


def _busy(m: Measurement) -> bool:
    """Most of the measurement's timed stretches ran preempted by other work (`Contention.busy`)."""
    from overdrive.core.interference import Contention

    return bool(m.contention) and Contention(**m.contention).busy


def format_memory(m: Measurement) -> str:
    """The peak-memory cell: allocated / reserved on CUDA, the RSS high-water mark on the CPU."""
    if m.peak_reserved_bytes is not None:
        return f"{format_bytes(m.peak_memory_bytes)} / {format_bytes(m.peak_reserved_bytes)}"
    return format_bytes(m.peak_memory_bytes)


ROOFLINE_NOTE = ("roofline: achieved FLOP/s (the model's FLOPs per sample × samples/s) over the binding roof (comp: the "
                 "GEMM peak in the plan's dtype; mem: FLOP/byte × copy bandwidth), both peaks measured on this device; "
                 "bytes: weights + inputs + outputs; ~: a runtime's hidden weights estimated; !: above the roof, uncertain")


def table_note(result: TuneResult, rows_description: str = "") -> str:
    """What the table's figures are: the memory kind, the roofline, the rows and rule of the fidelity column, the intervals."""
    memory_kind = ("CUDA allocator peak allocated / reserved" if result.baseline.peak_memory_kind.startswith("cuda")
                   else "process RSS high-water")
    busy = (f"; {BUSY_MARK}: timed while other work ran (most stretches preempted, none clean enough to replace them): "
            "the busy machine's absolute figure, not one to quote") if any(
        r.measurement is not None and _busy(r.measurement) for r in result.rows) else ""
    return f"peak memory: {memory_kind}; {ROOFLINE_NOTE}; {caption(result, rows_description or 'the evaluation rows')}{busy}"


def figure_lines(result: TuneResult) -> list[str]:
    """The roofline of the baseline and the plan (with the peaks measured), and the copy and sync audit of
    one forward of each."""
    lines = []
    if result.peaks:
        lines.append(f"measured peaks: {result.peaks}")
    for row in result.rows:
        m = row.measurement
        if row.phase not in ("baseline", "plan") or m is None or (row.phase == "plan" and not row.steps):
            continue
        name = "baseline" if row.phase == "baseline" else row.label
        if m.roofline:
            lines.append(f"roofline, {name}: {Roofline.from_dict(m.roofline).describe()}")
        if m.audit:
            lines.append(f"audit, {name}: {Audit.from_dict(m.audit).describe()}")
    return lines


def _key(result: TuneResult, fidelity_key: str) -> str:
    """The figure the fidelity column shows: the workload's, or max_abs_error for a degenerate reference."""
    return result.rule.key if result.rule is not None else fidelity_key


def rows_markdown(result: TuneResult, *, fidelity_key: str) -> str:
    """The same table as `rows_table`, as Markdown."""
    lines = ["| technique | kept? (why not) | latency p50/p90 ms | speedup vs baseline | samples/s | peak memory | "
             "% of roofline | fidelity |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for row in result.rows:
        m = row.measurement
        cells = [
            f"**{row.label}**" if row.phase in ("baseline", "plan") else row.label,
            _kept(row).replace("|", "/"),
            f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f}" if m else "",
            _speedup(row),
            f"{m.samples_per_s:,.1f}" if m else "",
            format_memory(m) if m else "",
            roofline_cell(m.roofline) if m else "",
            format_fidelity(m, _key(result, fidelity_key)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_lines(result: TuneResult, *, fidelity_key: str) -> list[str]:
    """One line per technique report (pruning: params, FLOPs, metric before / after pruning / after
    recovery, the fine-tune), for the step each row adds; repeated reports are shown once."""
    lines: list[str] = []
    for row in result.rows:
        for report in row.details:
            if row.phase in ("alone", "compose") and report.get("technique") == row.steps[-1]:
                line = describe_report(report, fidelity_key)
                if line not in lines:
                    lines.append(line)
    return lines


def compile_times(result: TuneResult, *, min_s: float = 1.0) -> list[tuple[str, float]]:
    """(label, compile_s) of the rows whose warm-up took ≥ `min_s` beyond steady state."""
    return [(r.label, r.measurement.compile_s) for r in result.rows
            if r.measurement and r.measurement.compile_s >= min_s and r.phase != "plan"]


def write_report_md(path: Path, *, result: TuneResult, workload_name: str, device_name: str, fidelity_key: str,
                    sweep: dict[str, list[tuple[int, Measurement]]], plot_name: str | None, command: str,
                    real_weights: bool, rows_description: str = "the evaluation rows", notes: list[str] = ()) -> None:
    b = result.baseline
    flops = (f"; FLOPs per sample (eager fp32, torch.utils.flop_counter; text: real tokens, no padding): "
             f"{result.flops_per_sample / 1e9:.3f} GFLOP" if result.flops_per_sample else "")
    env = environment()
    lines = [
        f"# overdrive optimize {workload_name}",
        "",
        f"- command: `{command}`",
        f"- device: {device_name}; torch {env['torch']}; date {env['date']}",
        f"- batch size {result.plan.batch_size}; {b.num_samples} evaluation samples{flops}",
        f"- plan: {' + '.join(result.plan.names) or 'baseline (nothing beat it)'}, {headline(result.plan.measured)}",
    ]
    if not real_weights:
        lines.append("- weights are random: the figures are for speed only, not accuracy claims")
    lines.append(f"- {caption(result, rows_description)}")
    lines += [f"- note: {note}" for note in notes]
    lines += [f"- **warning**: {warning}" for warning in getattr(result, "warnings", [])]
    memory_kind = ("CUDA allocator peak allocated / reserved" if b.peak_memory_kind.startswith("cuda")
                   else "process RSS high-water mark")
    lines += ["", "## Per-technique table", "", rows_markdown(result, fidelity_key=fidelity_key), "",
              f"Peak memory: {memory_kind}. Fidelity: against the eager fp32 outputs of the same rows. {ROOFLINE_NOTE}.", ""]
    figures = figure_lines(result)
    if figures:
        lines += ["## Roofline and the copy and sync audit", ""] + [f"- {line}" for line in figures] + [""]
    lines += ["## Latency vs batch size", ""]
    if plot_name:
        lines += [f"![latency vs batch size]({plot_name})", ""]
    lines += [sweep_markdown(sweep), ""]
    details = detail_lines(result, fidelity_key=fidelity_key)
    if details:
        lines += ["## Technique reports (pruning: structure, metric and recovery; precision: the per-layer search)", ""] + [f"- {line}" for line in details] + [""]
    compiled = compile_times(result)
    if compiled:
        lines += ["## Compile and warm-up time (apart from the figures above)", ""]
        lines += [f"- {label}: {seconds:.1f} s" for label, seconds in compiled]
        lines.append("")
    path.write_text("\n".join(lines))
