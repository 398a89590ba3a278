"""Draft tokens for speculative decoding, verified by the target model in one forward.

Speculative decoding (Leviathan et al., 2023; Chen et al., 2023) guesses the next k tokens cheaply, runs
the target model once over the last token and the k guesses, and keeps the guesses up to the first one
the target would not have chosen, plus the target's own token there: 1 to k + 1 tokens per forward.
Under greedy decoding the kept tokens are the target's argmax at every position, so the output is the
target's own greedy output (up to floating-point summation order: a forward over k + 1 tokens sums in
another order than k + 1 forwards over one; the tests count a change only beyond near ties).

Two drafters, each with `start` (a sequence's state), `propose` (k guesses, and for a sampled request the
distribution each was drawn from) and `keep` (how much of the sequence its state still holds after a
verification):

- `PromptLookup` is prompt-lookup decoding (Saxena, 2023; `prompt_lookup_num_tokens` in Hugging Face
  `generate`): the guesses are what followed the latest earlier occurrence of the sequence's last n-gram,
  in the prompt or in what was generated (an overlapping copy, so a repeating period is continued). It
  needs no second model and pays where answers copy from their prompt (summaries, code edits, retrieval)
  or repeat themselves.
- `DraftModel` runs a small decoder of the same vocabulary (`generate/draft.py` derives one from the target)
  autoregressively over its own KV cache.

Under sampling (temperature > 0) the guesses are verified by rejection sampling (Leviathan et al., 2023,
Algorithm 1; Chen et al., 2023): guess x, drawn from the draft's q, is kept with probability min(1, p(x) / q(x))
under the target's p, and at the first refusal the token is drawn from max(0, p − q) normalised, so every
token is distributed as the target's own sampling would draw it (`verify`). A prompt-lookup guess is a certain
one (q is 1 at x).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup drafts.

    Attributes:
        num_tokens: draft tokens per verification forward (k ≥ 1).
        max_ngram: the longest suffix looked up first (≥ min_ngram).
        min_ngram: the shortest suffix tried before giving up (≥ 1).
    """

    num_tokens: int = 4
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (self.num_tokens, self.max_ngram,
                                                                          self.min_ngram)):
            raise ValueError(f"PromptLookup takes integers; got {self}")
        if self.num_tokens < 1 or self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(f"PromptLookup needs num_tokens ≥ 1 and 1 ≤ min_ngram ≤ max_ngram; got {self}")

    def draft(self, ids: Sequence[int]) -> list[int]:
        """`num_tokens` guesses for what follows `ids` (the prompt and the tokens so far): the tokens after
        the latest earlier occurrence of its last n-gram, the longest n first, copied on past the end as
        LZ77 copies (what follows the end is what followed it a period earlier); [] when no n-gram recurs."""
        seq = list(ids)
        end = len(seq)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(end - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    for j in range(self.num_tokens):
                        seq.append(seq[start + n + j])  # an overlapping copy: it may read what it just wrote
                    return seq[end:]
        return []

    def start(self, ids: Sequence[int], slots: int, device, dtype) -> None:
        return None

    def propose(self, state, ids: Sequence[int], k: int, params, generator) -> tuple[list[int], torch.Tensor | None]:
        """Up to k guesses after `ids`; no distribution (each guess is certain)."""
        return self.draft(ids)[:k], None

    def keep(self, state, length: int) -> None:
        return None


@dataclass
class _DraftState:
    cache: object
    filled: int = 0  # the sequence's leading tokens the draft's cache holds


@dataclass(eq=False)
class DraftModel:
    """A draft decoder's guesses (`generate/draft.py` derives one from the target).

    Attributes:
        decoder: a `Decoder` of the target's vocabulary, on the target's device.
        num_tokens: guesses per verification forward (k ≥ 1).
        layers: the target's layers it kept, and `facts` what its distillation measured (for the plan and table).
    """

    decoder: torch.nn.Module
    num_tokens: int = 4
    layers: list[int] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def __post_init__(self):
        from overdrive.generate.decoder import Decoder

        if not isinstance(self.decoder, Decoder):
            raise ValueError(f"DraftModel takes overdrive's Decoder (Decoder.from_hf(draft)), got {type(self.decoder).__name__}")
        if not isinstance(self.num_tokens, int) or isinstance(self.num_tokens, bool) or self.num_tokens < 1:
            raise ValueError(f"DraftModel needs num_tokens ≥ 1, got {self.num_tokens!r}")

    def check(self, target: torch.nn.Module) -> None:
        """Raises ValueError: a draft that cannot guess for `target` (a `Decoder`): another vocabulary, a shorter
        context."""
        mine, theirs = self.decoder.config, target.config
        if mine.vocab_size != theirs.vocab_size:
            raise ValueError(f"the draft's vocabulary ({mine.vocab_size}) is not the target's ({theirs.vocab_size}): "
                             "a draft guesses the target's own token ids")
        if mine.max_positions < theirs.max_positions:
            raise ValueError(f"the draft's context ({mine.max_positions} positions) is shorter than the target's "
                             f"({theirs.max_positions})")

    def start(self, ids: Sequence[int], slots: int, device, dtype) -> _DraftState:
        from overdrive.generate.decoder import KVCache

        return _DraftState(KVCache(self.decoder.config, 1, slots, device=device, dtype=dtype))

    @torch.no_grad()
    def propose(self, state: _DraftState, ids: Sequence[int], k: int, params, generator) -> tuple[list[int], torch.Tensor | None]:
        """k guesses after `ids` (the prompt and the tokens so far), each fed back to the draft: greedy, or drawn
        from the draft's distribution under the request's temperature, top-k and top-p (returned, [k, vocab])."""
        from overdrive.generate.engine import warped_probs

        device = next(self.decoder.parameters()).device
        slot = torch.arange(state.cache.slots, device=device)
        feed, guesses, drawn = list(ids[state.filled:]), [], []
        for _ in range(k):
            at = slot[state.filled:state.filled + len(feed)]
            mask = (slot[None, :] <= at[:, None])[None, None]  # [1, 1, T, S]: the sequence's own slots, causally
            positions = at.clamp(max=self.decoder.config.max_positions - 1)  # past the context: guesses never kept
            logits = self.decoder(torch.tensor([feed], device=device), positions[None], state.cache, at, mask,
                                  last_only=True)[0, 0]
            state.filled += len(feed)
            if params.temperature == 0:
                guess = int(logits.argmax())
            else:
                probs = warped_probs(logits, params)
                guess = int(torch.multinomial(probs.cpu(), 1, generator=generator))
                drawn.append(probs)
            guesses.append(guess)
            feed = [guess]
        return guesses, torch.stack(drawn) if drawn else None

    def keep(self, state: _DraftState, length: int) -> None:
        """The sequence's first `length` tokens are those the draft saw: slots after them are written again."""
        state.filled = min(state.filled, length)


def accepted(draft: Sequence[int], chosen: Sequence[int]) -> list[int]:
    """The tokens one verification forward yields under greedy decoding: `draft` up to the first guess
    that differs from `chosen` (the target's argmax after the last token and after each guess, len(draft)
    + 1 of them or more), then the target's own token at that position."""
    out = []
    for guess, target in zip(draft, chosen):
        if guess != target:
            break
        out.append(guess)
    out.append(int(chosen[len(out)]))
    return out


def verify(draft: Sequence[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """The tokens one verification forward yields for a sampled request, by rejection sampling (the module
    docstring): each guess kept with probability min(1, p(x) / q(x)); at the first refusal a token drawn from
    max(0, p − q) normalised; after every guess kept, one more drawn from p.

    Args:
        draft: the guesses x_1..x_n.
        q: [n, vocab] the distributions they were drawn from; None: each guess certain (q one-hot at x_i).
        p: [n + 1, vocab] the target's distributions (after temperature, top-k, top-p) after the last token and
            after each guess.
        generator: the request's random generator.
    """
    p = p.float().cpu()
    q = None if q is None else q.float().cpu()
    out: list[int] = []
    for i, x in enumerate(draft):
        q_x = 1.0 if q is None else float(q[i, x])
        if float(torch.rand((), generator=generator)) * q_x < float(p[i, x]):  # u < p(x) / q(x), without dividing
            out.append(int(x))
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        if not total > 0:  # p ≤ q everywhere yet x refused: only float rounding can get here; p itself is exact
            residual, total = p[i], float(p[i].sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return out
