"""Where a measured call's tensors live and what memory it took: its inputs moved to the device (as
`run` moves them), its outputs copied out before the next call can overwrite them, and the peak
memory (the CUDA allocator's, or the process's RSS high-water mark on the CPU)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from overdrive.core.workload import Inputs

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
