"""The roofline: how close a measured throughput is to what this device allows.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful visual performance
model for multicore architectures", CACM 2009): a forward that does F FLOPs and moves Q bytes has
arithmetic intensity I = F / Q; on a device whose peaks are P FLOP/s and W bytes/s its roof is
min(P, I × W). The binding roof is the compute roof when P < I × W, else the memory roof, and the
fraction reported is the achieved FLOP/s over that roof.

The peaks are *measured* here, once per process and device, never taken from a data sheet:
- P: a large square GEMM in the plan's compute dtype (fp32, bf16, fp16; int8 through
  `torch._int_mm`; fp8 through `torch._scaled_mm` on CUDA), the best of several timed calls;
- W: a device-to-device copy of a large buffer, counted as read + write bytes, the best of several;
  for a step that only streams its weights in (a decode step), the read bandwidth: a reduction over a
  buffer several times the last-level cache (`peak_read_bandwidth`).
Published peaks are a cross-check only (an H200's dense bf16 is about 989 TFLOP/s and its HBM3e
about 4.8 TB/s: a measured GEMM reaching 60-80% of the sheet is normal).

What is counted, per batch (`traffic_per_batch`):
- FLOPs: the model's FLOPs per sample (torch.utils.flop_counter, matmul/conv as 2 × MACs) × rows:
  the work of the model as defined, as model-FLOPs utilisation counts it, whatever a runtime fuses
  or recomputes; a pruned model's FLOPs are its own.
- bytes: the weights once at their storage dtype (parameters and buffers, shared storage once,
  torch.ao's packed int8 weights), plus the batch's inputs and its outputs; for a runtime outside
  PyTorch, whose weights are out of sight, the fp32 model's parameters at the plan dtype's width
  (marked '~'). Activations that spill to memory are not counted, so the intensity is an upper bound.
- The memory roof is the device-memory (DRAM, HBM) copy bandwidth. On a CPU a model whose weights
  fit in the last-level cache can run above it: the share is then marked '!' (`ABOVE_ROOF`), as it is
  when a peak was measured low on a busy machine, or when a runtime outside PyTorch (OpenVINO's VNNI
  int8 kernels) beats the PyTorch GEMM the compute peak is measured with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
from torch import nn

from overdrive.core.timer import Timer

# Square GEMM sizes and copy buffer sizes used for the peaks; large enough to saturate the device.
_GEMM_N = {"cpu": 1024, "cuda": 8192}
_COPY_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
_READ_BYTES = {"cpu": 256 << 20, "cuda": 1 << 30}  # 8× a 32 MiB L3: a pass finds none of it cached
_REPEATS = 10

_PEAKS: dict[tuple[str, str], float] = {}


def _device_key(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return f"cpu:{torch.get_num_threads()}"


def _best_rate(device: torch.device, fn, amount: float) -> float:
    """The best amount / seconds over `_REPEATS` timed calls of `fn` after one untimed call (one
    timed call when a call takes over 0.2 s: a dtype this device runs slowly, fp16 on most CPUs)."""
    timer = Timer(device)
    _, first = timer(fn)
    best = math.inf
    for _ in range(1 if first > 0.2 else _REPEATS):
        _, seconds = timer(fn)
        best = min(best, seconds)
    return amount / best if best > 0 else math.nan


def _gemm(device: torch.device, dtype: str):
    """(a zero-argument GEMM call, its FLOPs) for `dtype`, or None where this device has no such GEMM."""
    n = _GEMM_N[device.type]
    flops = 2.0 * n ** 3
    generator = torch.Generator(device=device).manual_seed(0)
    if dtype == "int8":
        a = torch.randint(-64, 64, (n, n), dtype=torch.int8, device=device, generator=generator)
        b = torch.randint(-64, 64, (n, n), dtype=torch.int8, device=device, generator=generator)
        return (lambda: torch._int_mm(a, b)), flops
    if dtype == "float8":
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = torch.randn(n, n, device=device, generator=generator).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=generator).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return (lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)), flops
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(n, n, device=device, generator=generator).to(torch_dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(torch_dtype)
    return (lambda: a @ b), flops


def peak_flops(device: torch.device, dtype: str = "float32") -> float | None:
    """The measured GEMM peak of `device` in `dtype` ("float32", "bfloat16", "float16", "int8",
    "float8"), FLOP/s (int8: integer ops/s); None where the device has no such GEMM. Measured once
    per process, device and thread count."""
    device = torch.device(device)
    key = (_device_key(device), dtype)
    if key not in _PEAKS:
        try:
            with torch.no_grad():
                made = _gemm(device, dtype)
                _PEAKS[key] = _best_rate(device, made[0], made[1]) if made else math.nan
        except (RuntimeError, NotImplementedError):  # no kernel for this dtype here
            _PEAKS[key] = math.nan
    value = _PEAKS[key]
    return None if math.isnan(value) else value


def peak_bandwidth(device: torch.device) -> float:
    """The measured device-memory bandwidth of `device`, bytes/s: a copy of a large buffer counted
    as read + write. Measured once per process, device and thread count."""
    device = torch.device(device)
    key = (_device_key(device), "copy")
    if key not in _PEAKS:
        size = _COPY_BYTES[device.type]
        src = torch.ones(size // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        _PEAKS[key] = _best_rate(device, lambda: dst.copy_(src), 2.0 * size)
        del src, dst
    return _PEAKS[key]


def peak_read_bandwidth(device: torch.device) -> float:
    """The measured rate `device` reads its memory, bytes/s: the maximum of a float32 buffer of `_READ_BYTES`
    (one read of each byte, nothing written), the best of several. A copy moves its bytes both ways and, on a
    CPU, through fewer streams: here it measured about half this (`benchmarks/RESULTS.md`), so a step that
    only reads (decode) is held against this one. Measured once per process, device and thread count."""
    device = torch.device(device)
    key = (_device_key(device), "read")
    if key not in _PEAKS:
        size = _READ_BYTES[device.type]
        src = torch.ones(size // 4, dtype=torch.float32, device=device)
        _PEAKS[key] = _best_rate(device, src.amax, float(size))
        del src
    return _PEAKS[key]


# Bytes per element of each compute dtype, for weights a runtime outside PyTorch holds out of sight.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8": 1}


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers at their storage dtype, each storage once, and of
    the packed weights of torch.ao's quantised modules (int8 weights that are neither)."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if hasattr(module, "_packed_params") and callable(getattr(module, "weight", None)):
            tensors += [t for t in (module.weight(), module.bias() if callable(getattr(module, "bias", None)) else None)
                        if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        if tensor.device.type == "meta":
            continue
        if tensor.is_quantized:  # no untyped storage to key by: its own bytes
            total += tensor.numel() * tensor.element_size()
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def tensors_bytes(values) -> int:
    """Bytes of the tensors in `values` (a tensor, or a tuple / list / dict of them, nested)."""
    if isinstance(values, torch.Tensor):
        return values.numel() * values.element_size()
    if isinstance(values, dict):
        return sum(tensors_bytes(v) for v in values.values())
    if isinstance(values, (tuple, list)):
        return sum(tensors_bytes(v) for v in values)
    return 0


# Above the roof by more than this, a fraction means the peak was measured low (a busy machine), not a faster kernel.
ROOF_SLACK = 0.05
ABOVE_ROOF = ("above the roof: a peak was measured low (the machine was busy while it was measured, or a runtime's own "
              "kernels beat the PyTorch GEMM the peak is measured with), or on a CPU the weights fit in its cache (faster "
              "than the memory roof); such shares are uncertain")


@dataclass(frozen=True, kw_only=True)
class Roofline:
    """Where one measured configuration sits under its roofs.

    Attributes:
        dtype: the compute dtype whose GEMM peak is the compute roof.
        flops_per_s: achieved: FLOPs per sample × samples/s.
        bytes_per_s: achieved: bytes per batch (weights, inputs, outputs) × batches/s.
        intensity: FLOPs per byte moved (F / Q).
        peak_flops_per_s: the measured GEMM peak in `dtype`.
        peak_bytes_per_s: the measured copy bandwidth.
        weights_estimated: the weights are held out of PyTorch's sight (a runtime outside it): their
            bytes are the fp32 model's parameter count at `dtype`'s width, an estimate ('~' in the cell).
    """

    dtype: str
    flops_per_s: float
    bytes_per_s: float
    intensity: float
    peak_flops_per_s: float
    peak_bytes_per_s: float
    weights_estimated: bool = False

    @property
    def roof(self) -> float:
        """The attainable FLOP/s at this intensity: min(P, I × W)."""
        return min(self.peak_flops_per_s, self.intensity * self.peak_bytes_per_s)

    @property
    def bound(self) -> str:
        """"compute" when the GEMM peak is the lower roof at this intensity, else "memory"."""
        return "compute" if self.peak_flops_per_s <= self.intensity * self.peak_bytes_per_s else "memory"

    @property
    def fraction(self) -> float:
        """Achieved FLOP/s over the binding roof (0..1, above 1 only when the peaks were under-measured)."""
        return self.flops_per_s / self.roof if self.roof > 0 else math.nan

    def describe(self) -> str:
        unit = "TOP/s" if self.dtype == "int8" else "TFLOP/s"  # a mixed roof is in FLOP/s
        line = (f"{self.flops_per_s / 1e12:.3g} TFLOP/s and {self.bytes_per_s / 1e9:.3g} GB/s at {self.intensity:.3g} "
                f"FLOP/byte: {100 * self.fraction:.1f}% of the {self.bound} roof (measured peaks: {self.dtype} GEMM "
                f"{self.peak_flops_per_s / 1e12:.3g} {unit}, copy {self.peak_bytes_per_s / 1e9:.3g} GB/s)")
        if self.weights_estimated:
            line += "; the runtime holds the weights out of sight: their bytes are estimated at the plan's dtype"
        return line + (f"; {ABOVE_ROOF}" if self.fraction > 1 + ROOF_SLACK else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "roof": self.roof, "bound": self.bound, "fraction": self.fraction}

    @classmethod
    def from_dict(cls, data: dict) -> Roofline:
        """`to_dict`'s inverse (the derived figures are recomputed)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def roofline(*, flops_per_sample: float, bytes_per_batch: float, batch_size: int, samples_per_s: float,
             peak_flops_per_s: float, peak_bytes_per_s: float, dtype: str, weights_estimated: bool = False) -> Roofline:
    """The roofline point of a measured configuration (pure arithmetic; the peaks are given).

    Raises:
        ValueError: a non-positive figure.
    """
    if min(flops_per_sample, bytes_per_batch, batch_size, samples_per_s, peak_flops_per_s, peak_bytes_per_s) <= 0:
        raise ValueError("roofline figures must be positive")
    return Roofline(dtype=dtype, flops_per_s=flops_per_sample * samples_per_s,
                    bytes_per_s=bytes_per_batch * samples_per_s / batch_size,
                    intensity=flops_per_sample * batch_size / bytes_per_batch,
                    peak_flops_per_s=peak_flops_per_s, peak_bytes_per_s=peak_bytes_per_s,
                    weights_estimated=weights_estimated)


def measured_roofline(*, device: torch.device, dtype: str, flops_per_sample: float | None, bytes_per_batch: float,
                      batch_size: int, samples_per_s: float, weights_estimated: bool = False,
                      dtype_share: float = 1.0) -> Roofline | None:
    """`roofline` against this device's measured peaks (measured now if not yet); None when the
    FLOPs are unknown or the device has no GEMM in `dtype` (the fp32 one is used instead then).

    `dtype_share`: the share of the FLOPs that run in `dtype` (int8-dynamic lowers only the Linear
    layers); the rest run in fp32, and the compute roof is the time-weighted one,
    1 / (share / P_dtype + (1 − share) / P_fp32)."""
    if not flops_per_sample or samples_per_s <= 0 or bytes_per_batch <= 0:
        return None
    peak = peak_flops(device, dtype)
    if peak is None:
        dtype, peak = "float32", peak_flops(device, "float32")
    if peak is None:
        return None
    if dtype != "float32" and dtype_share < 1.0:
        fp32 = peak_flops(device, "float32")
        peak = 1.0 / (dtype_share / peak + (1.0 - dtype_share) / fp32)
        dtype = f"{dtype} on {100 * dtype_share:.2g}% of the FLOPs, float32 the rest,"
    return roofline(flops_per_sample=flops_per_sample, bytes_per_batch=bytes_per_batch, batch_size=batch_size,
                    samples_per_s=samples_per_s, peak_flops_per_s=peak, peak_bytes_per_s=peak_bandwidth(device),
                    dtype=dtype, weights_estimated=weights_estimated)


def describe_peaks(device: torch.device) -> str:
    """The peaks measured so far on `device` in this process, one phrase: 'float32 GEMM 0.124
    TFLOP/s, bfloat16 GEMM 0.364 TFLOP/s, copy 30.5 GB/s'; "" when none was."""
    key = _device_key(torch.device(device))
    gemms = [f"{dtype} GEMM {value / 1e12:.3g} T{'OP' if dtype == 'int8' else 'FLOP'}/s"
             for (where, dtype), value in _PEAKS.items() if where == key and dtype != "copy" and not math.isnan(value)]
    copy = _PEAKS.get((key, "copy"))
    return ", ".join(gemms + ([f"copy {copy / 1e9:.3g} GB/s"] if copy else []))


def roofline_cell(point: dict | None, compact: bool = False) -> str:
    """A table cell for a `Roofline.to_dict()`: '34% compute' ('34% comp' when `compact`); '' when unknown; a
    share above the roof (a peak measured low) is marked '!' (`ABOVE_ROOF`)."""
    if not point or not math.isfinite(point.get("fraction", math.nan)):
        return ""
    bound = {"compute": "comp", "memory": "mem"}[point["bound"]] if compact else point["bound"]
    mark = "!" if point["fraction"] > 1 + ROOF_SLACK else ""
    return f"{'~' if point.get('weights_estimated') else ''}{100 * point['fraction']:.0f}%{mark} {bound}"


def above_roof(points) -> bool:
    """Whether any of the `Roofline.to_dict()`s (None skipped) is above its roof beyond `ROOF_SLACK`."""
    return any(p and p.get("fraction", 0) > 1 + ROOF_SLACK for p in points)


def measure_peaks(device: torch.device, dtypes) -> None:
    """Measure the copy bandwidth and the GEMM peak of each dtype now (at start-up, before the models
    load the machine); later calls read them from the cache."""
    peak_bandwidth(device)
    for dtype in dict.fromkeys(["float32", *dtypes]):
        peak_flops(device, dtype)
