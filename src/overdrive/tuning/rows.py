"""What the tuner returns: a `Row` per candidate measured (the per-technique table) and the `TuneResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from overdrive.core.gain import Gain
from overdrive.core.measure import Measurement
from overdrive.techniques import TechniqueConfig
from overdrive.techniques.registry import config_to_dict
from overdrive.tuning.guard import FidelityRule
from overdrive.tuning.invariance import Verdict
from overdrive.tuning.plan import Plan


@dataclass(kw_only=True)
class Row:
    """One line of the table: a candidate, whether it was kept, why not, and its figures."""

    phase: str  # "baseline", "alone", "compose", "plan", "without"
    label: str
    steps: list[str]
    kept: bool
    reason: str = ""
    measurement: Measurement | None = None
    speedup: float | None = None  # throughput ÷ the baseline's, as quoted (`Gain.quoted`; None: uncertain, busy)
    gain: Gain | None = None  # the interleaved comparison this row was judged by
    versus: str = ""  # what `gain` is against
    invariance: Verdict | None = None  # batch-invariance figures (lossy candidates)
    details: list[dict] = field(default_factory=list)  # technique reports (pruning: params, FLOPs, recovery)
    config: TechniqueConfig | None = None  # an alone row's config (one of the technique's variants)
    setup_s: float | None = None  # seconds to build, warm up and judge it (exports, compiles, searches)
    trial_s: float | None = None  # seconds the whole row took, its comparison included

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "label": self.label,
            "techniques": self.steps,
            "kept": self.kept,
            "reason": self.reason,
            "speedup_vs_baseline": self.speedup,
            "gain": {**self.gain.to_dict(), "versus": self.versus} if self.gain else None,
            "batch_invariance": vars(self.invariance) if self.invariance else None,
            "measurement": self.measurement.to_dict() if self.measurement else None,
            "details": self.details,
            "config": config_to_dict(self.config) if self.config is not None else None,
            "setup_s": self.setup_s,
            "trial_s": self.trial_s,
        }

    def plan_figures(self) -> dict:
        """The plan row's figures as the plan file records them (`Plan.measured`): throughput, latency, the quoted
        speedup (None: uncertain, the machine was busy), its 99% confidence interval, the 99% interval a
        re-measurement (`overdrive bench`) lands in (`Gain.predict_rounds`), the point figure, fidelity, task metric."""
        m, gain = self.measurement, self.gain
        return {
            "samples_per_s": m.samples_per_s,
            "latency_ms": m.latency_ms,
            "speedup_vs_baseline": self.speedup,
            "speedup_ci99": [gain.low, gain.high] if gain else [1.0, 1.0],
            "speedup_interval99": list(gain.interval) if gain else [1.0, 1.0],
            "speedup_point": gain.ratio if gain else 1.0,
            "speedup_uncertain": gain.uncertain if gain else None,
            "fidelity": m.fidelity,
            "task_metric": m.task_metric,
        }


@dataclass(kw_only=True)
class TuneResult:
    rows: list[Row]
    plan: Plan
    baseline: Measurement
    flops_per_sample: float | None
    rule: FidelityRule | None = None
    warnings: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)
    peaks: str = ""  # the device peaks the roofline column is against (`core.roofline.describe_peaks`)
