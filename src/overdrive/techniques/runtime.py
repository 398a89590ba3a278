"""Techniques that change how the model is called, not what it computes: inference_mode,
torch.compile, and length bucketing of text batches."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from overdrive.techniques.base import BatchingPolicy, ForwardWrapper, Stage, Technique, TechniqueConfig, register
from overdrive.workloads.base import Workload


class InferenceModeModule(ForwardWrapper):
    """Runs `inner` under `torch.inference_mode()` (no autograd version counters or views tracking)."""

    def forward(self, *args):
        with torch.inference_mode():
            return self.inner(*args)


@dataclass(frozen=True, kw_only=True)
class InferenceModeConfig(TechniqueConfig):
    pass


@register
class InferenceMode(Technique):
    name = "inference-mode"
    config_cls = InferenceModeConfig
    stage = Stage.RUNTIME
    lossless = True
    description = "torch.inference_mode instead of no_grad"

    def apply(self, model, config, *, workload, device):
        return InferenceModeModule(model)


class CompileMode(str, enum.Enum):
    """torch.compile modes (https://pytorch.org/docs/stable/generated/torch.compile.html)."""

    DEFAULT = "default"
    REDUCE_OVERHEAD = "reduce-overhead"  # CUDA graphs
    MAX_AUTOTUNE = "max-autotune"


@dataclass(frozen=True, kw_only=True)
class CompileConfig(TechniqueConfig):
    """Attributes:
    mode: a torch.compile mode.
    dynamic: True compiles one graph with symbolic shapes (text, whose length varies by
        batch); False specialises on each shape; None lets torch decide after a recompile.
    """

    mode: CompileMode = CompileMode.DEFAULT
    dynamic: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "mode", CompileMode(self.mode))
        if self.dynamic not in (True, False, None):
            raise ValueError(f"CompileConfig.dynamic must be true, false or null, not {self.dynamic!r}")


@register
class Compile(Technique):
    """torch.compile with the Inductor backend. Compile time is reported apart (Measurement.compile_s)."""

    name = "compile"
    config_cls = CompileConfig
    stage = Stage.COMPILE
    lossless = False  # Inductor reorders float math; judged by the fidelity floor
    description = "torch.compile (Inductor); compile time reported apart"

    def unsupported_reason(self, workload: Workload, device: torch.device) -> str | None:
        if isinstance(workload.model, torch.jit.ScriptModule):
            return "not applicable: TorchScript modules cannot be compiled with torch.compile"
        return None

    def apply(self, model, config, *, workload, device):
        dynamic = config.dynamic if config.dynamic is not None else (True if workload.is_text else None)
        if config.mode == CompileMode.REDUCE_OVERHEAD and device.type != "cuda":
            raise RuntimeError("mode reduce-overhead uses CUDA graphs and needs a GPU")
        return torch.compile(model, backend="inductor", mode=config.mode.value, dynamic=dynamic)


@dataclass(frozen=True, kw_only=True)
class LengthBucketingConfig(TechniqueConfig):
    pass


@register
class LengthBucketing(Technique):
    """Sort text samples by token length before cutting batches, so each batch pads only to
    the longest of similar-length neighbours; outputs are returned in input order."""

    name = "length-bucketing"
    config_cls = LengthBucketingConfig
    stage = Stage.BATCHING
    lossless = True
    description = "sort text by length, pad per batch (batching)"

    def unsupported_reason(self, workload: Workload, device: torch.device) -> str | None:
        if not workload.is_text:
            return "not applicable: inputs have a fixed shape (no padding to save)"
        return None

    def batching(self, policy: BatchingPolicy, config) -> BatchingPolicy:
        return dataclasses.replace(policy, sort_by_length=True)
