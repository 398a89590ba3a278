"""The tuner: baseline, each technique alone (the attribution table), then greedy composition.

Composition follows the canonical order of `Stage` (batching → prune → precision → graph →
compile → runtime). Only techniques that were kept alone are tried; of a group of
alternatives (bf16 / fp16 / int8; one runtime per plan) the fastest kept one is tried first
and the others are skipped once one is kept (`techniques.conflict`). A runtime outside PyTorch
(ONNX Runtime, OpenVINO) that cannot follow the steps kept before it (autocast, compile) is
tried last, instead of them, against the plan so far, and kept only when it beats it.

The guard (DESIGN.md's "what every kept technique must pass"):
- Accuracy (`guard.py`): the baseline runs twice and must repeat itself; candidates are judged by
  the `FidelityRule` built from those runs (cosine or agreement with R², or the max absolute error
  for a degenerate reference) and the `Guard`'s budget; a zero budget keeps lossless techniques only.
- Fidelity is judged on the workload's rows (the user's data or example; the table says when they
  are random rows of the right shape only); a lossy technique must also keep each row's answer
  independent of its batch-mates (`invariance.InvarianceProbe`), and with rows of varying sizes every
  technique must answer a row that is all padding as fp32 does, finite (`invariance.EdgeProbe`).
- A model whose own answer depends on padding is measured on batches of one length, as serve and run
  give it; its dependence (or one on batch-mates, found by the probe) is recorded in the plan.
- Speed: a candidate and what it is compared with run interleaved (`gain.compare`) until the
  99% confidence interval of the gain decides; a step is kept only when the interval's low end
  clears `Guard.min_gain`. The table shows the interval; noisy timing is named in `warnings`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from overdrive.core import devices
from overdrive.core.errors import WorkloadError, one_line
from overdrive.core.flops import count_flops_per_sample, layer_flop_share
from overdrive.core.interference import Contention
from overdrive.core.gain import HEADLINE_ROUNDS, RECHECK_ROUNDS, RECHECK_WIDTH, Gain, compare
from overdrive.core.measure import (
    TIMING_ROWS,
    Measurement,
    Runner,
    cycle_indices,
    judge_outputs,
)
from overdrive.core.row_dependence import checked_dependence
from overdrive.core.workload import Workload
from overdrive.core.roofline import ABOVE_ROOF, above_roof, describe_peaks, measure_peaks, weight_bytes
from overdrive.techniques import TechniqueConfig, conflict, default_config, get_technique, list_techniques, technique_for
from overdrive.techniques.registry import compute_dtype, compute_layers, fallbacks
from overdrive.tuning.budget import Budget
from overdrive.tuning.guard import FidelityRule, Guard, fidelity_rule, late_graphs
from overdrive.tuning.invariance import EdgeProbe, InvarianceProbe
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build
from overdrive.tuning.rows import Row, TuneResult
from overdrive.tuning.schedule import Schedule, read_signals

NOISY_PASSES = 1.25  # p90 / p50 of the baseline's clean pass times: a machine busy in ways the OS did not show


Progress = Callable[[str], None]


def _describe_variant(variant: TechniqueConfig, default: TechniqueConfig) -> str:
    """What a variant changes from the default config: "mode=reduce-overhead"."""
    ours, theirs = variant.to_dict(), default.to_dict()
    return ", ".join(f"{k}={v}" for k, v in ours.items() if theirs.get(k) != v)


@dataclass(kw_only=True)
class Tuner:
    """Runs the optimize flow for one workload on one device.

    Attributes:
        workload, device, batch_size: what to tune and where.
        techniques: names to try (default: every registered technique that is not opt-in).
        guard: accuracy budget and speed bar.
        num_samples: evaluation samples (the first N of the workload's samples; cycled up to
            one full batch when the workload has fewer).
        min_rounds, max_rounds, max_compare_s: each comparison times at least `min_rounds`
            interleaved rounds and stops once its 99% interval decides, or at `max_rounds`
            rounds or `max_compare_s` seconds (see `gain.compare`); a candidate whose outputs
            already break the budget gets `min(2, min_rounds)` rounds, for the table's figures.
        timing_rows: rows per timed pass (see `measure.Runner`); None: every evaluation row.
        progress: called with a description before each measurement.
        configs: technique configs to use instead of the defaults, by name (e.g. a pruning
            ratio from the command line).
        budget: the time optimize may take (`tuning.budget`): candidates are tried by predicted gain
            per second, and one that cannot finish in what is left is reported untried.
    """

    workload: Workload
    device: torch.device
    batch_size: int
    techniques: list[str] | None = None
    guard: Guard = field(default_factory=Guard)
    num_samples: int | None = None
    min_rounds: int = 4
    max_rounds: int = 24
    max_compare_s: float = 40.0
    timing_rows: int | None = TIMING_ROWS
    progress: Progress = lambda _: None
    workload_spec: str | None = None
    configs: dict[str, TechniqueConfig] = field(default_factory=dict)
    budget: Budget = field(default_factory=lambda: Budget(None))

    def __post_init__(self):
        available = len(self.workload.samples)
        n = available if self.num_samples is None else min(self.num_samples, available)
        self.indices = cycle_indices(max(n, self.batch_size), available)
        names = self.techniques if self.techniques is not None else [t.name for t in list_techniques() if not t.opt_in]
        self.techniques = [get_technique(n).name for n in names]  # KeyError names the unknown one
        self.rule: FidelityRule | None = None
        self.probe: InvarianceProbe | None = None
        self.edge: EdgeProbe | None = None
        self.warnings: list[str] = []
        self.schedule = Schedule(self.budget, self.device, self.max_compare_s)

    def _step(self, name: str) -> TechniqueConfig:
        return get_technique(name).for_guard(self.configs.get(name) or default_config(name), self.guard)

    # -- runners ---------------------------------------------------------------------------------

    def _runner(self, steps: list[TechniqueConfig], reports: list[dict] | None = None) -> Runner:
        model, policy = build(self.workload, steps, self.device, reports)
        return Runner(model, self.workload, device=self.device, batch_size=self.batch_size, indices=self.indices,
                      policy=policy, timing_rows=self.timing_rows)

    @staticmethod
    def _release(*runners: Runner | None) -> None:
        for runner in runners:
            if runner is not None:
                runner.model = None
                runner.batches = []
        gc.collect()
        torch.compiler.reset()  # drop compiled graphs so the next candidate starts clean

    def _compare(self, reference: Runner, candidate: Runner, *, decide: bool) -> Gain:
        rounds = self.min_rounds if decide else min(2, self.min_rounds)
        return compare(reference, candidate, min_gain=self.guard.min_gain, min_rounds=rounds,
                       max_rounds=self.max_rounds if decide else rounds, max_s=self.max_compare_s)

    def _headline(self, reference: Runner, candidate: Runner) -> Gain:
        """The plan's gain over the baseline, timed for a figure rather than a decision: at least
        `HEADLINE_ROUNDS` clean rounds, then on (to 3 × `RECHECK_ROUNDS`) until its 99% interval is as narrow as `bench` asks
        (`RECHECK_WIDTH`) or the comparison's rounds or seconds run out; never past `max_rounds`."""
        rounds = min(max(self.min_rounds, HEADLINE_ROUNDS), self.max_rounds)
        return compare(reference, candidate, min_gain=self.guard.min_gain, min_rounds=rounds,
                       max_rounds=min(max(3 * RECHECK_ROUNDS, rounds), self.max_rounds), max_s=self.max_compare_s,
                       max_width=RECHECK_WIDTH)

    # -- the baseline ----------------------------------------------------------------------------

    def _baseline(self) -> tuple[Runner, torch.Tensor, float | None]:
        """The eager fp32 runner, warmed up, its outputs (the reference) and FLOPs per sample; sets the
        fidelity rule after checking that the baseline can be judged against at all.

        Raises:
            WorkloadError: the model fails at this batch size, gives non-finite outputs, gives
                different outputs for the same rows on two runs, or its fidelity figure fails the
                floor against its own outputs (a broken metric).
        """
        runner = self._runner([])
        flops = count_flops_per_sample(runner.model, self.workload, device=self.device, indices=self.indices)
        name = self.workload.name
        try:
            first = runner.warm_up()
            second = runner.outputs()
            runner.timed_pass()
        except Exception as exc:  # noqa: BLE001 - the user's model, at the user's batch size
            raise WorkloadError(f"{name}: the eager fp32 model failed at batch size {self.batch_size}: {one_line(exc)}") from None
        nonfinite = int((~torch.isfinite(first)).sum())
        if nonfinite:
            raise WorkloadError(f"{name}: the eager fp32 model gives {nonfinite} non-finite output values (NaN/inf) on its "
                                "samples, so no technique can be judged against it")
        self.rule = fidelity_rule(self.workload, self.guard, first, second)
        if self.rule.degenerate:  # said where a user reads, not only in the rule
            self.warnings.append(f"fidelity: {self.rule.describe()}")
        self.repeat = second
        self.flops, self.weights = flops, weight_bytes(runner.model)
        self.shares: dict[tuple, float | None] = {}
        self.base_model = runner.model
        return runner, first, flops

    def eta_s(self) -> float:
        """Seconds the tuner expects to need from now, within the budget (`Schedule.eta_s`)."""
        return self.schedule.eta_s()

    # -- candidates ------------------------------------------------------------------------------

    def _try(self, phase: str, label: str, steps: list[TechniqueConfig], reference: Runner, versus: str, *,
             judge: bool = True) -> tuple[Row, Runner | None]:
        """Build, warm up and judge a candidate, then time it against `reference` (briefly when its
        outputs already break the budget). Returns the row (judged unless `judge` is False) and the
        candidate's runner (None when it failed)."""
        self.progress(label)
        names = [s.name for s in steps]
        reports: list[dict] = []
        runner = None
        started = compared = time.monotonic()
        try:
            runner = self._runner(steps, reports)
            outputs = runner.warm_up()
            runner.timed_pass()
            m = judge_outputs(runner.measurement(), self.workload, outputs, self.indices, self.reference)
            verdict = None
            if self.probe is not None and any(not technique_for(s).lossless for s in steps):
                verdict = self.probe.check(runner.model, rule=self.rule)
            hints = [technique_for(s).batch_dependence for s in steps if technique_for(s).batch_dependence]
            breaks = self.guard.violation(m, self.baseline_task_metric, self.rule) \
                or (verdict.breaks(self.rule, hints) if verdict is not None else None) \
                or (self.edge.check(runner.model, rule=self.rule) if self.edge is not None else None) or late_graphs(runner)
            compared = time.monotonic()
            gain = self._compare(reference, runner, decide=breaks is None)
            if breaks is None:
                self.schedule.compare_s.append(time.monotonic() - compared)
            m = self._figures(judge_outputs(runner.measurement(), self.workload, outputs, self.indices, self.reference),
                              runner, steps, reports)
        except Exception as exc:  # noqa: BLE001 - a failing technique is a row, not a crash
            self._release(runner)
            ended = time.monotonic()
            return Row(phase=phase, label=label, steps=names, kept=False, reason=f"failed: {one_line(exc)}",
                       details=reports, setup_s=(compared if compared > started else ended) - started,
                       trial_s=ended - started), None
        row = Row(phase=phase, label=label, steps=names, kept=False, measurement=m, details=reports, gain=gain,
                  versus=versus, invariance=verdict, setup_s=compared - started, trial_s=time.monotonic() - started)
        if judge:
            self._judge(row, breaks)
        return row, runner

    def _figures(self, m: Measurement, runner: Runner, steps: list[TechniqueConfig], reports: list[dict], *,
                 audit: bool = False) -> Measurement:
        """Fill in the roofline (the FLOPs a pruning step left, else the baseline's) and, with `audit`,
        the copy and sync audit of one forward. Neither may fail a row: a failure is a warning."""
        flops = next((r["flops_per_sample_after"] for r in reversed(reports) if r.get("flops_per_sample_after")),
                     self.flops)
        fell_back = fallbacks(runner.model) if runner.model is not None else None
        if fell_back:
            self.warnings.append(f"{' + '.join(s.name for s in steps)}: {fell_back}; those calls' figures are eager")
        try:
            layers = compute_layers(steps)
            if layers is not None and layers not in self.shares:
                self.shares[layers] = layer_flop_share(self.base_model, self.workload, device=self.device,
                                                       indices=self.indices, layer_types=layers)
            share = self.shares.get(layers) if layers is not None else 1.0
            m.roofline = runner.roofline(flops, compute_dtype(steps), m.samples_per_s, fp32_weights=self.weights,
                                         dtype_share=1.0 if share is None else share)
            if audit:
                m.audit = runner.audit(opaque=any(technique_for(s).leaves_pytorch for s in steps))
        except Exception as exc:  # noqa: BLE001 - informative figures, never the verdict
            self.warnings.append(f"{' + '.join(s.name for s in steps) or 'the baseline'}: roofline or audit not "
                                 f"measured: {one_line(exc)}")
        return m

    def _judge(self, row: Row, breaks: str | None) -> Row:
        """Set kept and the reason: over budget (with the figure), or not clearly faster."""
        gain = row.gain
        if breaks:
            row.reason = breaks
        elif gain.low < self.guard.min_gain:
            row.reason = (f"not faster beyond the noise: {gain.describe()} over {row.versus} "
                          f"(99% interval, {gain.rounds} rounds; needs its low end ≥ {self.guard.min_gain:.2f}×)")
        else:
            row.kept = True
        if gain.uncertain and not breaks:  # a row refused for its answers: its timing decided nothing
            self.warnings.append(f"{row.label}: {gain.uncertain}: {gain.describe()} over {row.versus}; its figures are "
                                 "uncertain")
        return row

    def _skip_reason(self, name: str) -> str | None:
        technique = get_technique(name)
        reason = technique.unsupported_reason(self.workload, self.device, self._step(name)) or \
            technique.redundancy(self.workload)
        if reason:
            return f"skipped: {reason}"
        if self.guard.lossless_only and not technique.lossless:
            return f"skipped: lossy, and {self.guard.lossless_only}"
        return None

    # -- the flow --------------------------------------------------------------------------------

    def run(self) -> TuneResult:
        rows: list[Row] = []
        self.progress("the device's peaks (GEMM per dtype, copy bandwidth)")
        measure_peaks(self.device, [d for n in self.techniques if self._skip_reason(n) is None
                                    for d in [get_technique(n).dtype_of(self._step(n))] if d])
        self.progress("baseline (eager fp32)")
        checked_dependence(self.workload)  # a text model whose answer depends on padding is measured on one length per batch
        base, self.reference, flops = self._baseline()
        self.baseline_task_metric = self.workload.task_metric(self.reference, self.indices) if self.workload.has_task_metric \
            else None
        self.guard.check_baseline_metric(self.workload.name, self.baseline_task_metric)
        # The probe judges lossy candidates; the model's own batch dependence is worth knowing whatever is tried.
        self.probe = InvarianceProbe(self.workload, base.model, device=self.device, batch_size=self.batch_size,
                                     indices=self.indices)
        # The model's own dependence on batch-mates (the plan records it), and a row of padding only for every candidate.
        self.edge, edge_warning = EdgeProbe.of(self.workload, base.model, device=self.device, batch_size=self.batch_size,
                                               indices=self.indices)
        self.warnings += [w for w in (self.probe.record_dependence(rule=self.rule), edge_warning) if w]

        # 1. Each technique alone against the baseline, interleaved: the attribution table. A technique
        # with modes worth searching (compile on CUDA) has a row per variant; its fastest kept one composes.
        # Tried by predicted gain per second (`tuning.budget`); the table keeps the techniques' order.
        alone: dict[str, Row] = {}
        entries: list[tuple[int, Row]] = []
        candidates: list[tuple[int, str, TechniqueConfig, str]] = []
        for name in self.techniques:
            reason = self._skip_reason(name)
            if reason:
                entries.append((len(entries) + len(candidates), Row(phase="alone", label=name, steps=[name], kept=False,
                                                                  reason=reason)))
                continue
            step = self._step(name)
            variants = [step] if name in self.configs else get_technique(name).variants(step, self.workload, self.device)
            for variant in variants:
                label = name if variant == variants[0] else f"{name} ({_describe_variant(variant, variants[0])})"
                candidates.append((len(entries) + len(candidates), name, variant, label))
        self.schedule.start(read_signals(self.base_model, self.workload, device=self.device, indices=self.indices,
                                         batch_size=self.batch_size, pass_s=base.pass_s,
                                         candidates=[(c[1], c[2]) for c in candidates], shares=self.shares,
                                         min_rounds=self.min_rounds, max_compare_s=self.max_compare_s),
                            self.workload.model, self.batch_size)
        ordered = self.schedule.order(candidates)
        for i, (position, name, variant, label) in enumerate(ordered):
            untried = self.schedule.untried_alone(name, variant, label, list(alone.values()), ordered[i + 1:])
            if untried is not None:
                entries.append((position, untried))
                continue
            row, runner = self._try("alone", label, [variant], base, "the baseline")
            self._release(runner)
            row.speedup = row.gain.quoted if row.gain else None
            row.config = variant
            self.schedule.record(row)
            best = alone.get(name)
            if best is None or (row.kept and (not best.kept or row.measurement.samples_per_s
                                              > best.measurement.samples_per_s)):
                alone[name] = row
            entries.append((position, row))
        self.schedule.pending = []
        rows += [row for _, row in sorted(entries, key=lambda e: e[0])]
        baseline = self._figures(judge_outputs(base.measurement(), self.workload, self.repeat, self.indices,
                                               self.reference), base, [], [], audit=True)
        rows.insert(0, Row(phase="baseline", label="baseline (eager fp32)", steps=[], kept=True, measurement=baseline,
                           speedup=1.0))
        contention = Contention(**baseline.contention) if baseline.contention else None
        if contention is not None and contention.preempted:
            self.warnings.insert(0, f"other work used this machine while it was measured: {contention.describe()} (the "
                                    "baseline's); those stretches were timed again, not averaged in, and a figure that "
                                    "could not be had clean is marked uncertain")
        elif baseline.pass_spread > NOISY_PASSES:
            self.warnings.insert(0, f"the machine was busy: the baseline's passes over the same rows varied p90/p50 = "
                                    f"{baseline.pass_spread:.2f}×; gains are measured interleaved, but absolute figures "
                                    "are uncertain")

        # 2. Greedy composition of the winners in canonical order, each step against the plan so far.
        winners = [r for r in alone.values() if r.kept]
        winners.sort(key=lambda r: (get_technique(r.steps[0]).stage, -r.measurement.samples_per_s))
        current: list[TechniqueConfig] = []
        current_row: Row | None = None
        current_runner: Runner = base
        deferred: list[Row] = []  # runtimes outside PyTorch that cannot follow the steps kept: tried instead of them
        for i, winner in enumerate(winners):
            technique = get_technique(winner.steps[0])
            step = winner.config
            clash = conflict(current, step)
            if clash and technique.leaves_pytorch and not any(get_technique(s.name).leaves_pytorch for s in current):
                deferred.append(winner)
                continue
            if clash:
                rows.append(Row(phase="compose", label=f"+ {winner.label}", steps=[s.name for s in current] + [winner.steps[0]],
                                kept=False, reason=clash))
                continue
            candidate = current + [step]
            if not current:  # the first winner composed with nothing is its alone row; its model is built again
                step_row = Row(**{**winner.__dict__, "phase": "compose", "label": f"+ {winner.label}"})
                try:
                    runner = self._runner(candidate)
                    runner.warm_up()
                except Exception as exc:  # noqa: BLE001 - it ran alone; a second build failing is still a row
                    step_row.kept, step_row.reason, runner = False, f"failed when built again: {one_line(exc)}", None
            else:
                untried = self.schedule.untried_step(f"+ {winner.label}", [s.name for s in candidate], winner,
                                                     winners[i + 1:])
                if untried is not None:
                    rows.append(untried)
                    continue
                self.progress(f"+ {winner.label}")
                step_row, runner = self._try("compose", f"+ {winner.label}", candidate, current_runner,
                                             "the steps before it")

            rows.append(step_row)
            if step_row.kept:
                if current_runner is not base:
                    self._release(current_runner)
                current, current_row, current_runner = candidate, step_row, runner
            else:
                self._release(runner)

        # 2b. A runtime outside PyTorch runs the exported fp32 graph: it is tried instead of the steps it
        # cannot follow (autocast, compile), kept when the plan with it beats the plan without it.
        for i, winner in enumerate(deferred):
            step = winner.config
            kept_steps = [s for s in current if get_technique(s.name).exportable]
            clash = conflict(kept_steps, step)
            dropped = [s.name for s in current if s not in kept_steps]
            label = f"+ {winner.label}" + (f" instead of {', '.join(dropped)}" if dropped else "")
            if clash:
                rows.append(Row(phase="compose", label=label, steps=[s.name for s in kept_steps] + [winner.steps[0]],
                                kept=False, reason=clash))
                continue
            candidate = kept_steps + [step]
            untried = self.schedule.untried_step(label, [s.name for s in candidate], winner, deferred[i + 1:])
            if untried is not None:
                rows.append(untried)
                continue
            step_row, runner = self._try("compose", label, candidate, current_runner, "the plan so far")
            rows.append(step_row)
            if step_row.kept:
                if current_runner is not base:
                    self._release(current_runner)
                current, current_row, current_runner = candidate, step_row, runner
            else:
                self._release(runner)

        self.schedule.pending = []
        plan_row = self._plan_row(current, current_runner, base, baseline, current_row.details if current_row else [])
        while current and plan_row.gain.low < self.guard.min_gain:  # back off: the last step added goes first
            plan_row.phase, plan_row.kept = "compose", False
            plan_row.reason = (f"the plan is not faster than the baseline beyond the noise: {plan_row.gain.describe()} "
                               f"(needs its low end ≥ {self.guard.min_gain:.2f}×); backing off {current[-1].name}")
            rows.append(plan_row)
            self._release(current_runner)
            current, current_runner = current[:-1], base
            reports = []
            if current:
                try:
                    current_runner = self._runner(current, reports)
                    current_runner.warm_up()
                except Exception:  # noqa: BLE001 - it ran before; if it fails now, fall back to the baseline
                    current_runner, current = base, []
            plan_row = self._plan_row(current, current_runner, base, baseline, reports)
        rows.append(plan_row)
        rows += self._leave_one_out(current, current_runner)
        self._release(current_runner if current_runner is not base else None, base)
        if above_roof(r.measurement.roofline for r in rows if r.measurement is not None):
            self.warnings.append(f"a roofline share is {ABOVE_ROOF}")
        plan = Plan(
            workload=self.workload_spec or self.workload.name,
            device=self.device.type,
            batch_size=self.batch_size,
            steps=current,
            measured=plan_row.plan_figures(),
            environment={"torch": torch.__version__, "device_name": devices.describe(self.device)},
            batch_dependence=self.workload.batch_dependence.to_dict() if self.workload.batch_dependence else None,
        )
        return TuneResult(rows=rows, plan=plan, baseline=baseline, flops_per_sample=flops, rule=self.rule,
                          warnings=list(dict.fromkeys(self.warnings)), peaks=describe_peaks(self.device))

    def _plan_row(self, current: list[TechniqueConfig], runner: Runner, base: Runner, baseline: Measurement,
                  reports: list[dict]) -> Row:
        """The chosen plan, timed against the baseline once more (interleaved): the headline gain, with
        its roofline and the audit of one forward (`reports`: its steps' technique reports)."""
        names = [s.name for s in current]
        label = "plan: " + (" + ".join(names) or "baseline")
        if not current:
            return Row(phase="plan", label=label, steps=[], kept=True, measurement=baseline, speedup=1.0)
        self.progress(label + " vs baseline")
        since = len(runner.pass_s), len(runner.latencies_s)
        gain = self._headline(base, runner)
        if gain.uncertain:  # the headline is worth a second try: the machine may have quietened
            self.progress(label + " vs baseline, again (" + gain.uncertain.split(" (")[0] + ")")
            again = self._headline(base, runner)
            if (again.busy, again.high / max(again.low, 1e-12)) < (gain.busy, gain.high / max(gain.low, 1e-12)):
                gain = again
        gain.predict_rounds = RECHECK_ROUNDS  # the headline: where `overdrive bench` of the plan lands
        m = judge_outputs(runner.measurement(since=since), self.workload, runner.outputs(), self.indices, self.reference)
        m = self._figures(m, runner, current, reports, audit=True)
        return Row(phase="plan", label=label, steps=names, kept=True, measurement=m, speedup=gain.quoted, gain=gain,
                   versus="the baseline")

    def _leave_one_out(self, plan: list[TechniqueConfig], plan_runner: Runner) -> list[Row]:
        """For each opt-in step of a plan with others (pruning), the plan without it, timed against
        the plan: what that step adds on top of the rest (composition measured it before the rest existed)."""
        rows = []
        for step in plan:
            if len(plan) < 2 or not get_technique(step.name).opt_in:
                continue
            others = [s for s in plan if s is not step]
            if not self.schedule.affords_comparisons(2):
                self.warnings.append(f"plan without {step.name}: not measured, {self.budget.describe()} was spent")
                continue
            row, runner = self._try("without", f"plan without {step.name}", others, plan_runner, "the plan", judge=False)
            self._release(runner)
            if row.gain is not None:
                row.kept = True
                row.reason = (f"{step.name} adds {1 / row.gain.ratio:.2f}× [{1 / row.gain.high:.2f}, {1 / row.gain.low:.2f}] "
                              f"on top of {' + '.join(s.name for s in others)}")
            rows.append(row)
        return rows
