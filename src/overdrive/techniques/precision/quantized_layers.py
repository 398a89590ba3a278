"""Low-precision forms of one nn.Linear or nn.Conv2d, for the per-layer precision search (`mixed.py`).

Every form quantises activations per row (per token for text, per patch for a convolution), so a
row's output never depends on its batch-mates (int32 accumulation is exact, whatever the batch's size):

- `RowInt8Linear` (CPU, and CUDA without torchao): int8 weights, symmetric per output channel, and
  int8 activations, symmetric per row, computed at run time; `torch._int_mm` (int8 × int8 → int32)
  then one rescale. The same scheme as torchao's `Int8DynamicActivationInt8WeightConfig` (weights
  per channel, activations per token; Dettmers et al., "LLM.int8()", 2022, without the fp16
  outlier split: the search keeps outlier layers whole in higher precision instead).
- `RowInt8Conv2d` (CPU): the same GEMM over the convolution's patches (im2col), each patch quantised
  on its own.
- on CUDA with torchao: `Int8DynamicActivationInt8WeightConfig` and, on compute capability ≥ 8.9,
  `Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())` (e4m3), applied to the chosen
  layers only through `quantize_(..., filter_fn=...)`.

Eager, these forms are slower than fp32 on a CPU (the quantisation is separate passes); the
technique compiles the model with Inductor, which fuses them (`mixed.CompiledOnFirstCall`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

EPS = 1e-12
SCHEMES = ("int8", "fp8")
_CUDA_MIN_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows


def row_int8_matmul(rows: torch.Tensor, weight_int8: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """rows float [N, K] quantised per row to int8, times weight_int8 [K, O] → float32 [N, O], rescaled by
    the row scales and weight_scale [O]. Each output row depends on its own input row only."""
    n = rows.shape[0]
    if rows.is_cuda and n < _CUDA_MIN_ROWS:
        rows = torch.cat([rows, rows.new_zeros(_CUDA_MIN_ROWS - n, rows.shape[1])])
    scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=EPS) / 127.0
    quantized = torch.round(rows / scale).clamp(-127, 127).to(torch.int8)
    return (torch._int_mm(quantized, weight_int8).float() * scale * weight_scale)[:n]


def _weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight float [O, K] → (int8 [K, O], what _int_mm takes; float32 scales [O]), symmetric per output channel."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=EPS) / 127.0
    quantized = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.t().contiguous(), scale


class RowInt8Linear(nn.Module):
    """nn.Linear with int8 weights (per output channel) and int8 activations (per row, dynamic).

    forward: x float [..., in_features] (fp32, bf16 or fp16) -> y [..., out_features] in x's dtype;
    y = (round(x / s_x) @ round(W / s_w)ᵀ) · s_x · s_wᵀ + b, where s_x = max|x_row| / 127 and
    s_w = max|W_row| / 127. Rows are quantised alone, so each row's output is the same alone and
    in any batch.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = _weight_int8(linear.weight)
        self.register_buffer("weight_int8", weight)  # [in, out]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", linear.bias.detach().float().clone() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float()
        if rows.shape[0] == 0:
            return x.new_zeros(*shape[:-1], self.out_features)
        y = row_int8_matmul(rows, self.weight_int8, self.weight_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel weights, per-row activations"


class RowInt8Conv2d(nn.Module):
    """nn.Conv2d (groups 1, zero padding) as an int8 GEMM over its patches (im2col, `F.unfold`): int8
    weights per output channel, each patch (one output position of one image) quantised on its own.

    forward: x float [B, C, H, W] -> y [B, O, H', W'] in x's dtype, H' and W' as nn.Conv2d gives them.
    Every output position depends on its own patch only, so an image's output is the same alone and
    in any batch.
    """

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size, self.stride = tuple(conv.kernel_size), tuple(conv.stride)
        self.padding, self.dilation = tuple(conv.padding), tuple(conv.dilation)
        weight, scale = _weight_int8(conv.weight.reshape(conv.out_channels, -1))
        self.register_buffer("weight_int8", weight)  # [C·kh·kw, O]
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", conv.bias.detach().float().clone() if conv.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unbatched = x.dim() == 3
        images = (x.unsqueeze(0) if unbatched else x).float()
        b, _, h, w = images.shape
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = self.kernel_size, self.stride, self.padding, self.dilation
        h_out = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
        w_out = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
        cols = nn.functional.unfold(images, self.kernel_size, dilation=self.dilation, padding=self.padding,
                                    stride=self.stride)  # [B, C·kh·kw, L]
        rows = cols.transpose(1, 2).reshape(b * h_out * w_out, -1)
        y = row_int8_matmul(rows, self.weight_int8, self.weight_scale) if rows.shape[0] else \
            rows.new_zeros(0, self.out_channels)
        if self.bias is not None:
            y = y + self.bias
        y = y.reshape(b, h_out * w_out, self.out_channels).transpose(1, 2).reshape(b, self.out_channels, h_out, w_out)
        return (y[0] if unbatched else y).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, int8 per-channel weights, per-patch activations")


def torchao_available() -> bool:
    try:
        import torchao.quantization  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another torch
        return False
    return True


def fp8_reason(device: torch.device) -> str | None:
    """Why fp8 layers cannot run on `device`, or None."""
    if device.type != "cuda":
        return "fp8 matmuls need a CUDA GPU with compute capability ≥ 8.9 (Ada, Hopper)"
    if torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"fp8 matmuls need compute capability ≥ 8.9; this GPU has {major}.{minor}"
    if not torchao_available():
        return "fp8 layers use torchao, which is not installed (pip install torchao)"
    return None


LAYER_TYPES = (nn.Linear, nn.Conv2d)


def layer_reason(layer: nn.Module, scheme: str, device: torch.device) -> str | None:
    """Why `layer` cannot take `scheme` on `device`, or None."""
    if type(layer) not in LAYER_TYPES:
        return f"{type(layer).__name__} is not a plain nn.Linear or nn.Conv2d"
    if isinstance(layer, nn.Conv2d):
        if scheme != "int8" or device.type != "cpu":
            return f"convolutions take int8 on the CPU only (per-patch int8 GEMM); not {scheme} on {device.type}"
        if layer.groups != 1 or layer.padding_mode != "zeros" or isinstance(layer.padding, str):
            return "grouped, depthwise or non-zero-padded convolutions, or padding given as a string, are left in fp32"
        return None
    if device.type == "cuda" and (layer.in_features % 16 or layer.out_features % 16):
        return f"{layer.in_features}→{layer.out_features}: CUDA int8/fp8 kernels need sizes that are multiples of 16"
    return None


def describe_layer(layer: nn.Module) -> str:
    """"in→out" for a Linear, "C→O k×k" for a convolution."""
    if isinstance(layer, nn.Conv2d):
        return f"{layer.in_channels}→{layer.out_channels} conv {'×'.join(map(str, layer.kernel_size))}"
    return f"{layer.in_features}→{layer.out_features}"


def quantized_module(layer: nn.Module, scheme: str, device: torch.device) -> nn.Module:
    """`layer`'s `scheme` form on `device` (a new module; `layer`, an nn.Linear or nn.Conv2d, is left as it is).

    Raises:
        RuntimeError: an unknown scheme, or one that cannot run here (`layer_reason`, `fp8_reason`).
    """
    if scheme not in SCHEMES:
        raise RuntimeError(f"unknown precision scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    reason = layer_reason(layer, scheme, device) or (fp8_reason(device) if scheme == "fp8" else None)
    if reason:
        raise RuntimeError(f"cannot take {scheme}: {reason}")
    if isinstance(layer, nn.Conv2d):
        return RowInt8Conv2d(layer).to(device)
    if scheme == "fp8" or (device.type == "cuda" and torchao_available()):
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        if scheme == "fp8":
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow

            config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        else:
            config = Int8DynamicActivationInt8WeightConfig()
        holder = nn.Sequential(copy.deepcopy(layer).to(device))
        quantize_(holder, config)
        return holder[0]
    return RowInt8Linear(layer).to(device)


def quantize_layers(model: nn.Module, names: list[str], scheme: str, device: torch.device) -> nn.Module:
    """Replace the nn.Linear / nn.Conv2d layers `names` of `model` (in place) by their `scheme` form.

    Args:
        names: module paths as `model.named_modules()` gives them.
        scheme: "int8" (per-row dynamic activations, per-channel weights) or "fp8" (CUDA, e4m3, per row).

    Returns:
        `model`, changed in place.

    Raises:
        RuntimeError: a name is not a plain nn.Linear or nn.Conv2d of `model`, or the scheme cannot run here.
    """
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules:
            raise RuntimeError(f"the model has no layer {name!r} (the plan was made for another model?)")
        try:
            replacement = quantized_module(modules[name], scheme, device)
        except RuntimeError as exc:
            raise RuntimeError(f"layer {name!r} {exc}") from None
        set_module(model, name, replacement)
    return model


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` at path `name` of `model`."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
