"""`overdrive optimize` for a causal LM: each generation technique measured and guarded, the winners composed into
a `GenerationPlan`.

The flow, as for one-pass models: the baseline is overdrive's engine on the fp32 model, eager (`Generator`);
each technique is added in turn to the steps kept so far and timed against them in interleaved rounds
(`gain.compare`, through `DecodeRunner`) at the plan's batch size; it is kept when the low end of its gain's 99%
interval is at least `min_gain` and the generation guard passes. The guard (`generate/fidelity.py`) runs every
candidate against the fp32 eager reference on held-out prompts: greedy tokens (a change where the reference's
top-2 margin is above the near-tie threshold counts; exact techniques may change none, lossy ones a share
`max_diverged_share`), mean KL along the reference's path (`max_mean_kl`), held-out perplexity
(`max_perplexity_change`), and the batch-invariance probe (a prompt alone and in a batch of mixed lengths must get
the same tokens). The plan's own gain over the baseline is then timed for a figure (`gain.HEADLINE_ROUNDS`), at
the plan's batch size and at the other one measured (1 or `batch_size`).

Techniques, in the order tried (`TECHNIQUES`): `compile-decode`; one weight form, the one `quantize.pick_form`
times fastest at the plan's batch (the others reported untried with those timings), its layers searched
(`quantize.search_layers`); `kv-int8`; `bf16`; `prompt-lookup` (batch 1 only); `draft-model` (batch 1 only: a
draft derived from the target, `generate/draft.py`, distilled for the steps `draft_seconds` allows; it takes the
place of a kept prompt-lookup, a plan holding one speculative step, and is kept only if faster than the plan with
it). `int4-weight` on CUDA is reported untried with the reason (PyTorch's int4 kernel used here is the CPU one).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from overdrive.core.devices import settle_host_allocator
from overdrive.core.gain import HEADLINE_ROUNDS, RECHECK_ROUNDS, RECHECK_WIDTH, Gain, compare
from overdrive.core.interference import LoadMeter
from overdrive.core.measure import Runner
from overdrive.generate.engine import Generator, SamplingParams
from overdrive.generate.draft import DEFAULT_STEPS, distillation_texts, draft_layers, seconds_per_step
from overdrive.generate.plan import SPECULATIVE, GenerationPlan, build_generator
from overdrive.generate.quantize import FORMS, fp16_rows_refusal, linear_names, pick_form, search_layers
from overdrive.generate.workload import GenerationWorkload

TECHNIQUES = ("compile-decode", "weight-only", "kv-int8", "bf16", "prompt-lookup", "draft-model")
DESCRIPTIONS = {
    "compile-decode": "the decode step under torch.compile (fixed shapes; CUDA graphs on a GPU); exact",
    "weight-only": "one weight-only form, the fastest at the plan's batch, on the layers a per-layer KL search keeps",
    "int8-weight": "weight-only int8, a scale per output channel (aten._weight_int8pack_mm)",
    "int8-rowwise": "int8 weights and int8 activations with a scale per row, quantized per call (torch._int_mm; "
                    "overdrive's row kernel at ≤ 4 rows with AVX-512 VNNI, ≤ 512 with AVX2: the same exact sums)",
    "fp16-weight": "fp16 weights packed for FBGEMM, fp32 arithmetic",
    "int4-weight": "weight-only int4, a scale and zero point per 64 input channels (aten._weight_int4pack_mm_for_cpu)",
    "kv-int8": "the KV cache in int8, a float32 scale per token and head",
    "bf16": "weights, activations and the KV cache in bfloat16",
    "prompt-lookup": "speculative decoding with n-gram drafts from the prompt, verified greedily; batch 1; exact",
    "draft-model": "speculative decoding with a draft derived from the target (layers kept, distilled); batch 1; exact",
}
EXACT = {"compile-decode", "prompt-lookup", "draft-model"}  # may change no greedy token beyond near ties


class DecodeRunner(Runner):
    """A `Generator` timed the way `gain.compare` times a model (settling, stretches, the load read around each).

    A pass generates `new_tokens` greedy tokens (no stop token: every pass is the same work) for `prompts`: in
    one batch, or at `batch_size` 1 each prompt alone. Every pass of two runners compared holds the same tokens,
    so the ratio of pass times is the ratio of tokens/s. The time to first token and the decode steps of the
    last timed pass's batches are kept (`ttft_s`, `step_s`, `accepted`).

    Args:
        generator: the candidate, warmed up by the caller or by `warm_up`.
        prompts: token-id prompts (the first `batch_size` are used, or the first `alone` ones at batch 1).
        batch_size: sequences per batch; 1 runs `alone` prompts one after another.
        new_tokens: greedy tokens per sequence.
    """

    def __init__(self, generator: Generator, prompts: list[list[int]], *, batch_size: int, new_tokens: int,
                 alone: int = 2):
        if batch_size < 1 or not prompts:
            raise ValueError(f"need batch_size ≥ 1 and at least one prompt (got {batch_size}, {len(prompts)})")
        settle_host_allocator()
        self.generator, self.batch_size, self.new_tokens = generator, batch_size, new_tokens
        self.batches = [[p] for p in prompts[:alone]] if batch_size == 1 else [prompts[:batch_size]]
        self.params = SamplingParams(max_new_tokens=new_tokens)
        self.tokens_per_pass = sum(len(b) for b in self.batches) * new_tokens
        self.latencies_s: list[float] = []
        self.pass_s: list[float] = []
        self.pass_preempted: list[bool] = []
        self.meter = LoadMeter()
        self.settle_passes = 0
        self._settled: dict[float, tuple[float, int]] = {}
        self.ttft_s: list[float] = []
        self.step_s: list[float] = []
        self.accepted = 0  # draft tokens speculative decoding kept in the last pass

    def forwards_per_s(self) -> float:
        """Decode forwards per second in the last pass (each reads every weight once): a forward that kept n
        tokens by speculation added n entries to `step_s`, so the forwards are its entries less the drafts kept."""
        busy = sum(self.step_s)
        return (len(self.step_s) - self.accepted) / busy if busy > 0 else math.nan

    @torch.no_grad()
    def warm_up(self) -> float:
        """Two untimed passes (compilation, the allocator); returns their seconds."""
        started = time.perf_counter()
        for _ in range(2):
            self._pass(timed=False)
        return time.perf_counter() - started

    def _pass(self, *, timed: bool) -> tuple[float, list[float], None]:
        started = time.perf_counter()
        ttft, steps, accepted = [], [], 0
        for batch in self.batches:
            self.generator.generate(batch, self.params)
            ttft += [t.prefill_s for t in self.generator.timings]
            steps += [s for t in self.generator.timings for s in t.step_s]
            accepted += sum(t.accepted for t in self.generator.timings)
        seconds = time.perf_counter() - started
        self.ttft_s, self.step_s, self.accepted = ttft, steps, accepted
        return seconds, [seconds], None

    def tokens_per_s(self) -> float:
        """Tokens per second over the timed passes (their median)."""
        passes = sorted(self.pass_s) or [math.inf]
        return self.tokens_per_pass / passes[len(passes) // 2]


@dataclass
class GuardBudget:
    """What a generation candidate may change against the fp32 reference (`GenerationFidelity.breaks`): lossy
    techniques a share of prompts with a greedy token changed beyond near ties, a mean KL in nats per token and a
    relative held-out perplexity increase; exact ones (`EXACT`) no greedy token beyond near ties and a mean KL
    under `exact_kl` (summation order apart)."""

    max_diverged_share: float = 0.125
    max_mean_kl: float = 0.01
    max_perplexity_change: float = 0.01
    exact_kl: float = 1e-4

    def breaks(self, name: str, fidelity) -> str | None:
        if name in EXACT:
            return fidelity.breaks(max_diverged_share=0.0, max_mean_kl=self.exact_kl)
        return fidelity.breaks(max_diverged_share=self.max_diverged_share, max_mean_kl=self.max_mean_kl,
                               max_perplexity_change=self.max_perplexity_change)


@dataclass
class GenerationRow:
    """One row of the generation table. `status`: "baseline", "kept", "rejected" or "untried"; `gain` against what
    the step was added to (the plan row: against the baseline); `tokens_per_s` at the plan's batch size."""

    technique: str
    status: str
    reason: str = ""
    steps: list[dict] = field(default_factory=list)
    tokens_per_s: float | None = None
    gain: Gain | None = None
    fidelity: dict | None = None
    probe: dict | None = None
    detail: str = ""
    setup_s: float | None = None

    def to_dict(self) -> dict:
        return {"technique": self.technique, "status": self.status, "reason": self.reason, "steps": self.steps,
                "tokens_per_s": self.tokens_per_s, "gain": self.gain.to_dict() if self.gain else None,
                "fidelity": self.fidelity, "probe": self.probe, "detail": self.detail, "setup_s": self.setup_s}


@dataclass
class GenerationResult:
    """`optimize`'s answer for a causal LM: the table's rows, the plan, and its generator (ready to use)."""

    rows: list[GenerationRow]
    plan: GenerationPlan
    generator: Generator
    workload: GenerationWorkload
    warnings: list[str] = field(default_factory=list)

    @property
    def table(self) -> list[dict]:
        """The rows as dicts (`GenerationRow.to_dict`), with "kept" as a one-pass result's table has it."""
        return [{**r.to_dict(), "kept": r.status == "kept"} for r in self.rows]

    def to_dict(self) -> dict:
        return {"kind": "generation", "workload": self.workload.name, "rows": [r.to_dict() for r in self.rows],
                "plan": self.plan.to_dict(), "warnings": self.warnings, "facts": self.workload.facts}


def check_techniques(techniques: list[str] | None) -> None:
    """Raises: ConfigError naming the entries of `techniques` that are not generation techniques."""
    from overdrive.core.errors import ConfigError, arg

    unknown = [t for t in techniques or [] if t not in TECHNIQUES + FORMS]
    if unknown:
        raise ConfigError(f"{arg('techniques', unknown)}: not generation techniques; known: "
                          f"{', '.join(TECHNIQUES + FORMS)}")


def optimize_generation(workload: GenerationWorkload, *, device: str = "cpu", batch_size: int = 1,
                        other_batch_size: int | None = 8, new_tokens: int = 32, techniques: list[str] | None = None,
                        budget: GuardBudget = GuardBudget(), min_gain: float = 1.02, guard_prompts: int = 32,
                        guard_tokens: int = 24, search_kl: float | None = None, draft_seconds: float = 90.0,
                        progress: Callable[[str], None] = lambda _: None) -> GenerationResult:
    """Measures each technique of `TECHNIQUES` (or the named ones) on `workload`, keeps those faster by `min_gain`
    within `budget`, and times the plan against the baseline.

    Args:
        batch_size: sequences decoded together in the timings the decisions take (1: one user's latency).
        other_batch_size: a second batch size the plan is timed at against the baseline (None: none).
        new_tokens: greedy tokens per sequence in the timings.
        guard_prompts, guard_tokens: the guard's prompts and greedy tokens per prompt.
        search_kl: the per-layer search's mean-KL budget (default: half of `budget.max_mean_kl`).
        draft_seconds: about how long the draft model's distillation may take (its steps are chosen from one step's
            time: at least 1, at most `draft.DEFAULT_STEPS`).

    Raises:
        ConfigError: an unknown technique name, a batch size above the workload's prompts.
    """
    from overdrive.core.errors import ConfigError, arg
    from overdrive.generate.fidelity import batch_invariance, judge_generation

    check_techniques(techniques)
    wanted = list(TECHNIQUES) if techniques is None else list(techniques)
    if batch_size > len(workload.prompts):
        raise ConfigError(f"{arg('batch_size', batch_size)} exceeds the workload's {len(workload.prompts)} prompts")
    sizes = [batch_size] + ([other_batch_size] if other_batch_size and other_batch_size != batch_size
                            and other_batch_size <= len(workload.prompts) else [])
    hf, tok = workload.model, workload.tokenizer
    judge_prompts = workload.prompts[:guard_prompts]
    guard_tokens = max(2, min(guard_tokens, new_tokens))  # never more than the user's answers are long
    context = getattr(hf.config, "max_position_embeddings", None)
    longest = max(len(p) for p in workload.prompts)
    if context is not None and longest >= context:
        raise ConfigError(f"{arg('prompts')}: the longest prompt ({longest} tokens) fills the model's context of {context} "
                          "positions by itself; give shorter prompts")
    if context is not None and longest + max(new_tokens, guard_tokens) > context:
        raise ConfigError(f"{arg('max_new_tokens', new_tokens)}: the longest prompt ({longest} tokens) and "
                          f"{max(new_tokens, guard_tokens)} new tokens exceed the model's context of {context} "
                          "positions; give shorter prompts or fewer new tokens")

    def generator(steps: list[dict], batch: int = 16) -> Generator:
        return build_generator(hf, tok, steps, device=device, max_batch_size=batch)

    reference = generator([])
    progress("baseline")
    base = {b: DecodeRunner(generator([], b), workload.prompts, batch_size=b, new_tokens=new_tokens) for b in sizes}
    for runner in base.values():
        runner.warm_up()
    rows = [GenerationRow(technique="baseline (eager fp32, overdrive's engine)", status="baseline")]
    warnings: list[str] = []
    current: list[dict] = []
    current_runner = base[batch_size]

    def try_step(name: str, step: dict) -> Generator | None:
        """Judges, probes and times `step` added to the kept steps; returns the candidate (None: it failed)."""
        nonlocal current, current_runner
        steps = [s for s in current if not (name in SPECULATIVE and s["name"] in SPECULATIVE)] + [step]  # one drafter
        progress(f"{name}")
        started = time.perf_counter()
        try:
            candidate = generator(steps, max(16, batch_size))  # judged, probed and timed: one build, one compile
            fid = judge_generation(reference, candidate, judge_prompts, max_new_tokens=guard_tokens,
                                   held_out=workload.held_out)
            probe = batch_invariance(candidate, judge_prompts[:8], max_new_tokens=guard_tokens // 2)
            runner = DecodeRunner(candidate, workload.prompts, batch_size=batch_size,
                                  new_tokens=new_tokens)
            setup = time.perf_counter() - started + runner.warm_up()
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run here is a row, not the end of the run
            rows.append(GenerationRow(technique=name, status="rejected", steps=steps,
                                      reason=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
            return None
        breaks = budget.breaks(name, fid) or probe.breaks()
        row = GenerationRow(technique=name, status="rejected", steps=steps, fidelity=fid.to_dict(),
                            probe={"prompts": probe.prompts, "differ": probe.differ,
                                   "differ_beyond_ties": probe.differ_beyond_ties}, setup_s=setup)
        rows.append(row)
        if breaks:
            row.reason = breaks
            return candidate
        replaced = [s["name"] for s in current if s not in steps]
        instead = f" in place of {', '.join(replaced)}" if replaced else ""
        progress(f"{name}{instead} vs " + (" + ".join(s["name"] for s in current) or "baseline"))
        gain = compare(current_runner, runner, min_gain=min_gain)
        row.gain, row.tokens_per_s = gain, runner.tokens_per_s()
        if gain.uncertain:  # decided on its interval, as a one-pass technique is; its figures said uncertain
            warnings.append(f"{name}: {gain.uncertain}: {gain.describe()}; its figures are uncertain")
        # A step in place of a kept one (one drafter per plan) must beat it, whatever min_gain allows an added step
        bar = max(min_gain, 1.0) if replaced else min_gain
        if gain.low < bar:
            row.reason = f"not faster by {bar}× at the 99% interval's low end ({gain.describe()})" + \
                (f" than the plan with {', '.join(replaced)}" if replaced else "")
        else:
            row.status, current, current_runner = "kept", steps, runner
        if name in SPECULATIVE:
            drafted = sum(t.drafted for t in runner.generator.timings)
            row.detail = f"drafts accepted {sum(t.accepted for t in runner.generator.timings)} / {drafted} (last pass)"
            row.detail += f"; timed in place of {', '.join(replaced)}" if replaced else ""
        return candidate

    def try_draft(seconds: float) -> None:
        total = reference.model.config.num_layers
        layers = draft_layers(total)
        if len(layers) >= total:
            rows.append(GenerationRow(technique="draft-model", status="untried", reason=(
                f"the model has {total} layer(s): a draft derived from it would keep them all and cost what it does")))
            return
        eos = tok.eos_token_id if isinstance(getattr(tok, "eos_token_id", None), int) else None
        try:
            per_step = seconds_per_step(hf, layers, distillation_texts(tok), eos)
        except Exception as exc:  # noqa: BLE001 - a model whose layers cannot be dropped is a row, not the end of the run
            rows.append(GenerationRow(technique="draft-model", status="rejected",
                                      reason=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"))
            return
        steps = max(1, min(DEFAULT_STEPS, int(seconds / per_step)))  # at least one, however slow the machine
        progress(f"draft-model: distilling {len(layers)} of {total} layers, {steps} steps")
        candidate = try_step("draft-model", {"name": "draft-model", "layers": layers, "num_tokens": 4, "steps": steps})
        row, facts = rows[-1], candidate.speculative.facts if candidate is not None else None
        if facts:
            kl = f", KL to the target {facts['kl_before']:.2f} → {facts['kl_after']:.2f}" if facts.get("kl_after") else ""
            row.detail = (f"keeps layers {layers} of {total} ({facts['parameters'] / 1e6:.1f} M "
                          f"parameters), distilled {steps} steps on CPython's text{kl}; " + row.detail).rstrip("; ")

    for name in wanted:
        if name == "weight-only" or name in FORMS:
            forms = [name] if name in FORMS else list(FORMS)
            if "int4-weight" in forms and torch.device(device).type != "cpu":
                forms.remove("int4-weight")
                rows.append(GenerationRow(technique="int4-weight", status="untried", reason=(
                    "PyTorch's int4 weight-only kernel wired here is the CPU one; torchao's CUDA int4 is not wired yet")))
            shapes = [tuple(m.weight.shape) for n, m in reference.model.named_modules()
                      if n in set(linear_names(reference.model))]
            compiled = any(s["name"] == "compile-decode" for s in current)  # timed as the decode step will run
            best, timings = pick_form(shapes, rows=batch_size, forms=forms, compiled=compiled)
            runnable = [f for f in forms if timings[f] < math.inf]
            if best is None and min_gain <= 0 and runnable:  # every step within budget, whatever its speed
                best = min(runnable, key=timings.get)
            timed = ", ".join(f"{f} {t * 1e3:.2f} ms" for f, t in timings.items())
            for form in forms:
                if form == "fp16-weight" and (refusal := fp16_rows_refusal()) is not None:
                    rows.append(GenerationRow(technique=form, status="untried", reason=f"not offered here: {refusal}"))
                elif form != best:
                    rows.append(GenerationRow(technique=form, status="untried", reason=(
                        "its kernel takes none of this model's layers here"
                        + (" under torch.compile (the kept compile-decode)" if compiled else "")
                        if timings[form] == math.inf else
                        f"its layers ran slower at {batch_size} row{'s' * (batch_size != 1)}{' compiled' if compiled else ''} than "
                        + (f"{best}'s" if best else "float32's")
                        + f" ({timed}, summed over the layer shapes; a layer it cannot hold at float32's time)")))
            if best is None:
                continue
            started = time.perf_counter()
            progress(f"{best}: per-layer search")
            try:
                layers, sensitivity, kl = search_layers(reference.model, workload.calibration, form=best,
                                                        max_mean_kl=search_kl or budget.max_mean_kl / 2)
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
                rows.append(GenerationRow(technique=best, status="rejected", reason=f"failed: {exc}"[:200]))
                continue
            if not layers:
                rows.append(GenerationRow(technique=best, status="rejected", reason="no layer fits the search's KL budget"))
                continue
            try_step(best, {"name": best, "layers": layers})
            rows[-1].detail = (f"{len(layers)} of {len(sensitivity)} linear layers, search KL {kl:.2e}, "
                               f"{time.perf_counter() - started:.0f} s; " + rows[-1].detail).rstrip("; ")
        elif name in SPECULATIVE and batch_size != 1:
            rows.append(GenerationRow(technique=name, status="untried", reason=(
                f"verifies one sequence at a time: a plan at batch {batch_size} cannot use it (optimize at batch size 1)")))
        elif name == "prompt-lookup":
            try_step(name, {"name": name, "num_tokens": 4})
        elif name == "draft-model":
            try_draft(draft_seconds)
        elif name == "bf16" and any(s["name"] == "fp16-weight" for s in current):
            rows.append(GenerationRow(technique=name, status="untried", reason=(
                "does not compose with the kept fp16-weight: FBGEMM's packed fp16 GEMM takes float32 activations")))
        else:
            try_step(name, {"name": name})

    plan = GenerationPlan(workload=workload.name, device=device, batch_size=batch_size, max_new_tokens=new_tokens,
                          steps=current)
    final = build_generator(hf, tok, current, device=device, max_new_tokens=new_tokens)  # generate() as the plan
    measured: dict = {"batch_sizes": {}}
    for b in sizes:
        progress(f"plan vs baseline at batch {b}")
        runner = current_runner if b == batch_size else DecodeRunner(generator(current, b), workload.prompts,
                                                                       batch_size=b, new_tokens=new_tokens)
        if runner is not current_runner:
            runner.warm_up()
        if not current:
            measured["batch_sizes"][str(b)] = {"tokens_per_s": _timed_alone(base[b]), "memory": pass_memory(base[b])}
            continue
        gain = compare(base[b], runner, min_gain=min_gain, min_rounds=HEADLINE_ROUNDS, max_rounds=3 * RECHECK_ROUNDS,
                       max_width=RECHECK_WIDTH)
        gain.predict_rounds = RECHECK_ROUNDS
        measured["batch_sizes"][str(b)] = {
            "tokens_per_s": runner.tokens_per_s(), "baseline_tokens_per_s": base[b].tokens_per_s(),
            "gain": gain.to_dict(), "describe": gain.describe(),
            "ttft_ms_p50": _p50(runner.ttft_s) * 1e3, "itl_ms_p50": _p50(runner.step_s) * 1e3,
            "memory": pass_memory(runner)}
        if gain.high < 1:  # slower even at the interval's high end, however wide it is
            drafter = next((n for n in SPECULATIVE if n in plan.names), None)
            why = f" ({drafter} verifies one sequence at a time)" if drafter and b > 1 else ""
            advice = (f"it was chosen at batch {batch_size}; for batches of {b}, optimize at that batch size"
                      if b != batch_size else "its steps' gains did not hold when timed again: optimize again on a "
                      "quieter machine, or keep the baseline")
            warnings.append(f"at batch {b} the plan is slower than the baseline, {gain.describe()}{why}: {advice}")
        elif gain.uncertain:
            warnings.append(f"the plan's gain at batch {b} is uncertain: {gain.uncertain}")
    if base[batch_size].pass_s:  # the baseline's own row: its tokens/s over every pass it was timed in
        rows[0].tokens_per_s = base[batch_size].tokens_per_s()
    head = measured["batch_sizes"][str(batch_size)]
    if "gain" in head:
        measured.update(speedup_point=head["gain"]["ratio"], speedup_interval99=head["gain"]["interval"],
                        speedup_uncertain=head["gain"]["uncertain"], speedup_vs_baseline=head["gain"]["quoted"])
    plan.measured = measured
    if not workload.real_weights:
        warnings.append("random weights: the guard's figures say nothing about accuracy")
    warnings += workload.notes
    return GenerationResult(rows=rows, plan=plan, generator=final, workload=workload, warnings=warnings)


def pass_memory(runner: DecodeRunner) -> dict | str:
    """One more untimed pass of `runner`, its peak memory split (`memory.MemorySplit.to_dict`), or why it could not
    be measured."""
    from overdrive.generate.memory import measure_pass
    from overdrive.generate.roofline import kv_bytes_per_step

    gen = runner.generator
    slots = gen.timings[-1].slots if gen.timings else 0
    together = 1 if gen.speculative is not None else max(len(b) for b in runner.batches)  # speculation: one at a time
    kv = kv_bytes_per_step(gen.model, batch_size=together, slots=slots, dtype=gen.cache_dtype)
    kept = runner.ttft_s, runner.step_s, runner.accepted  # the timed pass's figures, not the profiled one's
    try:
        with torch.no_grad():
            return measure_pass(gen.model, lambda: runner._pass(timed=False), kv_cache_bytes=kv).to_dict()
    except RuntimeError as exc:
        return str(exc)
    finally:
        runner.ttft_s, runner.step_s, runner.accepted = kept


def _timed_alone(runner: DecodeRunner) -> float:
    runner.timed_passes(2)
    return runner.tokens_per_s()


def _p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan
