"""Measurement: latency percentiles, throughput, peak memory, compile time, FLOPs, fidelity.

Protocol (after gpt-fast and torch.utils.benchmark habits):
1. Inputs are collated and moved to the device before any clock starts (host→device copies
   are not part of model latency).
2. Warm-up pass: every batch of the evaluation set runs once; its outputs are the ones judged
   for fidelity, and its wall time minus the steady-state time of the same batches is
   reported as `compile_s` (torch.compile, cuDNN/oneDNN autotuning, lazy init).
3. Timed passes: whole passes over the full batches until at least `min_timed_calls` calls.
   Each call is timed by `Timer`: CUDA events read after the device finished, perf_counter on CPU.
   Throughput = rows per pass / the median pass time, so batches of different lengths
   weigh as they do in real use and one slow pass (a noisy neighbour) does not skew it.
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
from overdrive.core.workload import Inputs, Workload
from overdrive.techniques.registry import BatchingPolicy


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
        fidelity: figures against the fp32 reference (see the workload's `fidelity`).
        task_metric: e.g. {"accuracy_pct": 99.2} for workloads with labels.
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
    """Cut `indices` into batches in the policy's order, collate and move them to `device`."""
    order = policy.order(workload, indices)
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        inputs = workload.collate([workload.samples[indices[p]] for p in chunk])
        batches.append(Batch(positions=chunk, inputs=to_device(inputs, device)))
    synchronize(device)
    return batches


def cycle_indices(num_samples: int, num_available: int) -> list[int]:
    """`num_samples` sample indices, cycling over `num_available` samples when there are fewer,
    so that a batch of B rows really holds B rows even for a small evaluation set."""
    return [i % num_available for i in range(num_samples)]


@torch.no_grad()
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
) -> tuple[Measurement, torch.Tensor]:
    """Measure `model` on the workload's samples `indices` at `batch_size`.

    Args:
        model: the candidate, already on `device`; `model(*inputs)` returns [B, ...].
        workload: supplies samples, collate and metrics.
        device: where model and inputs live.
        batch_size: rows per call (> 0).
        indices: which samples to evaluate, in the order outputs are returned (may repeat,
            see `cycle_indices`).
        policy: how samples are grouped into batches.
        reference: fp32 outputs [N, ...] for the same indices; fidelity is computed when given.
        min_timed_calls: at least this many timed calls (whole passes over the full batches).
        min_timed_s: and at least this much timed wall time, seconds.
        max_timed_s: stop adding passes once this much time was spent timing, seconds.

    Returns:
        (measurement, outputs float32 [N, ...] on the CPU in the order of `indices`).

    Raises:
        ValueError: batch_size < 1 or no indices.
    """
    if batch_size < 1 or not indices:
        raise ValueError(f"need batch_size ≥ 1 and at least one sample (got {batch_size}, {len(indices)})")
    batches = make_batches(workload, indices=indices, batch_size=batch_size, policy=policy, device=device)
    timer = Timer(device)
    reset_peak_memory(device)

    # Warm-up pass: compiles, autotunes, and gives the outputs judged for fidelity.
    outputs: torch.Tensor | None = None
    warmup_s = 0.0
    for batch in batches:
        out, seconds = timer(model, *batch.inputs)
        warmup_s += seconds
        out = out.detach().float().cpu()  # copied into `outputs` below, before the next call
        if outputs is None:
            outputs = torch.empty((len(indices), *out.shape[1:]), dtype=torch.float32)
        outputs[batch.positions] = out

    # Timed passes over the full batches (all batches when none is full).
    timed = [b for b in batches if b.num_rows == batch_size] or batches
    rows_per_pass = sum(b.num_rows for b in timed)
    latencies_s: list[float] = []
    pass_s: list[float] = []
    started = time.perf_counter()
    while True:
        this_pass = 0.0
        for batch in timed:
            _, seconds = timer(model, *batch.inputs)
            latencies_s.append(seconds)
            this_pass += seconds
        pass_s.append(this_pass)
        elapsed = time.perf_counter() - started
        if (len(latencies_s) >= min_timed_calls and elapsed >= min_timed_s) or elapsed > max_timed_s:
            break
    peak_bytes, peak_kind = peak_memory(device)

    median_pass_s = percentile(pass_s, 50)
    steady_all_s = median_pass_s * sum(b.num_rows for b in batches) / rows_per_pass
    padded = [b.inputs[0].shape[1] for b in batches if workload.is_text and b.inputs[0].dim() >= 2]
    measurement = Measurement(
        batch_size=batch_size,
        num_samples=len(indices),
        num_timed_calls=len(latencies_s),
        latency_ms={
            "p50": 1e3 * percentile(latencies_s, 50),
            "p90": 1e3 * percentile(latencies_s, 90),
            "p99": 1e3 * percentile(latencies_s, 99),
            "mean": 1e3 * sum(latencies_s) / len(latencies_s),
        },
        samples_per_s=rows_per_pass / median_pass_s,
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        warmup_s=warmup_s,
        compile_s=max(0.0, warmup_s - steady_all_s),
        mean_padded_length=sum(padded) / len(padded) if padded else None,
        nonfinite_outputs=int((~torch.isfinite(outputs)).sum()),
    )
    if reference is not None:
        measurement.fidelity = workload.fidelity(outputs, reference)
    if workload.has_task_metric:
        measurement.task_metric = workload.task_metric(outputs, indices)
    return measurement, outputs


def count_flops_per_sample(model: nn.Module, workload: Workload, *, device: torch.device, indices: list[int]) -> float | None:
    """FLOPs per row of one eager forward on the first samples (torch.utils.flop_counter).

    Returns None when the model cannot run under FlopCounterMode (e.g. TorchScript).
    Counts matmul/conv FLOPs as 2 × MACs, as FlopCounterMode does. nn.MultiheadAttention's
    inference fast path (`torch._native_multi_head_attention`) is switched off while counting
    (and restored): FlopCounterMode does not see inside that fused op, so its projections and
    attention would count as zero.
    """
    from torch.utils.flop_counter import FlopCounterMode

    chunk = indices[: min(len(indices), workload.default_batch_size)]
    inputs = to_device(workload.collate([workload.samples[i] for i in chunk]), device)
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(*inputs)
    except Exception:  # noqa: BLE001 - FLOPs are informative, never required
        return None
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    return counter.get_total_flops() / len(chunk)
