"""The guard's accuracy side: the budget (`Guard`) and how candidates' outputs are judged against the
baseline's (`FidelityRule`, built from two runs of the baseline by `fidelity_rule`).

- The baseline runs twice on the same rows: outputs that move between the runs (dropout, batch
  statistics, random draws) are refused with the cause, and a fidelity figure that fails its own
  floor against identical outputs is reported as a broken metric.
- A degenerate reference (all outputs within `DEGENERATE_OUTPUT` of zero, or every row the same) is
  judged by the max absolute error instead of cosine or agreement.
- R² joins a cosine figure (an offset all rows share hides errors from cosine).
- A zero accuracy budget, a floor within float noise of 1, or `lossless` keeps lossless techniques only.

The speed side (the interleaved gain interval against `Guard.min_gain`) is `gain.compare`, used by `tuner.Tuner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from overdrive.core.errors import ConfigError, WorkloadError, arg
from overdrive.core.graph_ops import training_mode_ops
from overdrive.core.measure import Measurement, Runner
from overdrive.core.workload import Workload, explained_variance

# Reference outputs all smaller than this are float noise: cosine and agreement with them mean nothing
# (a random-weight torchvision MobileNet gives ~1e-10, a ViT with its zero-initialised head exactly 0).
DEGENERATE_OUTPUT = 1e-6
# A degenerate reference is judged by max |candidate − reference| ≤ DEGENERATE_ATOL + DEGENERATE_RTOL × max |reference|.
DEGENERATE_ATOL = 1e-5
DEGENERATE_RTOL = 1e-3
# Two runs of the eager fp32 model on the same rows may differ by float noise (atomics on a GPU), no more.
REPEAT_RTOL = 1e-4
SAME_ROWS_RTOL = 1e-6  # rows whose outputs differ by no more than this × the largest output are "the same"
# Under a zero budget, a lossless technique's fidelity figure must be within float tolerance of 1.
LOSSLESS_TOLERANCE = 1e-5


@dataclass(frozen=True, kw_only=True)
class Guard:
    """The accuracy budget and the speed bar.

    Attributes:
        min_fidelity: floor on the workload's fidelity figure (cosine or agreement; R² for outputs of one value
            per row), in [0, 1].
        max_accuracy_drop: most task-metric points a candidate may lose (workloads with a task metric);
            None: no task-metric budget beyond the fidelity floor; 0: lossless techniques only.
        min_gain: the low end of a step's 99% gain interval must reach this to be kept (0: keep every
            step within the budget, whatever its speed).
        lossless: keep lossless techniques only (also implied by `max_accuracy_drop` 0 and
            `min_fidelity` 1).
    """

    min_fidelity: float = 0.99
    max_accuracy_drop: float | None = None
    min_gain: float = 1.02
    lossless: bool = False

    def __post_init__(self):
        if not 0.0 <= self.min_fidelity <= 1.0:  # NaN fails every comparison, so it is refused too
            raise ConfigError(f"{arg('min_fidelity', self.min_fidelity)}: expected a number in [0, 1]")
        if self.max_accuracy_drop is not None and not 0 <= self.max_accuracy_drop < math.inf:
            raise ConfigError(f"{arg('max_accuracy_drop', self.max_accuracy_drop)}: expected a finite number ≥ 0 (points)")
        if not 0 <= self.min_gain < math.inf:
            raise ConfigError(f"{arg('min_gain', self.min_gain)}: expected a finite ratio ≥ 0 (e.g. 1.02)")

    def check_baseline_metric(self, workload: str, metric: dict | None) -> None:
        """Refuses an accuracy budget that the task metric cannot judge.

        Raises:
            WorkloadError: `max_accuracy_drop` is set and the metric on the eager fp32 outputs has a value that is
                not a finite number.
        """
        if self.max_accuracy_drop is None or not metric:
            return
        broken = {k: v for k, v in metric.items() if not isinstance(v, (int, float)) or not math.isfinite(v)}
        if broken:
            raise WorkloadError(f"{workload}: the task metric gives {broken} on the eager fp32 outputs: an accuracy "
                                "budget cannot be judged by it (does the metric divide by zero, or read NaN labels?)")

    @property
    def lossless_only(self) -> str | None:
        """Why only lossless techniques may be kept, or None."""
        if self.lossless:
            return "lossless techniques only were asked for"
        if self.max_accuracy_drop == 0:
            return "the accuracy budget is 0"
        if self.min_fidelity >= 1.0 - LOSSLESS_TOLERANCE:
            return f"the fidelity floor is {self.min_fidelity:g}, within float noise of 1"
        return None

    def violation(self, m: Measurement, baseline_task_metric: dict[str, float] | None, rule: FidelityRule) -> str | None:
        """The figure that breaks the budget, or None. Non-finite outputs (fp16 overflow) always do."""
        if m.nonfinite_outputs:
            return f"{m.nonfinite_outputs} non-finite output values (overflow?) where fp32 has none"
        broken = rule.violation(m.fidelity)
        if broken:
            return broken
        if self.max_accuracy_drop is not None and m.task_metric and baseline_task_metric:
            key = next(iter(baseline_task_metric))  # "accuracy_pct", or a user metric's "metric"
            value = m.task_metric.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return f"the task metric {key} is {value!r} on its outputs, not a number to judge a drop by"
            drop = baseline_task_metric[key] - value
            if drop > self.max_accuracy_drop:
                return f"accuracy drop {drop:.2f} pt > {self.max_accuracy_drop} pt budget"
        return None


@dataclass(frozen=True, kw_only=True)
class FidelityRule:
    """How candidates' outputs are judged against the reference: the fidelity figure `key` and each
    figure in `also` ≥ `floor` (`also` is R², `workload.explained_variance`, beside a cosine figure
    where the workload's fidelity gives it: cosine alone cannot see errors hidden by an offset all
    rows share), or, for a degenerate reference (`degenerate` says why), `max_abs_error` ≤ `floor`, and
    R² ≥ `r2_floor` where it is set (outputs within 1e-6 of zero that still vary from row to row: R² is
    scale-free, so it judges them as any others)."""

    key: str
    floor: float
    also: tuple[str, ...] = ()
    degenerate: str = ""
    r2_floor: float | None = None

    def passes(self, value: float) -> bool:
        return value <= self.floor if self.degenerate else value >= self.floor  # NaN fails both

    def violation(self, figures: dict[str, float]) -> str | None:
        for key in (self.key, *self.also):
            value = figures.get(key)
            if value is None or self.passes(value):  # an absent figure (R² of rows that do not vary) judges nothing
                continue
            if self.degenerate:
                return f"{key} {value:.3g} > {self.floor:.3g} tolerance"
            why = " (the error is large next to how much the outputs vary from row to row)" if key == "r2" else ""
            return f"{key} {value:.4f} < {self.floor:.6g} floor{why}"
        r2 = figures.get("r2")
        if self.r2_floor is not None and r2 is not None and not r2 >= self.r2_floor:
            return (f"r2 {r2:.4f} < {self.r2_floor:.6g} floor (the error is large next to how much the outputs vary "
                    "from row to row)")
        return None

    def describe(self) -> str:
        if self.degenerate:
            also = f" and r2 ≥ {self.r2_floor:.6g}" if self.r2_floor is not None else ""
            return f"degenerate reference ({self.degenerate}): judged by max_abs_error ≤ {self.floor:.3g}{also}, not cosine"
        return " and ".join(f"{k} ≥ {self.floor:.6g}" for k in (self.key, *self.also))


def fidelity_rule(workload: Workload, guard: Guard, first: torch.Tensor, second: torch.Tensor) -> FidelityRule:
    """The rule candidates are judged by, from two runs of the eager fp32 baseline on the same rows.

    Args:
        first, second: the baseline's outputs on the evaluation rows, twice ([N, ...], the same rows in order).

    Raises:
        WorkloadError: the outputs moved between the runs (with the cause: training-mode ops, random
            draws or state), or the fidelity function fails its own floor on identical outputs (a
            broken metric), or it does not give the workload's fidelity figure.
    """
    name, key = workload.name, workload.fidelity_key
    scale = float(first.abs().max()) if first.numel() else 0.0
    moved = float((first - second).abs().max()) if first.numel() else 0.0
    if moved > REPEAT_RTOL * max(scale, DEGENERATE_OUTPUT):
        figure = workload.fidelity(second, first).get(key, math.nan)
        raise WorkloadError(f"{name}: the eager fp32 model gives different outputs for the same rows on two runs "
                            f"(largest difference {moved:.3g} of outputs up to {scale:.3g}; {key} {figure:.4f} between "
                            f"the runs): {moving_cause(workload.model)}. No technique can be judged against a moving reference")
    rows = first.reshape(len(first), -1)
    floor = 1.0 - LOSSLESS_TOLERANCE if guard.lossless_only else guard.min_fidelity
    if scale < DEGENERATE_OUTPUT:
        varies = explained_variance(second, first) is not None  # rows that vary: R² judges them whatever their scale
        return FidelityRule(key="max_abs_error", floor=DEGENERATE_ATOL + DEGENERATE_RTOL * scale,
                            degenerate=f"every output is within {DEGENERATE_OUTPUT:g} of zero, the largest {scale:.2g}",
                            r2_floor=floor if varies and floor > 0 else None)
    if len(rows) > 1 and float((rows - rows[:1]).abs().max()) <= SAME_ROWS_RTOL * scale:
        return FidelityRule(key="max_abs_error", floor=DEGENERATE_ATOL + DEGENERATE_RTOL * scale,
                            degenerate="every row's output is the same, whatever its input")
    figures = workload.fidelity(second, first)
    own = figures.get(key)
    if own is None and key == "r2" and len(rows) < 2:  # one value: no spread to judge an error against
        return FidelityRule(key="max_abs_error", floor=DEGENERATE_ATOL + LOSSLESS_TOLERANCE * scale, degenerate=(
            "one evaluation row of one value: no spread over rows to judge R² against, so it must agree as a lossless "
            "technique does; give more rows (data=) to judge lossy techniques"))
    if own is None:
        raise WorkloadError(f"{name}: its fidelity function gives no {key!r} figure (it gives {sorted(figures)})")
    if not own >= min(floor, 1.0 - LOSSLESS_TOLERANCE):  # identical outputs give float noise below 1 (0.99999988)
        raise WorkloadError(f"{name}: broken fidelity metric: the eager fp32 model's outputs against themselves give "
                            f"{key} {own:.6g}, below the {floor:.6g} floor, so every technique would fail it (a fidelity "
                            "function that does not give its best figure for identical outputs?)")
    # R² beside a cosine figure, which an offset all rows share blinds; not beside an agreement figure (top-1), which
    # a workload names when only the argmax matters; a floor of 0 asks for no fidelity check
    also = ("r2",) if "r2" in figures and key.endswith("cosine") and floor > 0 else ()
    return FidelityRule(key=key, floor=floor, also=also)



def moving_cause(model: torch.nn.Module) -> str:
    """Why a model's outputs move between two runs on the same rows."""
    ops = training_mode_ops(model)
    if ops:
        return f"its graph holds training-mode ops ({', '.join(ops)}); export it after model.eval()"
    return ("no dropout or batch-norm layer is in training mode, so its forward draws random numbers, or keeps "
            "state that changes from call to call; make it deterministic in eval mode")


def late_graphs(runner: Runner) -> str | None:
    """Why a candidate would lose in `run` and `serve` what it wins here: torch.compile built graphs for
    evaluation rows past the warm-up those jobs give (`Runner.warm_up`), so a job stops mid-way to compile."""
    if not runner.late_graphs:
        return None
    return (f"compiled {runner.late_graphs} graph(s) for evaluation rows after the warm-up run and serve give it (batch 1 "
            f"and {runner.batch_size}, padded and not): a job would stop to compile each, slower than eager there")
