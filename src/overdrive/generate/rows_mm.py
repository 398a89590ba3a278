"""Matrix products and attention for decode's few rows on the CPU, overdrive's own (C++ built on first use, torch ops).

`int8_rows_mm`: an exact int8 × int8 → int32 product with AVX-512 VNNI (`vpdpbusd`), or AVX2 without VNNI.

`torch._int_mm` (oneDNN) is exact but, at the one to four rows a decode step has, reads the int8 weight far
below the memory's rate (on an AVX2 CPU it is slow at any row count); Inductor's loop over the same products is
bound by one float accumulator's latency, and on an AVX2 CPU it converts each int8 weight to float
(`benchmarks/RESULTS.md`, "Decode at a few rows", "Decode on an AVX2 CPU"). This kernel streams each weight row once
for all rows of the call, in order, and accumulates in int32:

- AVX-512 VNNI: `vpdpbusd` (u8 × s8, four products per int32 lane), the instruction llama.cpp's Q8_0 product uses
  on these CPUs. The activations are signed: each byte is read as u8 = q + 128 and the sum corrected by
  128 · Σ_k w[n, k], computed once per weight (`weight_sums`). |Σ| ≤ in × 255 × 128 < 2³¹ for in ≤ `MAX_IN`.
- AVX2, activations without -128 (int8-rowwise's own rounding gives -127..127): |w| (u8) times the activation
  carrying w's sign (s8, `vpsignb`) by `vpmaddubsw` (|pair| ≤ 2 · 128 · 127 < 2¹⁵: it never saturates), then
  `vpmaddwd` by ones into int32, as llama.cpp's AVX2 Q8_0 product. With a -128 (no int8 negation): the weights
  sign-extended to int16 (`vpmovsxbw`) against the activations widened once per call, `vpmaddwd` (|pair| ≤ 2 · 128²
  = 2¹⁵). |Σ| ≤ in × 128² < 2³¹ for in ≤ `MAX_IN`; `weight_sums` unused.

Every sum is a sum of integers in int32: the result equals `torch._int_mm`'s bit for bit, whatever the row count
and the instruction set, so a sequence's products do not depend on its batch-mates.

`int8_rows_linear` (and `int8_rows_linears`, several weights of one x in one call): `quantize.Int8RowwiseLinear`'s
whole forward in one call: each row of float32 x rounded to int8 with its own scale, the product above, both scales
and the bias, the same float32 operations in the same order as the layer's PyTorch code (bit for bit), without the
separate rounding and rescaling kernels (and their calls) a compiled step had around each product.

`float_rows_mm` (and `float_rows_mms`): x float32 [M, in] · W float32 [out, in]ᵀ with AVX2 FMA, each weight row
streamed once for the M rows (blocks of 4 rows × 3 weight rows held in registers): at the rows of decode (1 to
64) PyTorch's `aten.mm` (MKL/oneDNN) reaches a fraction of the CPU's arithmetic rate. Each output is eight lane
sums over k ≡ lane (mod 8) in order, then summed across the lanes, the tail in order: the same for a row whatever
the row count, so a row's bits do not depend on its batch-mates (`aten.mm`'s do, across row counts).

`decode_attention`: one query token per row against a [B, kv, S, D] float32 cache (grouped query heads), each
key and value read once for the query heads that share it, every float operation over the attended slots alone
(a row's bits do not depend on its padding or its batch-mates), in one call instead of two batched products and
a softmax.

The extension (`rows_mm.cpp` beside this file) is compiled on first use (`torch.utils.cpp_extension.load_inline`,
about half a minute, cached under `TORCH_EXTENSIONS_DIR`) for the best of the two the CPU reports (`ISA`), and offered only where the build succeeds;
`available()` says which, and why not."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

MAX_IN = 65_536  # 65,536 × 255 × 128 < 2³¹: no int32 sum can overflow (the op refuses more inputs)

SOURCE = Path(__file__).with_name("rows_mm.cpp")  # the ops in C++, read and compiled by `available()`

OP = None  # torch.ops.overdrive_rows.int8_rows_mm once `available()` has built it (a module global Dynamo reads)
LINEAR_OP = None  # torch.ops.overdrive_rows.int8_rows_linear, likewise
LINEARS_OP = None  # torch.ops.overdrive_rows.int8_rows_linears, likewise
FLOAT_OP = None  # torch.ops.overdrive_rows.float_rows_mm, likewise
FLOATS_OP = None  # torch.ops.overdrive_rows.float_rows_mms, likewise
ATTENTION_OP = None  # torch.ops.overdrive_rows.decode_attention, likewise
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
    global OP, LINEAR_OP, LINEARS_OP, FLOAT_OP, FLOATS_OP, ATTENTION_OP, ISA, ROWS, LARGE
    isa = _cpu_isa()
    if isa is None:
        return "the CPU reports neither avx512_vnni nor avx2 with fma (or this is not Linux)"
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(name=f"overdrive_rows_{isa.replace('-', '_')}", cpp_sources=SOURCE.read_text(),
                    extra_cflags=["-O3", "-ffp-contract=off", *ISAS[isa][1], "-fopenmp"], extra_ldflags=["-fopenmp"],
                    is_python_module=False, verbose=False)
    except Exception as error:  # no compiler, no ninja, a toolchain without these intrinsics
        why = f"its build failed ({type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1][:200]})"
        warnings.warn(f"overdrive's {isa} row kernels are not used: {why}; int8-rowwise and float32 decode run "
                      "slower at small batch", RuntimeWarning, stacklevel=2)
        return why

    @torch.library.register_fake("overdrive_rows::int8_rows_mm")
    def _(x: torch.Tensor, weight: torch.Tensor, weight_sums: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.int32)

    @torch.library.register_fake("overdrive_rows::int8_rows_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, weight_sums: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("overdrive_rows::decode_attention")
    def _(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("overdrive_rows::int8_rows_linears")
    def _(x: torch.Tensor, weights: list[torch.Tensor], weight_sums: list[torch.Tensor],
          scales: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]

    @torch.library.register_fake("overdrive_rows::float_rows_mms")
    def _(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        return [x.new_empty((x.shape[0], w.shape[0])) for w in weights]

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

    ops = torch.ops.overdrive_rows
    OP, LINEAR_OP, LINEARS_OP = ops.int8_rows_mm, ops.int8_rows_linear, ops.int8_rows_linears
    FLOAT_OP, FLOATS_OP, ATTENTION_OP = ops.float_rows_mm, ops.float_rows_mms, ops.decode_attention
    ISA, (ROWS, LARGE) = isa, ISAS[isa][2:]
    return None


def available() -> tuple[bool, str | None]:
    """(whether the kernels run here, why not). Builds them on the first call (for `ISA`); then

    - `OP` is `int8_rows_mm(x, weight, weight_sums)`: x int8 [M, in], weight int8 [out, in], weight_sums
      int32 [out] (Σ_k weight[n, k]) → int32 [M, out], equal to `torch._int_mm(x, weight.t())`;
    - `LINEAR_OP` is `int8_rows_linear(x, weight, weight_sums, scale, bias)`: x float32 [M, in], weight int8
      [out, in], weight_sums int32 [out], scale float32 [out], bias float32 [out] or None → float32 [M, out]:
      `quantize.Int8RowwiseLinear`'s forward in one call (each row of x rounded to int8 with its own scale, the
      exact product, the two scales, the bias), bit for bit; a row with NaN or inf gives NaN;
    - `LINEARS_OP` is `int8_rows_linears(x, weights, weight_sums, scales)`: lists of each → a list of float32
      [M, out_i], each `int8_rows_linear`'s without a bias, x rounded once;
    - `FLOAT_OP` is `float_rows_mm(x, weight)`: x float32 [M, in], weight float32 [out, in] → float32 [M, out]
      (differentiable: its backward is two products through PyTorch); `FLOATS_OP` is `float_rows_mms(x, weights)`,
      a list of weights → a list of outputs, each `float_rows_mm`'s bits (no backward);
    - `ATTENTION_OP` is `decode_attention(q, keys, values, mask, scale)`: q float32 [B, H, D], keys and values
      float32 [B, kv, S, D] (H a multiple of kv), mask bool [B, S] (True: attend), scale float → float32
      [B, H, D], softmax(q · kᵀ · scale) · v over the attended slots, zeros for a row with none (no backward).

    Each raises RuntimeError on other dtypes, shapes or devices (the int8 ones also beyond `MAX_IN` inputs); meta
    tensors get their shapes (the fake kernels torch.compile traces with).
    `OVERDRIVE_NO_ROW_KERNELS=1` turns them off (before the first call)."""
    if os.environ.get("OVERDRIVE_NO_ROW_KERNELS") == "1" and OP is None:
        return False, "turned off by OVERDRIVE_NO_ROW_KERNELS=1"
    why = _build()
    return why is None, why
