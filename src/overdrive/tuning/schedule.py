"""The time budget inside the tuner: the signals its estimates read, the order candidates are tried
in, the time kept back for composing and timing the plan, the rows of what the budget leaves
untried, and the time left (the estimates and the budget themselves: `tuning.budget`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from torch import nn

from overdrive.core.flops import layer_flop_share
from overdrive.core.roofline import peak_flops
from overdrive.core.workload import Workload
from overdrive.techniques import TechniqueConfig, get_technique
from overdrive.tuning.budget import Budget, Estimate, History, Signals, default_dtype_layers, estimate, padding_share
from overdrive.tuning.rows import Row


def read_signals(model: nn.Module, workload: Workload, *, device: torch.device, indices: list[int], batch_size: int,
                 pass_s: list[float], candidates: list[tuple[str, TechniqueConfig]], shares: dict[tuple, float | None],
                 min_rounds: int, max_compare_s: float) -> Signals:
    """The cheap facts the estimates use, after the baseline: the model's size, its pass time, the FLOP
    share of the layers each precision candidate lowers (memoised in `shares`, which the roofline column
    shares), the measured GEMM peaks of their dtypes, the padding of text batches."""
    peaks = {"float32": peak_flops(device, "float32")}
    found: dict[tuple, float | None] = {}
    for name, config in candidates:
        technique = get_technique(name)
        dtype = technique.dtype_of(config)
        if not dtype or dtype == "float32":
            continue
        layers = technique.dtype_layers or default_dtype_layers()
        try:
            if layers not in shares:
                shares[layers] = layer_flop_share(model, workload, device=device, indices=indices, layer_types=layers)
            found[layers] = shares[layers]
            peaks[dtype] = peak_flops(device, dtype)
        except Exception:  # noqa: BLE001 - a signal missing makes a prior of the prediction, nothing else
            continue
    median_pass_s = statistics.median(pass_s) if pass_s else 0.1
    first_compare_s = min(max_compare_s, min_rounds * 2 * max(median_pass_s, 0.2)) * 1.5  # min rounds of both passes
    return Signals(params_m=sum(p.numel() for p in model.parameters()) / 1e6, pass_s=median_pass_s, compare_s=first_compare_s,
                   padding=padding_share(workload, indices, batch_size), shares=found, peaks=peaks)


@dataclass
class Schedule:
    """What the tuner asks of the time budget, and what it has learned of this run's costs.

    Attributes:
        compare_s: seconds each comparison that decided a verdict took (their median estimates the next).
        pending: estimates of what is still to be tried, for the time left.
    """

    budget: Budget
    device: torch.device
    max_compare_s: float
    signals: Signals | None = None
    history: History = field(default_factory=lambda: History(None))
    compare_s: list[float] = field(default_factory=list)
    pending: list[Estimate] = field(default_factory=list)
    _guesses: dict[str, Estimate] = field(default_factory=dict, repr=False)  # `order`'s first estimates

    def start(self, signals: Signals, model: nn.Module, batch_size: int) -> None:
        """The signals read after the baseline, and what earlier runs measured for this model."""
        self.signals = signals
        try:
            self.history = History.for_model(model, self.device, batch_size)
        except Exception:  # noqa: BLE001 - a model whose weights cannot be read for a key has no history
            self.history = History(None)

    def compare_estimate(self) -> float:
        """Seconds one comparison takes: the median of those timed so far, else the first guess."""
        if self.compare_s:
            return statistics.median(self.compare_s)
        return self.signals.compare_s if self.signals is not None else self.max_compare_s

    def estimate(self, name: str, config: TechniqueConfig, label: str) -> Estimate:
        self.signals.compare_s = self.compare_estimate()
        return estimate(get_technique(name), config, self.signals, self.history, label, self.device)

    def order(self, candidates: list[tuple[int, str, TechniqueConfig, str]]) -> list[tuple[int, str, TechniqueConfig, str]]:
        """(position, name, config, label) candidates by predicted gain per second, best first (stable)."""
        self._guesses = {c[3]: self.estimate(c[1], c[2], c[3]) for c in candidates}
        return sorted(candidates, key=lambda c: -self._guesses[c[3]].priority)

    def untried_alone(self, name: str, config: TechniqueConfig, label: str, kept: list[Row],
                      rest: list[tuple[int, str, TechniqueConfig, str]]) -> Row | None:
        """The row of a candidate the budget cannot cover alone now, or None to try it; `rest` is
        what would still follow it (`order`'s candidates after it)."""
        self.pending = [self._guesses[c[3]] for c in rest]
        guess = self.estimate(name, config, label)
        reserve = self.reserve(kept)
        if self.budget.affords(guess.cost_s, reserve):
            return None
        return self._untried("alone", label, [name], guess.cost_s, reserve, guess.source)

    def untried_step(self, label: str, steps: list[str], winner: Row, rest: list[Row]) -> Row | None:
        """The row of a composition step the budget cannot cover (its build as measured alone and a
        comparison, with the plan's own timing kept back), or None to try it."""
        compare_s = self.compare_estimate()
        self.pending = [Estimate(gain=1.0, setup_s=w.setup_s or 0.0, compare_s=compare_s, source="") for w in rest]
        cost = (winner.setup_s or 0.0) + compare_s
        if self.budget.affords(cost, 2 * compare_s):
            return None
        return self._untried("compose", label, steps, cost, 2 * compare_s, "its build measured alone")

    def affords_comparisons(self, count: int) -> bool:
        return self.budget.affords(count * self.compare_estimate())

    def record(self, row: Row) -> None:
        """A candidate tried alone, for later runs' estimates."""
        self.history.record(row.label, gain=row.gain.ratio if row.gain else None, setup_s=row.setup_s or 0.0,
                            trial_s=row.trial_s or 0.0, kept=row.kept)

    def reserve(self, kept) -> float:
        """Seconds kept back for what must follow: the winners so far built again and composed, and the
        plan timed against the baseline (twice when the first try is uncertain)."""
        compare_s = self.compare_estimate()
        costs: dict[str, float] = {}  # of a group of alternatives (one precision, one runtime) one is composed
        for row in kept:
            if row.kept:
                group = get_technique(row.steps[0]).group or row.label
                costs[group] = max(costs.get(group, 0.0), (row.setup_s or 0.0) + compare_s)
        return 2 * compare_s + sum(costs.values())

    def _untried(self, phase: str, label: str, steps: list[str], cost: float, reserve: float, source: str) -> Row:
        left = max(self.budget.left(), 0.0)
        return Row(phase=phase, label=label, steps=steps, kept=False,
                   reason=f"untried: {self.budget.describe()} had {left:.0f} s left, {min(reserve, left):.0f} s of it kept "
                          f"for composing what was kept and timing the plan, and this takes about {cost:.0f} s (estimate, "
                          f"{source}); a larger --time-budget tries it")

    def eta_s(self) -> float:
        """Seconds the tuner expects to need from now: what is still to be tried, the plan's own timing,
        never more than the budget has left."""
        if self.signals is None:
            return self.budget.left()
        return min(self.budget.left(), sum(e.cost_s for e in self.pending) + 2 * self.compare_estimate())
