"""What every verb's output shares: units (bytes, fidelity figures), the console, results files, the plot."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path

from rich.console import Console

from overdrive.core.measure import Measurement


def format_bytes(n: int | None) -> str:
    """Bytes in binary units with at most three integer digits ("1018.5 MiB" is "0.99 GiB": the
    table's peak-memory column does not wrap, and a fourth digit pushed it past 100 columns)."""
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1000 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}" if n < 1 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


_SHORT = {"min_cosine": "min cos", "top1_agreement": "top-1 agree", "top10_agreement": "top-10 NN",
          "max_rel_error": "max rel err", "max_abs_error": "max abs err"}
_SHOWN = ("top1_agreement", "top10_agreement", "max_rel_error")  # shown besides the guarded figure


def format_fidelity(m: Measurement | None, key: str, compact: bool = False) -> str:
    """'acc 99.72%, min cos 0.9999, top-1 agree 1.000' — task metric, the guarded figure first, then
    the others (`compact`: the task metric and the guarded figure only)."""
    if m is None:
        return ""
    parts = []
    if m.task_metric:
        parts += [f"acc {v:.2f}%" if k == "accuracy_pct" else f"{k} {v:.4g}" for k, v in m.task_metric.items()]
    if key in m.fidelity:
        value = m.fidelity[key]
        parts.append(f"{_SHORT.get(key, key)} {value:.2e}" if key == "max_abs_error" else f"{_SHORT.get(key, key)} {value:.4f}")
    for other in [] if compact else _SHOWN:
        if other != key and other in m.fidelity:
            value = m.fidelity[other]
            parts.append(f"{_SHORT[other]} {value:.1e}" if other == "max_rel_error" else f"{_SHORT[other]} {value:.3f}")
    return ", ".join(parts)


def make_console() -> Console:
    """The terminal's width; when stdout is not a terminal (make, CI, pipes), tables are laid out for
    `COLUMNS` when set, else 100 columns, and lines of text are not wrapped (one line each, for logs
    and grep)."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) >= 40 else 100, soft_wrap=True)


def print_table(console: Console, table) -> None:
    """Print a rich Table within the console's width: rich 15 collapses a table that is too wide to one or two
    columns past the width when some columns have a minimum width (and crops its last border), so the width it
    is given is lowered until what it draws fits."""
    if table.width is None and console.measure(table).maximum >= console.width:
        table.width = console.width - 1
        while table.width > console.width // 2 and _drawn_width(console, table) > console.width:
            table.width -= 1
    console.print(table)


def _drawn_width(console: Console, table) -> int:
    """The widest line `table` draws when nothing crops it."""
    from rich.segment import Segment

    lines = console.render_lines(table, console.options.update_width(2 * console.width), pad=False)
    return max((Segment.get_line_length(line) for line in lines), default=0)


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
