"""Unstructured magnitude pruning: the smallest weights set to zero, for model size only.

Zeroes the fraction `ratio` of the weights of every conv and Linear layer (except the output
layer) with the smallest magnitude, per layer or globally (`torch.nn.utils.prune`,
L1-unstructured; Han et al., "Learning both Weights and Connections for Efficient Neural
Networks", NeurIPS 2015). The masks stay in force during the recovery fine-tune, then are
made permanent. Dense kernels multiply zeros as fast as any other number, so this does not
make the model faster; its report gives the size of the weights compressed with zlib before
and after, which is what it buys (a smaller download or checkpoint).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import CONV_OPS, LINEAR_OPS, missing_layers_reason
from overdrive.techniques.pruning.channels import output_layers
from overdrive.techniques.pruning.recovery import PruningConfig, PruningTechnique, example_inputs
from overdrive.techniques.registry import register

_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)


@dataclass(frozen=True, kw_only=True)
class PruneUnstructuredConfig(PruningConfig):
    """Attributes (and PruningConfig's fine-tune fields):
    ratio: fraction of the weights to zero, in (0, 1).
    global_pruning: rank weights across all layers (uneven per-layer sparsity) instead of per layer.
    """
    name: ClassVar[str] = "prune-unstructured"

    ratio: float = 0.5
    global_pruning: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"PruneUnstructuredConfig.ratio must be in (0, 1), got {self.ratio}")


def compressed_weight_bytes(model: nn.Module) -> int:
    """Bytes of all conv/Linear weights compressed with zlib (level 1): the size pruning can save."""
    compressor = zlib.compressobj(1)
    total = 0
    for m in model.modules():
        if isinstance(m, _LAYERS):
            total += len(compressor.compress(m.weight.detach().float().cpu().contiguous().numpy().tobytes()))
    return total + len(compressor.flush())


def weight_sparsity(model: nn.Module) -> float:
    """Fraction of conv/Linear weight entries that are exactly zero."""
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, _LAYERS)]
    return sum(int((w == 0).sum()) for w in weights) / max(1, sum(w.numel() for w in weights))


@register
class PruneUnstructured(PruningTechnique):
    config_cls = PruneUnstructuredConfig
    shrinks_layers = False
    description = ("zeroes the smallest weights (size only: dense kernels are not faster on zeros), "
                   "then recovers with the masks held; opt-in")

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not any(isinstance(m, _LAYERS) for m in workload.model.modules()):
            return missing_layers_reason(workload.model, layers="conv / nn.Linear", ops=CONV_OPS + LINEAR_OPS,
                                         rewrites="prune-unstructured masks the weights of conv and Linear modules")
        return None

    def prune(self, model, config, *, workload, device):
        head = set(map(id, output_layers(model, example_inputs(workload, device))))
        layers = [(m, "weight") for m in model.modules() if isinstance(m, _LAYERS) and id(m) not in head]
        size_before = compressed_weight_bytes(model)
        if config.global_pruning:
            torch_prune.global_unstructured(layers, pruning_method=torch_prune.L1Unstructured, amount=config.ratio)
        else:
            for module, name in layers:
                torch_prune.l1_unstructured(module, name, amount=config.ratio)
        return {
            "compressed_weight_bytes_before": size_before,
            "note": "unstructured zeros do not speed up dense kernels; this buys size only",
        }

    def finalize(self, model):
        for module in model.modules():
            if isinstance(module, _LAYERS) and torch_prune.is_pruned(module):
                torch_prune.remove(module, "weight")
        return {"weight_sparsity": weight_sparsity(model), "compressed_weight_bytes_after": compressed_weight_bytes(model)}

    def shrink_to(self, model, state, *, workload, device):
        """Nothing to reshape: the shapes never change."""

    def report_parts(self, report):
        return [*super().report_parts(report),
                f"{report['weight_sparsity']:.0%} of weights zero; zlib-compressed weights "
                f"{report['compressed_weight_bytes_before'] / 1e6:,.2f} → {report['compressed_weight_bytes_after'] / 1e6:,.2f} MB; "
                "dense kernels are not faster on zeros (size only)"]
