"""int8 dynamic quantization of Linear layers: int8 weights, activations quantized per batch
at run time (torch.ao.quantization.quantize_dynamic, FBGEMM/x86 kernels; CPU only)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import LINEAR_OPS, missing_layers_reason
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


@dataclass(frozen=True, kw_only=True)
class Int8DynamicConfig(TechniqueConfig):
    """No options: per-tensor int8 weights, dynamic per-batch uint8 activations (torch.ao defaults)."""
    name: ClassVar[str] = "int8-dynamic"


@register
class Int8Dynamic(Technique):
    fidelity_risk = 0.5  # one activation scale per tensor: the time budget's prediction weighs it (tuning.budget)
    config_cls = Int8DynamicConfig
    stage = Stage.PRECISION
    lossless = False
    group = "precision"
    compute_dtype = "int8"
    dtype_layers = (nn.Linear,)
    devices = ("cpu",)  # torch.ao dynamic quantization has CPU kernels only
    rewrites_modules = True
    description = "int8 dynamic quantization of nn.Linear (weights int8, activations per batch)"
    batch_dependence = "int8-dynamic quantizes each Linear's input with one scale for the whole batch"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        linears = [m for m in workload.model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            return missing_layers_reason(workload.model, layers="nn.Linear", ops=LINEAR_OPS,
                                         rewrites="int8-dynamic swaps nn.Linear modules for quantized ones")
        if not any(type(m) is nn.Linear for m in linears):
            kinds = sorted({type(m).__name__ for m in linears})
            return (f"not applicable: the model's {len(linears)} Linear layers are subclasses of nn.Linear "
                    f"({', '.join(kinds)}), which torch.ao's quantize_dynamic leaves alone (their forward may differ)")
        return None

    def apply(self, model, config, *, workload, device):
        linears = {name for name, m in model.named_modules() if type(m) is nn.Linear}
        called = called_linears(model, workload, device) if linears else set()
        if linears and not called:
            raise RuntimeError(f"none of the model's {len(linears)} nn.Linear layers is called as a module (the model reads "
                               "their weights itself, e.g. F.linear(x, layer.weight)), so none can be swapped for int8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization is deprecated in favour of torchao
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
            from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

            # only Linears that are called: a quantized Linear's weight is a method, and a model that reads
            # `layer.weight` itself (torchvision's Swin attention: F.linear(x, self.qkv.weight)) would fail on it
            quantized = quantize_dynamic(model, {name: default_dynamic_qconfig for name in called}, dtype=torch.qint8)
        if not any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in quantized.modules()):
            raise RuntimeError("no nn.Linear layer was quantized (quantize_dynamic swaps exact nn.Linear modules only)")
        kept = sorted(linears - called)
        if kept:
            quantized.overdrive_report = {
                "technique": self.name,
                "int8 Linear layers": f"{len(called)} of {len(linears)}; {len(kept)} stay fp32 because the model reads their "
                                      f"weights itself instead of calling them (e.g. {', '.join(kept[:2])})"}
        return quantized


def called_linears(model: nn.Module, workload: Workload, device: torch.device) -> set[str]:
    """The names of the exact nn.Linear modules of `model` that its forward calls, on a small real batch."""
    from overdrive.files.onnx import example_inputs

    called: set[str] = set()
    hooks = [m.register_forward_hook(lambda module, args, out, name=name: called.add(name))
             for name, m in model.named_modules() if type(m) is nn.Linear]
    try:
        with torch.no_grad():
            model(*(t.to(device) for t in example_inputs(workload, rows=2)))
    finally:
        for hook in hooks:
            hook.remove()
    return called
