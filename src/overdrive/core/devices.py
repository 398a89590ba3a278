"""Device resolution and capability checks, with errors that say what is present."""

from __future__ import annotations

import torch

from overdrive.core.errors import ConfigError, arg


def resolve_device(name: str | None) -> torch.device:
    """Turn a user's device string into a `torch.device` that exists on this machine.

    Args:
        name: "cpu", "cuda", "cuda:N", or None/"auto" (CUDA when present, else CPU).

    Returns:
        The device.

    Raises:
        ConfigError: the string is not a device, or the device is not present here.
    """
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"{arg('device', name)} is not a device; expected 'cpu', 'cuda' or 'cuda:N'") from exc
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{arg('device', name)} was asked for but no CUDA GPU is present on this machine; "
                              f"use {arg('device', 'cpu')}")
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ConfigError(f"{arg('device', name)}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", index)
    raise ConfigError(f"{arg('device', name)}: device type {device.type!r} is not supported; expected 'cpu' or 'cuda'")


def replica_devices(resolved: torch.device, requested: str | None) -> list[torch.device]:
    """Where to put one model replica each: every GPU when the user asked for "cuda" or "auto"
    (no index) and got CUDA; otherwise just `resolved` (from `resolve_device(requested)`)."""
    if resolved.type == "cuda" and requested in (None, "", "cuda", "auto"):  # resolve_device gives "cuda" index 0
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [resolved]


def supports_bf16(device: torch.device) -> bool:
    """Whether bf16 arithmetic is native on `device` (CUDA: compute capability ≥ 8.0)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu"


def supports_fp16(device: torch.device) -> tuple[bool, str]:
    """Whether fp16 arithmetic is native on `device`, and why not when it is not.

    On CPU, fp16 autocast exists in PyTorch but runs at fp32 speed or slower unless the
    CPU has AMX-FP16; we gate on that so the tuner does not measure an emulated path.
    """
    if device.type == "cuda":
        return True, ""
    if _cpu_feature("_is_amx_fp16_supported"):
        return True, ""
    return False, "this CPU has no native fp16 arithmetic (AMX-FP16); fp16 needs a GPU here"


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(device: torch.device) -> str:
    """A human-readable name for the device, for reports: 'NVIDIA H200', 'cpu (2 threads)'."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _cpu_feature(probe: str) -> bool:
    """A `torch.cpu._is_*_supported` probe; False where this torch version lacks it."""
    check = getattr(torch.cpu, probe, None)
    return bool(check()) if check is not None else False


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic instructions (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    return _cpu_feature("_is_avx512_bf16_supported") or _cpu_feature("_is_amx_tile_supported")


def serial_main_thread() -> int:
    """Set the calling (main) thread to one intra-op thread and return the count it had, for
    the worker threads that will run the model (each then calls `torch.set_num_threads`).

    Call it before the main thread runs any parallel torch op (before the model is loaded).
    ATen's OpenMP backend, libgomp, keeps a thread team for every thread that opens a parallel
    region, and once the process holds more OpenMP threads than CPUs it stops spinning between
    regions (its throttled spin count is 100), so every parallel op pays a futex wake-up. A
    process whose main thread loaded the model with N threads and whose workers then compute
    with N threads each is in that state: a one-sentence MiniLM call in such a worker thread took
    twice as long as in the main thread, and as long again once the main thread kept one thread
    (benchmarks/threads_cpu.py; benchmarks/RESULTS.md, threads_cpu).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    return threads


_ALLOCATOR_SETTLED = False


def settle_host_allocator() -> None:
    """Put glibc's malloc in the state a long-running process reaches, so that eager CPU figures do not
    depend on what the process did before (once per process; elsewhere than glibc, nothing).

    glibc serves a block above its mmap threshold (128 KiB at start) with a fresh mmap, whose pages fault
    in at every call, and raises the threshold to the size of the largest such block freed (up to 32
    MiB), after which blocks below it come from the heap, reused. An eager model's activations of a
    few hundred KiB to a few MiB therefore cost page faults on every call in a fresh process that never
    freed a large block, and nothing in one that did: the same eager conv net ran 1.4× or 2.6× slower than
    ONNX Runtime (which keeps its own arena) depending on whether a large copy had run earlier in the
    process. One 31 MiB block allocated and freed here raises the threshold to its ceiling in every
    process that measures, runs or serves.
    """
    global _ALLOCATOR_SETTLED
    if _ALLOCATOR_SETTLED:
        return
    _ALLOCATOR_SETTLED = True
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(31 << 20)  # above any threshold, below glibc's 32 MiB ceiling for raising it
        if block:
            libc.free(block)
    except (OSError, AttributeError):  # no C library to ask: nothing to settle
        pass
