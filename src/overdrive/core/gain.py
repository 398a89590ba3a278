"""The gain of one model over another, from interleaved passes: `compare`, `Gain` (its quoted figure,
whether it is uncertain, the interval a re-measurement lands in) and the statistics behind them.

The runners are `measure.Runner`s, warmed up; see `measure`'s protocol for what a pass and a stretch are.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from overdrive.core.interference import Contention

if TYPE_CHECKING:
    from overdrive.core.measure import Runner

# Two-sided 99.5% quantiles of Student's t for 1..30 degrees of freedom (the 99% interval). 99%, not 95%: a
# comparison looks at its interval after every round and stops once it decides, and each of those looks is a
# chance to decide wrongly on noise; a plan made of ten such decisions must come out the same run after run.
_T995 = [63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977, 2.947,
         2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750]
_Z995 = 2.576  # beyond 30 degrees of freedom


# A gain whose 99% interval spans more than this ratio (high / low) is too wide to quote as a point.
NOISY_INTERVAL = 1.4
# What differs between two processes timing the same plan beyond their rounds' own scatter (log-ratio standard
# deviation): with the allocator settled and the collector paused, `overdrive bench` of one plan in fresh processes
# on a 2-core VM scattered 0.07-0.11 all told (benchmarks/RESULTS.md, reproducible_cpu), of which the rounds explain most.
BETWEEN_PROCESSES_SD = 0.05
# The fewest interleaved rounds a second look at a figure times (`overdrive bench`, the report's sweep): the
# headline's prediction interval is for a new measurement of this many rounds (`Gain.predict_rounds`).
RECHECK_ROUNDS = 4
# ... and times on until its gain's 99% interval is no wider than this (high / low), up to 3 × RECHECK_ROUNDS rounds.
RECHECK_WIDTH = 1.2
# The fewest clean rounds behind a headline (the plan against the baseline): a comparison that stops at its first
# decision may stop after 4 rounds, whose standard deviation can come out a fifth of the machine's (2-core VM: rounds
# scatter 0.06-0.15 in log ratio; one 4-round headline read 0.025 and printed [1.53, 2.13], and bench in a fresh process
# measured 1.38×). Eight rounds give the deviation 7 degrees of freedom.
HEADLINE_ROUNDS = 2 * RECHECK_ROUNDS


@dataclass(kw_only=True)
class Gain:
    """How much faster a candidate ran than a reference, from interleaved passes.

    Each round times one stretch of each (in alternating order, ABBA, so a linear drift in the
    machine's speed cancels); the gain is the geometric mean over rounds of the reference's pass
    time over the candidate's, with a 99% confidence interval from Student's t on the log ratios.
    A round in which either side ran preempted by other work (`core.interference`) is set aside and
    timed again; only when too few clean rounds could be had are the preempted ones counted, and the
    gain is then `busy`.

    The confidence interval says where the true mean ratio is, which is what a decision needs. A
    figure quoted to a user is checked by measuring again (`overdrive bench`), whose own few rounds
    scatter too: with `predict_rounds` set, `interval` is the 99% prediction interval of a new
    measurement of that many rounds in another process, the range a second look lands in:
    mean ± √((t·sd)²·(1/n + 1/k) + (z·`BETWEEN_PROCESSES_SD`)²).

    Attributes:
        ratio: candidate throughput ÷ reference throughput (>1: faster).
        low, high: the 99% confidence interval of `ratio`.
        rounds: rounds the figures come from (pairs of stretches).
        log_sd: the standard deviation of the per-round log ratios.
        passes_per_round: passes each side ran per round (more for models whose pass is very short).
        preempted_rounds: rounds that ran preempted (set aside, or counted when `busy`).
        busy: fewer than the rounds needed ran clean, so preempted ones are in the figures.
        contention: how busy the machine was over the comparison (`Contention.to_dict`), where measured.
        predict_rounds: when set, `interval` is where a new measurement of this many rounds lands.
    """

    ratio: float
    low: float
    high: float
    rounds: int
    log_sd: float = math.nan
    passes_per_round: int = 1
    preempted_rounds: int = 0
    busy: bool = False
    contention: dict | None = None
    predict_rounds: int | None = None

    @property
    def interval(self) -> tuple[float, float]:
        """The interval shown with the figure: the 99% confidence interval, or with `predict_rounds`
        the 99% prediction interval of a measurement of that many rounds."""
        if self.predict_rounds is None or self.rounds < 2 or math.isnan(self.log_sd):
            return self.low, self.high
        within = _t995(self.rounds - 1) * self.log_sd * math.sqrt(1 / self.rounds + 1 / self.predict_rounds)
        half = math.hypot(within, _Z995 * BETWEEN_PROCESSES_SD)
        return self.ratio * math.exp(-half), self.ratio * math.exp(half)

    @property
    def uncertain(self) -> str | None:
        """Why the point figure cannot be quoted, or None: a busy machine, or an interval wider than
        `NOISY_INTERVAL` (high / low)."""
        low, high = self.interval
        if self.busy:
            waited = (self.contention or {}).get("waited_share")
            during = f", its threads waiting for a CPU {waited:.2f} s per second of the pass (summed over threads)" \
                if waited is not None else ""
            return f"the machine was busy ({self.preempted_rounds} of {self.rounds} rounds ran preempted by other work{during})"
        if high / max(low, 1e-12) > NOISY_INTERVAL:
            return f"the 99% interval is wide (high / low = {high / max(low, 1e-12):.2f})"
        return None

    @property
    def quoted(self) -> float | None:
        """The figure to quote: the ratio when certain, the interval's low end when the interval is
        wide, None when the machine was busy (no figure from it survives a second look)."""
        if self.busy:
            return None
        return self.ratio if self.uncertain is None else self.interval[0]

    def describe(self) -> str:
        """"2.31× [2.20, 2.43]"; "≥ 2.20× (wide: [2.20, 3.43])"; "uncertain (busy) [1.50, 9.30]"."""
        low, high = self.interval
        interval = f"[{_bound(low)}, {_bound(high)}]"
        if self.busy:
            return f"uncertain (busy) {interval}"
        if self.uncertain is not None:
            return f"≥ {low:.2f}× (wide: {interval})"
        return f"{self.ratio:.2f}× {interval}"

    def to_dict(self) -> dict:
        return {**asdict(self), "interval": list(self.interval), "quoted": self.quoted, "uncertain": self.uncertain}


def _bound(value: float) -> str:
    """An interval's end as printed: beyond 1000× (a few noisy rounds) it says only that."""
    return f"{value:.2f}" if value <= 1000 else "> 1000"


def _t995(df: int) -> float:
    """The two-sided 99% quantile of Student's t with `df` ≥ 1 degrees of freedom."""
    return _T995[df - 1] if df <= len(_T995) else _Z995


def gain_from_ratios(log_ratios: list[float]) -> Gain:
    """The Gain of per-round log(reference time / candidate time) values (≥ 1 of them)."""
    n = len(log_ratios)
    mean = sum(log_ratios) / n
    if n < 2:
        return Gain(ratio=math.exp(mean), low=0.0, high=math.inf, rounds=n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in log_ratios) / (n - 1))
    half = _t995(n - 1) * sd / math.sqrt(n)
    return Gain(ratio=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), rounds=n, log_sd=sd)


def compare(reference: Runner, candidate: Runner, *, min_gain: float, min_rounds: int = 4, max_rounds: int = 12,
            max_s: float = 20.0, min_unit_s: float = 0.2, max_width: float | None = None) -> Gain:
    """Time `candidate` against `reference` in interleaved rounds until the 99% interval of the
    gain decides against `min_gain` (its low end above it: faster; its high end below: not) and,
    with `max_width`, is no wider than that (high / low), or `max_rounds` clean rounds or `max_s`
    seconds have passed (at least `min_rounds` rounds).

    Both runners must be warmed up; each is settled first (`Runner.settle`). A side whose pass is
    shorter than `min_unit_s` runs several passes per round (its time per pass is their mean): a shared
    machine's speed wanders over tens of milliseconds (a 2-core VM: ±25% between 50 ms stretches), so
    short stretches would time the wander, not the model. A round in which either side ran preempted by
    other work is set aside and timed again (up to `max_rounds` set aside); when `max_s` runs out with
    fewer than `min_rounds` clean rounds, the set-aside ones are counted too and the Gain is `busy`.

    Returns:
        The Gain (each runner keeps its pass and call times for its Measurement).
    """
    repeats = {id(runner): runner.settle(min_unit_s=min_unit_s)[1] for runner in (reference, candidate)}
    marks = {id(runner): len(runner.meter.loads) for runner in (reference, candidate)}
    clean: list[float] = []
    preempted: list[float] = []
    started = time.perf_counter()
    while True:
        per_pass, flags = {}, []
        for runner in (reference, candidate) if (len(clean) + len(preempted)) % 2 == 0 else (candidate, reference):
            per_pass[id(runner)], flag = runner.timed_passes(repeats[id(runner)])
            flags.append(flag)
        ratio = math.log(per_pass[id(reference)] / max(per_pass[id(candidate)], 1e-12))
        (preempted if any(flags) else clean).append(ratio)
        elapsed = time.perf_counter() - started
        # Set-aside rounds stop counting once they outnumber the clean ones 2 to 1 (at least 2 × min_rounds):
        # a machine that busy stays busy for longer than a comparison should wait.
        out_of_time = elapsed >= max_s or len(preempted) >= min(max_rounds, max(2 * min_rounds, 2 * len(clean)))
        if len(clean) >= min_rounds or (out_of_time and len(clean) + len(preempted) >= min_rounds):
            busy = len(clean) < min_rounds
            gain = gain_from_ratios(clean + preempted if busy else clean)
            decided = (gain.low >= min_gain or gain.high < min_gain) and \
                (max_width is None or gain.high <= max_width * gain.low)
            if busy or decided or len(clean) >= max_rounds or out_of_time:
                gain.passes_per_round, gain.busy = repeats[id(candidate)], busy
                gain.preempted_rounds = len(preempted)
                gain.contention = Contention.of(
                    *[[x for r in (reference, candidate) for x in getattr(r.meter, a)[marks[id(r)]:]]
                      for a in ("loads", "flags")]).to_dict()
                return gain
