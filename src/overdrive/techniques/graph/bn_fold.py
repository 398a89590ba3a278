"""BatchNorm folding: a graph rewrite that keeps the math (eval mode only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from overdrive.core.errors import one_line
from overdrive.core.workload import Workload, eval_mode
from overdrive.techniques.registry import ForwardWrapper, Stage, Technique, TechniqueConfig, register

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def num_batchnorm(model: nn.Module) -> int:
    return sum(isinstance(m, _BN) for m in model.modules())


@dataclass(frozen=True, kw_only=True)
class BatchNormFoldConfig(TechniqueConfig):
    name: ClassVar[str] = "bn-fold"


@register
class BatchNormFold(Technique):
    """Fold each eval-mode BatchNorm into the conv (or Linear) that feeds it: W' = W·γ/σ, b' = (b−μ)·γ/σ + β.

    Uses torch.fx tracing and `torch.fx.experimental.optimization.fuse` (which folds only
    when the conv's output feeds nothing but the BatchNorm). Raises RuntimeError when no pair
    could be folded, so the tuner reports it rather than keeping a no-op.
    """

    config_cls = BatchNormFoldConfig
    stage = Stage.GRAPH
    lossless = True
    rewrites_modules = True
    description = "fold BatchNorm into the preceding conv (eval mode, via torch.fx)"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if num_batchnorm(workload.model) == 0:
            return "not applicable: the model has no BatchNorm layers"
        return None

    def apply(self, model, config, *, workload, device):
        if isinstance(model, ForwardWrapper):  # fold inside autocast / layout wrappers, which fx cannot trace
            model.inner = self.apply(model.inner, config, workload=workload, device=device)
            return model
        from torch.fx.experimental.optimization import fuse

        before = num_batchnorm(model)
        try:
            folded = fuse(eval_mode(model), inplace=False)
        except Exception as exc:  # fx cannot trace data-dependent control flow
            raise RuntimeError(f"torch.fx could not trace the model: {one_line(exc)}") from None
        after = num_batchnorm(folded)
        if after == before:
            raise RuntimeError(f"found {before} BatchNorm layer(s) but none directly after a conv or Linear")
        return folded
