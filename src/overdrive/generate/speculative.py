"""Draft tokens for speculative decoding, verified by the target model in one forward.

Speculative decoding (Leviathan et al., 2023; Chen et al., 2023) guesses the next k tokens cheaply, runs
the target model once over the last token and the k guesses, and keeps the guesses up to the first one
the target would not have chosen, plus the target's own token there: 1 to k + 1 tokens per forward.
Under greedy decoding the kept tokens are the target's argmax at every position, so the output is the
target's own greedy output (up to floating-point summation order: a forward over k + 1 tokens sums in
another order than k + 1 forwards over one; the tests count a change only beyond near ties).

`PromptLookup` is prompt-lookup decoding (Saxena, 2023; `prompt_lookup_num_tokens` in Hugging Face
`generate`): the guesses are what followed the latest earlier occurrence of the sequence's last n-gram,
in the prompt or in what was generated (an overlapping copy, so a repeating period is continued). It
needs no second model and pays where answers copy from their prompt (summaries, code edits, retrieval)
or repeat themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
