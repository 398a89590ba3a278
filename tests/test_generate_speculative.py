"""Speculative decoding by prompt lookup: the drafts, and the tokens it keeps being greedy decoding's own
(a speculation that changes a greedy token is a defect, not a trade), eager and compiled; a verifier that
keeps drafts the model did not choose is caught by the same comparison."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, Generator, PromptLookup, SamplingParams
from overdrive.generate import engine as engine_mod
from overdrive.generate.speculative import accepted
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


def test_a_sampled_request_is_refused_not_decoded_another_way():
    generator = Generator(Decoder.from_hf(_hf()), speculative=PromptLookup())
    with pytest.raises(ValueError, match="greedy"):
        generator.generate([[1, 2, 3]], SamplingParams(temperature=0.8, seed=1))


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
                       (lambda: Generator(generator.model, speculative=PromptLookup), "PromptLookup")):
        with pytest.raises(ValueError, match=match):
            bad()
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,) and SamplingParams(stop="END").stop == ("END",)
    ids = [3, 4, 5]
    expected = generator.generate([ids], SamplingParams(max_new_tokens=4))[0].token_ids
    assert generator.generate([np.array(ids)], SamplingParams(max_new_tokens=4))[0].token_ids == expected
    assert generator.generate([torch.tensor(ids)], SamplingParams(max_new_tokens=4))[0].token_ids == expected
