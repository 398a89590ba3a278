"""Is a transformed decoder still the model? The guard's figures for generation, against the fp32 reference.

Three figures, on held-out real prompts and text:

- **Greedy tokens.** The candidate's greedy continuation of each prompt, through its own `Generator` (its
  compiled decode step, its KV cache), against the reference's. A divergence at a step where the
  reference's top-2 logit margin was at most `near_tie` is a near tie (any change of summation order can
  flip it: fp32 on another core count does); one above it is the candidate changing an answer the
  reference was sure of. Both counts are reported; only the second breaks a budget.
- **KL divergence along the reference's path** (teacher forcing): the prompt and the reference's greedy
  continuation run through both models in one forward; KL(reference ‖ candidate) of the next-token
  distributions at every continuation position, mean and max, in nats per token.
- **Held-out perplexity**: exp(mean negative log-likelihood) over texts the model was not trained on.

A KV-cache defect that only decode reaches (a slot written for one sequence and read by another) is
caught by the greedy comparison in a batch of mixed lengths; one in precision by the KL.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from overdrive.generate.decoder import Decoder, KVCache
from overdrive.generate.engine import Generator, SamplingParams

# A reference top-2 logit margin at or below this is a near tie: fp32 with another summation order flips such
# tokens (a margin of 0.05 is a probability ratio of 1.05 between the two).
NEAR_TIE_MARGIN = 0.05


@torch.no_grad()
def sequence_logits(model: Decoder, ids: Sequence[int], cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The model's next-token logits float32 [T, vocab] at every position of `ids` (one forward, causal), its
    keys and values held in a KV cache of `cache_dtype` (default: the model's; int8 quantizes them as decoding
    does, so the figures judge the cache too)."""
    device = next(model.parameters()).device
    t = len(ids)
    cache = KVCache(model.config, 1, t, device=device, dtype=cache_dtype or next(model.parameters()).dtype)
    slots = torch.arange(t, device=device)
    mask = (slots[None, :] <= slots[:, None])[None, None]  # [1, 1, T, T]
    tokens = torch.tensor([list(ids)], device=device)
    return model(tokens, slots[None], cache, slots, mask)[0].float().cpu()


@torch.no_grad()
def batched_sequence_logits(model: Decoder, texts: Sequence[Sequence[int]], batch_size: int = 8) -> list[torch.Tensor]:
    """`sequence_logits` of each of `texts`, `batch_size` texts to a forward: right-padded with token 0, so that
    each row's positions are its own (padding comes after a row's last token, and attention is causal, so it
    cannot reach the row's logits). The figures equal one text at a time up to the summation order of a larger
    GEMM (~1e-6 on fp32 logits); for measurements compared with each other (the per-layer search), not answers."""
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for first in range(0, len(texts), batch_size):
        group = [list(ids) for ids in texts[first:first + batch_size]]
        b, t = len(group), max(map(len, group))
        tokens = torch.zeros(b, t, dtype=torch.long, device=device)
        for i, ids in enumerate(group):
            tokens[i, :len(ids)] = torch.tensor(ids, device=device)
        cache = KVCache(model.config, b, t, device=device, dtype=next(model.parameters()).dtype)
        slots = torch.arange(t, device=device)
        mask = (slots[None, :] <= slots[:, None])[None, None]  # [1, 1, T, T]
        logits = model(tokens, slots[None].expand(b, t), cache, slots, mask).float().cpu()
        out += [logits[i, :len(ids)] for i, ids in enumerate(group)]
    return out


def perplexity(model: Decoder, texts: Sequence[Sequence[int]], cache_dtype: torch.dtype | None = None) -> float:
    """exp(mean negative log-likelihood per predicted token) over token sequences (≥ 2 tokens each), with a KV
    cache of `cache_dtype` (see `sequence_logits`)."""
    nll, count = 0.0, 0
    for ids in texts:
        if len(ids) < 2:
            continue
        logits = sequence_logits(model, ids, cache_dtype)[:-1]
        nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(list(ids[1:])), reduction="sum"))
        count += len(ids) - 1
    if not count:
        raise ValueError("perplexity needs at least one text of two tokens or more")
    return math.exp(nll / count)


@dataclass
class GenerationFidelity:
    """How far a candidate's generations are from the reference's (see the module's docstring).

    Attributes:
        prompts: prompts compared; tokens: greedy tokens the reference produced over them.
        diverged: prompts whose candidate continuation differs from the reference's anywhere.
        diverged_beyond_ties: of those, the ones whose first differing step had a reference top-2 margin above
            `near_tie` (the candidate changed a token the reference was sure of).
        first_divergence: per prompt, the index of the first differing new token, or None.
        mean_kl, max_kl: KL(reference ‖ candidate) per continuation position along the reference's path, nats.
        perplexity_reference, perplexity: on the held-out texts (None when none were given).
    """

    prompts: int
    tokens: int
    diverged: int
    diverged_beyond_ties: int
    first_divergence: list[int | None]
    mean_kl: float
    max_kl: float
    near_tie: float = NEAR_TIE_MARGIN
    perplexity_reference: float | None = None
    perplexity: float | None = None

    @property
    def perplexity_change(self) -> float | None:
        """perplexity / the reference's − 1 (0.01: one per cent worse); None without held-out texts."""
        if self.perplexity is None or self.perplexity_reference is None:
            return None
        return self.perplexity / self.perplexity_reference - 1

    def breaks(self, *, max_diverged_share: float = 0.0, max_mean_kl: float = math.inf,
               max_perplexity_change: float = math.inf) -> str | None:
        """Why this candidate breaks the budget, or None. A divergence beyond near ties counts against
        `max_diverged_share` (of the prompts); non-finite figures always break it."""
        if not (math.isfinite(self.mean_kl) and math.isfinite(self.max_kl)):
            return "non-finite next-token distributions along the reference's path"
        share = self.diverged_beyond_ties / max(1, self.prompts)
        if share > max_diverged_share:
            return (f"greedy tokens changed on {self.diverged_beyond_ties} of {self.prompts} prompts where the reference's "
                    f"top-2 margin was above {self.near_tie} (> {max_diverged_share:.0%} allowed; "
                    f"{self.diverged - self.diverged_beyond_ties} more at near ties)")
        if self.mean_kl > max_mean_kl:
            return f"mean KL {self.mean_kl:.4f} nats per token > {max_mean_kl} allowed"
        change = self.perplexity_change
        if change is not None and (not math.isfinite(change) or change > max_perplexity_change):
            return f"held-out perplexity {self.perplexity_reference:.2f} → {self.perplexity:.2f} (+{change:.1%} > " \
                   f"{max_perplexity_change:.1%} allowed)"
        return None

    def to_dict(self) -> dict:
        return {**asdict(self), "perplexity_change": self.perplexity_change}


def judge_generation(reference: Generator, candidate: Generator, prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int = 32, held_out: Sequence[Sequence[int]] = (),
                     near_tie: float = NEAR_TIE_MARGIN) -> GenerationFidelity:
    """The candidate against the reference on token-id `prompts` (greedy, `max_new_tokens` each, batched as each
    generator batches) and, when given, held-out token sequences for perplexity.

    Raises:
        ValueError: no prompts.
    """
    if not prompts:
        raise ValueError("judging generation needs at least one prompt")
    params = SamplingParams(max_new_tokens=max_new_tokens)
    ours = reference.generate(prompts, params)
    theirs = candidate.generate(prompts, params)
    first: list[int | None] = []
    diverged = beyond = 0
    kls: list[torch.Tensor] = []
    for ids, ref, cand in zip(prompts, ours, theirs):
        path = list(ids) + ref.token_ids
        ref_logits = sequence_logits(reference.model, path, reference.cache_dtype)[len(ids) - 1: len(path) - 1]
        cand_logits = sequence_logits(candidate.model, path, candidate.cache_dtype)[len(ids) - 1: len(path) - 1]
        log_p, log_q = torch.log_softmax(ref_logits, -1), torch.log_softmax(cand_logits, -1)
        kls.append((log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0))  # KL ≥ 0: below is rounding (NaN kept)
        at = next((i for i, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids)) if a != b), None)
        if at is None and len(ref.token_ids) != len(cand.token_ids):
            at = min(len(ref.token_ids), len(cand.token_ids))  # one stopped where the other went on
        first.append(at)
        if at is not None:
            diverged += 1
            top2 = torch.topk(ref_logits[min(at, len(ref_logits) - 1)], 2).values
            beyond += int(float(top2[0] - top2[1]) > near_tie)
    kl = torch.cat(kls) if kls else torch.zeros(1)
    ppl_ref = perplexity(reference.model, held_out, reference.cache_dtype) if held_out else None
    ppl = perplexity(candidate.model, held_out, candidate.cache_dtype) if held_out else None
    return GenerationFidelity(prompts=len(prompts), tokens=sum(len(c.token_ids) for c in ours), diverged=diverged,
                              diverged_beyond_ties=beyond, first_divergence=first, mean_kl=float(kl.mean()),
                              max_kl=float(kl.max()), near_tie=near_tie, perplexity_reference=ppl_ref, perplexity=ppl)


@dataclass
class BatchInvariance:
    """Whether each prompt's greedy continuation alone equals its continuation inside a batch of mixed lengths.

    Attributes:
        prompts: prompts probed; differ: those whose two continuations differ anywhere;
        differ_beyond_ties: of those, the ones whose first differing step had a top-2 margin above `near_tie` in
            the model's own logits along the prompt-alone path (a near tie may flip with summation order).
    """

    prompts: int
    differ: list[int]
    differ_beyond_ties: list[int]
    near_tie: float = NEAR_TIE_MARGIN

    def breaks(self) -> str | None:
        if not self.differ_beyond_ties:
            return None
        return (f"{len(self.differ_beyond_ties)} of {self.prompts} prompts get other greedy tokens in a batch than alone "
                f"(prompts {self.differ_beyond_ties[:5]}): a sequence's answer depends on its batch-mates")


def batch_invariance(generator: Generator, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
                     near_tie: float = NEAR_TIE_MARGIN) -> BatchInvariance:
    """Each of `prompts` (≥ 2, of mixed lengths for the probe to mean anything) generated alone and in one batch
    (greedy, `max_new_tokens`), compared token by token (`BatchInvariance`)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    alone = [generator.generate([p], params)[0].token_ids for p in prompts]
    together = [c.token_ids for c in generator.generate(list(prompts), params)]
    differ, beyond = [], []
    for i, (ids, a, b) in enumerate(zip(prompts, alone, together)):
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None:
            continue
        differ.append(i)
        logits = sequence_logits(generator.model, list(ids) + a)[len(ids) - 1 + at]
        top2 = torch.topk(logits, 2).values
        if float(top2[0] - top2[1]) > near_tie:
            beyond.append(i)
    return BatchInvariance(prompts=len(prompts), differ=differ, differ_beyond_ties=beyond, near_tie=near_tie)
