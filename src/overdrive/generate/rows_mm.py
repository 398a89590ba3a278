"""Matrix products for decode's few rows on the CPU, overdrive's own (C++ built on first use, torch ops).

`int8_rows_mm`: an exact int8 × int8 → int32 product with AVX-512 VNNI (`vpdpbusd`), or AVX2 without VNNI.

`torch._int_mm` (oneDNN) is exact but, at the one to four rows a decode step has, reads the int8 weight far
below the memory's rate (on an AVX2 CPU it is slow at any row count); Inductor's loop over the same products is
bound by one float accumulator's latency, and on an AVX2 CPU it converts each int8 weight to float
(`benchmarks/RESULTS.md`, "Decode at a few rows", "Decode on an AVX2 CPU"). This kernel streams each weight row once
for all rows of the call, in order, and accumulates in int32:

- AVX-512 VNNI: `vpdpbusd` (u8 × s8, four products per int32 lane), the instruction llama.cpp's Q8_0 product uses
  on these CPUs. The activations are signed: each byte is read as u8 = q + 128 and the sum corrected by
  128 · Σ_k w[n, k], computed once per weight (`weight_sums`). |Σ| ≤ in × 255 × 128 < 2³¹ for in ≤ `MAX_IN`.
- AVX2: the weights sign-extended to int16 (`vpmovsxbw`) and multiplied with the activations, widened once per
  call, by `vpmaddwd` (pairs of int16 products summed into int32: |pair| ≤ 2 · 128² = 2¹⁵); `weight_sums` unused.
  |Σ| ≤ in × 128² < 2³¹ for in ≤ `MAX_IN`.

Every sum is a sum of integers in int32: the result equals `torch._int_mm`'s bit for bit, whatever the row count
and the instruction set, so a sequence's products do not depend on its batch-mates.

`float_rows_mm`: x float32 [M, in] · W float32 [out, in]ᵀ with AVX2 FMA, each weight row streamed once for the
M rows (blocks of 4 rows × 3 weight rows held in registers): at the rows of decode (1 to 64) PyTorch's `aten.mm`
(MKL/oneDNN) reaches a fraction of the CPU's arithmetic rate. Each output is eight lane sums over k ≡ lane (mod 8)
in order, then summed across the lanes, the tail in order: the same for a row whatever the row count, so a row's
bits do not depend on its batch-mates (`aten.mm`'s do, across row counts).

The extension is compiled on first use (`torch.utils.cpp_extension.load_inline`, about half a minute, cached under
`TORCH_EXTENSIONS_DIR`) for the best of the two the CPU reports (`ISA`), and offered only where the build succeeds;
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

// y[m, n] = sum_k x[m, k] * w[n, k], int8 x [M, K], int8 w [N, K], int32 out [M, N]. Each thread takes a span of
// weight rows, one at a time, in order (one sequential stream: interleaving four rows read ~45% slower on an
// AVX-512 CPU), and computes every row of x against it, four at a time (the accumulators held in registers; the
// weight row, at most 64 KiB, read again from the cache for the next four).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The activations as u8 (q + 128), each row padded to a multiple of 64 bytes (against weights masked to zero);
// 128 * wsum[n] taken off.
typedef uint8_t act_t;
static constexpr int64_t STEP = 64;
static inline act_t widen(int8_t v) { return (uint8_t)(v ^ (int8_t)0x80); }

template <int R>
static inline void dot_rows(const act_t* xa, int64_t Kp, const int8_t* r, int64_t K, int32_t wsum, int32_t* out,
                            int64_t stride) {
  const int64_t full = K / 64 * 64;
  __m512i acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_si512();
  for (int64_t k = 0; k < full; k += 64) {
    const __m512i b = _mm512_loadu_si512(r + k);
    for (int m = 0; m < R; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xa + m * Kp + k), b);
  }
  if (K > full) {
    const __m512i b = _mm512_maskz_loadu_epi8(~0ULL >> (64 - (K - full)), r + full);
    for (int m = 0; m < R; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(xa + m * Kp + full), b);
  }
  for (int m = 0; m < R; ++m) out[m * stride] = _mm512_reduce_add_epi32(acc[m]) - 128 * wsum;
}
#elif defined(__AVX2__)
// The activations widened to int16, each row padded with zeros to a multiple of 32; 32 weights a step
// sign-extended, vpmaddwd into int32; the weights' tail in scalar code.
typedef int16_t act_t;
static constexpr int64_t STEP = 32;
static inline act_t widen(int8_t v) { return v; }

static inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

template <int R>
static inline void dot_rows(const act_t* xa, int64_t Kp, const int8_t* r, int64_t K, int32_t, int32_t* out,
                            int64_t stride) {
  const int64_t full = K / 32 * 32;
  __m256i acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
  for (int64_t k = 0; k < full; k += 32) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(r + k)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(r + k + 16)));
    for (int m = 0; m < R; ++m) {
      const act_t* a = xa + m * Kp + k;
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i*)a)));
      acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i*)(a + 16))));
    }
  }
  for (int m = 0; m < R; ++m) {
    int32_t s = sum8(acc[m]);
    for (int64_t k = full; k < K; ++k) s += (int32_t)xa[m * Kp + k] * (int32_t)r[k];
    out[m * stride] = s;
  }
}
#else
#error "overdrive's int8 kernel needs AVX-512 VNNI or AVX2"
#endif

at::Tensor int8_rows_mm(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& wsum_in) {
  at::Tensor x = x_in, w = w_in, wsum = wsum_in;
  TORCH_CHECK(x.dtype() == torch::kInt8 && w.dtype() == torch::kInt8 && wsum.dtype() == torch::kInt32,
              "int8_rows_mm takes int8 x and weight and int32 weight_sums, got ", x.dtype(), ", ", w.dtype(), ", ",
              wsum.dtype());
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && wsum.dim() == 1 &&
              wsum.size(0) == w.size(0),
              "int8_rows_mm takes x [M, in], weight [out, in], weight_sums [out], got shapes ", x.sizes(), ", ",
              w.sizes(), ", ", wsum.sizes());
  TORCH_CHECK(w.size(1) <= 65536, "int8_rows_mm: ", w.size(1),
              " in features could overflow its int32 sums (at most 65536)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && wsum.device().is_cpu(), "int8_rows_mm takes CPU tensors");
  x = x.contiguous(); w = w.contiguous(); wsum = wsum.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1), Kp = (K + STEP - 1) / STEP * STEP;
  auto y = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const int8_t* xp = x.data_ptr<int8_t>(); const int8_t* wp = w.data_ptr<int8_t>();
  const int32_t* sp = wsum.data_ptr<int32_t>(); int32_t* yp = y.data_ptr<int32_t>();
  std::vector<act_t> xa(M * Kp, widen(0));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xa[m * Kp + k] = widen(xp[m * K + k]);
  const act_t* xs = xa.data();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* r = wp + n * K;
      for (int64_t m = 0; m < M; m += 4) {
        const act_t* a = xs + m * Kp;
        int32_t* out = yp + m * N + n;
        switch (std::min<int64_t>(M - m, 4)) {
          case 1: dot_rows<1>(a, Kp, r, K, sp[n], out, N); break;
          case 2: dot_rows<2>(a, Kp, r, K, sp[n], out, N); break;
          case 3: dot_rows<3>(a, Kp, r, K, sp[n], out, N); break;
          default: dot_rows<4>(a, Kp, r, K, sp[n], out, N); break;
        }
      }
    }
  });
  return y;
}

// y[m, n] = sum_k x[m, k] * w[n, k] in float32 with AVX2 FMA; each output summed in one fixed order (in eight
// lanes, k = lane mod 8 in order, then across the lanes, then the tail in order), whatever the block it falls in.
static inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block of R rows of x against C weight rows: R x C accumulators of eight lanes (4 x 3: 12 of the 16 registers)
template <int R, int C>
static inline void float_block(const float* xa, int64_t K, const float* r, float* out, int64_t stride) {
  const int64_t full = K / 8 * 8;
  __m256 acc[R][C];
  for (int m = 0; m < R; ++m) for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < full; k += 8) {
    __m256 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm256_loadu_ps(r + c * K + k);
    for (int m = 0; m < R; ++m) {
      const __m256 a = _mm256_loadu_ps(xa + m * K + k);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_fmadd_ps(a, b[c], acc[m][c]);
    }
  }
  for (int m = 0; m < R; ++m) for (int c = 0; c < C; ++c) {
    float s = lanes_sum(acc[m][c]);
    for (int64_t k = full; k < K; ++k) s += xa[m * K + k] * r[c * K + k];
    out[m * stride + c] = s;
  }
}

template <int C>
static inline void float_rows(const float* xp, int64_t M, int64_t K, const float* r, float* yp, int64_t N) {
  for (int64_t m = 0; m < M; m += 4) {
    switch (std::min<int64_t>(M - m, 4)) {
      case 1: float_block<1, C>(xp + m * K, K, r, yp + m * N, N); break;
      case 2: float_block<2, C>(xp + m * K, K, r, yp + m * N, N); break;
      case 3: float_block<3, C>(xp + m * K, K, r, yp + m * N, N); break;
      default: float_block<4, C>(xp + m * K, K, r, yp + m * N, N); break;
    }
  }
}

at::Tensor float_rows_mm(const at::Tensor& x_in, const at::Tensor& w_in) {
  TORCH_CHECK(x_in.dtype() == torch::kFloat32 && w_in.dtype() == torch::kFloat32,
              "float_rows_mm takes float32 x and weight, got ", x_in.dtype(), ", ", w_in.dtype());
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "float_rows_mm takes x [M, in], weight [out, in], got shapes ", x_in.sizes(), ", ", w_in.sizes());
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "float_rows_mm takes CPU tensors");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 2) / 3, 8, [&](int64_t p0, int64_t p1) {  // three weight rows at a time
    for (int64_t n = 3 * p0; n < std::min(3 * p1, N); n += 3) {
      switch (std::min<int64_t>(N - n, 3)) {
        case 1: float_rows<1>(xp, M, K, wp + n * K, yp + n, N); break;
        case 2: float_rows<2>(xp, M, K, wp + n * K, yp + n, N); break;
        default: float_rows<3>(xp, M, K, wp + n * K, yp + n, N); break;
      }
    }
  });
  return y;
}

TORCH_LIBRARY(overdrive_rows, m) {
  m.def("int8_rows_mm(Tensor x, Tensor weight, Tensor weight_sums) -> Tensor");
  m.def("float_rows_mm(Tensor x, Tensor weight) -> Tensor");
}
TORCH_LIBRARY_IMPL(overdrive_rows, CPU, m) {
  m.impl("int8_rows_mm", &int8_rows_mm);
  m.impl("float_rows_mm", &float_rows_mm);
}
"""

OP = None  # torch.ops.overdrive_rows.int8_rows_mm once `available()` has built it (a module global Dynamo reads)
FLOAT_OP = None  # torch.ops.overdrive_rows.float_rows_mm, likewise
# `decoder.project` calls FLOAT_OP under torch.compile up to this many rows; beyond, `aten.mm` (the op against
# aten.mm over a 125 M model's layers on an AVX2 EPYC: 2.0x at 1 row, 2.3x at 16, 1.7x at 64: RESULTS.md)
FLOAT_ROWS = 64
# instruction set → (the /proc/cpuinfo flags it needs, compiler flags, the rows up to which int8-rowwise calls
# the op, how it multiplies more rows: oneDNN's `torch._int_mm` or "float-spans", float32 GEMMs over spans short
# enough to be exact), the best first. With VNNI the op was measured against `_int_mm` at 1–4 rows; on an AVX2 CPU
# `_int_mm` was far slower than the op at every row count, and the op slower than float32's GEMM from ~512 rows
# (`benchmarks/RESULTS.md`, "Decode on an AVX2 CPU")
ISAS = {
    "avx512-vnni": (("avx512_vnni", "avx512bw", "avx512f", "avx2", "fma"),
                    ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mavx2", "-mfma"], 4, "_int_mm"),
    "avx2": (("avx2", "fma"), ["-mavx2", "-mfma"], 512, "float-spans"),
}
ROWS = 0  # int8-rowwise calls the op at 1 to this many rows: `ISAS`' figure for `ISA` once built
LARGE = "_int_mm"  # and beyond them, `ISAS`' choice for `ISA` once built
ISA: str | None = None  # the one built, once `available()` has said so


def _cpu_isa() -> str | None:
    """The best of `ISAS` the CPU reports (Linux's /proc/cpuinfo), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((line.split() for line in f if line.startswith("flags")), []))
    except OSError:
        return None
    return next((isa for isa, (needs, *_) in ISAS.items() if flags.issuperset(needs)), None)


_UNBUILT = object()
_STATE: object = _UNBUILT  # None once built, else why not


def _build() -> str | None:
    """None once the op is registered (`OP`), else why it is not offered; tried once per process."""
    global _STATE
    if _STATE is _UNBUILT:
        _STATE = _try_build()
    return _STATE


def _try_build() -> str | None:
    global OP, FLOAT_OP, ISA, ROWS, LARGE
    isa = _cpu_isa()
    if isa is None:
        return "the CPU reports neither avx512_vnni nor avx2 with fma (or this is not Linux)"
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(name=f"overdrive_rows_{isa.replace('-', '_')}", cpp_sources=_SOURCE,
                    extra_cflags=["-O3", *ISAS[isa][1], "-fopenmp"], extra_ldflags=["-fopenmp"],
                    is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a toolchain without these intrinsics
        why = f"its build failed ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1][:200]})"
        warnings.warn(f"overdrive's {isa} row kernels are not used: {why}; int8-rowwise and float32 decode run "
                      "slower at small batch", RuntimeWarning, stacklevel=2)
        return why

    @torch.library.register_fake("overdrive_rows::int8_rows_mm")
    def _(x: torch.Tensor, weight: torch.Tensor, weight_sums: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.int32)

    @torch.library.register_fake("overdrive_rows::float_rows_mm")
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    def backward(ctx, grad: torch.Tensor):  # y = x wᵀ: dx = grad · w, dw = gradᵀ · x
        x, weight = ctx.saved_tensors
        return (grad @ weight if ctx.needs_input_grad[0] else None,
                grad.t() @ x if ctx.needs_input_grad[1] else None)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    torch.library.register_autograd("overdrive_rows::float_rows_mm", backward, setup_context=setup_context)

    OP, FLOAT_OP = torch.ops.overdrive_rows.int8_rows_mm, torch.ops.overdrive_rows.float_rows_mm
    ISA, (ROWS, LARGE) = isa, ISAS[isa][2:]
    return None


def available() -> tuple[bool, str | None]:
    """(whether the kernels run here, why not). Builds them on the first call (for `ISA`); then

    - `OP` is `int8_rows_mm(x, weight, weight_sums)`: x int8 [M, in], weight int8 [out, in], weight_sums
      int32 [out] (Σ_k weight[n, k]) → int32 [M, out], equal to `torch._int_mm(x, weight.t())`;
    - `FLOAT_OP` is `float_rows_mm(x, weight)`: x float32 [M, in], weight float32 [out, in] → float32 [M, out]
      (differentiable: its backward is two products through PyTorch).

    Each raises RuntimeError on other dtypes, shapes or devices (`int8_rows_mm` also beyond `MAX_IN` inputs).
    `OVERDRIVE_NO_ROW_KERNELS=1` turns them off (before the first call)."""
    if os.environ.get("OVERDRIVE_NO_ROW_KERNELS") == "1" and OP is None:
        return False, "turned off by OVERDRIVE_NO_ROW_KERNELS=1"
    why = _build()
    return why is None, why
