"""Output of `optimize` and `bench`: the rich table, results.json, report.md and the plot."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

from rich.console import Console
from rich.table import Table

from overdrive.core.measure import Measurement
from overdrive.optimize.tuner import Row, TuneResult


def format_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


_SHORT = {"min_cosine": "min cos", "top1_agreement": "top-1 agree", "top10_agreement": "top-10 NN",
          "max_rel_error": "max rel err"}
_SHOWN = ("top1_agreement", "top10_agreement", "max_rel_error")  # shown besides the guarded figure


def format_fidelity(m: Measurement | None, key: str) -> str:
    """'acc 99.72%, min cos 0.9999, top-1 agree 1.000' — task metric, the guarded figure first, then the others."""
    if m is None:
        return ""
    parts = []
    if m.task_metric:
        parts.append(f"acc {m.task_metric['accuracy_pct']:.2f}%")
    if key in m.fidelity:
        parts.append(f"{_SHORT.get(key, key)} {m.fidelity[key]:.4f}")
    for other in _SHOWN:
        if other != key and other in m.fidelity:
            value = m.fidelity[other]
            parts.append(f"{_SHORT[other]} {value:.1e}" if other == "max_rel_error" else f"{_SHORT[other]} {value:.3f}")
    return ", ".join(parts)


def make_console() -> Console:
    """A console that is wide enough for the table even when stdout is not a terminal (make, CI, pipes)."""
    console = Console()
    return console if console.is_terminal else Console(width=170)


def _kept(row: Row) -> str:
    if row.phase in ("baseline", "plan"):
        return "—"
    if row.phase == "without":
        return row.reason or "—"
    return "yes" if row.kept else f"no: {row.reason}"


def rows_table(result: TuneResult, *, fidelity_key: str, title: str) -> Table:
    """The per-technique table: technique | kept? | latency p50/p90 | speedup | samples/s | peak memory | fidelity."""
    memory_kind = "CUDA allocator peak" if result.baseline.peak_memory_kind.startswith("cuda") else "process RSS high-water"
    table = Table(title=title, show_lines=False, caption=f"peak memory: {memory_kind}; fidelity: against eager fp32 outputs")
    for col, justify in [("technique", "left"), ("kept? (why not)", "left"), ("latency p50/p90 ms", "right"),
                         ("speedup vs baseline", "right"), ("samples/s", "right"), ("peak memory", "right"),
                         ("fidelity", "left")]:
        table.add_column(col, justify=justify, overflow="fold")
    previous_phase = None
    for row in result.rows:
        if previous_phase is not None and row.phase != previous_phase:
            table.add_section()
        previous_phase = row.phase
        m = row.measurement
        table.add_row(
            row.label,
            _kept(row),
            f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f}" if m else "",
            f"{row.speedup:.2f}×" if row.speedup is not None else "",
            f"{m.samples_per_s:,.1f}" if m else "",
            format_bytes(m.peak_memory_bytes) if m else "",
            format_fidelity(m, fidelity_key),
        )
    return table


def rows_markdown(result: TuneResult, *, fidelity_key: str) -> str:
    """The same table as `rows_table`, as Markdown."""
    lines = ["| technique | kept? (why not) | latency p50/p90 ms | speedup vs baseline | samples/s | peak memory | fidelity |",
             "|---|---|---:|---:|---:|---:|---|"]
    for row in result.rows:
        m = row.measurement
        cells = [
            f"**{row.label}**" if row.phase in ("baseline", "plan") else row.label,
            _kept(row).replace("|", "/"),
            f"{m.latency_ms['p50']:.2f} / {m.latency_ms['p90']:.2f}" if m else "",
            f"{row.speedup:.2f}×" if row.speedup is not None else "",
            f"{m.samples_per_s:,.1f}" if m else "",
            format_bytes(m.peak_memory_bytes) if m else "",
            format_fidelity(m, fidelity_key),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_lines(result: TuneResult, *, fidelity_key: str) -> list[str]:
    """One line per technique report (pruning: params, FLOPs, metric before / after pruning / after
    recovery, the fine-tune), for the step each row adds; repeated reports are shown once."""
    from overdrive.techniques.pruning.recovery import describe

    lines: list[str] = []
    for row in result.rows:
        for report in row.details:
            if row.phase in ("alone", "compose") and report.get("technique") == row.steps[-1]:
                line = describe(report, fidelity_key)
                if line not in lines:
                    lines.append(line)
    return lines


def compile_times(result: TuneResult, *, min_s: float = 1.0) -> list[tuple[str, float]]:
    """(label, compile_s) of the rows whose warm-up took ≥ `min_s` beyond steady state."""
    return [(r.label, r.measurement.compile_s) for r in result.rows
            if r.measurement and r.measurement.compile_s >= min_s and r.phase != "plan"]


def environment() -> dict:
    import torch

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "num_threads": torch.get_num_threads(),
    }


def write_results(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def plot_latency_vs_batch(path: Path, sweep: dict[str, list[tuple[int, Measurement]]], *, title: str) -> None:
    """Write a PNG of p50 latency (ms, log scale) and samples/s against batch size, one line per config."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_tp) = plt.subplots(1, 2, figsize=(10, 4))
    for label, points in sweep.items():
        sizes = [b for b, _ in points]
        ax_lat.plot(sizes, [m.latency_ms["p50"] for _, m in points], marker="o", label=label)
        ax_tp.plot(sizes, [m.samples_per_s for _, m in points], marker="o", label=label)
    for ax, ylabel in ((ax_lat, "latency p50 (ms)"), (ax_tp, "samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_lat.set_yscale("log")
    ax_tp.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_markdown(sweep: dict[str, list[tuple[int, Measurement]]]) -> str:
    lines = ["| configuration | batch size | latency p50 (ms) | latency p90 (ms) | samples/s |", "|---|---:|---:|---:|---:|"]
    for label, points in sweep.items():
        for b, m in points:
            lines.append(f"| {label} | {b} | {m.latency_ms['p50']:.2f} | {m.latency_ms['p90']:.2f} | {m.samples_per_s:,.1f} |")
    return "\n".join(lines)


def write_report_md(path: Path, *, result: TuneResult, workload_name: str, device_name: str, fidelity_key: str,
                    sweep: dict[str, list[tuple[int, Measurement]]], plot_name: str | None, command: str,
                    real_weights: bool) -> None:
    b = result.baseline
    flops = (f"; FLOPs per sample (eager fp32, torch.utils.flop_counter): {result.flops_per_sample / 1e9:.3f} GFLOP"
             if result.flops_per_sample else "")
    env = environment()
    lines = [
        f"# overdrive optimize {workload_name}",
        "",
        f"- command: `{command}`",
        f"- device: {device_name}; torch {env['torch']}; date {env['date']}",
        f"- batch size {result.plan.batch_size}; {b.num_samples} evaluation samples{flops}",
        f"- plan: {' + '.join(result.plan.names) or 'baseline (nothing beat it)'}, "
        f"{result.plan.measured['speedup_vs_baseline']:.2f}× baseline samples/s",
    ]
    if not real_weights:
        lines.append("- weights are random: the figures are for speed only, not accuracy claims")
    memory_kind = "CUDA allocator peak" if b.peak_memory_kind.startswith("cuda") else "process RSS high-water mark"
    lines += ["", "## Per-technique table", "", rows_markdown(result, fidelity_key=fidelity_key), "",
              f"Peak memory: {memory_kind}. Fidelity: against the eager fp32 outputs of the same samples.", "",
              "## Latency vs batch size", ""]
    if plot_name:
        lines += [f"![latency vs batch size]({plot_name})", ""]
    lines += [sweep_markdown(sweep), ""]
    details = detail_lines(result, fidelity_key=fidelity_key)
    if details:
        lines += ["## Pruning: structure, metric and recovery", ""] + [f"- {line}" for line in details] + [""]
    compiled = compile_times(result)
    if compiled:
        lines += ["## Compile and warm-up time (apart from the figures above)", ""]
        lines += [f"- {label}: {seconds:.1f} s" for label, seconds in compiled]
        lines.append("")
    path.write_text("\n".join(lines))
