"""Speculative decoding by prompt lookup and by a draft model derived from the target: the drafts, and the
tokens it keeps being greedy decoding's own (a speculation that changes a greedy token is a defect, not a
trade), eager and compiled; a verifier that keeps drafts the model did not choose is caught by the same
comparison; sampled requests verified by rejection sampling draw each token as the model's own sampling does
(checked against the exact distribution, and shown to catch a verifier that keeps every guess)."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, DraftModel, Generator, PromptLookup, SamplingParams
from overdrive.generate import engine as engine_mod
from overdrive.generate.draft import build_draft, derive, distill, draft_layers, seconds_per_step, windows
from overdrive.generate.speculative import accepted, verify
from tests.test_generate import VOCAB, _hf, _prompts


def test_the_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_ngram():
    lookup = PromptLookup(num_tokens=4, max_ngram=3)
    assert lookup.draft([1, 2, 3, 9, 1, 2]) == [3, 9, 1, 2]  # "1 2" occurred at 0
    assert lookup.draft([5, 1, 2, 7, 1, 2, 8, 1, 2]) == [8, 1, 2, 8]  # the latest occurrence, copied on as a period
    assert lookup.draft([4, 7, 9, 4, 7, 8, 9, 4, 7]) == [8, 9, 4, 7]  # "9 4 7" occurred at 2
    assert lookup.draft([1, 2, 5, 6, 2, 5]) == [6, 2, 5, 6]  # "6 2 5" did not occur; "2 5" did, at 1
    assert lookup.draft([1, 2, 3, 4]) == [] and lookup.draft([5]) == []
    assert PromptLookup(num_tokens=2).draft([3, 3, 3, 3]) == [3, 3]
    with pytest.raises(ValueError):
        PromptLookup(num_tokens=0)
    with pytest.raises(ValueError):
        PromptLookup(min_ngram=3, max_ngram=2)


def test_a_verification_keeps_the_agreeing_drafts_and_the_models_own_next_token():
    assert accepted([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]
    assert accepted([5, 6], [5, 6, 2]) == [5, 6, 2]  # every draft kept, and the token after them
    assert accepted([5], [4, 1]) == [4]
    assert accepted([], [3, 0, 0]) == [3]


def _repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuation is likely to copy from them: a period repeated, and random ones."""
    g = torch.Generator().manual_seed(3)
    periodic = [(torch.randint(1, VOCAB, (p,), generator=g).tolist() * 4)[:4 * p - 1] for p in (2, 3, 5)]
    return periodic + _prompts(3, seed=7)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_speculation_keeps_greedy_decodings_tokens_and_accepts_drafts(compiled):
    decoder = Decoder.from_hf(_hf())
    prompts = _repetitive_prompts()
    params = SamplingParams(max_new_tokens=20)
    plain = [c.token_ids for c in Generator(decoder, max_batch_size=8).generate(prompts, params)]
    speculative = Generator(decoder, speculative=PromptLookup(num_tokens=4), compile=compiled)
    out = speculative.generate(prompts, params)
    assert [c.token_ids for c in out] == plain
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in out)
    drafted = sum(t.drafted for t in speculative.timings)
    kept = sum(t.accepted for t in speculative.timings)
    assert drafted > 0 and kept > 0, (drafted, kept)  # it really speculated, and some drafts held
    assert sum(t.new_tokens for t in speculative.timings) == 20 * len(prompts) == \
        sum(len(t.step_s) + 1 for t in speculative.timings)  # the first token from the prefill, a step each other


def test_a_stop_token_inside_an_accepted_draft_ends_the_answer_there():
    decoder = Decoder.from_hf(_hf())
    prompt = _repetitive_prompts()[1]
    plain = Generator(decoder).generate([prompt], SamplingParams(max_new_tokens=20))[0].token_ids
    stop = plain[5]
    expected = plain[:plain.index(stop) + 1]
    got = Generator(decoder, speculative=PromptLookup()).generate(
        [prompt], SamplingParams(max_new_tokens=20, stop_token_ids=(stop,)))[0]
    assert got.token_ids == expected and got.finish_reason == "stop"


def test_a_verifier_that_keeps_drafts_the_model_did_not_choose_is_caught(monkeypatch):
    """The comparison above can fail: keeping every draft (as a verifier that skipped the check would)
    changes the tokens of these prompts."""
    decoder = Decoder.from_hf(_hf())
    prompts = _repetitive_prompts()
    params = SamplingParams(max_new_tokens=20)
    plain = [c.token_ids for c in Generator(decoder, max_batch_size=8).generate(prompts, params)]
    monkeypatch.setattr(engine_mod, "accepted", lambda draft, chosen: list(draft) + [int(chosen[len(draft)])])
    blind = Generator(decoder, speculative=PromptLookup()).generate(prompts, params)
    assert [c.token_ids for c in blind] != plain


def _draws(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int = 0, verifier=verify) -> torch.Tensor:
    """The first token of `n` verifications of one guess drawn from q (or a fixed guess: q None), as frequencies."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        if q is None:
            guess, drawn = 2, None
        else:
            guess, drawn = int(torch.multinomial(q, 1, generator=g)), q[None]
        counts[verifier([guess], drawn, torch.stack([p, p]), g)[0]] += 1
    return counts / n


@pytest.mark.parametrize("certain", [False, True], ids=["draft-model", "prompt-lookup"])
def test_rejection_sampling_draws_each_token_as_the_target_would(certain):
    """Leviathan et al.'s Algorithm 1: whatever the draft's q, the first token is distributed as the target's p.
    10,000 draws put each frequency within 0.02 of p at over 4 standard deviations."""
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(6, generator=g) * 1.5, 0)
    q = None if certain else torch.softmax(torch.randn(6, generator=g) * 1.5, 0)
    got = _draws(p, q, 10_000)
    assert (got - p).abs().max() < 0.02, (got, p)
    # The same check catches a verifier that keeps every guess: the tokens then follow q (or the fixed guess).
    keep_all = _draws(p, q, 5_000, verifier=lambda draft, q_, p_, g_: list(draft) + [0])
    assert (keep_all - p).abs().max() > 0.1


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_draft_model_keeps_greedy_decodings_tokens(compiled):
    hf = _hf(num_hidden_layers=3)
    decoder = Decoder.from_hf(hf)
    prompts = _prompts(5, seed=4)
    params = SamplingParams(max_new_tokens=16)
    plain = [c.token_ids for c in Generator(decoder, max_batch_size=8).generate(prompts, params)]
    draft = DraftModel(Decoder.from_hf(derive(hf, [0, 2])), num_tokens=3)  # undistilled: a poor draft, still exact
    speculative = Generator(decoder, speculative=draft, compile=compiled)
    assert [c.token_ids for c in speculative.generate(prompts, params)] == plain
    assert sum(t.drafted for t in speculative.timings) > 0
    # A draft that is the target itself guesses every token right, so nearly every guess is kept: its own cache
    # follows the sequence (after a round that kept every guess it feeds two tokens; after a refusal it writes
    # over what was refused). A draft cache that lost its place would guess from the wrong tokens.
    itself = Generator(decoder, speculative=DraftModel(Decoder.from_hf(hf), num_tokens=3))
    assert [c.token_ids for c in itself.generate(prompts, params)] == plain
    drafted, kept = sum(t.drafted for t in itself.timings), sum(t.accepted for t in itself.timings)
    assert kept >= 0.95 * drafted, (kept, drafted)


def test_a_sampled_speculative_request_draws_as_the_model_samples():
    """The first two tokens of seeded requests (top-k 2: four possible pairs; the second token is the first
    verified one): 400 speculated with a poor draft against 2,000 sampled plainly agree within sampling noise
    (total variation ~0.035 expected, 0.1 allowed), and a verifier that keeps every guess, so that tokens follow
    the draft, is caught by the same comparison (it gave pairs the model never samples: a distance of 1.0)."""
    hf = _hf(num_hidden_layers=3)
    decoder = Decoder.from_hf(hf)
    prompt = _prompts(1, seed=5)[0]
    draft = DraftModel(Decoder.from_hf(derive(hf, [1])), num_tokens=2)

    def pairs(generator, n: int, first_seed: int) -> dict:
        params = [SamplingParams(max_new_tokens=2, temperature=1.0, top_k=2, seed=s) for s in range(first_seed, first_seed + n)]
        counts: dict = {}
        for c in generator.generate([prompt] * n, params):
            counts[tuple(c.token_ids)] = counts.get(tuple(c.token_ids), 0) + 1 / n
        return counts

    def distance(a: dict, b: dict) -> float:
        return 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b))

    plain = pairs(Generator(decoder, max_batch_size=64), 2000, 0)
    assert distance(plain, pairs(Generator(decoder, speculative=draft), 400, 10_000)) < 0.1
    original = engine_mod.verify
    try:
        engine_mod.verify = lambda d, q, p, g: list(d) + [0]
        blind = pairs(Generator(decoder, speculative=draft), 50, 20_000)
    finally:
        engine_mod.verify = original
    assert distance(plain, blind) > 0.5


def test_speculation_up_to_the_last_position_of_a_learned_position_model():
    """GPT-2's learned position embeddings have no row past its context: a prompt and answer filling all 32 positions
    put the last verification's guesses (and fillers) past the end, which raised IndexError; they are never kept."""
    hf = _hf("gpt2", n_positions=32, n_layer=3)
    decoder = Decoder.from_hf(hf)
    prompt, params = [5, 6, 7] * 3 + [5], SamplingParams(max_new_tokens=22)  # 10 + 22 = all 32 positions
    plain = Generator(decoder).generate([prompt], params)[0].token_ids
    for drafter in (PromptLookup(num_tokens=4), DraftModel(Decoder.from_hf(derive(hf, [0])), num_tokens=4)):
        assert Generator(decoder, speculative=drafter).generate([prompt], params)[0].token_ids == plain


def test_a_draft_that_cannot_guess_for_its_target_is_refused_by_name_and_no_guess_is_wasted():
    """From a new user's trial: each of these raised from deep inside torch (IndexError, AttributeError) or was taken;
    and the last verification drafted k guesses when the answer needed fewer (counted as drafted and refused)."""
    import transformers

    hf = _hf("gpt2", n_positions=32, n_layer=3)
    texts = [list(range(1, 10)) * 20]
    for bad, match in ((lambda: DraftModel(hf), "takes overdrive's Decoder"),
                       (lambda: Generator(Decoder.from_hf(hf), speculative=DraftModel(Decoder.from_hf(_hf(vocab_size=50)))),
                        "vocabulary \\(50\\) is not the target's \\(96\\)"),
                       (lambda: derive(transformers.BertForMaskedLM(transformers.BertConfig(
                           vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)), [0]),
                        "derived from a Hugging Face causal LM"),
                       (lambda: build_draft(hf, [0], [[500] * 50], steps=1), "outside the model's vocabulary of 96"),
                       (lambda: build_draft(hf, [0], texts, steps=-1), "steps are an integer ≥ 0"),
                       (lambda: draft_layers(4, 2.5), "whole number of layers"),
                       (lambda: draft_layers(0), "layer count is a positive integer"),
                       (lambda: derive(hf, [0, 1.0]), "increasing indices"),
                       (lambda: build_draft(hf, [0], ["hello world"], steps=1), "lists of token ids"),
                       (lambda: Generator(Decoder.from_hf(hf), speculative=hf), "got GPT2LMHeadModel$")):
        with pytest.raises(ValueError, match=match):
            bad()
    # Distillation rows fit a context shorter than its 128-token window (GPT-2's positions end at 32: IndexError)
    assert seconds_per_step(hf, [0], texts) > 0 and build_draft(hf, [0], texts, steps=2)[1]["steps"] == 2
    itself = Generator(Decoder.from_hf(hf), speculative=DraftModel(Decoder.from_hf(hf), num_tokens=4))
    for new, drafted in ((2, 0), (7, 4)):  # 7: the prefill's token, 4 guesses + the target's, then 1 more alone
        itself.generate([[5, 6, 7]], SamplingParams(max_new_tokens=new))
        assert (itself.timings[-1].accepted, itself.timings[-1].drafted) == (drafted, drafted)


def test_a_derived_draft_keeps_the_layers_asked_and_distillation_brings_it_toward_the_target():
    hf = _hf(num_hidden_layers=4)
    assert draft_layers(4) == [0] and draft_layers(12) == [0, 6, 11] and draft_layers(6, keep=2) == [0, 5]
    whole = derive(hf, [0, 1, 2, 3])
    x = torch.tensor([_prompts(1, seed=2)[0]])
    torch.testing.assert_close(whole(input_ids=x).logits, hf(input_ids=x).logits)  # all layers: the target itself
    draft = derive(hf, [0, 3])
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2 and len(hf.model.layers) == 4
    assert [layer.self_attn.layer_idx for layer in draft.model.layers] == [0, 1]
    with pytest.raises(ValueError, match="increasing"):
        derive(hf, [2, 1])
    rows = windows(_prompts(64, seed=9), eos=None, window=16)
    facts = distill(draft, hf, rows, steps=30)
    assert facts["steps"] == 30 and facts["kl_after"] < 0.7 * facts["kl_before"], facts
    assert Decoder.from_hf(draft).config.num_layers == 2  # the engine takes it


def test_bad_requests_are_one_clear_error_before_any_token():
    """From a new user's trial: float ids were truncated, a float max_new_tokens or draft length failed inside
    torch, a bare int stop id failed after the first token, a bare stop string was read letter by letter."""
    import numpy as np

    generator = Generator(Decoder.from_hf(_hf()))
    for bad, match in ((lambda: generator.generate([[1.7, 2.2]]), "integers"),
                       (lambda: generator.generate([1, 2, 3]), "list of prompts"),
                       (lambda: generator.generate("a text"), "list of prompts"),
                       (lambda: SamplingParams(max_new_tokens=2.5), "max_new_tokens must be an integer"),
                       (lambda: SamplingParams(stop_token_ids=(1.5,)), "stop_token_ids"),
                       (lambda: SamplingParams(stop=("",)), "non-empty"),
                       (lambda: PromptLookup(num_tokens=2.5), "integers"),
                       (lambda: Generator(generator.model, speculative=PromptLookup), "PromptLookup"),
                       (lambda: DraftModel(generator.model, num_tokens=0), "num_tokens")):
        with pytest.raises(ValueError, match=match):
            bad()
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,) and SamplingParams(stop="END").stop == ("END",)
    ids = [3, 4, 5]
    expected = generator.generate([ids], SamplingParams(max_new_tokens=4))[0].token_ids
    assert generator.generate([np.array(ids)], SamplingParams(max_new_tokens=4))[0].token_ids == expected
    assert generator.generate([torch.tensor(ids)], SamplingParams(max_new_tokens=4))[0].token_ids == expected
