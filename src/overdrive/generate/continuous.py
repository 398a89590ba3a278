"""Continuous batching (iteration-level scheduling, Orca: Yu et al., OSDI 2022) over a paged KV cache (vLLM).

The running batch is formed again at every decode step: a request joins as soon as a row and the KV blocks for its
prompt are free (first come, first served), and leaves the step after its last token, giving its blocks back, so
a batch stays full while answers of different lengths finish. The requests joining at a step are prefilled together
(one forward, left-padded, each into its own blocks), then decode one token per step with the others. A step
prefills at most `max_prefill_tokens` prompt tokens: a longer prompt, or the rest of the budget, is prefilled in
chunks over the following steps (chunked prefill, Sarathi: Agrawal et al., 2023), so a long prompt joining delays
the running sequences' next token by one chunk's forward at most, not by its whole prompt's. When a running sequence needs a block
and none is free, the latest-admitted sequence is preempted: its blocks are freed and it waits at the head of the
queue, to be prefilled again over its prompt and the tokens it had (recomputation, as vLLM's default), keeping its
sampling generator, so its answer is the one it would have had.

Prefix caching (vLLM's automatic prefix caching): each block whose slots all hold computed keys and values is
registered in the pool under the exact tokens it and every block before it hold (`BlockPool`); a sequence admitted
later takes the registered blocks its context starts with, held by others or kept after their sequences ended,
and prefills only the rest (always its last token, whose logits it needs). A shared block is never written again:
a sequence writes only at positions after those it took. A preempted sequence finds its own blocks again unless
they were needed meanwhile.

Each sequence reads only its own blocks at its own positions (0 up to its length; prefill's padding positions are
masked out and write to a scratch block); its batch-mates change nothing but the floating-point summation order of the shared matrix products, and each request samples
from its own seeded `torch.Generator`, so a request alone and in a busy batch gives the same tokens (a test).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from overdrive.generate.decoder import Decoder
from overdrive.generate.engine import Completion, Generator, SamplingParams, TokenLogprob, sample_next, token_logprob
from overdrive.generate.paged import BlockPool, PagedKVCache


@dataclass
class TokenEvent:
    """One step's news for a request: the token it produced (`token_id`), its `TokenLogprob` when the request asked
    for logprobs, and its `Completion` when that token ended it (`finished`; None while it runs). `token_id` -1: no
    token, the request was ended from outside (`ContinuousGenerator.abort`; `finished` says why)."""

    request_id: int
    token_id: int
    finished: Completion | None = None
    logprob: TokenLogprob | None = None


@dataclass
class SchedulerStats:
    """Counters since the generator was made: decode `steps`, `preemptions`, the most sequences running at once,
    the most KV blocks in use, and the slots the running sequences held against those their tokens fill (summed over
    decode steps; `kv_waste` is the share held but empty, at most block_size - 1 slots per sequence), and the context
    tokens admitted sequences asked the prefix cache for (`prefix_queries`) against those it held (`prefix_hits`)."""

    steps: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_blocks: int = 0
    slots_held: int = 0
    slots_filled: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def kv_waste(self) -> float:
        return 1 - self.slots_filled / self.slots_held if self.slots_held else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the context tokens of admitted sequences whose keys and values came from the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class _Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    completion: Completion
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # tokens whose keys and values are in the cache; the last chosen token is fed next step
    registered: int = 0  # its leading blocks registered in the prefix cache
    parent: int = -1  # the content id of the last of them (-1: none)

    @property
    def context(self) -> list[int]:
        """What its prefill puts in the cache: the prompt, and a preempted sequence's tokens but the last (which
        the next decode step feeds)."""
        return self.prompt + self.completion.token_ids[:-1]


def _available_memory(device: torch.device) -> int:
    """Bytes free on `device` (CUDA: the driver's free memory; CPU: the system's available pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


class ContinuousGenerator(Generator):
    """A `Generator` that batches continuously (the module docstring): `submit` requests, call `step` for each
    decode step's `TokenEvent`s, or `generate` a list of prompts in one call.

    Args:
        model, tokenizer, cache_dtype, compile, defaults: as `Generator`'s (compile: the decode step, at batch
            sizes rounded up to a power of two and attention spans to a multiple of `SLOT_ROUNDING`, so a few
            graphs serve every batch).
        max_batch_size: sequences decoding together at most.
        block_size: KV slots per block. Small by default: attention here gathers the pool's rows one by one (no
            kernel that wants large pages), so a block of 2 costs no measurable speed, wastes at most one slot per
            sequence and lets the prefix cache share prompts at every second token (vLLM's GPU default is 16;
            SGLang's RadixAttention shares single tokens); the measurements are in benchmarks/RESULTS.md.
        num_blocks: blocks in the pool (one is scratch). Default: enough for `max_batch_size` sequences of the
            model's full context, capped at `kv_memory_fraction` of the device's free memory.
        kv_memory_fraction: see num_blocks.
        max_prefill_tokens: prompt tokens prefilled in one step at most (requests joining together are prefilled in
            one forward; a longer prompt is prefilled in chunks of at most this many over several steps), so joining
            requests stall the running ones little.
        scheduling: "continuous" (default), or "static" — a batch is admitted only when the last one has ended
            entirely (rows that end early wait for the longest, as static batching does); for comparison.
        prefix_caching: reuse the blocks of a context's leading tokens computed before (the module docstring).
        pad_to_compiled: with `compile`, run a decode step at the smallest batch size and span already compiled that
            holds it (padding rows and masked slots), compiling a new graph only when none does, as vLLM pads a
            batch up to a captured CUDA graph's size: an offline run, whose batch shrinks as its last prompts end,
            then compiles nothing after its warm-up; a server (off: the default) keeps small batches small.

    Raises:
        ValueError: max_batch_size, block_size or max_prefill_tokens not an integer ≥ 1, a speculative generator
            asked for (prompt lookup verifies one sequence at a time), a pool too small for one full-context
            sequence when `num_blocks` is not given and memory is short (named).
    """

    def __init__(self, model: Decoder, tokenizer=None, *, max_batch_size: int = 16, block_size: int = 2,
                 num_blocks: int | None = None, kv_memory_fraction: float = 0.25,
                 cache_dtype: torch.dtype | None = None, compile: bool = False,
                 defaults: SamplingParams | None = None, scheduling: str = "continuous",
                 max_prefill_tokens: int = 1024, prefix_caching: bool = True, pad_to_compiled: bool = False):
        if scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling is 'continuous' or 'static', got {scheduling!r}")
        for name, value in (("max_batch_size", max_batch_size), ("block_size", block_size),
                            ("max_prefill_tokens", max_prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")
        self.scheduling, self.max_prefill_tokens, self.prefix_caching = scheduling, max_prefill_tokens, prefix_caching
        super().__init__(model, tokenizer, max_batch_size=max_batch_size, cache_dtype=cache_dtype, compile=compile,
                         defaults=defaults)
        config = model.config
        per_block = PagedKVCache(config, 1, block_size, device="meta", dtype=self.cache_dtype).nbytes()
        if num_blocks is None:
            wanted = max_batch_size * math.ceil(config.max_positions / block_size)
            affordable = int(_available_memory(self.device) * kv_memory_fraction) // per_block
            num_blocks = 1 + min(wanted, affordable)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = PagedKVCache(config, num_blocks, block_size, device=self.device, dtype=self.cache_dtype)
        self.stats = SchedulerStats()
        self.waiting: deque[_Sequence] = deque()
        self.prefilling: list[_Sequence] = []  # admitted, their blocks held, part of their prompt still to prefill
        self.running: list[_Sequence] = []  # in admission order: the last is the first preempted
        self._next_id = 0
        self.pad_to_compiled = pad_to_compiled
        self._shapes: set[tuple[int, int]] = set()  # (batch, span) of the decode steps compiled so far

    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues one request and returns its id (ids count up from 0).

        Raises:
            ValueError: a prompt `encode` refuses, or one whose prompt plus max_new_tokens exceed the model's
                positions or the whole KV pool (it could never finish)."""
        ids = self.encode(prompt)
        params = params or self.defaults
        self.check(ids, params)
        seq = _Sequence(self._next_id, ids, params, self._generator(params),
                        Completion(prompt_tokens=len(ids), logprobs=None if params.logprobs is None else []))
        self._next_id += 1
        self.waiting.append(seq)
        return seq.request_id

    def check(self, ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError when a prompt of token ids `ids` with `params` could never finish: its prompt plus
        max_new_tokens beyond the model's positions or the whole KV pool. Reads nothing that changes."""
        need = len(ids) + params.max_new_tokens
        if need > self.model.config.max_positions:
            raise ValueError(f"a prompt of {len(ids)} tokens plus {params.max_new_tokens} new ones exceeds the "
                             f"model's {self.model.config.max_positions} positions")
        if math.ceil(need / self.block_size) > self.pool.capacity:
            raise ValueError(f"a prompt of {len(ids)} tokens plus {params.max_new_tokens} new ones needs "
                             f"{math.ceil(need / self.block_size)} KV blocks; the pool holds {self.pool.capacity}")

    def cancel(self, request_id: int) -> bool:
        """Drops a waiting or running request and gives its blocks back at once (a client that went away); False
        when it is not queued or running (it ended, or was never submitted)."""
        return self.abort(request_id, "cancelled") is not None

    def abort(self, request_id: int, finish_reason: str) -> Completion | None:
        """Ends a waiting or running request now, its blocks given back at once: its `Completion` with the tokens it
        has (their text when a tokenizer is known) and `finish_reason` (e.g. "timeout"); None when it is not queued
        or running."""
        for queue in (self.waiting, self.prefilling, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.pool.free(seq.blocks)
                    seq.blocks = []
                    c = seq.completion
                    c.finish_reason = finish_reason
                    if self.tokenizer is not None:
                        c.text = self._text(c, seq.params)
                    return c
        return None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """Admits what fits, then runs one decode step for every running sequence: each request's new token, in
        the order they were produced (a joining request's first token comes from its prefill). A step that found
        nothing running returns its new requests' first tokens straight after their prefill, and they decode from
        the next step: alone, a request's time to first token is its prefill's, not a prefill and a decode step's.
        (With others running, the step decodes them too: their next tokens do not wait for a step of their own.)"""
        events: list[TokenEvent] = []
        waited_on = bool(self.running)
        self._admit(events)
        if self.running and (waited_on or not events):
            self._decode_running(events)
        return events

    @torch.no_grad()
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Completions for `prompts`, in their order (as `Generator.generate`, scheduled continuously).

        Raises:
            ValueError: as `submit`; requests still queued from `submit` (finish them with `step` first)."""
        if self.has_unfinished:
            raise ValueError("requests submitted earlier are still running: step them to the end first")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(f"generate takes a list of prompts, got {prompts!r}: wrap one prompt in a list")
        per_request = [params] * len(prompts) if params is None or isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(per_request)} sampling params for {len(prompts)} prompts")
        try:
            ids = [self.submit(p, q) for p, q in zip(prompts, per_request)]
        except ValueError:
            self.waiting.clear()
            raise
        done: dict[int, Completion] = {}
        while self.has_unfinished:
            done.update((e.request_id, e.finished) for e in self.step() if e.finished is not None)
        return [done[i] for i in ids]

    # --- scheduling -------------------------------------------------------------------------------------------

    def _admit(self, events: list[TokenEvent]) -> None:
        """Prefills, in one forward and within the step's `max_prefill_tokens`: the next chunk of each sequence
        partway through its prompt, then waiting requests while a row and the blocks for their whole context are
        free (their first chunk). A sequence whose last chunk this was starts decoding (a new request's first token
        comes from this forward)."""
        # static batching: a batch is admitted only when the last has ended (it runs until its longest answer ends)
        admit = not (self.scheduling == "static" and (self.running or self.prefilling))
        chunks: list[tuple[_Sequence, list[int]]] = []  # (sequence, the tokens this forward puts after its cached ones)
        budget = self.max_prefill_tokens
        for seq in self.prefilling:
            if budget == 0:
                break
            chunks.append((seq, seq.context[seq.cached:seq.cached + budget]))
            budget -= len(chunks[-1][1])
        admitted: list[_Sequence] = []
        while admit and self.waiting and budget > 0 and \
                len(self.running) + len(self.prefilling) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            context = seq.context
            need = len(context) // self.block_size + 1  # its context and the slot of the next token
            shared = self.pool.lookup(context[:-1], self.block_size) if self.prefix_caching else []
            if self.pool.num_free - self.pool.unheld(shared) < need - len(shared):
                break  # first come, first served: it waits for blocks, and so do those behind it
            self.waiting.popleft()
            self.pool.acquire(shared)
            seq.blocks = shared + [self.pool.allocate() for _ in range(need - len(shared))]
            seq.cached, seq.registered = len(shared) * self.block_size, len(shared)
            seq.parent = self.pool.content_id(shared[-1]) if shared else -1
            self.stats.prefix_queries += len(context)
            self.stats.prefix_hits += seq.cached
            admitted.append(seq)
            chunks.append((seq, context[seq.cached:seq.cached + budget]))
            budget -= len(chunks[-1][1])
        if not chunks:
            return
        try:
            self.prefilling += admitted
            logits = self._prefill(chunks)
            done = [row for row, (seq, _) in enumerate(chunks) if seq.cached == len(seq.context)]
            fresh = [row for row in done if not chunks[row][0].completion.token_ids]
            seqs = [chunks[row][0] for row in fresh]
            tokens = self._choose(logits[fresh], seqs) if fresh else []
            chosen = dict(zip(fresh, zip(tokens, self._logprobs(logits[fresh], seqs, tokens))))
            for row in done:  # its whole context is cached: it decodes from the next step
                seq = chunks[row][0]
                self.prefilling.remove(seq)
                self.running.append(seq)
                if row in chosen:  # a new request: its first token (it may end there and leave at once)
                    self._emit(seq, *chosen[row], events)
        except BaseException:
            for seq in admitted:  # those not running are in neither queue: nobody else could free their blocks
                if seq not in self.running and seq.blocks:
                    if seq in self.prefilling:
                        self.prefilling.remove(seq)
                    self.pool.free(seq.blocks)
                    seq.blocks = []
            raise
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        self._note_blocks()

    def _prefill(self, chunks: list[tuple[_Sequence, list[int]]]) -> torch.Tensor:
        """One forward over each sequence's `chunk` of tokens, at its positions after the `cached` ones already in
        its blocks, left-padded to the longest chunk (a padding position writes to the scratch block and attends to
        one slot; its output is dropped); the logits [J, vocab] of each chunk's last token. Advances `cached`."""
        dev, j = self.device, len(chunks)
        longest = max(len(chunk) for _, chunk in chunks)
        tables = [self._rows(seq.blocks) for seq, _ in chunks]
        read_index = torch.zeros((j, max(t.numel() for t in tables)), dtype=torch.long)  # beyond its blocks: scratch
        tokens = torch.zeros((j, longest), dtype=torch.long)
        pad = torch.tensor([longest - len(chunk) for _, chunk in chunks])
        start = torch.tensor([seq.cached for seq, _ in chunks])
        for row, ((_, chunk), table) in enumerate(zip(chunks, tables)):
            read_index[row, :table.numel()] = table
            tokens[row, longest - len(chunk):] = torch.tensor(chunk)
        offset = torch.arange(longest)[None, :] - pad[:, None]  # [J, T] each token's place in its chunk
        real = offset >= 0
        position = (start[:, None] + offset).clamp(min=0)  # [J, T] its place in its sequence
        slots = read_index.gather(1, position).masked_fill(~real, 0)
        span = torch.arange(read_index.shape[1])
        mask = (real[:, :, None] & (span[None, None, :] <= position[:, :, None])) | \
            (~real[:, :, None] & (span[None, None, :] == 0))  # [J, T, S]: causal over its own tokens
        self.cache.read_index = read_index.to(dev)
        logits = self.model(tokens.to(dev), position.to(dev), self.cache, slots.to(dev), mask[:, None].to(dev),
                            last_only=True)
        for seq, chunk in chunks:
            seq.cached += len(chunk)
            self._register(seq)
        return logits[:, 0]

    def _decode_running(self, events: list[TokenEvent]) -> None:
        """One token for every running sequence, in one forward (compiled when asked: `self._decode`)."""
        self._grow_or_preempt()
        if not self.running:
            return
        b, dev, size = len(self.running), self.device, self.block_size
        padded = 1 << (b - 1).bit_length() if self.compiled else b  # a few compiled batch sizes
        padded = min(max(padded, b), max(self.max_batch_size, b))
        span = max(s.cached + 1 for s in self.running)
        span = -(-span // size) * size
        if self.compiled:
            span = -(-span // self.SLOT_ROUNDING) * self.SLOT_ROUNDING
            fits = ([shape for shape in self._shapes if shape[0] >= padded and shape[1] >= span]
                    if self.pad_to_compiled else [])
            if fits:
                padded, span = min(fits, key=lambda shape: shape[0] * shape[1])
            self._shapes.add((padded, span))
        blocks = torch.zeros((padded, span // size), dtype=torch.long)  # block 0: scratch, masked
        for row, s in enumerate(self.running):
            blocks[row, :len(s.blocks)] = torch.tensor(s.blocks)
        read_index = (blocks[:, :, None] * size + torch.arange(size)).reshape(padded, span)
        at = torch.zeros(padded, dtype=torch.long)  # each row's position (padding rows: 0)
        at[:b] = torch.tensor([s.cached for s in self.running])
        slots = read_index.gather(1, at[:, None])  # [P, 1] the pool row of each new token
        mask = torch.arange(span)[None, :] <= at[:, None]  # [P, S]
        tokens = torch.zeros((padded, 1), dtype=torch.long)
        tokens[:b, 0] = torch.tensor([s.completion.token_ids[-1] for s in self.running])
        self.cache.read_index = read_index.to(dev)
        logits = self._decode(tokens.to(dev), at[:, None].to(dev), self.cache, slots.to(dev),
                              mask[:, None, None].to(dev))[:b, 0]
        held = sum(len(s.blocks) for s in self.running) * size
        self.stats.steps += 1
        self.stats.slots_held += held
        self.stats.slots_filled += sum(s.cached + 1 for s in self.running)
        chosen = self._choose(logits, self.running)
        logprobs = self._logprobs(logits, self.running, chosen)
        for s in list(self.running):
            s.cached += 1
            self._register(s)
        for s, token, logprob in zip(list(self.running), chosen, logprobs):
            self._emit(s, token, logprob, events)

    def _grow_or_preempt(self) -> None:
        """Gives each running sequence the block its next token needs, preempting the latest-admitted sequences
        while none is free."""
        for seq in list(self.running):
            if seq.cached < len(seq.blocks) * self.block_size or seq not in self.running:
                continue  # room in its last block, or preempted below
            while self.pool.num_free == 0:
                victim = self.running.pop()
                self.pool.free(victim.blocks)
                victim.blocks, victim.cached = [], 0  # its registered blocks stay cached: it may find them again
                self.waiting.appendleft(victim)
                self.stats.preemptions += 1
                if victim is seq:  # it was the latest: the sequences before it all have their blocks
                    return
            seq.blocks.append(self.pool.allocate())
        self._note_blocks()

    def _choose(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        """The next token of each sequence from logits [B, vocab]."""
        if all(s.params.temperature == 0 for s in seqs):
            return logits.argmax(-1).tolist()
        return [sample_next(logits[row], s.params, s.generator) for row, s in enumerate(seqs)]

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[_Sequence], chosen: list[int]) -> list[TokenLogprob | None]:
        """Each sequence's `TokenLogprob` of its chosen token when it asked for logprobs (else None)."""
        return [None if s.params.logprobs is None else token_logprob(logits[row], token, s.params.logprobs)
                for row, (s, token) in enumerate(zip(seqs, chosen))]

    def _emit(self, seq: _Sequence, token: int, logprob: TokenLogprob | None, events: list[TokenEvent]) -> None:
        c = seq.completion
        c.token_ids.append(int(token))
        if logprob is not None:
            c.logprobs.append(logprob)
        self._finish_if_done(c, seq.params)
        if c.finish_reason is not None:
            if self.tokenizer is not None:
                c.text = self._text(c, seq.params)
            if seq in self.running:
                self.running.remove(seq)
            self.pool.free(seq.blocks)
            seq.blocks = []
        events.append(TokenEvent(seq.request_id, int(token), c if c.finish_reason is not None else None, logprob))

    def _register(self, seq: _Sequence) -> None:
        """Registers in the prefix cache the blocks of `seq` that its cached tokens have filled since the last call."""
        size = self.block_size
        if not self.prefix_caching or seq.registered == seq.cached // size:
            return
        tokens = seq.prompt + seq.completion.token_ids  # the token at each position
        while seq.registered < seq.cached // size:
            k = seq.registered
            seq.parent = self.pool.register(seq.blocks[k], seq.parent, tuple(tokens[k * size:(k + 1) * size]))
            seq.registered += 1

    def _rows(self, blocks: list[int]) -> torch.Tensor:
        """The pool rows of `blocks`' slots, in order: int64 [len(blocks) · block_size] (on the host)."""
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def _note_blocks(self) -> None:
        self.stats.peak_blocks = max(self.stats.peak_blocks, self.pool.capacity - self.pool.num_free)
