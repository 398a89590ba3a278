"""overdrive's own decoder for the Llama family (Llama, Mistral, Qwen2), with a pre-allocated KV cache.

The generation engine owns its attention so that the KV cache (its layout, its precision, later its
pages) is overdrive's, not a library's: Hugging Face's cache classes and keyword names change between
releases (`past_key_values` became `cache` in transformers 5). The module names follow Hugging Face's
`LlamaForCausalLM`, so its state dict loads as it is (`Decoder.from_hf`), and its greedy tokens are
tested against `generate`'s (`tests/test_generate.py`).

The architecture (Touvron et al., 2023): token embedding; per layer, RMSNorm, self-attention with rotary
position embeddings (RoPE, Su et al., 2021) and grouped key/value heads (GQA, Ainslie et al., 2023), a
residual, RMSNorm, a SwiGLU MLP (Shazeer, 2020), a residual; a final RMSNorm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FAMILIES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderConfig:
    """The shapes of a Llama-family decoder. `attention_bias`: q/k/v projections with a bias (Qwen2)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 2048
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_hf(cls, config) -> DecoderConfig:
        """From a Hugging Face config of the Llama family.

        Raises:
            ValueError: another model type, a RoPE scaling other than the default, or a sliding window.
        """
        kind = getattr(config, "model_type", None)
        if kind not in FAMILIES:
            raise ValueError(f"overdrive's decoder takes the {', '.join(FAMILIES)} families; this model is {kind!r}")
        rope = getattr(config, "rope_parameters", None) or {}
        scaling = getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"RoPE of type {rope_type!r} is not supported yet (only the default)")
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or (kind == "mistral" and window
                                                             and window < config.max_position_embeddings):
            raise ValueError("sliding-window attention is not supported yet")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not supported yet")
        activation = getattr(config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"the MLP's activation {activation!r} is not supported yet (only SiLU, SwiGLU's)")
        if kind != "qwen2" and getattr(config, "attention_bias", False):
            raise ValueError("attention biases on a Llama or Mistral (q/k/v/o projections) are not supported yet")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps, rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))),
            max_positions=config.max_position_embeddings,
            attention_bias=bool(getattr(config, "attention_bias", kind == "qwen2")),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))


class KVCache:
    """Keys and values of every layer, allocated once: `keys[i]`, `values[i]` [B, kv_heads, S, head_dim]
    for batch B and S slots, in `dtype`. A batch's prompts end at the same slot (left padding, masked), so
    all its sequences write at the same slot each step.

    With `dtype` torch.int8 the cache holds each token's key and value per head in int8 with one float32
    scale each (`key_scales[i]`, `value_scales[i]` [B, kv_heads, S, 1]: symmetric absmax over head_dim,
    as per-token KV quantization in vLLM and KIVI's value cache), a quarter of fp32's bytes plus the scales;
    attention reads them dequantized. A token is quantized on its own, so no row depends on its batch-mates.
    """

    def __init__(self, config: DecoderConfig, batch_size: int, slots: int, *, device: torch.device | str,
                 dtype: torch.dtype):
        shape = (batch_size, config.num_kv_heads, slots, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.quantized = dtype == torch.int8
        scales = (batch_size, config.num_kv_heads, slots, 1)
        self.key_scales = [torch.ones(scales, device=device) if self.quantized else None for _ in self.keys]
        self.value_scales = [torch.ones(scales, device=device) if self.quantized else None for _ in self.keys]
        self.batch_size, self.slots = batch_size, slots

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Layer i's (keys, values, key scales, value scales); the scales are None unless int8."""
        return self.keys[i], self.values[i], self.key_scales[i], self.value_scales[i]

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *(t for t in (*self.key_scales, *self.value_scales) if t is not None))
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], float32 scale [..., 1]): symmetric absmax per vector."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def _store(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """Writes x [B, kv, T, D] at `slots` and returns the whole cache in `dtype` for attention."""
    if scales is None:
        cache.index_copy_(2, slots, x.to(cache.dtype))
        return cache.to(dtype)
    q, scale = quantize_per_token(x)
    cache.index_copy_(2, slots, q)
    scales.index_copy_(2, slots, scale)
    return (cache.float() * scales).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: tuple, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [B, 1, T, head_dim]; kv the layer's cache (`KVCache.layer`: keys and values
        [B, kv, S, head_dim] and their int8 scales or None), written at `slots` int64 [T]; mask [B, 1, T, S] bool
        (True: attend)."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys, values, key_scales, value_scales = kv
        keys, values = _store(keys, key_scales, slots, k, q.dtype), _store(values, value_scales, slots, v, q.dtype)
        # Query head h reads key/value head h // (heads / kv_heads), as Hugging Face's repeat_kv pairs them.
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Decoder(nn.Module):
    """A Llama-family causal LM over a `KVCache`; module names as Hugging Face's `LlamaForCausalLM`."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> Decoder:
        """The same weights in overdrive's decoder, in the Hugging Face model's dtype and device.

        Raises:
            ValueError: a model outside the Llama family or with features not supported (`DecoderConfig.from_hf`),
                or weights that do not match the config's shapes.
        """
        config = DecoderConfig.from_hf(hf_model.config)
        reference = next(hf_model.parameters())
        decoder = cls(config).to(device=reference.device, dtype=reference.dtype)
        state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
        missing, unexpected = decoder.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"the weights do not match a {type(hf_model).__name__}: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        decoder.inv_freq = decoder.inv_freq.to(device=reference.device, dtype=torch.float32)
        return decoder.eval()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, slots: torch.Tensor,
                mask: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Runs `tokens` [B, T] (int64) at RoPE `positions` [B, T], writing their keys and values at cache
        `slots` int64 [T] (the same for every row); `mask` [B, 1, T, S] bool says which slots each token
        attends to.

        Returns:
            logits float32 [B, T, vocab] ([B, 1, vocab] with `last_only`).
        """
        x = self.model.embed_tokens(tokens)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, head_dim]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache.layer(i), slots, mask)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()
