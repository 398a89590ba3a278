"""Low-precision weights for a decoder's linear layers, searched per layer against the generation guard.

Decoding at small batch reads every weight once per token and does little arithmetic with it, so its
speed is set by the bytes of weights read (the decode roofline). Each `nn.Linear` chosen is replaced by
one of three forms (`FORMS`), each computing every row from that row alone (a sequence's tokens do not
depend on its batch-mates):

- `int8-weight`: weight-only int8, the weight [out, in] rounded with one symmetric scale per output
  channel (absmax / 127, as gpt-fast's and torchao's int8 weight-only forms), activations in the
  model's dtype; kernel `torch.ops.aten._weight_int8pack_mm`, or the weight dequantized per call.
- `fp16-weight`: weight-only fp16 through FBGEMM's packed fp16 GEMM (`quantized.linear_dynamic_fp16`,
  CPU only; fp32 activations and accumulation). Opaque to torch.compile (a packed weight object).
- `int8-rowwise`: int8 weights as above and int8 activations with one scale per row, quantized at
  each call (dynamic W8A8, as torchao's int8 dynamic-activation form), multiplied by `torch._int_mm`;
  on a CPU with AVX-512 VNNI or AVX2, by overdrive's row kernel instead at up to `rows_mm.ROWS` rows a call
  (`rows_mm.int8_rows_linear` for float32 x: the rounding, product and scales in one call; 1–4 rows with VNNI:
  decode at small batch; up to 512 on AVX2, where `_int_mm` is slow at every row count, and beyond them float32
  GEMMs over exact spans), eager or compiled (the same exact int32 sums, faster:
  `benchmarks/RESULTS.md`, "Decode at a few rows", "Decode on an AVX2 CPU");
  without it, under torch.compile on the CPU a one-row call (a decode step of one sequence) is a reduction Inductor
  fuses into one loop reading each int8 weight once (`_int_mm` blocks for a matrix product): the products
  of int8 values in float32, summed over spans of at most `EXACT_SPAN` inputs, whose every partial sum is
  an integer below 2²⁴ and so exact in any order, the spans added in int32. Both kernels compute the
  exact integer dot products, so a row's bits do not depend on which one its call's row count picked
  (Inductor must not fold the activations' rounding into that loop: `COMPILE_OPTIONS`).
  A per-tensor activation scale (FBGEMM's `quantize_dynamic`) is not offered: it makes each row's
  answer depend on the others in its call (batch-mates, and in prefill the prompt's later tokens).
- `int4-weight`: weight-only int4 in groups of `INT4_GROUP_SIZE` input channels, asymmetric (a scale and a
  zero point per group, as gpt-fast's and torchao's int4 weight-only forms), through PyTorch's CPU kernel
  `torch.ops.aten._weight_int4pack_mm_for_cpu` (CPU only; layers with out features a multiple of 16 and in
  features a multiple of the group; `holds` says which).

Which layers is a search (`search_layers`): each layer's sensitivity is the mean KL divergence of the
next-token distributions along held-out text when that layer alone is converted
(`fidelity.sequence_logits`); layers are taken from the least sensitive while the whole model's KL
stays within the budget. Which form is fastest depends on the CPU and the batch (`pick_form`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.generate import rows_mm
from overdrive.generate.decoder import Decoder, project

FORMS = ("int8-weight", "fp16-weight", "int8-rowwise", "int4-weight")
INT4_GROUP_SIZE = 64
EXACT_SPAN = 1024  # 1,024 products of at most 127² sum below 2²⁴: float32 holds every partial sum exactly
# Inductor options for a compiled decode step over int8-rowwise layers: a pointwise chain (the activations'
# rounding) is computed into its own buffer rather than inlined into the reduction that reads it, which
# recomputed it for every weight (4.3 against 0.97 ms for a [32000, 768] layer at one row)
COMPILE_OPTIONS = {"realize_opcount_threshold": 1}
KERNELS = ("int8pack", "dequantize")  # of int8-weight


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [R, C], scale float32 [R]): each row of `w` rounded with its own symmetric scale, absmax / 127."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8WeightLinear(nn.Module):
    """y = x · (q · s)ᵀ + b, with q int8 [out, in] and s [out] in the layer's dtype; x [..., in] → y [..., out]."""

    def __init__(self, linear: nn.Linear, kernel: str = "int8pack"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        q, scale = _int8_rows(linear.weight)
        self.register_buffer("weight_int8", q)
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features, self.kernel = linear.in_features, linear.out_features, kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8,
                                                   self.scale.to(x.dtype)).reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None])
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


_FP16_ROWS: list[str | None] = []  # memo of `fp16_rows_refusal`


def fp16_rows_refusal() -> str | None:
    """Why FBGEMM's fp16 GEMM cannot be offered on this CPU, or None: on some (an AVX2 EPYC, not an AVX-512 one) a
    row's result depends on how many rows share its call (its kernel blocks rows by the call's count), which would
    make a sequence's tokens depend on its batch-mates. Probed once per process: a random [48, 64] layer called
    with 1 to 40 rows against the same rows in one 40-row call, bit for bit."""
    if not _FP16_ROWS:
        generator = torch.Generator().manual_seed(0)
        packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(48, 64, generator=generator), None)
        x = torch.randn(40, 64, generator=generator)
        whole = torch.ops.quantized.linear_dynamic_fp16(x, packed)
        differ = [m for m in range(1, 40) if not torch.equal(torch.ops.quantized.linear_dynamic_fp16(x[:m], packed),
                                                             whole[:m])]
        _FP16_ROWS.append(None if not differ else (
            "FBGEMM's fp16 GEMM on this CPU gives a row different bits at different row counts (calls of "
            f"{', '.join(map(str, differ[:6]))}{' …' if len(differ) > 6 else ''} rows against one of 40): a "
            "sequence's tokens would depend on its batch-mates"))
    return _FP16_ROWS[0]


class Fp16WeightLinear(nn.Module):
    """y = x · fp16(W)ᵀ + b through FBGEMM's packed fp16 GEMM; x float32 [..., in] on the CPU → y [..., out].

    Raises:
        ValueError: a layer not on the CPU or not in float32, or a CPU where the kernel's rows depend on their
            call's row count (`fp16_rows_refusal`).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.weight.device.type != "cpu" or linear.weight.dtype != torch.float32:
            raise ValueError("fp16-weight is FBGEMM's CPU kernel for float32 layers; this layer is "
                             f"{linear.weight.dtype} on {linear.weight.device.type}")
        if (why := fp16_rows_refusal()) is not None:
            raise ValueError(f"fp16-weight is not offered here: {why}")
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach(), None)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def exact_float_spans(q: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """q int8 [M, in] · weight int8 [out, in]ᵀ → [M, out], the exact integer products (float32 holding integers, or
    int32), as float32 GEMMs over spans of `EXACT_SPAN` inputs: every partial sum an integer of at most 2²⁴ in
    magnitude, exact in any order, the spans added in int32. The weight converted to float32 at each call."""
    qf = q.float()
    spans = [F.linear(qf[:, a:a + EXACT_SPAN], weight[:, a:a + EXACT_SPAN].float())
             for a in range(0, q.shape[1], EXACT_SPAN)]
    return spans[0] if len(spans) == 1 else sum(span.to(torch.int32) for span in spans)


class Int8RowwiseLinear(nn.Module):
    """y = (qx · qwᵀ) · sx · sw + b: int8 weights (a scale per output channel) and int8 activations (a scale
    per row, from that row alone), the dot products exact (`torch._int_mm`'s int32; at ≤ `rows_mm.ROWS` rows on an
    AVX-512 VNNI or AVX2 CPU, `rows_mm.int8_rows_linear`'s for float32 x, the whole forward in one call, the same
    bits, or `rows_mm.int8_rows_mm`'s; else compiled, one row: exact float32 spans; beyond
    `rows_mm.ROWS` on AVX2, float32 GEMMs over spans of `EXACT_SPAN` inputs, as exact); x [..., in] →
    y [..., out] in x's dtype. `weight_sums` (for the VNNI form of that kernel) are derived from `weight_int8` when
    built and when a state dict is loaded; `weight_int8` changed in place any other way needs `_sum_weights()`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = _int8_rows(linear.weight)
        self.register_buffer("weight_int8", q)  # [out, in]
        self.register_buffer("scale", scale)
        # Σ_k q[n, k], for the VNNI form of `rows_mm`'s unsigned activations: derived, not in the state dict, so
        # recomputed whenever one is loaded (stale sums would skew every output of ≤ 4 rows and no other)
        self.register_buffer("weight_sums", q.sum(1, dtype=torch.int32), persistent=False)
        self.register_load_state_dict_post_hook(lambda module, incompatible: module._sum_weights())
        rows_mm.available()  # built (or refused) once per process, before any trace reads `rows_mm.OP`
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    rows_kernel = "int8_rows_linear"  # `decoder.project_many` calls several such layers of one x in one kernel call

    def takes_rows_kernel(self, x: torch.Tensor) -> bool:
        """Whether this call is `rows_mm.int8_rows_linear`'s (the rounding, product, scales and bias in one call):
        float32 x on the CPU, 1 to `rows_mm.ROWS` rows, where the kernels are built, no gradient asked for (the op
        has no backward; the layer's PyTorch path gives the rounding's)."""
        rows = x.numel() // max(x.shape[-1], 1)
        return (rows_mm.LINEAR_OP is not None and x.device.type == "cpu" and x.dtype == torch.float32
                and 0 < rows <= rows_mm.ROWS and self.in_features <= rows_mm.MAX_IN
                and (self.bias is None or self.bias.dtype == torch.float32)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.bias is not None
                                                      and self.bias.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.takes_rows_kernel(x):
            y = rows_mm.LINEAR_OP(rows, self.weight_int8, self.weight_sums, self.scale, self.bias)
            return y.reshape(*x.shape[:-1], self.out_features)
        qx, sx = _int8_rows(rows)
        if (rows_mm.OP is not None and 0 < rows.shape[0] <= rows_mm.ROWS and x.device.type == "cpu"
                and self.in_features <= rows_mm.MAX_IN):
            acc = rows_mm.OP(qx, self.weight_int8, self.weight_sums)
        elif torch.compiler.is_compiling() and rows.shape[0] == 1 and x.device.type == "cpu":
            qf, k = qx.float(), self.in_features
            spans = [(qf[:, None, a:a + EXACT_SPAN] * self.weight_int8[:, a:a + EXACT_SPAN].float()).sum(-1)
                     for a in range(0, k, EXACT_SPAN)]
            acc = spans[0] if len(spans) == 1 else sum(span.to(torch.int32) for span in spans)
        elif rows_mm.LARGE == "float-spans" and x.device.type == "cpu" and rows.shape[0] > 0:
            acc = exact_float_spans(qx, self.weight_int8)
        else:
            acc = torch._int_mm(qx, self.weight_int8.t())
        y = acc.float() * sx[:, None] * self.scale[None, :]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else (y + self.bias).to(x.dtype)  # x's dtype, whatever the bias's

    def _sum_weights(self) -> None:
        self.weight_sums = self.weight_int8.sum(1, dtype=torch.int32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4WeightLinear(nn.Module):
    """y = x · Wᵀ + b with W [out, in] held in int4, groups of `group_size` input channels each with a scale s and
    a zero point z (W ≈ (q - 8) · s + z, q in 0..15: min-max over the group); x [..., in] float32 or bfloat16 on
    the CPU → y [..., out].

    Raises:
        ValueError: a layer not on the CPU, or whose shape the kernel cannot take (`holds`).
    """

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE):
        super().__init__()
        why = _int4_refusal(linear, group_size)
        if why:
            raise ValueError(why)
        out_f, in_f = linear.weight.shape
        groups = linear.weight.detach().float().reshape(-1, group_size)
        low, high = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
        scale = (high - low).clamp(min=1e-6) / 15
        q = groups.sub(low).div(scale).round().clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        zero = low + scale * 8
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        scales_and_zeros = torch.cat([scale.reshape(out_f, -1, 1), zero.reshape(out_f, -1, 1)], 2)
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features, self.group_size = in_f, out_f, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.weight_int4,
                                                       self.group_size, self.scales_and_zeros.to(x.dtype))
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def _int4_refusal(linear: nn.Linear, group_size: int) -> str | None:
    out_f, in_f = linear.weight.shape
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"int4-weight needs PyTorch's CPU int4 kernel (torch ≥ 2.6; this is {torch.__version__})"
    if linear.weight.device.type != "cpu":
        return f"int4-weight is PyTorch's CPU int4 kernel; this layer is on {linear.weight.device.type}"
    if out_f % 16 or in_f % group_size:
        return (f"int4-weight takes layers with out features a multiple of 16 and in features a multiple of "
                f"{group_size}; this one is [{out_f}, {in_f}]")
    return None


def compile_options(model: nn.Module) -> dict:
    """Inductor options a compiled decode step over `model` needs (`COMPILE_OPTIONS` where it holds int8-rowwise
    layers on the CPU without `rows_mm`'s kernels, whose one-row calls are then Inductor's reduction; otherwise
    none: the kernels are opaque calls, and the option, which keeps each of the step's intermediates apart, slows
    the step's other small ops: `benchmarks/RESULTS.md`, "Decode's step overhead on the AVX2 CPU")."""
    held = any(isinstance(m, Int8RowwiseLinear) and m.weight_int8.device.type == "cpu" for m in model.modules())
    return dict(COMPILE_OPTIONS) if held and rows_mm.OP is None else {}


def holds(form: str, linear: nn.Linear) -> bool:
    """Whether `form` can hold `linear` (int4-weight's kernel takes some shapes only; fp16-weight float32 CPU ones,
    on a CPU where its rows do not depend on their batch-mates)."""
    if form == "int4-weight":
        return _int4_refusal(linear, INT4_GROUP_SIZE) is None
    if form == "fp16-weight":
        return (linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32
                and fp16_rows_refusal() is None)
    return True


def convert_linear(linear: nn.Linear, form: str, kernel: str = "int8pack") -> nn.Module:
    """`linear` in `form` (one of `FORMS`; `kernel` for int8-weight).

    Raises:
        ValueError: an unknown form, or one that cannot hold this layer (`Fp16WeightLinear`).
    """
    if form == "int8-weight":
        return Int8WeightLinear(linear, kernel)
    if form == "fp16-weight":
        return Fp16WeightLinear(linear)
    if form == "int8-rowwise":
        return Int8RowwiseLinear(linear)
    if form == "int4-weight":
        return Int4WeightLinear(linear)
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def linear_names(model: nn.Module, form: str | None = None) -> list[str]:
    """The qualified names of `model`'s `nn.Linear` layers, in module order (with `form`: those it `holds`)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and (form is None or holds(form, m))]


def quantize_linears(model: nn.Module, names: Iterable[str] | None = None, *, form: str = "int8-weight",
                     kernel: str = "int8pack") -> list[str]:
    """Replaces the named `nn.Linear` layers of `model` (by default all that `form` holds) by their `form`, in place.

    Returns:
        The names replaced, in module order.

    Raises:
        KeyError: a name that is not an `nn.Linear` of the model.
        ValueError: see `convert_linear`.
    """
    order = linear_names(model)
    chosen = linear_names(model, form) if names is None else list(names)
    unknown = [n for n in chosen if n not in set(order)]
    if unknown:
        raise KeyError(f"not linear layers of the model: {unknown[:4]}")
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, convert_linear(getattr(owner, child), form, kernel))
    return [n for n in order if n in set(chosen)]


def copy_decoder(model: Decoder) -> Decoder:
    """A fresh decoder with `model`'s config and weights (ties kept), on its device and dtype."""
    reference = next(model.parameters())
    other = Decoder(model.config).to(device=reference.device, dtype=reference.dtype)
    other.load_state_dict(model.state_dict())
    other.inv_freq = model.inv_freq.clone()
    return other.eval()


def mean_kl(reference: Decoder, candidate: Decoder, texts: Sequence[Sequence[int]],
            reference_logits: list[torch.Tensor] | None = None) -> float:
    """Mean KL(reference ‖ candidate) of the next-token distributions at every position of `texts`, nats
    (`fidelity.batched_sequence_logits`: both sides batched alike)."""
    from overdrive.generate.fidelity import batched_sequence_logits

    if reference_logits is None:
        reference_logits = batched_sequence_logits(reference, texts)
    total, count = 0.0, 0
    for ids, ref, cand in zip(texts, reference_logits, batched_sequence_logits(candidate, texts)):
        log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(cand, -1)
        total += float((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0).sum())  # KL ≥ 0: below is rounding
        count += len(ids)
    return total / max(count, 1)


def search_layers(reference: Decoder, texts: Sequence[Sequence[int]], *, max_mean_kl: float, form: str = "int8-weight",
                  kernel: str = "int8pack", progress: Callable[[str], None] = lambda _: None
                  ) -> tuple[list[str], dict[str, float], float]:
    """The layers to hold in `form`: of the linear layers `form` holds, each one's sensitivity (mean KL with it
    alone converted), then layers from the least sensitive, added while the whole model's mean KL stays
    ≤ `max_mean_kl` (each addition measured, not summed: errors of layers compound).

    Returns:
        (the chosen names, in module order; {name: its sensitivity, nats}; the chosen model's mean KL).
    """
    from overdrive.generate.fidelity import batched_sequence_logits

    reference_logits = batched_sequence_logits(reference, texts)
    sensitivity: dict[str, float] = {}
    for name in linear_names(reference, form):
        trial = copy_decoder(reference)
        quantize_linears(trial, [name], form=form, kernel=kernel)
        sensitivity[name] = mean_kl(reference, trial, texts, reference_logits)
        progress(f"{form} sensitivity {name}: {sensitivity[name]:.2e}")
    chosen: list[str] = []
    kl = 0.0
    order = sorted(sensitivity, key=sensitivity.get)
    # Double the step while additions fit, back off when one breaks the budget: log(layers) trials per break.
    step, at = 1, 0
    while at < len(order):
        batch = order[at:at + step]
        trial = copy_decoder(reference)
        quantize_linears(trial, chosen + batch, form=form, kernel=kernel)
        trial_kl = mean_kl(reference, trial, texts, reference_logits)
        if trial_kl <= max_mean_kl:
            chosen += batch
            kl, at, step = trial_kl, at + len(batch), step * 2
        elif step > 1:
            step = 1
        else:
            at += 1  # this layer breaks the budget on top of the others: leave it in fp32
    names = [n for n in linear_names(reference) if n in set(chosen)]
    return names, sensitivity, kl


def last_level_cache_bytes() -> int:
    """The CPU's largest cache, bytes (Linux's sysfs; `_CACHE_FALLBACK` where it cannot be read)."""
    sizes = []
    for path in _CACHE_DIR.glob("index*/size"):
        text = path.read_text().strip().upper()
        try:
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (ValueError, OSError):
            continue
    return max(sizes, default=_CACHE_FALLBACK)


_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
_CACHE_FALLBACK = 32 << 20


def _call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x)


def _project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return project(layer, x)


MAX_COPIES = 256  # of one shape, in `pick_form`'s sweeps


def pick_form(shapes: Iterable[tuple[int, int]], rows: int = 1, forms: Sequence[str] = FORMS,
              repeats: int = 20, compiled: bool = False) -> tuple[str | None, dict[str, float]]:
    """Which form runs the float32 CPU layers of `shapes` [(out, in)] fastest at `rows` rows, timed here:
    (the fastest form, or None when none beats float32; {"float32" or form: seconds per call summed over
    the shapes}). Each distinct shape is timed once (the median over sweeps, at least `repeats` calls in all) and
    counted as often as it occurs. A layer a form cannot hold (`holds`) stays in float32 and counts float32's time;
    a form that holds none of them, or cannot run here, reads inf. `compiled`: each layer timed under
    torch.compile (fixed shapes), as a compiled decode step runs it (float32 through `decoder.project`); a form
    torch.compile cannot take reads inf.

    Where the layers' float32 weights together exceed the CPU's last-level cache, a decode step streams every
    weight from memory, layer after layer: each shape is then timed as a sweep, back to back, over distinct copies
    of it whose float32 weights fill twice that cache (at most `MAX_COPIES`), so that no call finds its weights
    cached. A shape timed alone and repeated would stay in the cache and favour the form with more bytes; a call
    timed after evicting the cache pays a fixed cost (a cold thread pool) that the step's
    back-to-back calls do not (`benchmarks/RESULTS.md`, "Decode on an AVX2 CPU")."""
    shapes = list(shapes)
    counts = Counter(shapes)
    cache = last_level_cache_bytes()
    streamed = sum(o * i * 4 for o, i in shapes) > cache
    if compiled:  # a graph per distinct shape and form: Dynamo's limit on graphs per code object raised to that
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   2 * len(counts) * (len(forms) + 1))
    timings: dict[str, float] = {"float32": 0.0, **{f: 0.0 for f in forms}}
    held = dict.fromkeys(forms, 0)
    for (out_f, in_f), count in counts.items():
        copies = min(MAX_COPIES, -(-2 * cache // max(out_f * in_f * 4, 1))) if streamed else 1
        linears = [nn.Linear(in_f, out_f, bias=False) for _ in range(copies)]
        x = torch.randn(rows, in_f)
        for label in timings:
            if label != "float32" and not holds(label, linears[0]):
                timings[label] += fp32_s * count
                continue
            try:
                layers = linears if label == "float32" else [convert_linear(linear, label) for linear in linears]
                run = _call
                if compiled:  # float32 as the compiled step runs a plain layer: through `project`
                    run = torch.compile(_project if label == "float32" else _call, dynamic=False, fullgraph=True,
                                        options=compile_options(layers[0]) or None)
                sweeps = []
                with torch.inference_mode():
                    for layer in layers:  # warm-up: compiled, each layer once
                        run(layer, x)
                    for _ in range(max(3, -(-repeats // copies))):
                        started = time.perf_counter()
                        for layer in layers:
                            run(layer, x)
                        sweeps.append((time.perf_counter() - started) / copies)
                elapsed = statistics.median(sweeps)
            except (RuntimeError, ValueError):
                elapsed = float("inf")
            timings[label] += elapsed * count
            if label == "float32":
                fp32_s = elapsed
            else:
                held[label] += 1
    for form in forms:
        if not held[form]:
            timings[form] = float("inf")
    best = min(forms, key=timings.get) if forms else None
    return (best if best is not None and timings[best] < timings["float32"] else None), timings
