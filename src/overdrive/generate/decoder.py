"""overdrive's own decoder for the Llama family (Llama, Mistral, Qwen2, Phi-3) and GPT-2, with a pre-allocated
KV cache.

The generation engine owns its attention so that the KV cache (its layout, its precision, later its
pages) is overdrive's, not a library's: Hugging Face's cache classes and keyword names change between
releases (`past_key_values` became `cache` in transformers 5). The module names follow Hugging Face's
`LlamaForCausalLM`, so its state dict loads as it is; the other families' weights are renamed and split to
those names (`Decoder.from_hf`: Phi-3's fused qkv_proj and gate_up_proj, GPT-2's Conv1D c_attn, c_proj and
c_fc, stored [in, out]). Each family's greedy tokens are tested against `generate`'s (`tests/test_generate.py`).

The Llama architecture (Touvron et al., 2023): token embedding; per layer, RMSNorm, self-attention with rotary
position embeddings (RoPE, Su et al., 2021; Phi-3 may rotate only part of each head) and grouped key/value
heads (GQA, Ainslie et al., 2023), a residual, RMSNorm, a SwiGLU MLP (Shazeer, 2020), a residual; a final
RMSNorm and the LM head. GPT-2 (Radford et al., 2019) differs in LayerNorm with biases, learned absolute position
embeddings in place of RoPE, biases on every projection and a plain GELU (tanh approximation) MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from overdrive.generate import rows_mm

if TYPE_CHECKING:
    from overdrive.generate.paged import PagedKVCache

FAMILIES = ("llama", "mistral", "qwen2", "phi3", "gpt2")
_GELU = {"gelu_new": "gelu-tanh", "gelu_pytorch_tanh": "gelu-tanh", "gelu_fast": "gelu-tanh", "gelu": "gelu"}


@dataclass(frozen=True)
class DecoderConfig:
    """The shapes of a decoder. `attention_bias`: q/k/v projections with a bias (Qwen2, GPT-2); `output_bias`: the
    output projection and the MLP with biases (GPT-2); `norm`: "rms" (RMSNorm) or "layer" (LayerNorm with a bias),
    with epsilon `norm_eps`; `positions`: "rope" (rotating the first `rotary_dim` of each head's `head_dim`; None:
    all) or "learned" (absolute position embeddings, `max_positions` of them); `mlp`: "swiglu" (gate, up, down),
    "gelu-tanh" or "gelu" (up, GELU, down); `attention_scales`: the softmax scale of each layer (None: 1/√head_dim
    for all)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_positions: int = 2048
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    family: str = "llama"
    norm: str = "rms"
    positions: str = "rope"
    rotary_dim: int | None = None
    mlp: str = "swiglu"
    output_bias: bool = False
    attention_scales: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, config) -> DecoderConfig:
        """From a Hugging Face config of one of `FAMILIES`.

        Raises:
            ValueError: another model type, or a setting the decoder would not follow (a RoPE scaling other than
                the default, a sliding window shorter than the context, an activation other than the family's,
                biases where the family has none, cross-attention).
        """
        kind = getattr(config, "model_type", None)
        if kind not in FAMILIES:
            raise ValueError(f"overdrive's decoder takes the {', '.join(FAMILIES)} families; this model is {kind!r}")
        if kind == "gpt2":
            return cls._from_gpt2(config)
        rope = getattr(config, "rope_parameters", None) or {}
        scaling = getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ValueError(f"RoPE of type {rope_type!r} is not supported yet (only the default)")
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", False) or (kind in ("mistral", "phi3") and window
                                                             and window < config.max_position_embeddings):
            raise ValueError("sliding-window attention is not supported yet")
        if getattr(config, "mlp_bias", False):
            raise ValueError("MLP biases are not supported yet")
        activation = getattr(config, "hidden_act", "silu")
        if activation not in ("silu", "swish"):
            raise ValueError(f"the MLP's activation {activation!r} is not supported yet (only SiLU, SwiGLU's)")
        if kind != "qwen2" and getattr(config, "attention_bias", False):
            raise ValueError(f"attention biases on a {kind} model (q/k/v/o projections) are not supported yet")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        partial = float(rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
            norm_eps=config.rms_norm_eps, rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 1e4))),
            max_positions=config.max_position_embeddings,
            attention_bias=bool(getattr(config, "attention_bias", kind == "qwen2")) and kind == "qwen2",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), family=kind,
            rotary_dim=None if partial == 1.0 else int(head_dim * partial))

    @classmethod
    def _from_gpt2(cls, config) -> DecoderConfig:
        if getattr(config, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention is not a causal LM overdrive's decoder takes")
        activation = getattr(config, "activation_function", "gelu_new")
        if activation not in _GELU:
            raise ValueError(f"the MLP's activation {activation!r} is not supported yet (GPT-2's GELUs only)")
        heads, hidden = config.n_head, config.n_embd
        head_dim = hidden // heads
        scale = head_dim ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        by_layer = getattr(config, "scale_attn_by_inverse_layer_idx", False)
        return cls(
            vocab_size=config.vocab_size, hidden_size=hidden, intermediate_size=config.n_inner or 4 * hidden,
            num_layers=config.n_layer, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
            norm_eps=config.layer_norm_epsilon, max_positions=config.n_positions, attention_bias=True,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)), family="gpt2", norm="layer",
            positions="learned", mlp=_GELU[activation], output_bias=True,
            attention_scales=tuple(scale / (i + 1 if by_layer else 1) for i in range(config.n_layer)))


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

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes layer i's new keys and values k, v [B, kv, T, head_dim] at `slots` int64 [T] (the same for every
        row) and returns the layer's whole keys and values [B, kv, S, head_dim] in `dtype`, for attention."""
        return (_store(self.keys[i], self.key_scales[i], slots, k, dtype),
                _store(self.values[i], self.value_scales[i], slots, v, dtype))

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *(t for t in (*self.key_scales, *self.value_scales) if t is not None))
        return sum(t.numel() * t.element_size() for t in tensors)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], float32 scale [..., 1]): symmetric absmax per vector."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8), scale


def write(cache: torch.Tensor, scales: torch.Tensor | None, dim: int, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Writes x at index `slots` of `cache`'s dimension `dim` (quantized per token, its scales beside, when `scales`
    is not None)."""
    if scales is None:
        cache.index_copy_(dim, slots, x.to(cache.dtype))
        return
    q, scale = quantize_per_token(x)
    cache.index_copy_(dim, slots, q)
    scales.index_copy_(dim, slots, scale)


def read(cache: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`cache` in `dtype`, dequantized by its `scales` when it holds int8."""
    return cache.to(dtype) if scales is None else (cache.float() * scales).to(dtype)


def _store(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, x: torch.Tensor,
           dtype: torch.dtype) -> torch.Tensor:
    """Writes x [B, kv, T, D] at `slots` and returns the whole cache in `dtype` for attention."""
    write(cache, scales, 2, slots, x)
    return read(cache, scales, dtype)


ROWS = 4  # `project`'s reduction up to this many rows, where `rows_mm.float_rows_mm` is not built (at 8, aten.mm won)


def project(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)`, x [..., in] → [..., out]; a plain float `nn.Linear` traced by torch.compile on the CPU:

    - float32, at most `rows_mm.FLOAT_ROWS` rows: `rows_mm.float_rows_mm` (AVX2 FMA, each weight row read once for
      all rows, each output summed in one order whatever the row count: a row's bits do not depend on its
      batch-mates), where `rows_mm.available()` has built it (the engine builds it before compiling);
    - else, at most `ROWS` rows: a reduction per row, y[r, n] = Σ_k x[r, k]·W[n, k] (+ b[n]), for Inductor to
      generate.

    At decode's rows PyTorch's product (oneDNN/MKL through `aten.mm`) streams the weight at under half their rate
    (`benchmarks/RESULTS.md`, "Decode at a few rows", "Decode on an AVX2 CPU"). Eager calls, other modules
    (quantised forms, a layer with hooks), more rows and other devices call `linear` itself. Float sums in another
    order than `F.linear`'s (as `F.linear`'s own at one row and at sixteen differ): not bit-equal to eager; the
    guard's near-tie counts and batch-invariance probe judge the tokens."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not (type(linear) is nn.Linear and torch.compiler.is_compiling() and x.device.type == "cpu" and rows > 0
            and not (linear._forward_hooks or linear._forward_pre_hooks)):
        return linear(x)
    if rows_mm.FLOAT_OP is not None and rows <= rows_mm.FLOAT_ROWS and x.dtype == linear.weight.dtype == torch.float32:
        y = rows_mm.FLOAT_OP(x.reshape(rows, x.shape[-1]), linear.weight)
    elif rows <= ROWS:
        flat = x.reshape(rows, 1, x.shape[-1])
        # Each row's sums kept as a column then transposed: Inductor streams the weight faster in that layout
        y = torch.cat([(flat[r] * linear.weight).sum(-1, keepdim=True).t() for r in range(rows)])  # [rows, out]
    else:
        return linear(x)
    if linear.bias is not None:
        y = y + linear.bias
    return y.reshape(*x.shape[:-1], linear.out_features)


def project_many(linears: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """`[project(linear, x) for linear in linears]` (x [..., in] → each [..., out]) in one call of a row kernel where
    every layer takes the same one (a layer's q, k and v projections; gate and up): plain float32 `nn.Linear`s
    under torch.compile on the CPU at up to `rows_mm.FLOAT_ROWS` rows through `rows_mm.float_rows_mms`, int8-rowwise
    layers through `rows_mm.int8_rows_linears` (x rounded once). One parallel region and one call instead of
    several: each output the same bits as its own layer's call. Anything else (mixed forms, hooks): layer by layer."""
    rows = x.numel() // max(x.shape[-1], 1)
    hooked = any(linear._forward_hooks or linear._forward_pre_hooks for linear in linears)
    flat = x.reshape(rows, x.shape[-1])
    if (not hooked and rows_mm.FLOATS_OP is not None and torch.compiler.is_compiling() and x.device.type == "cpu"
            and 0 < rows <= rows_mm.FLOAT_ROWS and x.dtype == torch.float32
            and all(type(linear) is nn.Linear and linear.weight.dtype == torch.float32 for linear in linears)
            and not (torch.is_grad_enabled() and (x.requires_grad or any(l.weight.requires_grad for l in linears)))):
        ys = rows_mm.FLOATS_OP(flat, [linear.weight for linear in linears])
    elif (not hooked and rows_mm.LINEARS_OP is not None
          and all(getattr(type(linear), "rows_kernel", None) == "int8_rows_linear" and linear.takes_rows_kernel(x)
                  for linear in linears)):
        ys = rows_mm.LINEARS_OP(flat, [linear.weight_int8 for linear in linears],
                                [linear.weight_sums for linear in linears], [linear.scale for linear in linears])
    else:
        return [project(linear, x) for linear in linears]
    return [(y if linear.bias is None else y + linear.bias).reshape(*x.shape[:-1], linear.out_features)
            for y, linear in zip(ys, linears)]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float | None) -> torch.Tensor:
    """Attention of q [B, H, T, D] over keys/values [B, kv, S, D] (query head h reads key/value head
    h // (H / kv), as Hugging Face's repeat_kv pairs them) under mask [B, 1, T, S] bool (True: attend), softmax
    scaled by `scale` (None: 1/√D) → [B, H, T, D]. `F.scaled_dot_product_attention`; but one query token on the
    CPU (the CPU's flash-attention kernel costs ~0.1 ms a call there, most of a small model's decode step) is
    `rows_mm.decode_attention` for float32 without gradients where it is built, eager or compiled (each key and
    value read once for a key/value head's query heads; a row's bits independent of its padding and its
    batch-mates), else, traced by torch.compile, written out (scores, a float32 softmax, the weighted sum) for
    Inductor to fuse."""
    b, heads, t, d = q.shape
    kv, slots = keys.shape[1], keys.shape[2]
    if t == 1 and q.device.type == "cpu" and not torch.compiler.is_compiling():
        rows_mm.available()  # built (or refused) once per process: eager decode the same whatever ran before
    if (t == 1 and q.device.type == "cpu" and rows_mm.ATTENTION_OP is not None
            and q.dtype == keys.dtype == values.dtype == torch.float32
            and not (torch.is_grad_enabled() and (q.requires_grad or keys.requires_grad or values.requires_grad))):
        out = rows_mm.ATTENTION_OP(q.reshape(b, heads, d), keys, values, mask.expand(b, 1, 1, slots).reshape(b, slots),
                                   scale if scale is not None else d ** -0.5)
        return out.reshape(b, heads, 1, d)
    if not (t == 1 and torch.compiler.is_compiling() and q.device.type == "cpu"):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=heads != kv)
    grouped = q.reshape(b, kv, heads // kv, d)  # T = 1: the query heads of each key/value head together
    scores = (grouped @ keys.transpose(-1, -2)).float() * (scale if scale is not None else d ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, 1, 1, S] over [B, kv, group, S]
    # a row with no slot to attend to (a padding row of a batch) gets zeros, as SDPA gives it, not NaN
    weights = torch.softmax(scores, dim=-1).masked_fill(~mask.any(-1, keepdim=True), 0.0).to(values.dtype)
    return (weights @ values).reshape(b, heads, 1, d)


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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dimensions of each head of x [B, H, T, head_dim]; the rest pass as they are."""
    dims = cos.shape[-1]
    if dims == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rotated, passed = x[..., :dims], x[..., dims:]
    return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int = 0):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.layer = layer
        self.scale = c.attention_scales[layer] if c.attention_scales else None  # None: SDPA's 1/sqrt(head_dim)
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.output_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, slots: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [B, 1, T, rotary dims] (None: learned positions, no rotation); `cache` a
        `KVCache` or `PagedKVCache`, its `update` writing the new keys and values at `slots` and returning the
        keys and values [B, kv, S, head_dim] attended to; mask [B, 1, T, S] bool (True: attend)."""
        b, t, _ = x.shape
        q, k, v = project_many((self.q_proj, self.k_proj, self.v_proj), x)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = cache.update(self.layer, k, v, slots, q.dtype)
        # Query head h reads key/value head h // (heads / kv_heads), as Hugging Face's repeat_kv pairs them.
        out = attend(q, keys, values, mask, self.scale)
        return project(self.o_proj, out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        c = config
        self.kind = c.mlp
        if c.mlp == "swiglu":
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.output_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.output_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.output_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = project_many((self.gate_proj, self.up_proj), x)
            return project(self.down_proj, F.silu(gate) * up)
        hidden = F.gelu(project(self.up_proj, x), approximate="tanh" if self.kind == "gelu-tanh" else "none")
        return project(self.down_proj, hidden)


def _norm(config: DecoderConfig) -> nn.Module:
    if config.norm == "layer":
        return nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
    return RMSNorm(config.hidden_size, config.norm_eps)


class Block(nn.Module):
    def __init__(self, config: DecoderConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = _norm(config)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = _norm(config)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, slots, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, slots, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.positions == "learned":
            self.embed_positions = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = _norm(config)


class Decoder(nn.Module):
    """A causal LM of `FAMILIES` over a `KVCache`; module names as Hugging Face's `LlamaForCausalLM` (GPT-2's learned
    positions in `model.embed_positions`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        dims = config.rotary_dim or config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dims, 2, dtype=torch.float) / dims))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_hf(cls, hf_model: nn.Module) -> Decoder:
        """The same weights in overdrive's decoder, in the Hugging Face model's dtype and device.

        Raises:
            ValueError: a model outside `FAMILIES` or with features not supported (`DecoderConfig.from_hf`),
                or weights that do not match the config's shapes.
        """
        config = DecoderConfig.from_hf(hf_model.config)
        reference = next(hf_model.parameters())
        decoder = cls(config).to(device=reference.device, dtype=reference.dtype)
        state = {k: v for k, v in hf_model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}
        try:
            state = _FROM_HF.get(config.family, lambda s, c: s)(state, config)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(f"the weights do not match a {type(hf_model).__name__}: no {exc} (the decoder takes a "
                             "causal LM with its LM head, e.g. GPT2LMHeadModel, not the bare model)") from None
        missing, unexpected = decoder.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"the weights do not match a {type(hf_model).__name__}: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        decoder.inv_freq = decoder.inv_freq.to(device=reference.device, dtype=torch.float32)
        return decoder.eval()

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache | PagedKVCache, slots: torch.Tensor,
                mask: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Runs `tokens` [B, T] (int64) at `positions` [B, T] (RoPE's, or the learned embeddings' index), writing
        their keys and values at cache `slots` (a `KVCache`: int64 [T], the same for every row; a `PagedKVCache`:
        int64 [B, T], each token's slot in the pool); `mask` [B, 1, T, S] bool says which of the S slots the cache
        returns each token attends to.

        Returns:
            logits float32 [B, T, vocab] ([B, 1, vocab] with `last_only`).
        """
        x = self.model.embed_tokens(tokens)
        cos = sin = None
        if self.config.positions == "learned":
            x = x + self.model.embed_positions(positions)
        else:
            freqs = positions[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, rotary dims]
            cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cache, slots, mask)
        if last_only:
            x = x[:, -1:]
        return project(self.lm_head, self.model.norm(x)).float()


def _phi3_state(state: dict, config: DecoderConfig) -> dict:
    """Phi-3's fused projections split to Llama's: qkv_proj [(heads + 2 kv) · head_dim, hidden] into q, k, v;
    gate_up_proj [2 · intermediate, hidden] into gate (the first half, as `Phi3MLP` chunks it) and up."""
    out = {}
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for key, value in state.items():
        if key.endswith("self_attn.qkv_proj.weight"):
            prefix = key[: -len("qkv_proj.weight")]
            q, k, v = value.split([q_rows, kv_rows, kv_rows], dim=0)
            out.update({f"{prefix}q_proj.weight": q, f"{prefix}k_proj.weight": k, f"{prefix}v_proj.weight": v})
        elif key.endswith("mlp.gate_up_proj.weight"):
            prefix = key[: -len("gate_up_proj.weight")]
            gate, up = value.split([config.intermediate_size] * 2, dim=0)
            out.update({f"{prefix}gate_proj.weight": gate, f"{prefix}up_proj.weight": up})
        else:
            out[key] = value
    return out


def _gpt2_state(state: dict, config: DecoderConfig) -> dict:
    """GPT-2's names to the decoder's; its Conv1D weights are stored [in, out] and are transposed to nn.Linear's
    [out, in]; c_attn's columns are q, k, v in that order (`GPT2Attention` splits them so). Keys not consumed pass
    through, for `load_state_dict` to name as unexpected; old releases' causal-mask buffers are dropped."""
    rest = {k: v for k, v in state.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    take = rest.pop
    out = {"model.embed_tokens.weight": take("transformer.wte.weight"),
           "model.embed_positions.weight": take("transformer.wpe.weight"),
           "model.norm.weight": take("transformer.ln_f.weight"), "model.norm.bias": take("transformer.ln_f.bias")}
    if "lm_head.weight" in rest:
        out["lm_head.weight"] = take("lm_head.weight")
    renames = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm", "attn.c_proj": "self_attn.o_proj",
               "mlp.c_fc": "mlp.up_proj", "mlp.c_proj": "mlp.down_proj"}
    for i in range(config.num_layers):
        hf, ours = f"transformer.h.{i}.", f"model.layers.{i}."
        for name, value in zip("qkv", take(f"{hf}attn.c_attn.weight").t().chunk(3, dim=0)):
            out[f"{ours}self_attn.{name}_proj.weight"] = value
        for name, value in zip("qkv", take(f"{hf}attn.c_attn.bias").chunk(3)):
            out[f"{ours}self_attn.{name}_proj.bias"] = value
        for theirs, mine in renames.items():
            weight = take(f"{hf}{theirs}.weight")
            out[f"{ours}{mine}.weight"] = weight if theirs.startswith("ln") else weight.t()
            out[f"{ours}{mine}.bias"] = take(f"{hf}{theirs}.bias")
    return {**out, **rest}


_FROM_HF = {"phi3": _phi3_state, "gpt2": _gpt2_state}
