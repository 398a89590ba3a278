"""What `optimize` returns (`OptimizeResult`: the table, the plan, the model, `save`), and what a plan records of
the workload so `load(plan, model)` rebuilds it (`record_workload`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core import devices
from overdrive.core.measure import Measurement
from overdrive.core.report import environment, plot_latency_vs_batch, write_results
from overdrive.core.workload import Workload
from overdrive.techniques.compose import build, resolve_steps
from overdrive.tuning.guard import FidelityRule, Guard
from overdrive.tuning.plan import Plan
from overdrive.tuning.report import headline as describe_headline, rows_markdown, write_report_md
from overdrive.tuning.rows import Row
from overdrive.tuning.sweep import Session

PLOT_NAME = "latency_vs_batch_size.png"


def input_signature(workload: Workload, max_rows: int = 4096) -> list[dict[str, Any]] | None:
    """Per model input: its keyword (when the model takes keywords), row shape and dtype, for tensor
    workloads (None for text). Along a varying dimension the shape is the longest row's (of the
    first `max_rows`)."""
    sample = workload.samples[0]
    columns = (sample,) if isinstance(sample, torch.Tensor) else sample
    if workload.is_text or not all(isinstance(c, torch.Tensor) for c in columns):
        return None
    shapes = [list(c.shape) for c in columns]
    for row in list(workload.samples[1:max_rows]) if workload.dynamic_dims else []:
        for shape, c in zip(shapes, (row,) if isinstance(row, torch.Tensor) else row):
            shape[:] = [max(a, b) for a, b in zip(shape, c.shape)]
    names = workload.input_names or [None] * len(columns)
    return [{**({"name": n} if n else {}), "shape": shape, "dtype": str(c.dtype).removeprefix("torch.")}
            for n, shape, c in zip(names, shapes, columns)]


def plan_dims(workload: Workload) -> dict[str, list[int]] | None:
    """The workload's varying dimensions as the plan records them ({input name or index: dims}), so
    `serve`, `run` and `bench` rebuild the model taking the same row sizes; None when there are none."""
    if not workload.dynamic_dims:
        return None
    names = workload.input_names
    return {(names[i] if names else str(i)): list(ds) for i, ds in sorted(workload.dynamic_dims.items())}


def record_workload(plan: Plan, workload: Workload) -> None:
    """Write into `plan` what `load(plan, model)` needs to rebuild the same workload from the model
    alone: the inputs' names, row shapes and dtypes, the judged outputs, the varying dimensions."""
    plan.inputs = input_signature(workload)
    plan.outputs = list(workload.output_names) if workload.output_names else None
    plan.dynamic_dims = plan_dims(workload)


@dataclass(kw_only=True)
class OptimizeResult:
    """What `optimize` found.

    Attributes:
        rows: every candidate measured, in table order (baseline, alone, compose, plan, without).
        plan: the chosen techniques, batch size and headline figures; `save` writes it.
        baseline: the eager fp32 measurement every speedup is against.
        sweep: {configuration: [(batch size, Measurement)]} for the report's plot.
        sweep_warnings: points of the sweep that failed.
        warnings: what makes figures uncertain (noisy timing) or says how the model was judged.
        rule: how candidates were judged against the reference (fidelity floor, or max absolute
            error for a degenerate reference).
        session: the workload, device, batch size and samples it was measured with.
        guard: the accuracy budget and speed bar that judged the candidates.
        flops_per_sample: FLOPs of one eager fp32 forward per row (None where not countable).
        peaks: the GEMM and copy peaks measured on the device, which the roofline figures are against.
        command: how the run was asked for (recorded in results.json and report.md).
    """

    rows: list[Row]
    plan: Plan
    baseline: Measurement
    sweep: dict[str, list[tuple[int, Measurement]]]
    sweep_warnings: list[str]
    session: Session
    guard: Guard
    flops_per_sample: float | None
    command: str
    warnings: list[str] = field(default_factory=list)
    rule: FidelityRule | None = None
    peaks: str = ""
    time_budget_s: float | None = None  # the time budget it ran under (None: no limit)
    _model: nn.Module | None = field(default=None, repr=False)

    @property
    def table(self) -> list[dict[str, Any]]:
        """The per-technique rows: technique, kept, why not, latency p50/p90 (ms), speedup vs the
        baseline as it may be quoted (`gain.Gain.quoted`: the interval's low end when it is wide, None
        when the machine was busy; `speedup_uncertain` says why, `gain` holds what was measured),
        samples/s, peak memory (bytes; on CUDA also reserved), the roofline point
        (`core.roofline.Roofline.to_dict`), the audit (baseline and plan, `core.audit.Audit.to_dict`),
        fidelity figures and task metric."""
        out = []
        for row in self.rows:
            m = row.measurement
            out.append({"technique": row.label, "phase": row.phase, "kept": row.kept, "reason": row.reason,
                        "latency_ms_p50": m.latency_ms["p50"] if m else None,
                        "latency_ms_p90": m.latency_ms["p90"] if m else None,
                        "speedup_vs_baseline": row.speedup,
                        "speedup_uncertain": row.gain.uncertain if row.gain else None,
                        "gain": {**row.gain.to_dict(), "versus": row.versus} if row.gain else None,
                        "samples_per_s": m.samples_per_s if m else None,
                        "peak_memory_bytes": m.peak_memory_bytes if m else None,
                        "peak_reserved_bytes": m.peak_reserved_bytes if m else None,
                        "roofline": m.roofline if m else None, "audit": m.audit if m else None,
                        "fidelity": dict(m.fidelity) if m else {}, "task_metric": dict(m.task_metric or {}) if m else {}})
        return out

    @property
    def speedup(self) -> float | None:
        """The plan's speedup over the eager baseline as it may be quoted (`gain.Gain.quoted`): the point
        figure, the low end of a wide interval, or None when the machine was too busy for a figure
        (`headline` says which, with the interval `overdrive bench` of the plan lands in)."""
        return self.plan.measured.get("speedup_vs_baseline")

    @property
    def headline(self) -> str:
        """The plan's speedup in words: "2.31× [2.10, 2.52] the baseline's samples/s", or why it is uncertain."""
        return describe_headline(self.plan.measured) if self.plan.steps else "the baseline: nothing beat it"

    @property
    def model(self) -> nn.Module:
        """The plan's model, built once on the device it was measured on, ready to call as your model
        is: the same arguments (`model(**inputs)` for a dict example), and for a model with structured
        outputs the same structure (its `ModelOutput` class, dict or tuple) holding the outputs the
        plan judged, each in its own shape; outputs it does not carry (token-level outputs that
        follow the input length, a KV cache) are None (`overdrive.workloads.structured`). Length
        bucketing, a batching policy, is not part of it: `run` and `serve` apply it."""
        if self._model is None:
            from overdrive.workloads.structured import user_facing

            built = build(self.session.workload, self.plan.steps, self.session.device)[0]
            self._model = user_facing(built, self.session.workload.model)
        return self._model

    def _repr_markdown_(self) -> str:  # a notebook shows the table
        return rows_markdown(self, fidelity_key=self.session.workload.fidelity_key)

    @property
    def rows_description(self) -> str:
        """What the candidates were judged on, e.g. "fidelity on your data (300 rows)"."""
        return self.session.workload.describe_rows(self.session.num_distinct_samples)

    def save_plan(self, folder: str | Path) -> Path:
        """Write plan.json into `folder`, with the pruned weights of pruning steps beside it
        (`<technique>.pt`), so reloading the plan does not prune and fine-tune again. Returns its path."""
        folder = Path(folder)
        self.plan.steps = resolve_steps(self.plan.steps, self.session.workload, self.session.device, folder)
        self.plan.save(folder / "plan.json")
        return folder / "plan.json"

    def save(self, folder: str | Path) -> Path:
        """Write plan.json (and checkpoints), results.json (every figure, with units), report.md
        and the latency-vs-batch-size plot into `folder`. Returns the plan's path."""
        folder = Path(folder)
        plan_path = self.save_plan(folder)
        workload, device_name = self.session.workload, devices.describe(self.session.device)
        plot = PLOT_NAME if any(self.sweep.values()) else None  # no sweep (sweep_batch_sizes=[]): no plot
        if plot:
            plot_latency_vs_batch(folder / plot, self.sweep, title=f"{workload.name} on {device_name}")
        write_results(folder / "results.json", self.to_dict())
        write_report_md(folder / "report.md", result=self, workload_name=workload.name, device_name=device_name,
                        fidelity_key=workload.fidelity_key, sweep=self.sweep, plot_name=plot, command=self.command,
                        real_weights=workload.real_weights,
                        rows_description=workload.describe_rows(self.session.num_distinct_samples), notes=workload.notes)
        return plan_path

    def to_dict(self) -> dict[str, Any]:
        """Everything measured, with units: what results.json holds."""
        s, g = self.session, self.guard
        return {
            "command": self.command,
            "workload": s.workload.name,
            "real_weights": s.workload.real_weights,
            "device": devices.describe(s.device),
            "environment": environment(),
            "batch_size": s.batch_size,
            "num_samples": s.num_samples,
            "num_distinct_samples": s.num_distinct_samples,
            "sweep_warnings": self.sweep_warnings,
            "headline": self.headline,
            "warnings": self.warnings,
            "notes": s.workload.notes,
            "rows_source": s.workload.rows_source,
            "evaluation_rows": s.workload.describe_rows(s.num_distinct_samples),
            "guard": {"min_fidelity": g.min_fidelity, "max_accuracy_drop_pt": g.max_accuracy_drop, "min_gain": g.min_gain,
                      "lossless_only": g.lossless_only, "rule": self.rule.describe() if self.rule else None},
            "fidelity_key": s.workload.fidelity_key,
            "flops_per_sample": self.flops_per_sample,
            "measured_peaks": self.peaks,
            "units": {"latency_ms": "milliseconds per call", "samples_per_s": "rows per second",
                      "peak_memory_bytes": "bytes", "compile_s": "seconds", "warmup_s": "seconds",
                      "accuracy_pct": "percent", "metric": "the workload metric's own units",
                      "flops_per_sample": "floating-point operations",
                      "roofline": "flops_per_s: FLOP/s; bytes_per_s: bytes/s; intensity: FLOP/byte; fraction: of the binding roof",
                      "audit": "counts and bytes per forward of one batch"},
            "rows": [r.to_dict() for r in self.rows],
            "sweep": {label: [{"batch_size": b, **m.to_dict()} for b, m in points] for label, points in self.sweep.items()},
            "plan": self.plan.to_dict(),
        }
