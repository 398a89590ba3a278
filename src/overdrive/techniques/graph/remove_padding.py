"""Padding removal for BERT-style encoders: position-wise work runs on the real tokens only.

A padded text batch [B, L] holds T = Σ lengths real tokens and B·L − T pad tokens. Every
Linear, GELU, LayerNorm and residual add of an encoder layer works on each position alone, so
running them on the padded batch spends (B·L − T)/(B·L) of their FLOPs on pads. This rewrite
packs the real tokens into one [T, H] tensor after the embeddings and runs those ops on it;
only self-attention sees the padded [B, heads, L, head_size] layout (scattered in, with the
key-padding mask, one `scaled_dot_product_attention` call, then gathered back). The last
hidden state is scattered back to [B, L, H], with zeros at the pads.

This is the "remove padding" (Effective Transformer) of NVIDIA FasterTransformer's BERT
(docs/bert_guide.md, "remove padding"), and what ByteTransformer (Zhai et al., IPDPS 2023)
calls padding-free: it is lossless (outputs at real tokens equal the original's up to float
summation order) and gains in proportion to the padding: much on MiniLM batches in input
order, nothing after length bucketing (`benchmarks/remove_padding_cpu.py`; benchmarks/RESULTS.md,
remove_padding_cpu), so the tuner (which tries it after length bucketing) keeps it only when
it measures a gain.

An encoder qualifies when it has the Hugging Face BERT layout (`embeddings`, `encoder.layer` of
layers with attention.self.{query,key,value}, attention.output, intermediate and output, as
`overdrive.core.transformer.bert_encoder_layers` detects it), absolute position embeddings
and no decoder or cross-attention. Pruned blocks (fewer heads, narrower FFN) qualify: heads
are counted from the projection widths. The layers' own submodules are called, so the
dynamically quantized Linears of `int8-dynamic` compose. Other layouts (a ViT's
nn.MultiheadAttention layers) have fixed-shape inputs and no padding to remove.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.core.transformer import bert_encoder_layers
from overdrive.core.workload import Workload
from overdrive.techniques.graph_programs import ATTENTION_OPS, holds_graph, missing_layers_reason
from overdrive.techniques.registry import Stage, Technique, TechniqueConfig, register


def bert_encoders(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, encoder) for each BERT-layout encoder in `model` that padding removal
    can run: every layer a plain self-attention block, absolute positions, not a decoder."""
    found = []
    for parent in model.modules():
        if isinstance(parent, PaddingFreeEncoder):  # already rewritten
            continue
        for attribute, child in parent.named_children():
            if not isinstance(child, PaddingFreeEncoder) and _qualifies(child):
                found.append((parent, attribute, child))
    return found


def _qualifies(module: nn.Module) -> bool:
    """A BERT-layout encoder (`bert_encoder_layers`, quantized projections allowed) with absolute
    positions that is not a decoder."""
    if bert_encoder_layers(module, quantized=True) is None:
        return False
    config = getattr(module, "config", None)
    if config is None or getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return False
    return getattr(config, "position_embedding_type", "absolute") == "absolute"


class PaddingFreeEncoder(nn.Module):
    """Runs a BERT-layout encoder on packed real tokens (module docstring).

    forward(input_ids int64 [B, L], attention_mask int64/bool [B, L] (1 = token),
    token_type_ids int64 [B, L] or None) -> transformers' `BaseModelOutputWithPooling`:
    `last_hidden_state` float [B, L, H] (zero at pad positions) and, when the encoder has a
    pooler, `pooler_output` [B, H] (its pooler on the first token, as the original computes it);
    it also indexes as `[0]`. Eval only: in training mode, or with other keyword arguments, the
    original encoder runs.
    """

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.inner = encoder
        self.train(encoder.training)  # a new Module starts in training mode

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if kwargs or self.training:
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, **kwargs)
        hidden = self.inner.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)  # [B, L, H]
        batch, length, width = hidden.shape
        flat = hidden.reshape(batch * length, width)
        if attention_mask is None or bool(attention_mask.all()):
            positions, key_mask = None, None  # nothing to remove: a view, no gather
        else:
            positions = attention_mask.reshape(-1).nonzero().squeeze(1)  # [T]
            flat = flat.index_select(0, positions)
            key_mask = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, L], True = attend
        for layer in self.inner.encoder.layer:
            attended = self._attention(layer.attention.self, flat, positions, key_mask, batch, length)
            attended = layer.attention.output(attended, flat)  # dense, dropout, LayerNorm(· + residual)
            flat = layer.output(layer.intermediate(attended), attended)
        if positions is not None:
            flat = flat.new_zeros(batch * length, flat.shape[1]).index_copy_(0, positions, flat)
        hidden = flat.view(batch, length, -1)
        pooler = getattr(self.inner, "pooler", None)
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooler(hidden) if pooler is not None else None)

    @staticmethod
    def _attention(attention: nn.Module, tokens: torch.Tensor, positions: torch.Tensor | None,
                   key_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
        """Self-attention of packed tokens [T, H] -> [T, heads × head_size], padded only inside."""
        head_size = attention.attention_head_size
        qkv = torch.cat([attention.query(tokens), attention.key(tokens), attention.value(tokens)], dim=1)  # [T, 3W]
        if positions is not None:
            qkv = qkv.new_zeros(batch * length, qkv.shape[1]).index_copy_(0, positions, qkv)
        q, k, v = qkv.view(batch, length, 3, -1, head_size).permute(2, 0, 3, 1, 4)  # each [B, heads, L, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=getattr(attention, "scaling", None))
        out = out.transpose(1, 2).reshape(batch * length, -1)  # [B·L, W]
        return out if positions is None else out.index_select(0, positions)


@dataclass(frozen=True, kw_only=True)
class RemovePaddingConfig(TechniqueConfig):
    name: ClassVar[str] = "remove-padding"


@register
class RemovePadding(Technique):
    config_cls = RemovePaddingConfig
    stage = Stage.GRAPH
    lossless = True
    rewrites_modules = True
    description = "run a BERT encoder's Linear/LayerNorm/GELU on real tokens only (FasterTransformer's remove padding)"

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        if not workload.is_text and not workload.dynamic_dims:
            return "not applicable: inputs have a fixed shape (no padding to remove)"
        if not workload.is_text and "attention_mask" not in (workload.input_names or []):
            return ("not applicable: the model is given no attention_mask, so every position is a token (no padding "
                    "to remove)")
        if not _qualifies(workload.model) and not bert_encoders(workload.model):
            if holds_graph(workload.model):
                return missing_layers_reason(workload.model, layers="Hugging Face BERT encoder", ops=ATTENTION_OPS,
                                             rewrites="remove-padding rewrites a BERT encoder module's layers")
            return "not applicable: no Hugging Face BERT-layout encoder (embeddings + encoder.layer) in the model"
        return None

    def apply(self, model, config, *, workload, device):
        if _qualifies(model):  # the model is the encoder itself
            return PaddingFreeEncoder(model)
        encoders = bert_encoders(model)
        if not encoders:
            raise RuntimeError("no Hugging Face BERT-layout encoder found in the model")
        for parent, attribute, encoder in encoders:
            setattr(parent, attribute, PaddingFreeEncoder(encoder))
        return model
