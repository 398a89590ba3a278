"""TensorRT as a technique, through torch-tensorrt (an optional extra: a large CUDA download that
`make` does not install; `pip install torch-tensorrt` matching the torch version).

The plan's model is compiled by `torch_tensorrt.compile(ir="dynamo")` with the batch (and a text
workload's sequence) dynamic between 1 and the plan's shapes, and the precisions the config
enables; layers TensorRT lacks stay in PyTorch. CUDA only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.workload import Workload
from overdrive.techniques.registry import TechniqueConfig, register
from overdrive.techniques.runtime.exported import ExportedRuntime


class TrtPrecision(str, enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"


@dataclass(frozen=True, kw_only=True)
class TensorRtConfig(TechniqueConfig):
    """Attributes:
    precision: the lowest precision TensorRT may pick per layer (fp32 keeps fp32; fp16/bf16 let it
        choose the faster of that and fp32, layer by layer).
    max_batch_size: the largest batch the engine accepts (rows beyond it are refused by TensorRT).
    """
    name: ClassVar[str] = "tensorrt"

    precision: TrtPrecision = TrtPrecision.FP16
    max_batch_size: int = 256

    def __post_init__(self):
        object.__setattr__(self, "precision", TrtPrecision(self.precision))


@register
class TensorRt(ExportedRuntime):
    config_cls = TensorRtConfig
    lossless = False
    devices = ("cuda",)
    package = "torch_tensorrt"
    install_hint = "an optional extra: pip install torch-tensorrt matching your torch"
    description = "TensorRT through torch-tensorrt (CUDA; fp16/bf16 where faster)"

    def dtype_of(self, config):
        """The lowest precision TensorRT may pick: the compute roof it could reach."""
        return {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(config.precision.value, "float32")

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if workload.is_torchscript:
            return "not applicable: torch-tensorrt's dynamo path cannot trace TorchScript modules"
        return super().applicability(workload, device)

    def apply(self, model, config, *, workload, device):
        import torch_tensorrt

        from overdrive.files.onnx import example_inputs, varying_dims

        example = [t.to(device) for t in example_inputs(workload)]
        dims = varying_dims(workload, len(example))
        specs = []
        for i, t in enumerate(example):
            low, high = list(t.shape), list(t.shape)
            if not workload.fixed_batch_size:
                low[0], high[0] = 1, config.max_batch_size
            for d in dims.get(i, ()):
                low[d], high[d] = 1, max(t.shape[d], 512)
            specs.append(torch_tensorrt.Input(min_shape=low, opt_shape=list(t.shape), max_shape=high, dtype=t.dtype))
        precisions = {torch.float32} | ({torch.float16} if config.precision == TrtPrecision.FP16 else set()) | (
            {torch.bfloat16} if config.precision == TrtPrecision.BF16 else set())
        return torch_tensorrt.compile(model.to(device).eval(), ir="dynamo", inputs=specs, enabled_precisions=precisions)
