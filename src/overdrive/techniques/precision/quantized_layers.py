"""Low-precision forms of one nn.Linear, for the per-layer precision search (`mixed.py`).

Every form quantises activations per row (per token for text), so a row's output never depends on
its batch-mates (int32 accumulation is exact, whatever the batch's size):

- `RowInt8Linear` (CPU, and CUDA without torchao): int8 weights, symmetric per output channel, and
  int8 activations, symmetric per row, computed at run time; `torch._int_mm` (int8 × int8 → int32)
  then one rescale. The same scheme as torchao's `Int8DynamicActivationInt8WeightConfig` (weights
  per channel, activations per token; Dettmers et al., "LLM.int8()", 2022, without the fp16
  outlier split: the search keeps outlier layers whole in higher precision instead).
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


def layer_reason(layer: nn.Module, scheme: str, device: torch.device) -> str | None:
    """Why `layer` cannot take `scheme` (per-row dynamic) on `device`, or None."""
    if type(layer) is not nn.Linear:
        return f"a subclass ({type(layer).__name__}), whose forward may differ: left in fp32"
    if device.type == "cuda" and (layer.in_features % 16 or layer.out_features % 16):
        return f"{layer.in_features}→{layer.out_features}: CUDA int8/fp8 kernels need sizes that are multiples of 16"
    return None


def describe_layer(layer: nn.Module) -> str:
    """"in→out" for a Linear, "C→O k×k" for a convolution."""
    if isinstance(layer, nn.Conv2d):
        return f"{layer.in_channels}→{layer.out_channels} conv {'×'.join(map(str, layer.kernel_size))}"
    return f"{layer.in_features}→{layer.out_features}"


def quantized_module(layer: nn.Module, scheme: str, device: torch.device) -> nn.Module:
    """`layer`'s `scheme` form on `device` (a new module; `layer`, an nn.Linear, is left as it is).

    Raises:
        RuntimeError: an unknown scheme, or one that cannot run here (`layer_reason`, `fp8_reason`).
    """
    if scheme not in SCHEMES:
        raise RuntimeError(f"unknown precision scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    reason = layer_reason(layer, scheme, device) or (fp8_reason(device) if scheme == "fp8" else None)
    if reason:
        raise RuntimeError(f"cannot take {scheme}: {reason}")
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
    """Replace the nn.Linear layers `names` of `model` (in place) by their `scheme` form.

    Args:
        names: module paths as `model.named_modules()` gives them.
        scheme: "int8" (per-row dynamic activations, per-channel weights) or "fp8" (CUDA, e4m3, per row).

    Returns:
        `model`, changed in place.

    Raises:
        RuntimeError: a name is not a plain nn.Linear of `model`, or the scheme cannot run here.
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
    """Put `module` at path `name` of `model`, and at every other path that holds the same layer (a layer
    reached under two names, as tied or aliased layers are, is switched everywhere)."""
    old = model.get_submodule(name)
    paths = [path for path, m in model.named_modules(remove_duplicate=False) if m is old and path] or [name]
    for path in paths:
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, module)
