"""The generation engine: prefill and decode over a pre-allocated KV cache, for batches of prompts of
mixed lengths, with greedy and sampled decoding, stop tokens and strings, and finish reasons.

A batch's prompts are left-padded to the longest, so that they all end at the same cache slot and every
decode step writes one slot for all of them; each sequence's padding slots are masked out of every
attention and its RoPE positions count its own tokens only, so a prompt's tokens do not depend on its
batch-mates (up to floating-point summation order: a test compares a prompt alone and in a batch).
Prefill runs every prompt's tokens in one forward; a decode step runs one token per sequence. Each request's
sampling draws from its own `torch.Generator` seeded by the request, so a seeded request gives the same
tokens alone or in a batch.

With `speculative` (`generate.speculative`: `PromptLookup` or a `DraftModel`), each prompt runs alone: a
forward over its last token and k drafted ones keeps the drafts the model agrees with and its own next token
(1 to k + 1 tokens per forward), so a greedy request's tokens are greedy decoding's own, and a sampled
request's are verified by rejection sampling, distributed as the model's own sampling. Rows of a batch would
accept different counts and leave the shared cache slot, so speculation is for batch 1, where a decode step is
bound by reading the weights and a forward over k + 1 tokens costs about what one over a single token does.

Sampling follows Hugging Face's order: temperature, then top-k, then top-p (nucleus sampling,
Holtzman et al., 2020).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from overdrive.core.devices import synchronize
from overdrive.generate import rows_mm
from overdrive.generate.decoder import Decoder, KVCache
from overdrive.generate.speculative import DraftModel, PromptLookup, accepted, verify


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. `temperature` 0 is greedy (argmax; top-k/top-p ignored);
    `seed` seeds the request's own generator (None: a fresh seed from torch's global generator);
    `stop_token_ids` and `stop` take one token id / string or several; `logprobs` k (0 to `MAX_LOGPROBS`) records
    each new token's log-probability and the k most likely tokens' at its step (`Completion.logprobs`).

    Raises:
        ValueError: a value of the wrong type or out of range (named)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "seed", "logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not (_is_int(self.stop_token_ids) or isinstance(self.stop_token_ids, Sequence)):
            raise ValueError(f"stop_token_ids must be a token id or a list of them, got {self.stop_token_ids!r}")
        stop_ids = (self.stop_token_ids,) if _is_int(self.stop_token_ids) else tuple(self.stop_token_ids)
        if not all(_is_int(t) for t in stop_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers), got {self.stop_token_ids!r}")
        if not isinstance(self.stop, (str, Sequence)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop_ids))
        object.__setattr__(self, "stop", stop)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be from 0 to {MAX_LOGPROBS}, got {self.logprobs}")


MAX_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """A new token's log-probability (natural log) under the model at its step, `logprob`, and the `top` k most
    likely tokens' there, (token id, log-probability), most likely first. The model's own distribution: the
    log-softmax of its float32 logits, before temperature, top-k and top-p (as vLLM returns them by default)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprob(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """`TokenLogprob` of `token` and the k most likely tokens from one step's logits [vocab]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(logprobs, k) if k else None
    return TokenLogprob(int(token), float(logprobs[token]),
                        list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])


@dataclass
class Completion:
    """One request's answer: the new token ids (stop token included when one ended it, as Hugging Face
    returns it), their text when a tokenizer is known (cut before a stop string), and why it ended:
    "stop" (a stop token or string), "length" (max_new_tokens) or "timeout" (a server's deadline for it passed:
    `ContinuousGenerator.abort`; the tokens are those it had); `logprobs`, one `TokenLogprob` per new token
    when `SamplingParams.logprobs` asked for them (else None)."""

    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BatchTimings:
    """Where one batch's time went, in seconds: `prefill_s` from the prompts to the first token of every
    sequence (the time to first token), `step_s` each decode step after it (the inter-token latency: one
    token for every sequence still running); `prompt_tokens` the prompts' own tokens (padding apart),
    `new_tokens` the tokens produced; `slots` the KV cache's length. With speculative decoding, `drafted` and
    `accepted` count the draft tokens proposed and kept (the acceptance rate is accepted / drafted), and a
    forward that kept n tokens adds n entries of its time / n to `step_s`."""

    batch_size: int
    prompt_tokens: int
    slots: int = 0  # the KV cache's slots per sequence (what each decode step's attention reads)
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from one row's logits float32 [vocab]."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(warped_probs(logits, params).cpu(), 1, generator=generator))


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from, float32 [vocab]: softmax of one row's logits [vocab] after
    temperature, top-k and top-p (`params.temperature` > 0)."""
    # Shifted so the largest score is 0 before dividing: a tiny temperature then gives -inf, never inf or NaN.
    scores = (logits - logits.max()) / params.temperature
    if params.top_k is not None and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p is not None and params.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= params.top_p  # keep the smallest set reaching top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, -math.inf))
    return torch.softmax(scores, dim=-1)


RECOMPILE_LIMIT = 64


class _CompiledStep:
    """A compiled decode step that raises Dynamo's recompile limit (8 by default) to `limit` in the thread that
    calls it: Dynamo keeps its graphs per code object, so every compiled Generator in a process (each batch size,
    slot count, dtype and cache dtype a tuner tries, each a server meets) counts against one limit, and past it a
    fullgraph step fails. Set where it runs, as torch ≥ 2.13 keeps a config value set by the user per thread (a
    ContextVar): set once in the main thread, a server's engine thread would still see 8."""

    def __init__(self, compiled, limit: int):
        self.compiled, self.limit = compiled, limit

    def __call__(self, *args, **kwargs):
        if torch._dynamo.config.recompile_limit < self.limit:
            torch._dynamo.config.recompile_limit = self.limit
        return self.compiled(*args, **kwargs)


class Generator:
    """Generates continuations with a `Decoder`.

    Args:
        model: the decoder (`Decoder.from_hf(hf_model)`), on its device, in its dtype.
        tokenizer: optional; a Hugging Face tokenizer, for text prompts, text answers and stop strings.
        max_batch_size: prompts per batch (more are run in turn).
        cache_dtype: the KV cache's dtype (default: the model's); torch.int8 holds keys and values in int8 with a
            float32 scale per token and head (`KVCache`).
        compile: compile the decode step with torch.compile (fixed shapes: the cache's slots are rounded up to a
            multiple of `SLOT_ROUNDING`, so batches of similar lengths share one graph; CUDA graphs on a GPU
            through mode "reduce-overhead"). Prefill stays eager (its length varies).
        speculative: the drafter whose guesses are verified (`PromptLookup`, `DraftModel`): one prompt at a time;
            greedy requests keep greedy decoding's tokens, sampled ones are verified by rejection sampling.
        defaults: the `SamplingParams` of a `generate` call given none (default: greedy, 64 new tokens, ending at
            the tokenizer's end-of-text token where there is one, as Hugging Face's `generate` ends).
    """

    SLOT_ROUNDING = 128

    def __init__(self, model: Decoder, tokenizer=None, *, max_batch_size: int = 16,
                 cache_dtype: torch.dtype | None = None, compile: bool = False,
                 speculative: PromptLookup | DraftModel | None = None, defaults: SamplingParams | None = None):
        if speculative is not None and not isinstance(speculative, (PromptLookup, DraftModel)):
            raise ValueError(f"speculative must be a PromptLookup or a DraftModel (or None), got {type(speculative).__name__}")
        if isinstance(speculative, DraftModel):
            speculative.check(model)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.speculative = speculative
        eos = getattr(tokenizer, "eos_token_id", None)
        self.defaults = defaults or SamplingParams(stop_token_ids=(eos,) if _is_int(eos) else ())
        self.max_batch_size = max_batch_size
        self.compiled = compile
        self._decode = model
        if compile:
            from overdrive.generate.quantize import compile_options

            cuda = next(model.parameters()).device.type == "cuda"  # CUDA graphs there; Inductor's options on the CPU
            if not cuda:  # overdrive's row kernels (`decoder.project`, int8-rowwise) built before any trace reads them
                rows_mm.available()
            how = {"mode": "reduce-overhead"} if cuda else {"options": compile_options(model) or None}
            # One graph per batch size (powers of two) and slot count (multiples of SLOT_ROUNDING) a step may meet
            graphs = (max_batch_size.bit_length() + 1) * -(-model.config.max_positions // self.SLOT_ROUNDING)
            self._decode = _CompiledStep(torch.compile(model, dynamic=False, fullgraph=True, **how),
                                         max(RECOMPILE_LIMIT, graphs))
        reference = next(model.parameters())
        self.device, self.dtype = reference.device, reference.dtype
        self.cache_dtype = cache_dtype or self.dtype
        self.timings: list[BatchTimings] = []  # the last `generate` call's, one per batch

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids.

        Raises:
            ValueError: a text prompt without a tokenizer or that encodes to no token, an empty prompt, ids that
                are not integers or lie outside the vocabulary.
        """
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer (or pass token ids)")
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            if not ids:
                raise ValueError(f"the prompt {prompt!r} encodes to no token")
            if max(ids) >= self.model.config.vocab_size:
                raise ValueError(f"the tokenizer gives token id {max(ids)}, beyond the model's vocabulary of "
                                 f"{self.model.config.vocab_size}: the tokenizer is not the model's")
            return ids
        if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):  # a tensor or an array of ids
            prompt = prompt.tolist()
        if _is_int(prompt) or not isinstance(prompt, Sequence):
            raise ValueError(f"a prompt is a string or a sequence of token ids, got {prompt!r} (generate takes a "
                             "list of prompts: [[1, 2, 3]], not [1, 2, 3])")
        if not all(_is_int(t) for t in prompt):
            raise ValueError(f"token ids must be integers, got {[t for t in prompt if not _is_int(t)][:4]}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("an empty prompt: give at least one token")
        if min(ids) < 0 or max(ids) >= self.model.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.model.config.vocab_size}); got {min(ids)}..{max(ids)}")
        return ids

    @torch.no_grad()
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Completions for `prompts` (text or token ids), in their order; `params` one for all or one per prompt
        (None: the generator's `defaults`).

        Raises:
            ValueError: an empty or out-of-vocabulary prompt, a text prompt without a tokenizer, a prompt plus
                max_new_tokens longer than the model's positions, or a request asking for logprobs to a speculative
                generator.
        """
        if isinstance(prompts, str) or _is_int(prompts):
            raise ValueError(f"generate takes a list of prompts, got {prompts!r}: wrap one prompt in a list")
        encoded = [self.encode(p) for p in prompts]
        params = self.defaults if params is None else params
        per_request = [params] * len(encoded) if isinstance(params, SamplingParams) else list(params)
        if len(per_request) != len(encoded):
            raise ValueError(f"{len(per_request)} sampling params for {len(encoded)} prompts")
        for ids, p in zip(encoded, per_request):
            if len(ids) + p.max_new_tokens > self.model.config.max_positions:
                raise ValueError(f"a prompt of {len(ids)} tokens plus {p.max_new_tokens} new ones exceeds the "
                                 f"model's {self.model.config.max_positions} positions")
        if self.speculative is not None and any(p.logprobs is not None for p in per_request):
            raise ValueError("logprobs are not recorded under speculative decoding: use a Generator without "
                             "`speculative`")
        out: list[Completion] = []
        self.timings = []
        if self.speculative is not None:
            for ids, p in zip(encoded, per_request):
                self.timings.append(BatchTimings(batch_size=1, prompt_tokens=len(ids)))
                out.append(self._speculate(ids, p, self.timings[-1]))
            return out
        for first in range(0, len(encoded), self.max_batch_size):
            out += self._batch(encoded[first:first + self.max_batch_size], per_request[first:first + self.max_batch_size])
        return out

    def _batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Completion]:
        b, dev = len(prompts), self.device
        timings = BatchTimings(batch_size=b, prompt_tokens=sum(len(p) for p in prompts))
        self.timings.append(timings)
        synchronize(dev)
        started = time.perf_counter()
        longest = max(len(p) for p in prompts)
        slots = longest + max(q.max_new_tokens for q in params)
        if self.compiled:
            slots = min(self.model.config.max_positions, -(-slots // self.SLOT_ROUNDING) * self.SLOT_ROUNDING)
        cache = KVCache(self.model.config, b, slots, device=dev, dtype=self.cache_dtype)
        timings.slots = slots
        pad = torch.tensor([longest - len(p) for p in prompts], device=dev)  # [B] left padding
        tokens = torch.zeros((b, longest), dtype=torch.long, device=dev)
        for row, ids in enumerate(prompts):
            tokens[row, longest - len(ids):] = torch.tensor(ids, device=dev)
        slot = torch.arange(slots, device=dev)
        own = slot[None, :] >= pad[:, None]  # [B, S]: the slot is the sequence's (its padding is not)
        # Prefill: the token at slot i attends to the sequence's slots up to i (padding attends to itself only:
        # its outputs are never used, and a row with nothing to attend to would give NaN).
        query = slot[:longest]
        mask = (own[:, None, :] & (slot[None, None, :] <= query[None, :, None])) | \
            (slot[None, None, :] == query[None, :, None])  # [B, T, S]
        positions = (query[None, :] - pad[:, None]).clamp(min=0)  # RoPE positions count the sequence's own tokens
        logits = self.model(tokens, positions, cache, query, mask[:, None], last_only=True)[:, 0]  # [B, V]

        generators = [self._generator(q) for q in params]
        done = [Completion(prompt_tokens=len(p), logprobs=None if q.logprobs is None else []) for p, q in
                zip(prompts, params)]
        greedy = all(q.temperature == 0 for q in params)
        for step in range(max(q.max_new_tokens for q in params)):
            chosen = logits.argmax(-1).cpu() if greedy else torch.zeros(b, dtype=torch.long)
            for row, (c, q) in enumerate(zip(done, params)):
                if c.finish_reason is None:
                    c.token_ids.append(int(chosen[row]) if greedy else sample_next(logits[row], q, generators[row]))
                    chosen[row] = c.token_ids[-1]
                    if q.logprobs is not None:
                        c.logprobs.append(token_logprob(logits[row], c.token_ids[-1], q.logprobs))
                    timings.new_tokens += 1
                    self._finish_if_done(c, q)
            now = time.perf_counter()  # the tokens are on the host: the device has finished
            if step:
                timings.step_s.append(now - started)
            else:
                timings.prefill_s = now - started
            started = now
            if all(c.finish_reason is not None for c in done):
                break
            # Decode: every sequence writes its token at the same slot; its RoPE position counts its own tokens.
            at = slot[longest + step: longest + step + 1]  # [1]
            mask = (own & (slot[None, :] <= at))[:, None, None, :]  # [B, 1, 1, S]
            logits = self._decode(chosen.to(dev)[:, None], (at - pad)[:, None], cache, at, mask)[:, 0]
        if self.tokenizer is not None:
            for c, q in zip(done, params):
                c.text = self._text(c, q)
        return done

    def _speculate(self, ids: list[int], q: SamplingParams, timings: BatchTimings) -> Completion:
        """One prompt with drafted tokens verified k + 1 at a time (the module docstring): greedy, or by rejection
        sampling for a sampled request (`speculative.verify`)."""
        dev, k, drafter = self.device, self.speculative.num_tokens, self.speculative
        generator = self._generator(q)
        synchronize(dev)
        started = time.perf_counter()
        n = len(ids)
        slots = n + q.max_new_tokens + k  # a verification writes k slots past its last token (drafts or filler)
        if self.compiled:  # rounded for a few graphs, as a batch's are, but no further than the context needs
            rounded = -(-slots // self.SLOT_ROUNDING) * self.SLOT_ROUNDING
            slots = max(slots, min(rounded, self.model.config.max_positions))
        cache = KVCache(self.model.config, 1, slots, device=dev, dtype=self.cache_dtype)
        state = drafter.start(ids, slots, dev, self.cache_dtype)
        timings.slots = slots
        slot = torch.arange(slots, device=dev)
        query = slot[:n]
        mask = (slot[None, None, :] <= query[None, :, None])[:, None]  # [1, 1, T, S]
        logits = self.model(torch.tensor([ids], device=dev), query[None], cache, query, mask, last_only=True)
        c = Completion(prompt_tokens=n, token_ids=[sample_next(logits[0, 0], q, generator)])
        timings.new_tokens = 1
        self._finish_if_done(c, q)
        now = time.perf_counter()
        timings.prefill_s, started = now - started, now
        at_last = n  # the slot of the last chosen token, which is not in the cache yet
        while c.finish_reason is None:
            sequence = ids + c.token_ids
            wanted = min(k, q.max_new_tokens - len(c.token_ids) - 1)  # a verification adds one token of its own
            draft, drawn = drafter.propose(state, sequence, wanted, q, generator) if wanted > 0 else ([], None)
            draft = draft[:wanted]
            feed = [c.token_ids[-1]] + draft + [0] * (k - len(draft))  # always k + 1 tokens: one compiled shape
            at = slot[at_last:at_last + k + 1]
            mask = (slot[None, :] <= at[:, None])[None, None]  # [1, 1, k + 1, S]
            # Near the context's end the last guesses (or fillers) lie past the model's positions; they are past the
            # answer's last token too (prompt + max_new_tokens fit), so their outputs are never kept: clamped, as
            # learned position embeddings (GPT-2) have no row for them.
            positions = at.clamp(max=self.model.config.max_positions - 1)
            logits = self._decode(torch.tensor([feed], device=dev), positions[None], cache, at, mask)  # [1, k + 1, V]
            if q.temperature == 0:
                new = accepted(draft, logits[0].argmax(-1).cpu().tolist())
            else:
                target = torch.stack([warped_probs(logits[0, i], q) for i in range(len(draft) + 1)])
                new = verify(draft, drawn, target, generator)
            drafter.keep(state, len(sequence) + min(len(new) - 1, max(wanted - 1, 0)))  # the kept guesses it was fed
            kept = 0
            for token in new:
                c.token_ids.append(token)
                kept += 1
                self._finish_if_done(c, q)
                if c.finish_reason is not None:
                    break
            timings.drafted += len(draft)
            timings.accepted += min(kept, len(new) - 1)
            timings.new_tokens += kept
            now = time.perf_counter()
            timings.step_s += [(now - started) / kept] * kept
            started = now
            at_last += len(new)
        if self.tokenizer is not None:
            c.text = self._text(c, q)
        return c

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.temperature == 0:
            return None
        g = torch.Generator(device="cpu")
        g.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, ())))
        return g

    def _finish_if_done(self, c: Completion, q: SamplingParams) -> None:
        if c.token_ids[-1] in q.stop_token_ids:
            c.finish_reason = "stop"
        elif q.stop and self.tokenizer is not None and any(s in self.tokenizer.decode(c.token_ids) for s in q.stop):
            c.finish_reason = "stop"
        elif len(c.token_ids) >= q.max_new_tokens:
            c.finish_reason = "length"

    def _text(self, c: Completion, q: SamplingParams) -> str:
        ids = c.token_ids[:-1] if c.token_ids and c.token_ids[-1] in q.stop_token_ids else c.token_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in q.stop if s in text]
        return text[:min(cuts)] if cuts else text
