"""Measurement: latency percentiles, throughput, peak memory, compile time, fidelity (FLOPs: `core.flops`).

Protocol (after gpt-fast and torch.utils.benchmark habits):
1. Inputs are collated and moved to the device before any clock starts (host→device copies
   are not part of model latency).
2. Warm-up pass: every batch of the evaluation set runs once; its outputs are the ones judged
   for fidelity, and its wall time minus the steady-state time of the same batches is
   reported as `compile_s` (torch.compile, cuDNN/oneDNN autotuning, lazy init).
3. Timed passes: whole passes over every batch (the partial last one too) until at least
   `min_timed_calls` calls. Each call is timed by `Timer`: CUDA events read after the device
   finished, perf_counter on CPU. Throughput = rows per pass / the median pass time, so batches
   of different lengths weigh as they do in real use and one slow pass does not skew it.
4. Comparisons (`compare`): the candidate's and the reference's passes interleaved (ABBA), so
   both see the same machine; the gain has a 99% confidence interval, and a decision is taken
   only once that interval clears the bar or falls below it (or the time is up).
Peak memory: on CUDA, `torch.cuda.max_memory_allocated` after a reset; on CPU the process's
resident-set high-water mark (VmHWM), reset through /proc/self/clear_refs where Linux allows.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from overdrive.core.devices import synchronize
from overdrive.core.timer import Timer
from overdrive.core.workload import Inputs, Workload, equal_length_batches
from overdrive.techniques.registry import BatchingPolicy

# Rows per timed pass in `optimize` and `bench`: enough batches for a steady figure, short enough for
# several interleaved rounds (fidelity is still judged on every evaluation row).
TIMING_ROWS = 256


@dataclass(kw_only=True)
class Measurement:
    """One measured configuration. Units are in the names.

    Attributes:
        batch_size: rows per call.
        num_samples: evaluation samples judged for fidelity.
        num_timed_calls: calls in the timed passes.
        latency_ms: {"p50", "p90", "p99", "mean"} per call, milliseconds.
        samples_per_s: rows per second over the timed passes.
        peak_memory_bytes: see `peak_memory_kind`; None where it cannot be read.
        peak_memory_kind: "cuda_max_allocated" or "process_rss_hwm".
        warmup_s: wall time of the warm-up pass, seconds.
        compile_s: warm-up time beyond the steady-state time of the same batches, seconds.
        mean_padded_length: mean padded sequence length per batch (text workloads), tokens.
        nonfinite_outputs: NaN/inf values among the outputs (overflow detection).
        fidelity: figures against the fp32 reference (see the workload's `fidelity`), and
            `max_abs_error`, the largest absolute difference from it.
        task_metric: e.g. {"accuracy_pct": 99.2} for workloads with labels.
        num_passes: timed passes over all the evaluation rows.
        pass_spread: p90 / p50 of the pass times (1.0: steady; well above: a busy machine).
        gain: throughput over the eager baseline's, timed interleaved with it (`compare`), where it was.
        peak_reserved_bytes: on CUDA, the allocator's reserved peak over the warm-up
            (`torch.cuda.max_memory_reserved`, what the process holds); None on the CPU.
        roofline: where the throughput sits under the measured roofs (`core.roofline.Roofline.to_dict`).
        audit: one forward's copies, syncs and operations (`core.audit.Audit.to_dict`), where audited.
    """

    batch_size: int
    num_samples: int
    num_timed_calls: int
    latency_ms: dict[str, float]
    samples_per_s: float
    peak_memory_bytes: int | None
    peak_memory_kind: str
    warmup_s: float
    compile_s: float
    mean_padded_length: float | None = None
    nonfinite_outputs: int = 0
    fidelity: dict[str, float] = field(default_factory=dict)
    task_metric: dict[str, float] | None = None
    num_passes: int = 0
    pass_spread: float = math.nan
    gain: Gain | None = None
    peak_reserved_bytes: int | None = None
    roofline: dict | None = None
    audit: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS (Linux ≥ 4.0)
    except OSError:
        pass  # not Linux or not allowed: the high-water mark then covers the whole process


def peak_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes, kind): CUDA allocator peak, or the process RSS high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    try:
        kib = int(re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text()).group(1))
        return kib * 1024, "process_rss_hwm"
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_rss_hwm"


def owned_host_float32(output: torch.Tensor) -> torch.Tensor:
    """`output` on the CPU as float32, contiguous and in memory of its own.

    A model may return a view of a buffer it reuses (CUDA graphs, static-buffer runtimes, a
    module that writes into `self.out`): its next call overwrites it. A caller that keeps an
    output past the model's next call takes it through here. The conversion's result is kept
    when it already is a new tensor (a device->host copy, another dtype, a strided view made
    contiguous); otherwise it is copied.

    Args:
        output: the model's output [B, ...], any float or integer dtype, on any device.

    Returns:
        float32 [B, ...] on the CPU, contiguous, sharing no storage with `output`.
    """
    owned = output.detach().float().cpu().contiguous()
    if owned.device == output.device and owned.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
        owned = owned.clone()
    return owned


def to_device(inputs: Inputs, device: torch.device) -> Inputs:
    """`inputs` on `device`; to a GPU through pinned host memory, non-blocking (as `run` copies them)."""
    if device.type == "cuda":
        return tuple(t.pin_memory().to(device, non_blocking=True) if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                     else t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    return tuple(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in inputs)


@dataclass(kw_only=True)
class Batch:
    positions: list[int]  # rows of the caller's `indices` list this batch holds
    inputs: Inputs

    @property
    def num_rows(self) -> int:
        return len(self.positions)


def make_batches(
    workload: Workload, *, indices: list[int], batch_size: int, policy: BatchingPolicy, device: torch.device
) -> list[Batch]:
    """Cut `indices` into batches in the policy's order, collate and move them to `device`. For a
    model that takes only one batch size, a short last batch is filled up with copies of its first
    row (as `serve` and `run` do); only its own rows are judged. A model whose answer depends on padding
    gets batches of rows of one length only, as `serve` and `run` give it (`Workload.equal_lengths_only`)."""
    order = policy.order(workload, indices)
    batches = []
    if workload.equal_lengths_only:
        chunks = equal_length_batches(order, lambda p: workload.sample_length(workload.samples[indices[p]]), batch_size)
    else:
        chunks = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    for chunk in chunks:
        rows = [workload.samples[indices[p]] for p in chunk]
        if workload.fixed_batch_size and len(rows) < workload.fixed_batch_size:
            rows += rows[:1] * (workload.fixed_batch_size - len(rows))
        inputs = workload.collate(rows)
        batches.append(Batch(positions=chunk, inputs=to_device(inputs, device)))
    synchronize(device)
    return batches


def cycle_indices(num_samples: int, num_available: int) -> list[int]:
    """`num_samples` sample indices, cycling over `num_available` samples when there are fewer,
    so that a batch of B rows really holds B rows even for a small evaluation set."""
    return [i % num_available for i in range(num_samples)]


class Runner:
    """A model ready to be timed on a workload's batches: its warm-up, passes and call times.

    The warm-up pass runs every evaluation row (its outputs are the ones judged); a *timed pass*
    runs every batch of the first `timing_rows` of them, the partial last batch too, so a timed
    pass is the same work for every candidate whatever its batching policy (length bucketing
    changes which rows share a batch, not which rows run). Outputs are copied to float32 CPU
    tensors before the next call, so a model that returns a view of a reused buffer is judged right.

    Args:
        model: the candidate, already on `device`; `model(*inputs)` returns [B, ...].
        workload: supplies samples and collate.
        device: where model and inputs live.
        batch_size: rows per call (> 0).
        indices: which samples to evaluate, in the order outputs are returned (may repeat,
            see `cycle_indices`).
        policy: how samples are grouped into batches.
        timing_rows: rows per timed pass (the first ones of `indices`, at least one batch); None: all.

    Raises:
        ValueError: batch_size < 1 or no indices.
    """

    def __init__(self, model: nn.Module, workload: Workload, *, device: torch.device, batch_size: int,
                 indices: list[int], policy: BatchingPolicy = BatchingPolicy(), timing_rows: int | None = None):
        if batch_size < 1 or not indices:
            raise ValueError(f"need batch_size ≥ 1 and at least one sample (got {batch_size}, {len(indices)})")
        self.model, self.workload, self.device = model, workload, device
        self.batch_size, self.indices = batch_size, indices
        self.batches = make_batches(workload, indices=indices, batch_size=batch_size, policy=policy, device=device)
        timed = len(indices) if timing_rows is None else min(len(indices), max(timing_rows, batch_size))
        self.timed_batches = self.batches if timed == len(indices) else make_batches(
            workload, indices=indices[:timed], batch_size=batch_size, policy=policy, device=device)
        self.timer = Timer(device)
        self.rows_per_pass = timed
        self.latencies_s: list[float] = []
        self.pass_s: list[float] = []
        self.warmup_s = 0.0
        self.peak: tuple[int | None, str] = (None, "")
        self.peak_reserved: int | None = None
        self.output_row_bytes = 0  # bytes of one row of the model's output, as it returns it

    @torch.no_grad()
    def outputs(self) -> torch.Tensor:
        """One untimed pass: float32 [N, ...] on the CPU in the order of `indices`."""
        return self._pass(timed=False)[1]

    @torch.no_grad()
    def warm_up(self) -> torch.Tensor:
        """The first pass (compiles, autotunes, lazy initialisation): its wall time is `warmup_s`,
        the peak memory is read over it, and its outputs (returned) are the ones judged."""
        baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        reset_peak_memory(self.device)
        self.warmup_s, outputs = self._pass(timed=False)
        peak, kind = peak_memory(self.device)
        self.peak = ((peak - baseline) if peak is not None and self.device.type == "cuda" else peak, kind)
        if self.device.type == "cuda":
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        return outputs

    @torch.no_grad()
    def timed_pass(self) -> float:
        """One timed pass; its call times are kept. Returns its seconds."""
        seconds, _ = self._pass(timed=True)
        self.pass_s.append(seconds)
        return seconds

    def _pass(self, *, timed: bool) -> tuple[float, torch.Tensor | None]:
        outputs: torch.Tensor | None = None
        total = 0.0
        for batch in self.timed_batches if timed else self.batches:
            out, seconds = self.timer(self.model, *batch.inputs)
            total += seconds
            if timed:
                self.latencies_s.append(seconds)
                continue
            self.output_row_bytes = out.numel() * out.element_size() // max(1, out.shape[0]) if out.dim() else 0
            out = out.detach().float().cpu()  # a copy before the next call, even of a reused output buffer
            if outputs is None:
                outputs = torch.empty((len(self.indices), *out.shape[1:]), dtype=torch.float32)
            outputs[batch.positions] = out[: batch.num_rows]
        return total, outputs

    def measurement(self, since: tuple[int, int] = (0, 0)) -> Measurement:
        """The Measurement of the passes timed so far (at least one), or of those timed after
        `since` = (passes, calls) counted earlier (the passes of one comparison).

        Throughput is rows per timed pass over the median pass time; compile time is the warm-up's
        excess over the time the median pass would take for every row. `pass_spread` is p90 / p50 of the pass times: passes are the same work,
        so a spread well above 1 means the machine was busy while measuring.
        """
        pass_s, latencies_s = self.pass_s[since[0]:], self.latencies_s[since[1]:]
        if not pass_s:
            raise ValueError("no timed pass yet")
        median_pass_s = percentile(pass_s, 50)
        padded = [b.inputs[0].shape[1] for b in self.batches if self.workload.is_text and b.inputs[0].dim() >= 2]
        return Measurement(
            batch_size=self.batch_size,
            num_samples=len(self.indices),
            num_timed_calls=len(latencies_s),
            latency_ms={
                "p50": 1e3 * percentile(latencies_s, 50),
                "p90": 1e3 * percentile(latencies_s, 90),
                "p99": 1e3 * percentile(latencies_s, 99),
                "mean": 1e3 * sum(latencies_s) / len(latencies_s),
            },
            samples_per_s=self.rows_per_pass / median_pass_s,
            peak_memory_bytes=self.peak[0],
            peak_reserved_bytes=self.peak_reserved,
            peak_memory_kind=self.peak[1] or peak_memory(self.device)[1],
            warmup_s=self.warmup_s,
            compile_s=max(0.0, self.warmup_s - median_pass_s * len(self.indices) / self.rows_per_pass),
            mean_padded_length=sum(padded) / len(padded) if padded else None,
            num_passes=len(pass_s),
            pass_spread=percentile(pass_s, 90) / median_pass_s if median_pass_s > 0 else math.nan,
        )


    def roofline(self, flops_per_sample: float | None, dtype: str, samples_per_s: float,
                 fp32_weights: int | None = None, dtype_share: float = 1.0) -> dict | None:
        """The roofline point (`core.roofline`) of `samples_per_s` for this runner's model and batches:
        bytes per batch = the model's weights + the mean timed batch's inputs + its outputs; where the
        weights are out of PyTorch's sight (a runtime outside it), `fp32_weights` (the fp32 model's)
        at `dtype`'s width, marked as an estimate; `dtype_share` of the FLOPs run in `dtype`, the rest in
        fp32 (`measured_roofline`). None when the FLOPs are unknown."""
        from overdrive.core.roofline import DTYPE_BYTES, measured_roofline, tensors_bytes, weight_bytes

        if self.model is None or not self.timed_batches:
            return None
        inputs = sum(tensors_bytes(b.inputs) for b in self.timed_batches) / len(self.timed_batches)
        model_bytes = weight_bytes(self.model)
        estimated = not model_bytes and bool(fp32_weights)
        if estimated:
            model_bytes = fp32_weights * DTYPE_BYTES.get(dtype, 4) / 4
        point = measured_roofline(device=self.device, dtype=dtype, flops_per_sample=flops_per_sample,
                                  bytes_per_batch=model_bytes + inputs + self.output_row_bytes * self.batch_size,
                                  batch_size=self.batch_size, samples_per_s=samples_per_s, weights_estimated=estimated,
                                  dtype_share=dtype_share)
        return point.to_dict() if point is not None else None

    def audit(self, *, opaque: bool = False) -> dict:
        """One forward of the model on its first batch, audited (`core.audit.audit_forward`)."""
        from overdrive.core.audit import audit_forward

        return audit_forward(self.model, self.batches[0].inputs, device=self.device, opaque=opaque).to_dict()


def judge_outputs(measurement: Measurement, workload: Workload, outputs: torch.Tensor, indices: list[int],
                  reference: torch.Tensor | None) -> Measurement:
    """Fill in the figures of `outputs` (float32 [N, ...] in the order of `indices`): non-finite
    values, fidelity against `reference` (with `max_abs_error`), and the task metric, over the
    distinct samples (a sample repeated to fill a batch counts once)."""
    measurement.nonfinite_outputs = int((~torch.isfinite(outputs)).sum())
    seen: set[int] = set()
    first = [p for p, index in enumerate(indices) if not (index in seen or seen.add(index))]
    if len(first) < len(indices):  # samples repeated to fill a batch count once: figures are over distinct rows
        outputs, indices = outputs[first], [indices[p] for p in first]
        reference = reference[first] if reference is not None else None
    if reference is not None:
        measurement.fidelity = workload.fidelity(outputs, reference)
        measurement.fidelity["max_abs_error"] = float((outputs - reference).abs().max()) if outputs.numel() else 0.0
    if workload.has_task_metric:
        measurement.task_metric = workload.task_metric(outputs, indices)
    return measurement


def measure(
    model: nn.Module,
    workload: Workload,
    *,
    device: torch.device,
    batch_size: int,
    indices: list[int],
    policy: BatchingPolicy = BatchingPolicy(),
    reference: torch.Tensor | None = None,
    min_timed_calls: int = 10,
    min_timed_s: float = 1.0,
    max_timed_s: float = 30.0,
    flops_per_sample: float | None = None,
    dtype: str = "float32",
    audit: bool = False,
) -> tuple[Measurement, torch.Tensor]:
    """Measure `model` alone on the workload's samples `indices` at `batch_size`: warm-up, then
    timed passes (see `Runner`). To compare two models, `compare` interleaves their passes instead.

    Args:
        model, workload, device, batch_size, indices, policy: see `Runner`.
        reference: fp32 outputs [N, ...] for the same indices; fidelity is computed when given.
        min_timed_calls: at least this many timed calls (whole passes).
        min_timed_s: and at least this much timed wall time, seconds.
        max_timed_s: stop adding passes once this much time was spent timing, seconds.
        flops_per_sample: the model's FLOPs per row (`count_flops_per_sample`): with it, the
            measurement's roofline point against this device's peaks, the GEMM peak in `dtype`.
        audit: also audit one forward (`Measurement.audit`, `core.audit`).

    Returns:
        (measurement, outputs float32 [N, ...] on the CPU in the order of `indices`).

    Raises:
        ValueError: batch_size < 1 or no indices.
    """
    runner = Runner(model, workload, device=device, batch_size=batch_size, indices=indices, policy=policy)
    outputs = runner.warm_up()
    started = time.perf_counter()
    while True:
        runner.timed_pass()
        elapsed = time.perf_counter() - started
        if (len(runner.latencies_s) >= min_timed_calls and elapsed >= min_timed_s) or elapsed > max_timed_s:
            break
    m = judge_outputs(runner.measurement(), workload, outputs, indices, reference)
    m.roofline = runner.roofline(flops_per_sample, dtype, m.samples_per_s)
    m.audit = runner.audit() if audit else None
    return m, outputs


# Two-sided 99.5% quantiles of Student's t for 1..30 degrees of freedom (the 99% interval). 99%, not 95%: a
# comparison looks at its interval after every round and stops once it decides, and each of those looks is a
# chance to decide wrongly on noise; a plan made of ten such decisions must come out the same run after run.
_T995 = [63.657, 9.925, 5.841, 4.604, 4.032, 3.707, 3.499, 3.355, 3.250, 3.169, 3.106, 3.055, 3.012, 2.977, 2.947,
         2.921, 2.898, 2.878, 2.861, 2.845, 2.831, 2.819, 2.807, 2.797, 2.787, 2.779, 2.771, 2.763, 2.756, 2.750]
_Z995 = 2.576  # beyond 30 degrees of freedom


@dataclass(kw_only=True)
class Gain:
    """How much faster a candidate ran than a reference, from interleaved passes.

    Each round times one pass of each (in alternating order, ABBA, so a linear drift in the
    machine's speed cancels); the gain is the geometric mean over rounds of the reference's pass
    time over the candidate's, with a 99% confidence interval from Student's t on the log ratios.

    Attributes:
        ratio: candidate throughput ÷ reference throughput (>1: faster).
        low, high: the 99% confidence interval of `ratio`.
        rounds: rounds timed (pairs of passes).
        passes_per_round: passes each side ran per round (more for models whose pass is very short).
    """

    ratio: float
    low: float
    high: float
    rounds: int
    passes_per_round: int = 1

    def describe(self) -> str:
        return f"{self.ratio:.2f}× [{self.low:.2f}, {self.high:.2f}]"

    def to_dict(self) -> dict:
        return asdict(self)


def gain_from_ratios(log_ratios: list[float]) -> Gain:
    """The Gain of per-round log(reference time / candidate time) values (≥ 1 of them)."""
    n = len(log_ratios)
    mean = sum(log_ratios) / n
    if n < 2:
        return Gain(ratio=math.exp(mean), low=0.0, high=math.inf, rounds=n)
    sd = math.sqrt(sum((x - mean) ** 2 for x in log_ratios) / (n - 1))
    half = (_T995[n - 2] if n - 1 <= len(_T995) else _Z995) * sd / math.sqrt(n)
    return Gain(ratio=math.exp(mean), low=math.exp(mean - half), high=math.exp(mean + half), rounds=n)


def compare(reference: Runner, candidate: Runner, *, min_gain: float, min_rounds: int = 4, max_rounds: int = 12,
            max_s: float = 20.0, min_unit_s: float = 0.05) -> Gain:
    """Time `candidate` against `reference` in interleaved rounds until the 99% interval of the
    gain decides against `min_gain` (its low end above it: faster; its high end below: not),
    or `max_rounds` rounds or `max_s` seconds have passed (at least `min_rounds` rounds).

    Both runners must be warmed up. A side whose pass is shorter than `min_unit_s` runs several
    passes per round (its time per pass is their mean), so timer resolution and call overhead
    do not decide.

    Returns:
        The Gain (each runner keeps its pass and call times for its Measurement).
    """
    repeats = {}
    for runner in (reference, candidate):  # one settling pass each after the warm-up, also sizing the rounds
        seconds = runner.timed_pass()
        repeats[id(runner)] = max(1, min(1000, math.ceil(min_unit_s / max(seconds, 1e-9))))
    log_ratios: list[float] = []
    started = time.perf_counter()
    while True:
        per_pass = {}
        for runner in (reference, candidate) if len(log_ratios) % 2 == 0 else (candidate, reference):
            n = repeats[id(runner)]
            per_pass[id(runner)] = sum(runner.timed_pass() for _ in range(n)) / n
        log_ratios.append(math.log(per_pass[id(reference)] / max(per_pass[id(candidate)], 1e-12)))
        gain = gain_from_ratios(log_ratios)
        rounds, elapsed = len(log_ratios), time.perf_counter() - started
        decided = gain.low >= min_gain or gain.high < min_gain
        if rounds >= min_rounds and (decided or rounds >= max_rounds or elapsed >= max_s):
            gain.passes_per_round = repeats[id(candidate)]
            return gain


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (TorchDynamo's `unique_graphs`
    counter); 0 when unknown. `run` and `serve` compare it before and after their warm-up."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
