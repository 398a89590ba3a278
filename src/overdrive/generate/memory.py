"""The peak memory of generation, measured, split into the weights, the KV cache and the rest.

A generation pass holds the weights (resident before it starts) and allocates, while it runs, its KV cache
(pre-allocated per batch: keys and values for every layer, sequence and slot) and its activations, logits and
workspace. `measure_pass` runs one pass and measures the most memory the pass held allocated at once:

- CUDA: the caching allocator's counters (`torch.cuda.max_memory_allocated` after a reset, less what was allocated
  before the pass).
- CPU: the allocations and frees PyTorch's CPU allocator reports to the profiler (`torch.profiler`,
  `profile_memory=True`), each op's in the order the ops started (an op's own allocations counted at its start;
  frees outside any op as "[memory]" events), whose running sum's maximum is the peak. The process's resident set
  would not do: glibc keeps freed pages, so a second pass raises no high-water mark.

The KV cache's share is what the engine allocates for it (`roofline.kv_bytes_per_step`: every slot is allocated
and read); the rest of the peak is activations, logits and workspace (a draft model's own cache included).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from overdrive.generate.decoder import Decoder
from overdrive.generate.roofline import storage_bytes


@dataclass
class MemorySplit:
    """Bytes: `weights` (every parameter's and buffer's storage, once), `kv_cache` (the cache the pass allocated),
    `other` (the pass's peak less its KV cache: activations, logits, workspace), `peak` = weights + the pass's
    peak; `source`: how the pass's peak was measured ("cuda_max_allocated" or "cpu_profiler")."""

    weights: int
    kv_cache: int
    other: int
    peak: int
    source: str

    def describe(self) -> str:
        return (f"{self.peak / 1e6:,.1f} MB peak = {self.weights / 1e6:,.1f} weights + {self.kv_cache / 1e6:,.1f} KV "
                f"cache + {self.other / 1e6:,.1f} other")

    def to_dict(self) -> dict:
        return asdict(self)


def pass_peak_bytes(run: Callable[[], object], device: torch.device) -> tuple[int, str]:
    """(bytes, source): the most memory `run()` held allocated at once above what was allocated when it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before), "cuda_max_allocated"
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_stderr() as stderr, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with _native_stderr_restored(stderr):
            run()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    held = peak = 0
    for event in events:
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak, "cpu_profiler"


@contextlib.contextmanager
def _quiet_native_stderr():
    """File descriptor 2 pointed at /dev/null: the profiler's native library (Kineto) logs its start and stop, and on
    a machine without a GPU an "ERROR: gpuGetDeviceCount failed" line, to stderr, though nothing failed. Yields a
    descriptor of the real stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)
    try:
        yield saved
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _native_stderr_restored(stderr: int):
    """Inside `_quiet_native_stderr`: the real stderr back while the measured pass runs (its warnings are the user's)."""
    quiet = os.dup(2)
    os.dup2(stderr, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(quiet, 2)
        os.close(quiet)


def measure_pass(model: Decoder, run: Callable[[], object], *, kv_cache_bytes: int) -> MemorySplit:
    """One pass `run()` of a generator over `model`, its peak split (`MemorySplit`); `kv_cache_bytes`: what the
    pass's KV cache holds (the largest batch's, `roofline.kv_bytes_per_step`).

    Raises:
        RuntimeError: the pass's measured peak is under its own KV cache (the allocations were not all seen).
    """
    device = next(model.parameters()).device
    weights = storage_bytes(model)
    held, source = pass_peak_bytes(run, device)
    if held < kv_cache_bytes:
        raise RuntimeError(f"the pass's measured peak ({held:,} bytes, {source}) is under its KV cache "
                           f"({kv_cache_bytes:,} bytes): its allocations were not all seen")
    return MemorySplit(weights=weights, kv_cache=kv_cache_bytes, other=held - kv_cache_bytes, peak=weights + held,
                       source=source)
