"""Attention-head pruning for transformer encoders: whole heads removed from every layer.

Layers are Hugging Face BERT-family layers or nn.MultiheadAttention layers (torchvision ViT,
nn.TransformerEncoderLayer), as `overdrive.core.transformer` finds them; an
nn.MultiheadAttention is first replaced, losslessly, by `SplitQKVAttention` (separate q/k/v
Linears), since its packed projection cannot lose heads.

Each layer keeps the same number of heads, round((1 − ratio) × heads) (at least one), chosen
by importance:
- `activation` (the default when the workload has training samples; else `l2`): the L2 norm
  of the head's context output over the tokens of training batches × the Frobenius norm of
  its output-projection columns — the size of what the head adds to the residual stream, the
  structured form of Wanda's |W|·‖X‖ (Sun et al., "A Simple and Effective Pruning Approach
  for Large Language Models", ICLR 2024);
- `l2`: the L2 norm of the head's query/key/value rows and output-projection columns (weights only);
- `taylor`: first-order Taylor |w · ∂L/∂w| summed over those weights on labelled training
  batches (Michel et al., "Are Sixteen Heads Really Better than One?", NeurIPS 2019, rank
  heads by the loss gradient; Molchanov et al. 2019 give the Taylor form).
The q/k/v Linear layers lose the heads' rows and the output projection their columns, so the
matmuls really shrink; the attention modules' `num_attention_heads` / `all_head_size` (BERT),
torchvision's `EncoderBlock.num_heads` and the Hugging Face config are updated
(`overdrive.core.transformer`). Recovery (distillation toward the unpruned model, or
cross-entropy with labels) is `recovery.PruningTechnique`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from overdrive.core.transformer import EncoderLayer, encoder_layers, update_config
from overdrive.techniques.pruning.encoder import EncoderPruningConfig, EncoderPruningTechnique, weight_score
from overdrive.techniques.registry import register


@dataclass(frozen=True, kw_only=True)
class PruneHeadsConfig(EncoderPruningConfig):
    """EncoderPruningConfig: `ratio` is the fraction of each layer's attention heads removed."""
    name: ClassVar[str] = "prune-heads"


def head_scores(block: EncoderLayer, taylor: bool, context_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Importance of each head of `block`, float [heads]: Σ w² (or Σ |w · grad|) over its weights,
    or, given the context norms [heads × head_size], ‖context_h‖ × ‖W_out[:, h]‖_F."""
    size, heads = block.head_size, block.num_heads
    if context_norms is not None:
        out_norm = block.attention_output.weight.detach().float().pow(2).reshape(-1, heads, size).sum((0, 2)).sqrt()
        return context_norms.reshape(heads, size).pow(2).sum(1).sqrt() * out_norm
    total = torch.zeros(heads, device=block.query.weight.device)
    for linear in (block.query, block.key, block.value):
        total += weight_score(linear.weight, taylor).reshape(heads, size, -1).sum((1, 2))
        if linear.bias is not None:
            total += weight_score(linear.bias, taylor).reshape(heads, size).sum(1)
    total += weight_score(block.attention_output.weight, taylor).reshape(-1, heads, size).sum((0, 2))
    return total


@register
class PruneHeads(EncoderPruningTechnique):
    config_cls = PruneHeadsConfig
    description = ("removes whole attention heads from transformer encoders (BERT family, ViT / nn.MultiheadAttention; "
                   "smaller q/k/v/output matmuls), then recovers; opt-in")

    def output_linear(self, block):
        return block.attention_output

    def counts(self, block, config):
        return block.num_heads, max(1, round(block.num_heads * (1.0 - config.ratio)))

    def scores(self, block, taylor, activation):
        return head_scores(block, taylor, activation)

    def prepare(self, block, model):
        block.split_attention(model)  # nn.MultiheadAttention -> separate q/k/v Linears (lossless)

    def keep(self, block, kept, gram):
        block.keep_heads(kept, gram)

    def shrink_to(self, model, state, *, workload, device):
        blocks = encoder_layers(model)
        for block in blocks:
            key = block.weight_key("query")
            if key not in state:  # an nn.MultiheadAttention left packed (unpruned); else load_state_dict says what is missing
                continue
            block.split_attention(model)
            target = state[key].shape[0] // block.head_size
            if target < block.num_heads:
                block.keep_heads(torch.arange(target))
        update_config(model, blocks)
