"""FFN-width pruning for transformer encoders: intermediate neurons removed from every layer.

Layers are Hugging Face BERT-family layers (intermediate.dense, output.dense) or
nn.MultiheadAttention layers with a two-Linear MLP (torchvision ViT's mlp[0] / mlp[3],
nn.TransformerEncoderLayer's linear1 / linear2), as `overdrive.core.transformer` finds them.

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

from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.transformer import EncoderLayer, encoder_layers, update_config
from overdrive.techniques.pruning.encoder import EncoderPruningConfig, EncoderPruningTechnique, kept_count, weight_score
from overdrive.techniques.registry import register


@dataclass(frozen=True, kw_only=True)
class PruneFFNConfig(EncoderPruningConfig):
    """EncoderPruningConfig, where `ratio` is the fraction of each layer's intermediate width
    removed, plus:
    round_to: the kept width is a multiple of this.
    """
    name: ClassVar[str] = "prune-ffn"

    round_to: int = 64

    def __post_init__(self):
        super().__post_init__()
        if self.round_to < 1:
            raise ValueError(f"PruneFFNConfig.round_to must be ≥ 1, got {self.round_to}")


def neuron_scores(block: EncoderLayer, taylor: bool, activation_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each intermediate neuron of `block`, float [width]."""
    if activation_norms is not None:
        return activation_norms * block.output.weight.detach().float().pow(2).sum(0).sqrt()
    total = weight_score(block.intermediate.weight, taylor).sum(1) + weight_score(block.output.weight, taylor).sum(0)
    if block.intermediate.bias is not None:
        total += weight_score(block.intermediate.bias, taylor)
    return total


@register
class PruneFFN(EncoderPruningTechnique):
    config_cls = PruneFFNConfig
    description = ("narrows the feed-forward (intermediate) layers of transformer encoders (BERT family, "
                   "ViT / nn.MultiheadAttention), then recovers; opt-in")

    def output_linear(self, block):
        return block.output

    def counts(self, block, config):
        width = block.intermediate.out_features
        return width, kept_count(width, config.ratio, config.round_to)

    def scores(self, block, taylor, activation):
        return neuron_scores(block, taylor, activation)

    def keep(self, block, kept, gram):
        block.keep_ffn(kept, gram)

    def shrink_to(self, model, state, *, workload, device):
        blocks = encoder_layers(model)
        for block in blocks:
            if block.weight_key("query") in state:  # the state comes after a head-pruning step
                block.split_attention(model)
            target = state[block.weight_key("intermediate")].shape[0]
            if target < block.intermediate.out_features:
                block.keep_ffn(torch.arange(target))
        update_config(model, blocks)
