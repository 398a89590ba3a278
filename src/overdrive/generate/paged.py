"""A paged KV cache (PagedAttention, Kwon et al., 2023, as vLLM keeps it): keys and values live in one pool of
fixed-size blocks allocated once; each sequence holds a block table (the pool blocks its tokens occupy, in order),
takes a block when its last one fills and gives all of them back when it ends, so memory is held for the tokens a
sequence has, not for the longest it might reach (at most `block_size` - 1 slots wasted per sequence).

The pool is flat: slot s of block b is row b · block_size + s. A forward writes each new token at its own row
(`slots` [B, T]) and reads each sequence's tokens back in order through `read_index` [B, S] (its block table
expanded to rows), gathered into the [B, kv, S, head_dim] that scaled-dot-product attention takes. Block 0 is never
handed out: rows of a batch padded to a compiled size write there and read it, and their outputs are dropped.
"""

from __future__ import annotations

import torch

from overdrive.generate.decoder import DecoderConfig, read, write


class BlockPool:
    """The free list of a pool of `num_blocks` blocks; block 0 is the scratch block and never handed out.

    Raises:
        ValueError: fewer than two blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: blocks 1, 2, ... first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """The blocks a sequence can ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    def allocate(self) -> int | None:
        """A free block's id, or None when none is free."""
        return self._free.pop() if self._free else None

    def free(self, blocks: list[int]) -> None:
        """Gives `blocks` back.

        Raises:
            ValueError: a block freed twice or one that is not the pool's (a scheduler bug, never silent)."""
        held = set(self._free)
        for b in blocks:
            if not 0 < b < self.num_blocks or b in held:
                raise ValueError(f"block {b} freed twice or not of this pool")
            held.add(b)
        self._free.extend(reversed(blocks))


class PagedKVCache:
    """Every layer's keys and values in one pool of `num_blocks` × `block_size` slots: `keys[i]`, `values[i]`
    [num_blocks · block_size, kv_heads, head_dim] in `dtype` (torch.int8: per-token int8 with float32 scales
    [num_blocks · block_size, kv_heads, 1], as `KVCache`). Set `read_index` int64 [B, S] (the pool rows of each
    sequence's first S tokens) before a forward; `update` writes the new tokens and returns the gathered keys and
    values."""

    def __init__(self, config: DecoderConfig, num_blocks: int, block_size: int, *, device: torch.device | str,
                 dtype: torch.dtype):
        rows = num_blocks * block_size
        shape = (rows, config.num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        quantized = dtype == torch.int8
        scales = (rows, config.num_kv_heads, 1)
        self.key_scales = [torch.ones(scales, device=device) if quantized else None for _ in self.keys]
        self.value_scales = [torch.ones(scales, device=device) if quantized else None for _ in self.keys]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.read_index = torch.zeros((1, block_size), dtype=torch.long, device=device)

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes layer i's k, v [B, kv, T, head_dim] at pool rows `slots` int64 [B, T] and returns the keys and
        values at `read_index` [B, S], as [B, kv, S, head_dim] in `dtype`."""
        b, kv, t, d = k.shape
        rows = slots.reshape(-1)
        out = []
        for pool, scales, x in ((self.keys[i], self.key_scales[i], k), (self.values[i], self.value_scales[i], v)):
            write(pool, scales, 0, rows, x.transpose(1, 2).reshape(b * t, kv, d))
            index = self.read_index.reshape(-1)
            gathered = read(pool.index_select(0, index),
                            None if scales is None else scales.index_select(0, index), dtype)
            out.append(gathered.view(b, -1, kv, d).transpose(1, 2))
        return out[0], out[1]

    def nbytes(self) -> int:
        tensors = (*self.keys, *self.values, *(t for t in (*self.key_scales, *self.value_scales) if t is not None))
        return sum(t.numel() * t.element_size() for t in tensors)

    def bytes_per_slot(self) -> int:
        """One token's keys and values over every layer, scales included."""
        return self.nbytes() // (self.num_blocks * self.block_size)
