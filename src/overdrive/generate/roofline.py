"""The decode roofline: how close a decode step comes to the memory bandwidth limit.

At small batch a decode step reads every weight once and the KV cache of every sequence, and does little
arithmetic with them, so its speed limit is bytes read ÷ the rate the device reads its memory (the read
bandwidth `core.roofline.peak_read_bandwidth` measures). The share of that limit a decoder reaches says how
much a faster kernel could still buy, and where the bytes are (weights or KV cache) says what to shrink.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from overdrive.generate.decoder import Decoder


def weight_bytes_per_step(model: Decoder) -> int:
    """Bytes of weights one decode step reads, at their storage dtype: every layer, the final norm and the LM
    head, each storage once; the token embedding only where the LM head reads it (tied weights), since a step
    looks up one row of it per sequence (and of learned position embeddings, never counted); FBGEMM's packed fp16
    weights (`quantize.Fp16WeightLinear`) at 2 bytes."""
    embedding = model.model.embed_tokens.weight
    head = getattr(model.lm_head, "weight", None)
    skip = set() if head is not None and head.untyped_storage().data_ptr() == embedding.untyped_storage().data_ptr() \
        else {embedding.untyped_storage().data_ptr()}
    if hasattr(model.model, "embed_positions"):
        skip.add(model.model.embed_positions.weight.untyped_storage().data_ptr())
    return storage_bytes(model, skip=skip)


def storage_bytes(model: torch.nn.Module, *, skip: set[int] = frozenset()) -> int:
    """Bytes of `model`'s parameters' and buffers' storages, each storage once (tied weights once), but those whose
    data pointer is in `skip`; FBGEMM's packed fp16 weights (`quantize.Fp16WeightLinear`: no tensor of theirs is a
    parameter or buffer) at 2 bytes each."""
    from overdrive.generate.quantize import Fp16WeightLinear

    seen, total = set(skip), 0
    for module in model.modules():
        if isinstance(module, Fp16WeightLinear):
            total += 2 * module.in_features * module.out_features
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in seen:
                seen.add(pointer)
                total += tensor.untyped_storage().nbytes()
    return total


def kv_bytes_per_step(model: Decoder, *, batch_size: int, slots: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one decode step reads: keys and values of every layer, every sequence, every slot the
    attention reads (the engine's attention reads all `slots` of its cache, masked); an int8 cache adds its
    float32 scale per token and head (`KVCache`)."""
    c = model.config
    per_vector = c.head_dim * torch.empty((), dtype=dtype).element_size() + (4 if dtype == torch.int8 else 0)
    return 2 * c.num_layers * batch_size * c.num_kv_heads * slots * per_vector


@dataclass
class DecodeRoofline:
    """One decode configuration against the bandwidth limit.

    Attributes:
        weight_bytes, kv_bytes: read per decode step; steps_per_s: decode steps per second (each one token for
        every sequence); achieved_bytes_per_s = (weight_bytes + kv_bytes) × steps_per_s; peak_bytes_per_s: the
        measured read bandwidth; share = achieved ÷ peak (1.0: at the limit; above 1 means the bytes are
        over-counted, e.g. weights that stay in a cache bigger than them).
    """

    weight_bytes: int
    kv_bytes: int
    steps_per_s: float
    achieved_bytes_per_s: float
    peak_bytes_per_s: float
    share: float

    def describe(self) -> str:
        return (f"{self.achieved_bytes_per_s / 1e9:.1f} of {self.peak_bytes_per_s / 1e9:.1f} GB/s ({self.share:.0%} of "
                f"the bandwidth limit; {self.weight_bytes / 1e6:.0f} MB weights + {self.kv_bytes / 1e6:.1f} MB KV per step)")

    def to_dict(self) -> dict:
        return asdict(self)


def decode_roofline(model: Decoder, *, batch_size: int, slots: int, cache_dtype: torch.dtype, steps_per_s: float,
                    peak_bytes_per_s: float | None = None) -> DecodeRoofline:
    """The roofline point of decoding at `steps_per_s` (`peak_bytes_per_s`: the measured read bandwidth of the
    model's device by default, `core.roofline.peak_read_bandwidth`)."""
    if peak_bytes_per_s is None:
        from overdrive.core.roofline import peak_read_bandwidth

        peak_bytes_per_s = peak_read_bandwidth(next(model.parameters()).device)
    weights = weight_bytes_per_step(model)
    kv = kv_bytes_per_step(model, batch_size=batch_size, slots=slots, dtype=cache_dtype)
    achieved = (weights + kv) * steps_per_s
    return DecodeRoofline(weight_bytes=weights, kv_bytes=kv, steps_per_s=steps_per_s, achieved_bytes_per_s=achieved,
                          peak_bytes_per_s=peak_bytes_per_s, share=achieved / peak_bytes_per_s)
