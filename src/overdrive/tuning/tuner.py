"""The tuner: baseline, each technique alone (the attribution table), then greedy composition.

Composition follows the canonical order of `Stage` (batching → prune → precision → graph →
compile → runtime). Only techniques that were kept alone are tried; of a group of
alternatives (bf16 / fp16 / int8) the fastest kept one is tried first and the others are
skipped once one is kept. A step is rolled back when its throughput is not at least
`Guard.min_gain` × the current best, or when it breaks the accuracy budget; the row says why.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from overdrive.core import devices
from overdrive.core.errors import ConfigError, WorkloadError, arg, one_line
from overdrive.core.measure import Measurement, count_flops_per_sample, cycle_indices, measure
from overdrive.core.workload import Workload
from overdrive.techniques import TechniqueConfig, default_config, get_technique, list_techniques
from overdrive.tuning.plan import Plan, build


@dataclass(frozen=True, kw_only=True)
class Guard:
    """The accuracy budget and the speed bar.

    Attributes:
        min_fidelity: floor on the workload's fidelity figure (cosine or agreement), in [0, 1].
        max_accuracy_drop: most task-metric points a candidate may lose (workloads with a task metric);
            None: no task-metric budget beyond the fidelity floor.
        min_gain: a candidate must reach this × the throughput it is compared with to be kept.
    """

    min_fidelity: float = 0.99
    max_accuracy_drop: float | None = None
    min_gain: float = 1.02

    def __post_init__(self):
        if not 0.0 <= self.min_fidelity <= 1.0:  # NaN fails every comparison, so it is refused too
            raise ConfigError(f"{arg('min_fidelity', self.min_fidelity)}: expected a number in [0, 1]")
        if self.max_accuracy_drop is not None and not 0 <= self.max_accuracy_drop < math.inf:
            raise ConfigError(f"{arg('max_accuracy_drop', self.max_accuracy_drop)}: expected a finite number ≥ 0 (points)")
        if not 0 < self.min_gain < math.inf:
            raise ConfigError(f"{arg('min_gain', self.min_gain)}: expected a finite ratio > 0 (e.g. 1.02)")

    def violation(self, m: Measurement, baseline: Measurement, fidelity_key: str) -> str | None:
        """The figure that breaks the budget, or None. Non-finite outputs (fp16 overflow) always do."""
        if m.nonfinite_outputs:
            return f"{m.nonfinite_outputs} non-finite output values (overflow?) where fp32 has none"
        value = m.fidelity.get(fidelity_key)
        if value is not None and not value >= self.min_fidelity:  # NaN fails too
            return f"{fidelity_key} {value:.4f} < {self.min_fidelity} floor"
        if self.max_accuracy_drop is not None and m.task_metric and baseline.task_metric:
            key = next(iter(baseline.task_metric))  # "accuracy_pct", or a user metric's "metric"
            drop = baseline.task_metric[key] - m.task_metric[key]
            if drop > self.max_accuracy_drop:
                return f"accuracy drop {drop:.2f} pt > {self.max_accuracy_drop} pt budget"
        return None


@dataclass(kw_only=True)
class Row:
    """One line of the table: a candidate, whether it was kept, why not, and its figures."""

    phase: str  # "baseline", "alone", "compose", "plan"
    label: str
    steps: list[str]
    kept: bool
    reason: str = ""
    measurement: Measurement | None = None
    speedup: float | None = None  # samples/s ÷ baseline samples/s
    details: list[dict] = field(default_factory=list)  # technique reports (pruning: params, FLOPs, recovery)

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "label": self.label,
            "techniques": self.steps,
            "kept": self.kept,
            "reason": self.reason,
            "speedup_vs_baseline": self.speedup,
            "measurement": self.measurement.to_dict() if self.measurement else None,
            "details": self.details,
        }


@dataclass(kw_only=True)
class TuneResult:
    rows: list[Row]
    plan: Plan
    baseline: Measurement
    flops_per_sample: float | None
    settings: dict = field(default_factory=dict)


Progress = Callable[[str], None]
# Reference outputs all smaller than this are float noise: cosine and agreement with them mean nothing
# (a random-weight torchvision MobileNet gives ~1e-10, a ViT with its zero-initialised head exactly 0).
DEGENERATE_OUTPUT = 1e-6


@dataclass(kw_only=True)
class Tuner:
    """Runs the optimize flow for one workload on one device.

    Attributes:
        workload, device, batch_size: what to tune and where.
        techniques: names to try (default: every registered technique that is not opt-in).
        guard: accuracy budget and speed bar.
        num_samples: evaluation samples (the first N of the workload's samples; cycled up to
            one full batch when the workload has fewer).
        min_timed_calls, min_timed_s: each measurement times at least this many calls and
            seconds (whole passes), so fast candidates get several passes and a robust median.
        progress: called with a description before each measurement.
        configs: technique configs to use instead of the defaults, by name (e.g. a pruning
            ratio from the command line).
    """

    workload: Workload
    device: torch.device
    batch_size: int
    techniques: list[str] | None = None
    guard: Guard = field(default_factory=Guard)
    num_samples: int | None = None
    min_timed_calls: int = 10
    min_timed_s: float = 3.0
    progress: Progress = lambda _: None
    workload_spec: str | None = None
    configs: dict[str, TechniqueConfig] = field(default_factory=dict)

    def __post_init__(self):
        available = len(self.workload.samples)
        n = available if self.num_samples is None else min(self.num_samples, available)
        self.indices = cycle_indices(max(n, self.batch_size), available)
        names = self.techniques if self.techniques is not None else [t.name for t in list_techniques() if not t.opt_in]
        self.techniques = [get_technique(n).name for n in names]  # KeyError names the unknown one

    def _step(self, name: str) -> TechniqueConfig:
        return self.configs.get(name) or default_config(name)

    def _measure(self, steps: list[TechniqueConfig], reference: torch.Tensor | None, reports: list[dict]) -> Measurement:
        model, policy = build(self.workload, steps, self.device, reports)
        try:
            m, _ = measure(
                model, self.workload, device=self.device, batch_size=self.batch_size,
                indices=self.indices, policy=policy, reference=reference, min_timed_calls=self.min_timed_calls,
                min_timed_s=self.min_timed_s,
            )
            return m
        finally:
            del model
            gc.collect()
            torch.compiler.reset()  # drop compiled graphs so the next candidate starts clean

    def _try(self, phase: str, label: str, steps: list[TechniqueConfig], reference: torch.Tensor) -> Row:
        """Measure a candidate; the row is judged later (`_judge`), once its comparison is known."""
        self.progress(label)
        names = [s.name for s in steps]
        reports: list[dict] = []
        try:
            m = self._measure(steps, reference, reports)
        except Exception as exc:  # noqa: BLE001 - a failing technique is a row, not a crash
            return Row(phase=phase, label=label, steps=names, kept=False, reason=f"failed: {one_line(exc)}", details=reports)
        return Row(phase=phase, label=label, steps=names, kept=False, measurement=m, details=reports)

    def _judge(self, row: Row, baseline: Measurement, compare_to: Measurement) -> Row:
        """Set speedup, kept and the reason: over budget (with the figure), or not faster."""
        m = row.measurement
        if m is None:
            return row
        row.speedup = m.samples_per_s / baseline.samples_per_s
        violation = self.guard.violation(m, baseline, self.workload.fidelity_key)
        gain = m.samples_per_s / compare_to.samples_per_s
        if violation:
            row.reason = violation
        elif gain < self.guard.min_gain:
            versus = "baseline" if compare_to is baseline else "the throughput without it"
            row.reason = f"not faster: {gain:.2f}× {versus} (needs ≥ {self.guard.min_gain:.2f}×)"
        else:
            row.kept = True
        return row

    def _measure_baseline(self, *, count_flops: bool) -> tuple[Measurement, torch.Tensor, float | None]:
        """Measure eager fp32 and (when asked) count its FLOPs per sample.

        Raises:
            WorkloadError: the user's model fails at this batch size or gives non-finite outputs.
        """
        model, _ = build(self.workload, [], self.device)
        flops = count_flops_per_sample(model, self.workload, device=self.device, indices=self.indices) if count_flops else None
        try:
            m, out = measure(model, self.workload, device=self.device, batch_size=self.batch_size, indices=self.indices,
                             min_timed_calls=self.min_timed_calls, min_timed_s=self.min_timed_s)
        except Exception as exc:  # noqa: BLE001 - the user's model, at the user's batch size
            raise WorkloadError(f"{self.workload.name}: the eager fp32 model failed at batch size {self.batch_size}: "
                            f"{one_line(exc)}") from None
        finally:
            del model
        if m.nonfinite_outputs:
            raise WorkloadError(f"{self.workload.name}: the eager fp32 model gives {m.nonfinite_outputs} non-finite output "
                                "values (NaN/inf) on its samples, so no technique can be judged against it")
        largest = float(out.abs().max()) if out.numel() else 0.0
        if largest < DEGENERATE_OUTPUT:
            raise WorkloadError(f"{self.workload.name}: every output of the eager fp32 model is within {DEGENERATE_OUTPUT:g} "
                                f"of zero (the largest is {largest:.2g}), so agreement with it measures float noise and no "
                                "technique can be judged against it (random weights whose activations vanish, or a "
                                "zero-initialised head?)")
        return m, out, flops

    def _leave_one_out(self, plan: list[TechniqueConfig], plan_m: Measurement, baseline: Measurement,
                       reference: torch.Tensor) -> list[Row]:
        """For each opt-in step of a plan with others (pruning), the plan without it: what that
        step adds on top of the rest (composition measures it first, before the rest exist)."""
        rows = []
        for step in plan:
            if len(plan) < 2 or not get_technique(step.name).opt_in:
                continue
            others = [s for s in plan if s is not step]
            row = self._try("without", f"plan without {step.name}", others, reference)
            if row.measurement is not None:
                row.speedup = row.measurement.samples_per_s / baseline.samples_per_s
                row.kept = True
                row.reason = (f"{step.name} adds {plan_m.samples_per_s / row.measurement.samples_per_s:.2f}× "
                              f"on top of {' + '.join(s.name for s in others)}")
            rows.append(row)
        return rows

    def run(self) -> TuneResult:
        rows: list[Row] = []
        self.progress("baseline (eager fp32)")
        baseline, reference, flops = self._measure_baseline(count_flops=True)

        # 1. Each technique alone: the attribution table.
        alone: dict[str, Row] = {}
        for name in self.techniques:
            reason = get_technique(name).unsupported_reason(self.workload, self.device)
            if reason:
                rows.append(Row(phase="alone", label=name, steps=[name], kept=False, reason=f"skipped: {reason}"))
                continue
            alone[name] = self._try("alone", name, [self._step(name)], reference)
            rows.append(alone[name])

        # The baseline again: the faster of its two measurements is the one every speedup is
        # against, so drift on a shared machine cannot make a technique look better than it is.
        if alone:
            self.progress("baseline (eager fp32), again")
            again, _, _ = self._measure_baseline(count_flops=False)
            if again.samples_per_s > baseline.samples_per_s:
                baseline = again
        baseline.fidelity = self.workload.fidelity(reference, reference)
        rows.insert(0, Row(phase="baseline", label="baseline (eager fp32)", steps=[], kept=True, measurement=baseline, speedup=1.0))
        for row in alone.values():
            self._judge(row, baseline, baseline)

        # 2. Greedy composition of the winners in canonical order.
        winners = [r for r in alone.values() if r.kept]
        winners.sort(key=lambda r: (get_technique(r.label).stage, -r.measurement.samples_per_s))
        current: list[TechniqueConfig] = []
        current_m = baseline
        kept_groups: dict[str, str] = {}
        for row in winners:
            technique = get_technique(row.label)
            if technique.group and technique.group in kept_groups:
                rows.append(Row(phase="compose", label=f"+ {row.label}", steps=[s.name for s in current] + [row.label],
                                kept=False, reason=f"alternative to {kept_groups[technique.group]}, already kept"))
                continue
            if not current:  # the first winner composed with nothing is its alone row
                step_row = Row(**{**row.__dict__, "phase": "compose", "label": f"+ {row.label}"})
            else:
                step_row = self._judge(
                    self._try("compose", f"+ {row.label}", current + [self._step(row.label)], reference), baseline, current_m
                )
            rows.append(step_row)
            if step_row.kept:
                current = current + [self._step(row.label)]
                current_m = step_row.measurement
                if technique.group:
                    kept_groups[technique.group] = row.label

        names = [s.name for s in current]
        rows.append(Row(phase="plan", label="plan: " + (" + ".join(names) or "baseline"), steps=names, kept=True,
                        measurement=current_m, speedup=current_m.samples_per_s / baseline.samples_per_s))
        rows += self._leave_one_out(current, current_m, baseline, reference)
        plan = Plan(
            workload=self.workload_spec or self.workload.name,
            device=self.device.type,
            batch_size=self.batch_size,
            steps=current,
            measured={
                "samples_per_s": current_m.samples_per_s,
                "latency_ms": current_m.latency_ms,
                "speedup_vs_baseline": current_m.samples_per_s / baseline.samples_per_s,
                "fidelity": current_m.fidelity,
                "task_metric": current_m.task_metric,
            },
            environment={"torch": torch.__version__, "device_name": devices.describe(self.device)},
        )
        return TuneResult(rows=rows, plan=plan, baseline=baseline, flops_per_sample=flops)
