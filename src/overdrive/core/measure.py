"""Measurement: latency percentiles, throughput, peak memory, compile time, fidelity (FLOPs: `core.flops`).

Protocol (after gpt-fast and torch.utils.benchmark habits):
1. Inputs are collated and moved to the device before any clock starts (host→device copies
   are not part of model latency).
2. Warm-up pass: every batch of the evaluation set runs once; its outputs are the ones judged
   for fidelity, and its wall time minus the steady-state time of the same batches is
   reported as `compile_s` (torch.compile, cuDNN/oneDNN autotuning, lazy init).
3. Settling: timed passes go on, uncounted, until two in a row agree (`Runner.settle`): caches,
   allocator pools and thread pools reach their steady state, however many passes that takes.
4. Timed passes: whole passes over every batch (the partial last one too) until at least
   `min_timed_calls` calls. Each call is timed by `Timer`: CUDA events read after the device
   finished, perf_counter on CPU. Throughput = rows per pass / the median pass time, so batches
   of different lengths weigh as they do in real use and one slow pass does not skew it.
5. Interference (`core.interference`): around each timed stretch the OS says how long this
   process's threads waited for a CPU. A stretch that ran preempted by other work is flagged and
   left out of the figures (its round repeated in a comparison), never averaged in; before each
   stretch the process's own idle threads (an OpenMP team or a runtime's pool, still spinning after
   the other side's pass) are let go to sleep, so one side's threads do not slow the other's.
6. Comparisons (`core.gain.compare`): the candidate's and the reference's passes interleaved (ABBA), so
   both see the same machine; the gain has a 99% confidence interval, and a decision is taken
   only once that interval clears the bar or falls below it (or the time is up). A gain measured
   on a busy machine (too few clean rounds) or with a wide interval says so (`Gain.uncertain`),
   and its quoted figure (`Gain.quoted`) is then its interval's low end, or none.
Peak memory: on CUDA, `torch.cuda.max_memory_allocated` after a reset; on CPU the process's
resident-set high-water mark (VmHWM), reset through /proc/self/clear_refs where Linux allows.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from overdrive.core.devices import settle_host_allocator, synchronize
from overdrive.core.interference import LoadMeter, wait_until_idle
from overdrive.core.memory import peak_memory, reset_peak_memory, to_device
from overdrive.core.timer import Timer
from overdrive.core.workload import Inputs, Workload, equal_length_batches, warm_up_rows
from overdrive.core.workload import BatchingPolicy

if TYPE_CHECKING:
    from overdrive.core.gain import Gain

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
        warmup_s: wall time of the warm-up (the jobs' warm-up calls and the first pass), seconds.
        compile_s: warm-up time beyond the steady-state time of the same batches, seconds.
        mean_padded_length: mean padded sequence length per batch (text workloads), tokens.
        nonfinite_outputs: NaN/inf values among the outputs (overflow detection).
        fidelity: figures against the fp32 reference (see the workload's `fidelity`), and
            `max_abs_error`, the largest absolute difference from it.
        task_metric: e.g. {"accuracy_pct": 99.2} for workloads with labels.
        num_passes: timed passes over all the evaluation rows that the figures come from.
        pass_spread: p90 / p50 of the pass times (1.0: steady; well above: a busy machine).
        gain: throughput over the eager baseline's, timed interleaved with it (`compare`), where it was.
        peak_reserved_bytes: on CUDA, the allocator's reserved peak over the warm-up
            (`torch.cuda.max_memory_reserved`, what the process holds); None on the CPU.
        roofline: where the throughput sits under the measured roofs (`core.roofline.Roofline.to_dict`).
        audit: one forward's copies, syncs and operations (`core.audit.Audit.to_dict`), where audited.
        preempted_passes: of `num_passes`, those that ran preempted by other work (left out of the
            figures unless every pass was; `core.interference`).
        contention: how busy the machine was over this runner's timed stretches
            (`core.interference.Contention.to_dict`).
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
    preempted_passes: int = 0
    contention: dict | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "gain": self.gain.to_dict() if self.gain else None}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


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
        settle_host_allocator()
        self.model, self.workload, self.device = model, workload, device
        self.batch_size, self.indices = batch_size, indices
        self.batches = make_batches(workload, indices=indices, batch_size=batch_size, policy=policy, device=device)
        timed = len(indices) if timing_rows is None else min(len(indices), max(timing_rows, batch_size))
        self.timed_batches = self.batches if timed == len(indices) else make_batches(
            workload, indices=indices[:timed], batch_size=batch_size, policy=policy, device=device)
        self.timer = Timer(device)
        self.rows_per_pass = timed
        self.latencies_s: list[float] = []  # every timed call, in order
        self.pass_s: list[float] = []  # every timed pass, in order
        self.pass_preempted: list[bool] = []  # per pass: it ran preempted by other work (`core.interference`)
        self.meter = LoadMeter()  # the load of each timed stretch
        self.settle_passes = 0  # uncounted passes `settle` ran
        self._settled: dict[float, tuple[float, int]] = {}  # min_unit_s -> what a settle that converged found
        self.late_graphs = 0  # graphs torch.compile built in the first pass, after the jobs' warm-up
        self.job_warm_up_rows = 0  # rows the jobs' warm-up ran (`warmup_s` holds their time)
        self.warmup_s = 0.0
        self.peak: tuple[int | None, str] = (None, "")
        self.peak_reserved: int | None = None
        self.output_row_bytes = 0  # bytes of one row of the model's output, as it returns it

    @torch.no_grad()
    def outputs(self) -> torch.Tensor:
        """One untimed pass: float32 [N, ...] on the CPU in the order of `indices`."""
        return self._pass(timed=False)[2]

    @torch.no_grad()
    def warm_up(self) -> torch.Tensor:
        """The warm-up `run` and `serve` give a model before their records (`core.workload.warm_up_rows`, at
        batch 1 and this batch size), then the first pass over every row (compiles, autotunes, lazy
        initialisation): its wall time is `warmup_s`, the peak memory is read over it, its outputs (returned)
        are the ones judged, and the graphs torch.compile built in it, past the jobs' warm-up, are
        `late_graphs`: a job would stop mid-way to compile each."""
        started = time.perf_counter()
        graphs = self._job_warm_up()
        job_s = time.perf_counter() - started
        baseline = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        reset_peak_memory(self.device)
        self.warmup_s, _, outputs = self._pass(timed=False)
        self.warmup_s += job_s
        self.late_graphs = compiled_graphs() - graphs
        peak, kind = peak_memory(self.device)
        self.peak = ((peak - baseline) if peak is not None and self.device.type == "cuda" else peak, kind)
        if self.device.type == "cuda":
            self.peak_reserved = torch.cuda.max_memory_reserved(self.device)
        return outputs

    def _job_warm_up(self) -> int:
        """The calls `run` makes before its records (`warm_up_rows` at batch 1 and this batch size, over the
        rows sorted by length); returns `compiled_graphs()` after them."""
        w = self.workload
        rows = [w.samples[i] for i in dict.fromkeys(self.indices)]
        if w.bucket_length is not None:
            rows.sort(key=w.bucket_length)
        sizes = [w.fixed_batch_size] if w.fixed_batch_size else sorted({1, self.batch_size})
        for size in sizes:
            for group in warm_up_rows(rows, size, equal_lengths_only=w.equal_lengths_only):
                self.model(*to_device(w.collate(group), self.device))
                self.job_warm_up_rows += len(group)
        synchronize(self.device)
        return compiled_graphs()

    @torch.no_grad()
    def timed_pass(self) -> float:
        """One timed pass; its call times are kept, and whether it ran preempted. Returns its seconds."""
        return self.timed_passes(1)[0]

    @torch.no_grad()
    def timed_passes(self, n: int) -> tuple[float, bool]:
        """`n` timed passes in one stretch (`_stretch`). Their call times are kept.

        Returns:
            (mean seconds per pass, whether the stretch ran preempted by other work).
        """
        passes, preempted = self._stretch(n)
        for seconds, latencies in passes:
            self.pass_s.append(seconds)
            self.latencies_s += latencies
        self.pass_preempted += [preempted] * n
        return sum(seconds for seconds, _ in passes) / n, preempted

    def _stretch(self, n: int) -> tuple[list[tuple[float, list[float]]], bool]:
        """`n` timed passes, after this process's idle threads have gone to sleep (`interference.wait_until_idle`),
        with Python's cyclic garbage collector paused (as `timeit` does: a collection's cost depends on every
        object the process holds, so a long-lived process would time its heap, not the model), and the
        stretch's load read around it. Returns ([(seconds, call seconds)] per pass, whether it ran preempted)."""
        wait_until_idle()
        collecting = gc.isenabled()
        gc.disable()
        try:
            start = self.meter.start()
            passes = [self._pass(timed=True)[:2] for _ in range(n)]
            return passes, self.meter.stop(start)
        finally:
            if collecting:
                gc.enable()

    @torch.no_grad()
    def settle(self, *, min_unit_s: float = 0.0, tolerance: float = 0.1, max_units: int = 8,
               max_s: float = 10.0) -> tuple[float, int]:
        """Uncounted timed stretches until two clean ones in a row agree within `tolerance` (or
        `max_units` stretches, `max_s` seconds, or two stretches in a row that ran preempted): after
        the warm-up, oneDNN's primitive cache, the allocator's pools and the thread pools can take a
        few more passes to reach their steady state. A stretch is as many passes as take `min_unit_s`
        (at least one).

        A runner that has settled (two clean stretches agreed) stays settled: a later call (the next
        comparison of the same baseline) runs one stretch to bring its caches back after another model ran,
        and returns what the first found.

        Returns:
            (seconds of the last clean pass, or of the last pass when none was clean; passes per stretch).
        """
        if min_unit_s in self._settled:
            repeats = self._settled[min_unit_s][1]
            self._stretch(repeats)
            self.settle_passes += repeats
            return self._settled[min_unit_s]
        started, clean, last = time.perf_counter(), [], math.inf
        def passes_per_stretch(seconds: float) -> int:
            return max(1, min(1000, math.ceil(min_unit_s / max(seconds, 1e-9))))

        repeats = passes_per_stretch(min(self._pass(timed=True)[0] for _ in range(3 if min_unit_s else 1)))
        for _ in range(max_units):
            passes, preempted = self._stretch(repeats)
            last = sum(seconds for seconds, _ in passes) / repeats
            self.settle_passes += repeats
            if not preempted:
                clean.append(last)
                if len(clean) >= 2 and max(clean[-2:]) <= (1 + tolerance) * min(clean[-2:]):
                    self._settled[min_unit_s] = (last, passes_per_stretch(last))
                    return self._settled[min_unit_s]
            elif self.meter.flags[-2:] == [True, True]:
                break  # a busy machine: settling cannot be seen through it (the comparison sets such rounds aside)
            if time.perf_counter() - started > max_s:
                break
        settled = clean[-1] if clean else last
        return settled, passes_per_stretch(settled)

    def _pass(self, *, timed: bool) -> tuple[float, list[float], torch.Tensor | None]:
        """One pass: (seconds, each call's seconds, outputs float32 [N, ...] when not `timed`)."""
        outputs: torch.Tensor | None = None
        total, latencies = 0.0, []
        for batch in self.timed_batches if timed else self.batches:
            out, seconds = self.timer(self.model, *batch.inputs)
            total += seconds
            if timed:
                latencies.append(seconds)
                continue
            self.output_row_bytes = out.numel() * out.element_size() // max(1, out.shape[0]) if out.dim() else 0
            out = out.detach().float().cpu()  # a copy before the next call, even of a reused output buffer
            if outputs is None:
                outputs = torch.empty((len(self.indices), *out.shape[1:]), dtype=torch.float32)
            outputs[batch.positions] = out[: batch.num_rows]
        return total, latencies, outputs

    def measurement(self, since: tuple[int, int] = (0, 0)) -> Measurement:
        """The Measurement of the passes timed so far (at least one), or of those timed after
        `since` = (passes, calls) counted earlier (the passes of one comparison).

        Passes that ran preempted by other work are left out (all are used, and `preempted_passes`
        says so, when none ran clean). Throughput is rows per timed pass over the median pass time;
        compile time is the warm-up's excess over the time the median pass would take for every row.
        `pass_spread` is p90 / p50 of the pass times: passes are the same work, so a spread well above
        1 means the machine was busy while measuring.
        """
        calls = len(self.timed_batches)
        window = range(since[0], len(self.pass_s))
        if not window:
            raise ValueError("no timed pass yet")
        clean = [i for i in window if not self.pass_preempted[i]] or list(window)
        pass_s = [self.pass_s[i] for i in clean]
        latencies_s = [t for i in clean for t in self.latencies_s[i * calls:(i + 1) * calls]]
        median_pass_s = percentile(pass_s, 50)
        padded = [b.inputs[0].shape[1] for b in self.batches if self.workload.is_text and b.inputs[0].dim() >= 2]
        preempted = sum(self.pass_preempted[i] for i in window)
        return Measurement(
            preempted_passes=preempted,
            contention=self.meter.contention().to_dict() if self.meter.loads else None,
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
            compile_s=max(0.0, self.warmup_s - median_pass_s * (len(self.indices) + self.job_warm_up_rows) / self.rows_per_pass),
            mean_padded_length=sum(padded) / len(padded) if padded else None,
            num_passes=len(clean),
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
        min_timed_calls: at least this many timed calls (whole passes) that did not run preempted.
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
    runner.settle(max_s=max_timed_s / 3)
    started = time.perf_counter()
    while True:
        runner.timed_pass()
        elapsed = time.perf_counter() - started
        clean_calls = len(runner.timed_batches) * runner.pass_preempted.count(False)
        if (clean_calls >= min_timed_calls and elapsed >= min_timed_s) or elapsed > max_timed_s:
            break
    m = judge_outputs(runner.measurement(), workload, outputs, indices, reference)
    m.roofline = runner.roofline(flops_per_sample, dtype, m.samples_per_s)
    m.audit = runner.audit() if audit else None
    return m, outputs


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (TorchDynamo's `unique_graphs`
    counter); 0 when unknown. `run` and `serve` compare it before and after their warm-up."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])
