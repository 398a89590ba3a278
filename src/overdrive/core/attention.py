"""Multi-head attention with separate query/key/value Linears: a prunable nn.MultiheadAttention.

`nn.MultiheadAttention` packs the three input projections into one `in_proj_weight` [3E, E]
and its forward requires embed_dim = num_heads × head_dim, so heads cannot be removed from it
in place. `SplitQKVAttention.from_multihead` copies its weights into three `nn.Linear` (query,
key, value) and an output Linear, losslessly; the number of heads then follows from the
projection widths (width ÷ head_dim), so keeping some heads is keeping their rows of q/k/v and
their columns of the output projection (`overdrive.core.transformer`). The forward has
nn.MultiheadAttention's signature and semantics (`batch_first`, unbatched inputs,
`key_padding_mask`, `attn_mask`, `need_weights` with per-head or averaged weights,
`is_causal`), following `torch.nn.functional.multi_head_attention_forward`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SplitQKVAttention(nn.Module):
    """Multi-head attention over `query`, `key`, `value` and `out_proj` Linears.

    Args:
        query: Linear(embed_dim → heads × head_dim).
        key: Linear(kdim → heads × head_dim).
        value: Linear(vdim → heads × head_dim).
        out_proj: Linear(heads × head_dim → embed_dim).
        head_dim: channels per head (stays fixed when heads are removed).
        batch_first: inputs and outputs are [B, L, E] (else [L, B, E]).
        dropout: dropout probability on the attention weights, in training mode only.

    The class attributes `in_proj_weight`, `in_proj_bias` (None) and `_qkv_same_embed_dim`
    (False) are read by nn.TransformerEncoderLayer's fast-path checks, which then take the
    regular path through this module's forward.
    """

    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(self, query: nn.Linear, key: nn.Linear, value: nn.Linear, out_proj: nn.Linear, *, head_dim: int,
                 batch_first: bool, dropout: float = 0.0):
        super().__init__()
        widths = {query.out_features, key.out_features, value.out_features, out_proj.in_features}
        if len(widths) != 1 or query.out_features % head_dim:
            raise ValueError(f"q/k/v output widths and the output projection's input width must be equal and divide by "
                             f"head_dim {head_dim}; got {query.out_features}, {key.out_features}, {value.out_features}, "
                             f"{out_proj.in_features}")
        self.query, self.key, self.value, self.out_proj = query, key, value, out_proj
        self.head_dim, self.batch_first, self.dropout = head_dim, batch_first, dropout

    @property
    def num_heads(self) -> int:
        return self.query.out_features // self.head_dim

    @property
    def embed_dim(self) -> int:
        return self.out_proj.out_features

    @classmethod
    @torch.no_grad()
    def from_multihead(cls, mha: nn.MultiheadAttention) -> SplitQKVAttention:
        """The same attention as `mha`, with its packed (or separate) input projections copied into
        three Linears and its output projection into a fourth; same device, dtype and train mode.

        Raises:
            ValueError: `mha` has `bias_k`/`bias_v` or `add_zero_attn` (extra key/value
                positions this module does not model).
        """
        if mha.bias_k is not None or mha.bias_v is not None or mha.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn cannot be split into q/k/v Linears")
        if mha._qkv_same_embed_dim:
            weights = mha.in_proj_weight.chunk(3)
        else:
            weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
        biases = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)

        def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
            out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
            out.weight.copy_(weight)
            if bias is not None:
                out.bias.copy_(bias)
            return out

        split = cls(*(linear(w, b) for w, b in zip(weights, biases)), linear(mha.out_proj.weight, mha.out_proj.bias),
                    head_dim=mha.head_dim, batch_first=mha.batch_first, dropout=mha.dropout)
        return split.train(mha.training)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `query` over `key`/`value`, as nn.MultiheadAttention.forward.

        Args:
            query: float [B, L, E] (batch_first), [L, B, E], or unbatched [L, E].
            key: float [B, S, kdim] (same layout as `query`).
            value: float [B, S, vdim].
            key_padding_mask: [B, S] (or [S] unbatched), bool (True = ignore that key) or float
                (added to the scores).
            need_weights: also return the attention weights (computed explicitly, not by SDPA).
            attn_mask: [L, S] or [B × heads, L, S], bool (True = not allowed) or float (added).
            average_attn_weights: average the returned weights over the heads.
            is_causal: a hint that `attn_mask` is the causal mask (which must still be given).

        Returns:
            (output float like `query` with E channels, weights float [B, L, S] averaged or
            [B, heads, L, S], unbatched without B; None unless `need_weights`).

        Raises:
            RuntimeError: `is_causal` without `attn_mask`, or a mask of the wrong shape.
        """
        batched = query.dim() == 3
        if not batched:  # [L, E] -> [1, L, E]
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # [L, B, E] -> [B, L, E]
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        q, k, v = self.query(query), self.key(key), self.value(value)  # [B, L, W], [B, S, W], [B, S, W]
        batch, length, width = q.shape
        source, size = k.shape[1], self.head_dim
        heads = width // size  # from the projection width: fewer after head pruning
        q = q.view(batch, length, heads, size).transpose(1, 2)  # [B, H, L, d]
        k = k.view(batch, source, heads, size).transpose(1, 2)  # [B, H, S, d]
        v = v.view(batch, source, heads, size).transpose(1, 2)  # [B, H, S, d]
        mask, is_causal = _merged_mask(attn_mask, key_padding_mask, is_causal, need_weights, q.dtype,
                                       batch=batch, heads=heads, length=length, source=source)
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * size ** -0.5) @ k.transpose(-2, -1)  # [B, H, L, S]
            if mask is not None:
                scores = scores + mask
            weights = F.softmax(scores, dim=-1)
            out = (F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights) @ v  # [B, H, L, d]
            if average_attn_weights:
                weights = weights.mean(dim=1)  # [B, L, S]
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, width))  # [B, L, E]
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights


def _float_mask(mask: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A bool mask (True = masked) as an additive mask of `dtype` (−inf there); a float mask in
    `dtype` (the projections' output dtype, bf16 under autocast, as SDPA requires)."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    if not mask.dtype.is_floating_point:
        raise RuntimeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")
    return mask.to(dtype)


def _merged_mask(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None, is_causal: bool,
                 need_weights: bool, dtype: torch.dtype, *, batch: int, heads: int, length: int,
                 source: int) -> tuple[torch.Tensor | None, bool]:
    """One additive float mask [B or 1, H or 1, L, S] from `attn_mask` and `key_padding_mask`,
    and whether SDPA may take `is_causal` instead, as multi_head_attention_forward decides."""
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint (nn.Transformer.generate_square_subsequent_mask)")
    if is_causal and key_padding_mask is None and not need_weights:
        return None, True  # SDPA builds the causal mask itself
    mask = None
    if attn_mask is not None:
        mask = _float_mask(attn_mask, dtype, "attn_mask")
        if mask.dim() == 2:
            if mask.shape != (length, source):
                raise RuntimeError(f"The shape of the 2D attn_mask is {tuple(mask.shape)}, but should be {(length, source)}.")
            mask = mask.view(1, 1, length, source)
        elif mask.dim() == 3:
            if mask.shape != (batch * heads, length, source):
                raise RuntimeError(f"The shape of the 3D attn_mask is {tuple(mask.shape)}, but should be "
                                   f"{(batch * heads, length, source)}.")
            mask = mask.view(batch, heads, length, source)
        else:
            raise RuntimeError(f"attn_mask's dimension {mask.dim()} is not supported")
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, source):
            raise RuntimeError(f"expected key_padding_mask of shape {(batch, source)}, got {tuple(key_padding_mask.shape)}")
        padding = _float_mask(key_padding_mask, dtype, "key_padding_mask").view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    return mask, False
