"""Weight-only int8 for a decoder's linear layers, searched per layer against the generation guard.

Decoding at small batch reads every weight once per token and does little arithmetic with it, so its
speed is set by the bytes of weights read (the decode roofline): int8 weights read a quarter of fp32's.
Each `nn.Linear` chosen becomes an `Int8WeightLinear`: its weight [out, in] rounded to int8 with one
symmetric scale per output channel (absmax / 127, as gpt-fast's and torchao's int8 weight-only forms),
the activations staying in the model's dtype. Which layers is a search (`search_int8_layers`): each
layer's sensitivity is the mean KL divergence of the next-token distributions along held-out text when
that layer alone is quantized (`fidelity.sequence_logits`), and layers are taken from the least
sensitive while the whole model's KL stays within the budget.

Kernels: `torch.ops.aten._weight_int8pack_mm` (x [M, in] float, weight int8 [out, in], scales [out]) where
it is faster than reading fp32 (`KERNELS`, chosen by `pick_kernel` on the layer shapes at hand), else the
weight dequantized per call (`x @ (q · s)ᵀ`: no faster than fp32, but exact to the same figures).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.generate.decoder import Decoder

KERNELS = ("int8pack", "dequantize")


class Int8WeightLinear(nn.Module):
    """y = x · (q · s)ᵀ + b, with q int8 [out, in] and s [out] in the layer's dtype; x [..., in] → y [..., out]."""

    def __init__(self, linear: nn.Linear, kernel: str = "int8pack"):
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127  # [out]
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
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


def linear_names(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s `nn.Linear` layers, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantize_int8_weights(model: nn.Module, names: Iterable[str] | None = None, *, kernel: str = "int8pack") -> list[str]:
    """Replaces the named `nn.Linear` layers of `model` (all of them by default) by `Int8WeightLinear`, in place.

    Returns:
        The names replaced, in module order.

    Raises:
        KeyError: a name that is not an `nn.Linear` of the model.
    """
    order = linear_names(model)
    chosen = order if names is None else list(names)
    unknown = [n for n in chosen if n not in set(order)]
    if unknown:
        raise KeyError(f"not linear layers of the model: {unknown[:4]}")
    for name in chosen:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, Int8WeightLinear(getattr(owner, child), kernel))
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
    """Mean KL(reference ‖ candidate) of the next-token distributions at every position of `texts`, nats."""
    from overdrive.generate.fidelity import sequence_logits

    total, count = 0.0, 0
    for i, ids in enumerate(texts):
        ref = reference_logits[i] if reference_logits is not None else sequence_logits(reference, ids)
        log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(sequence_logits(candidate, ids), -1)
        total += float((log_p.exp() * (log_p - log_q)).sum())
        count += len(ids)
    return total / max(count, 1)


def search_int8_layers(reference: Decoder, texts: Sequence[Sequence[int]], *, max_mean_kl: float,
                       kernel: str = "int8pack", progress: Callable[[str], None] = lambda _: None
                       ) -> tuple[list[str], dict[str, float], float]:
    """The layers to hold in int8: each linear layer's sensitivity (mean KL with it alone in int8), then
    layers from the least sensitive, added while the whole model's mean KL stays ≤ `max_mean_kl` (each
    addition measured, not summed: errors of layers compound).

    Returns:
        (the chosen names, in module order; {name: its sensitivity, nats}; the chosen model's mean KL).
    """
    from overdrive.generate.fidelity import sequence_logits

    reference_logits = [sequence_logits(reference, ids) for ids in texts]
    sensitivity: dict[str, float] = {}
    for name in linear_names(reference):
        trial = copy_decoder(reference)
        quantize_int8_weights(trial, [name], kernel=kernel)
        sensitivity[name] = mean_kl(reference, trial, texts, reference_logits)
        progress(f"int8 sensitivity {name}: {sensitivity[name]:.2e}")
    chosen: list[str] = []
    kl = 0.0
    order = sorted(sensitivity, key=sensitivity.get)
    # Double the step while additions fit, back off when one breaks the budget: log(layers) trials per break.
    step, at = 1, 0
    while at < len(order):
        batch = order[at:at + step]
        trial = copy_decoder(reference)
        quantize_int8_weights(trial, chosen + batch, kernel=kernel)
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


def pick_kernel(shapes: Iterable[tuple[int, int]], rows: int = 1, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", repeats: int = 20) -> tuple[str | None, dict[str, float]]:
    """Which kernel reads int8 weights faster than the float layer reads its own, timed on `shapes`
    [(out, in)] at `rows` rows: ("int8pack" or None, {kernel: seconds summed over the shapes}). None: neither
    beats the float weights here (weight-only int8 then saves memory, not time)."""
    timings: dict[str, float] = {"float": 0.0, "int8pack": 0.0}
    for out_f, in_f in shapes:
        linear = nn.Linear(in_f, out_f, bias=False).to(device=device, dtype=dtype)
        packed = Int8WeightLinear(linear, "int8pack")
        x = torch.randn(rows, in_f, device=device, dtype=dtype)
        for label, layer in (("float", linear), ("int8pack", packed)):
            with torch.inference_mode():
                try:
                    for _ in range(3):
                        layer(x)
                except RuntimeError:
                    timings[label] = float("inf")
                    continue
                started = time.perf_counter()
                for _ in range(repeats):
                    layer(x)
                timings[label] += (time.perf_counter() - started) / repeats
    return ("int8pack" if timings["int8pack"] < timings["float"] else None), timings
