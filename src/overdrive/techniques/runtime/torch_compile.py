"""torch.compile with the Inductor backend; compile time is reported apart."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.workload import Workload
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


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
    name: ClassVar[str] = "compile"

    mode: CompileMode = CompileMode.DEFAULT
    dynamic: bool | None = None

    def __post_init__(self):
        object.__setattr__(self, "mode", CompileMode(self.mode))
        if self.dynamic not in (True, False, None):
            raise ValueError(f"CompileConfig.dynamic must be true, false or null, not {self.dynamic!r}")


def default_dynamic(workload: Workload) -> bool | None:
    """torch.compile's `dynamic` for a workload: True when its row shapes vary (text, dynamic dims)."""
    return True if workload.is_text or workload.dynamic_dims else None


@register
class Compile(Technique):
    """torch.compile with the Inductor backend. Compile time is reported apart (Measurement.compile_s)."""
    setup_cost = "compile"  # `tuning.budget`: what building it costs before its first timed pass

    config_cls = CompileConfig
    stage = Stage.COMPILE
    lossless = False  # Inductor reorders float math; judged by the fidelity floor
    description = "torch.compile (Inductor); compile time reported apart"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if workload.is_torchscript:
            return "not applicable: torch.compile cannot trace TorchScript modules"
        return None

    def variants(self, config, workload, device):
        """On CUDA the default mode, "reduce-overhead" (CUDA graphs) and "max-autotune" (Triton GEMM and
        convolution autotuning, and CUDA graphs), each measured alone; on the CPU the default only
        (there "max-autotune" mostly adds compile time)."""
        if device.type != "cuda" or config.mode != CompileMode.DEFAULT:
            return [config]
        return [config, *(CompileConfig(mode=mode, dynamic=config.dynamic)
                          for mode in (CompileMode.REDUCE_OVERHEAD, CompileMode.MAX_AUTOTUNE))]

    def includes(self, config) -> tuple[str, ...]:
        """reduce-overhead and max-autotune capture CUDA graphs themselves."""
        return ("cuda-graphs",) if config.mode != CompileMode.DEFAULT else ()

    def apply(self, model, config, *, workload, device):
        dynamic = config.dynamic if config.dynamic is not None else default_dynamic(workload)
        if config.mode == CompileMode.REDUCE_OVERHEAD and device.type != "cuda":
            raise RuntimeError("mode reduce-overhead uses CUDA graphs and needs a GPU")
        return torch.compile(model, backend="inductor", mode=config.mode.value, dynamic=dynamic)
