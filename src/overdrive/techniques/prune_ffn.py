"""FFN-width pruning for BERT-style encoders: intermediate neurons removed from every layer.

Each layer keeps the same number of intermediate neurons, (1 − ratio) × width rounded to a
multiple of `round_to` (64 by default, a tensor-core and SIMD friendly width), chosen by
importance: `activation` (the default when the workload has training samples; else `l2`),
the L2 norm of the neuron's activation over the tokens of
training batches × the L2 norm of its output column (Wanda's |W|·‖X‖, Sun et al., ICLR 2024,
per neuron); `l2`, the norm of its input row (with bias) and output column; or `taylor`,
first-order Taylor |w · ∂L/∂w| on labelled training batches (Molchanov et al., CVPR 2019).
The intermediate Linear loses rows, the output Linear columns, and the config's
`intermediate_size` is updated. Recovery is `recovery.PruningTechnique`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from overdrive.techniques.base import register
from overdrive.techniques.recovery import PruningConfig, PruningTechnique, importance_gradients
from overdrive.techniques.transformer_blocks import (
    EncoderBlock,
    activation_norm,
    calibration_batches,
    find_blocks,
    input_gram,
    keep_ffn,
    kept_count,
    layer_hints,
    update_config,
)
from overdrive.workloads.base import Workload


class NeuronImportance(str, enum.Enum):
    AUTO = "auto"  # activation when the workload has training samples to calibrate on, else l2
    L2 = "l2"
    TAYLOR = "taylor"
    ACTIVATION = "activation"


@dataclass(frozen=True, kw_only=True)
class PruneFFNConfig(PruningConfig):
    """Attributes (and PruningConfig's fine-tune fields):
    ratio: fraction of each layer's intermediate width to remove, in (0, 1).
    importance: how neurons are ranked.
    round_to: the kept width is a multiple of this.
    reconstruct: refit the output Linear's kept columns by least squares on training samples so
        the layer reproduces its unpruned output (when the workload has training samples).
    """

    ratio: float = 1 / 3
    importance: NeuronImportance = NeuronImportance.AUTO
    reconstruct: bool = True
    round_to: int = 64

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "importance", NeuronImportance(self.importance))
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"PruneFFNConfig.ratio must be in (0, 1), got {self.ratio}")
        if self.round_to < 1:
            raise ValueError(f"PruneFFNConfig.round_to must be ≥ 1, got {self.round_to}")


def neuron_scores(block: EncoderBlock, taylor: bool, activation_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each intermediate neuron of `block`, float [width]."""
    if activation_norms is not None:
        return activation_norms * block.output.weight.detach().float().pow(2).sum(0).sqrt()

    def score(t: torch.Tensor) -> torch.Tensor:
        if taylor:
            return (t.detach() * t.grad).abs() if t.grad is not None else torch.zeros_like(t)
        return t.detach() ** 2

    total = score(block.intermediate.weight).sum(1) + score(block.output.weight).sum(0)
    if block.intermediate.bias is not None:
        total += score(block.intermediate.bias)
    return total


@register
class PruneFFN(PruningTechnique):
    name = "prune-ffn"
    config_cls = PruneFFNConfig
    description = "narrows the feed-forward (intermediate) layers of BERT-style encoders, then recovers; opt-in"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not find_blocks(workload.model):
            return "not applicable: no BERT-style encoder layers (intermediate.dense / output.dense) in the model"
        return None

    def prune(self, model, config, *, workload, device):
        blocks = find_blocks(model)
        importance = config.importance
        if importance is NeuronImportance.AUTO:
            importance = NeuronImportance.ACTIVATION if workload.train_samples else NeuronImportance.L2
        reconstruct = config.reconstruct and bool(workload.train_samples)
        taylor = importance is NeuronImportance.TAYLOR
        if taylor:
            importance_gradients(model, workload, device)
        activation = importance is NeuronImportance.ACTIVATION
        batches = calibration_batches(workload, device) if activation or reconstruct else None
        for block in blocks:  # in order: each layer's statistics see the layers before it already pruned
            width = block.intermediate.out_features
            keep = kept_count(width, config.ratio, config.round_to)
            if keep >= width:
                continue
            gram = input_gram(model, block.output, batches) if batches else None
            scores = neuron_scores(block, taylor, activation_norm(gram) if activation else None)
            keep_ffn(block, scores.topk(keep).indices.sort().values, gram if reconstruct else None)
        model.zero_grad(set_to_none=True)
        update_config(model, blocks)
        return {"importance": importance.value, "reconstructed": reconstruct}

    def distillation_hints(self, model, teacher):
        return layer_hints(model, teacher)

    def shrink_to(self, model, state, *, workload, device):
        blocks = find_blocks(model)
        for block in blocks:
            target = state[f"{block.name}.intermediate.dense.weight"].shape[0]
            if target < block.intermediate.out_features:
                keep_ffn(block, torch.arange(target))
        update_config(model, blocks)
