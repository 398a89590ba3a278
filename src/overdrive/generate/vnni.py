"""An exact int8 × int8 → int32 matrix product for a few rows, with AVX-512 VNNI (`vpdpbusd`).

`torch._int_mm` (oneDNN) is exact but, at the one to four rows a decode step has, reads the int8 weight far
below the memory's rate; Inductor's loop over the same products is bound by one float accumulator's latency
(`benchmarks/RESULTS.md`, "Decode at a few rows"). This kernel streams each weight row once for all rows of
the call, in order, and accumulates with `vpdpbusd` (u8 × s8, four products per int32
lane), the instruction llama.cpp's Q8_0 product uses on these CPUs. The activations are signed: each byte is
read as u8 = q + 128 and the sum corrected by 128 · Σ_k w[n, k], computed once per weight. Every sum is a sum of
integers in int32 (|Σ| ≤ in × 255 × 128 < 2³¹ for in ≤ `MAX_IN`): the result equals `torch._int_mm`'s bit for bit,
whatever the row count, so a sequence's products do not depend on its batch-mates.

The extension is compiled on first use (`torch.utils.cpp_extension.load_inline`, about half a minute, cached under
`TORCH_EXTENSIONS_DIR`) and offered only where the CPU reports `avx512_vnni` and the build succeeds;
`available()` says which, and why not.
"""

from __future__ import annotations

import os
import warnings

import torch

MAX_IN = 65_536  # 65,536 × 255 × 128 < 2³¹: no int32 sum can overflow (the op refuses more inputs)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// y[m, n] = sum_k x[m, k] * w[n, k] (+ 128 * rowsum correction), int8 x [M, K], int8 w [N, K], int32 out [M, N].
template <int M>
static void rows_kernel(const int8_t* x, const int8_t* w, const int32_t* wsum, int32_t* y, int64_t N, int64_t K,
                        int64_t n0, int64_t n1) {
  // the activations as u8 (q + 128), each row padded with zeros to a multiple of 64 bytes
  const int64_t Kp = (K + 63) / 64 * 64;
  std::vector<uint8_t> xu(M * Kp, 0);
  for (int m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xu[m * Kp + k] = (uint8_t)(x[m * K + k] ^ (int8_t)0x80);
  const int64_t full = K / 64 * 64;
  const __mmask64 tail = (K - full) ? (~0ULL >> (64 - (K - full))) : 0;
  // One weight row at a time, in order: one sequential stream (interleaving four rows read ~45% slower here)
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* r = w + n * K;
    __m512i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t k = 0; k < full; k += 64) {
      const __m512i b = _mm512_loadu_si512(r + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu.data() + m * Kp + k), b);
    }
    if (tail) {
      const __m512i b = _mm512_maskz_loadu_epi8(tail, r + full);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xu.data() + m * Kp + full), b);
    }
    for (int m = 0; m < M; ++m) y[m * N + n] = _mm512_reduce_add_epi32(acc[m]) - 128 * wsum[n];
  }
}

at::Tensor int8_rows_mm(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& wsum_in) {
  at::Tensor x = x_in, w = w_in, wsum = wsum_in;
  TORCH_CHECK(x.dtype() == torch::kInt8 && w.dtype() == torch::kInt8 && wsum.dtype() == torch::kInt32,
              "int8_rows_mm takes int8 x and weight and int32 weight_sums, got ", x.dtype(), ", ", w.dtype(), ", ",
              wsum.dtype());
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && wsum.numel() == w.size(0),
              "int8_rows_mm takes x [M, in], weight [out, in], weight_sums [out], got shapes ", x.sizes(), ", ",
              w.sizes(), ", ", wsum.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 4, "int8_rows_mm takes 1 to 4 rows, got ", x.size(0));
  TORCH_CHECK(w.size(1) <= 65536, "int8_rows_mm: ", w.size(1), " in features could overflow its int32 sums (at most 65536)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && wsum.device().is_cpu(), "int8_rows_mm takes CPU tensors");
  x = x.contiguous(); w = w.contiguous(); wsum = wsum.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  const int8_t* xp = x.data_ptr<int8_t>(); const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* sp = wsum.data_ptr<int32_t>(); int32_t* yp = y.data_ptr<int32_t>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_kernel<1>(xp, wp, sp, yp, N, K, n0, n1); break;
      case 2: rows_kernel<2>(xp, wp, sp, yp, N, K, n0, n1); break;
      case 3: rows_kernel<3>(xp, wp, sp, yp, N, K, n0, n1); break;
      default: rows_kernel<4>(xp, wp, sp, yp, N, K, n0, n1); break;
    }
  });
  return y;
}

TORCH_LIBRARY(overdrive_vnni, m) { m.def("int8_rows_mm(Tensor x, Tensor weight, Tensor weight_sums) -> Tensor"); }
TORCH_LIBRARY_IMPL(overdrive_vnni, CPU, m) { m.impl("int8_rows_mm", &int8_rows_mm); }
"""

ROWS = 4  # the row counts the kernel takes (1 to 4)
OP = None  # torch.ops.overdrive_vnni.int8_rows_mm once `available()` has built it (a module global Dynamo reads)


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line and " avx512bw" in line for line in f)
    except OSError:
        return False


_UNBUILT = object()
_STATE: object = _UNBUILT  # None once built, else why not


def _build() -> str | None:
    """None once the op is registered (`OP`), else why it is not offered; tried once per process."""
    global _STATE
    if _STATE is _UNBUILT:
        _STATE = _try_build()
    return _STATE


def _try_build() -> str | None:
    global OP
    if not _cpu_has_vnni():
        return "the CPU reports no avx512_vnni (or this is not Linux)"
    try:
        from torch.utils.cpp_extension import load_inline

        flags = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"]
        load_inline(name="overdrive_int8_vnni", cpp_sources=_SOURCE, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a toolchain without these intrinsics
        why = f"its build failed ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1][:200]})"
        warnings.warn(f"overdrive's VNNI int8 kernel is not used: {why}; int8-rowwise runs at about half its speed "
                      "at small batch", RuntimeWarning, stacklevel=2)
        return why

    @torch.library.register_fake("overdrive_vnni::int8_rows_mm")
    def _(x: torch.Tensor, weight: torch.Tensor, weight_sums: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.int32)

    OP = torch.ops.overdrive_vnni.int8_rows_mm
    return None


def available() -> tuple[bool, str | None]:
    """(whether the kernel runs here, why not). Builds it on the first call; then `OP` is
    `int8_rows_mm(x, weight, weight_sums)`: x int8 [M, in] (1 ≤ M ≤ `ROWS`), weight int8 [out, in], weight_sums
    int32 [out] (Σ_k weight[n, k]) → int32 [M, out], equal to `torch._int_mm(x, weight.t())`; it raises
    RuntimeError on other dtypes, shapes or devices, or more than `MAX_IN` inputs. `OVERDRIVE_NO_VNNI=1` turns it off (before the first call)."""
    if os.environ.get("OVERDRIVE_NO_VNNI") == "1" and OP is None:
        return False, "turned off by OVERDRIVE_NO_VNNI=1"
    why = _build()
    return why is None, why
