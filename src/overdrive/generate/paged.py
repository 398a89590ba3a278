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

from collections import OrderedDict

import torch

from overdrive.generate.decoder import DecoderConfig, read, write


class BlockPool:
    """The blocks of a pool of `num_blocks`, with reference counts and a prefix cache; block 0 is the scratch block
    and never handed out.

    Prefix caching (vLLM's automatic prefix caching; SGLang's RadixAttention shares prefixes the same way): a block
    whose slots all hold computed keys and values is `register`ed under its key, (the content id of the block before
    it in its sequence, or -1 for a first block; its tokens), and gets a content id of its own. A later sequence
    whose tokens start the same way `lookup`s its leading full blocks one after another and `acquire`s them instead
    of computing them again. Content ids are never reused, so a key names one exact token prefix: after a block is
    evicted and reused, the keys that named it as a parent match nothing (exact, no hash collisions). A block whose
    references all end is *cached* when registered (kept, evicted least recently used first when a block is needed)
    and free otherwise.

    Raises:
        ValueError: fewer than two blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # popped from the end: blocks 1, 2, ... first
        self._refs = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, oldest first
        self._by_key: dict[tuple[int, tuple[int, ...]], int] = {}
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block → its key, for registered blocks
        self._content: dict[int, int] = {}  # block → its content id, for registered blocks
        self._next_content = 0

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Registered blocks nobody holds (kept for their prefix until a block is needed)."""
        return len(self._cached)

    @property
    def capacity(self) -> int:
        """The blocks a sequence can ever hold (all but the scratch block)."""
        return self.num_blocks - 1

    def allocate(self) -> int | None:
        """A free block's id (else the least recently used cached block's, its registration dropped), held once;
        None when every block is held."""
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            del self._by_key[self._key.pop(block)], self._content[block]
        else:
            return None
        self._refs[block] = 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Drops one reference to each of `blocks` (a sequence's, in order); a block nobody holds any more is cached
        if registered (the last of `blocks` evicted first), else free.

        Raises:
            ValueError: a block not held or not of this pool (a scheduler bug, never silent)."""
        for b in blocks:
            if not 0 < b < self.num_blocks or self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice or not of this pool")
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, parent: int, tokens: tuple[int, ...]) -> int:
        """Records held `block` as holding the keys and values of `tokens` (a whole block's) after the prefix whose
        last block has content id `parent` (-1: none), and returns the content id to pass as the next block's
        `parent`. When another block holds that content already, that block's id is returned and `block` stays
        unregistered (it is freed as any block)."""
        key = (parent, tokens)
        if (other := self._by_key.get(key)) is not None:
            return self._content[other]
        if block in self._key:  # registered under another key already (a scheduler bug)
            raise ValueError(f"block {block} is registered already")
        self._by_key[key], self._key[block] = block, key
        self._content[block] = self._next_content
        self._next_content += 1
        return self._content[block]

    def lookup(self, tokens: list[int], block_size: int) -> list[int]:
        """The registered blocks that hold `tokens`' leading whole blocks, in order, as far as they match (held by
        nobody yet: `acquire` them)."""
        blocks, parent = [], -1
        for start in range(0, len(tokens) - block_size + 1, block_size):
            block = self._by_key.get((parent, tuple(tokens[start:start + block_size])))
            if block is None:
                break
            blocks.append(block)
            parent = self._content[block]
        return blocks

    def unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` nobody holds (cached: counted in `num_free` until acquired)."""
        return sum(self._refs[b] == 0 for b in blocks)

    def acquire(self, blocks: list[int]) -> None:
        """Takes one reference to each of `blocks` (from `lookup`)."""
        for b in blocks:
            self._cached.pop(b, None)
            self._refs[b] += 1

    def content_id(self, block: int) -> int | None:
        """`block`'s content id when registered, else None."""
        return self._content.get(block)


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
