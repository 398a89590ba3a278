"""The KV cache in int8 (a float32 scale per token and head): a quarter of fp32's bytes plus the scales, the
same answers within the generation guard's budgets, no row depending on its batch-mates, compiled as eager."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, Generator, KVCache, SamplingParams
from overdrive.generate.decoder import quantize_per_token
from overdrive.generate.fidelity import batch_invariance, judge_generation
from overdrive.generate.roofline import kv_bytes_per_step
from tests.test_generate import _hf, _prompts

pytest.importorskip("transformers")


def test_per_token_quantization_round_trips_within_half_a_step():
    x = torch.randn(2, 3, 5, 16) * torch.tensor([1e-3, 1.0, 50.0]).view(1, 3, 1, 1)
    q, scale = quantize_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (2, 3, 5, 1)
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-7).all()
    assert (q.abs().amax(-1) == 127).all()  # each vector uses the whole range
    zeros = quantize_per_token(torch.zeros(1, 4))[0]
    assert (zeros == 0).all()  # an all-zero vector stays finite and zero


def test_an_int8_cache_is_a_quarter_of_fp32_plus_its_scales_and_the_roofline_counts_both():
    decoder = Decoder.from_hf(_hf())
    c = decoder.config
    fp32 = KVCache(c, 2, 10, device="cpu", dtype=torch.float32)
    int8 = KVCache(c, 2, 10, device="cpu", dtype=torch.int8)
    vectors = 2 * c.num_layers * 2 * c.num_kv_heads * 10
    assert fp32.nbytes() == vectors * c.head_dim * 4 and int8.nbytes() == vectors * (c.head_dim + 4)
    assert kv_bytes_per_step(decoder, batch_size=2, slots=10, dtype=torch.int8) == int8.nbytes()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_int8_cache_stays_within_the_guard_and_keeps_rows_independent(compiled):
    decoder = Decoder.from_hf(_hf())
    prompts = _prompts(8, seed=5)
    reference = Generator(decoder, max_batch_size=8)
    candidate = Generator(decoder, max_batch_size=8, cache_dtype=torch.int8, compile=compiled)
    fid = judge_generation(reference, candidate, prompts, max_new_tokens=12)
    assert fid.diverged_beyond_ties == 0 and fid.mean_kl < 1e-3, fid
    assert fid.mean_kl > 0  # it really ran in int8: the distributions moved a little
    probe = batch_invariance(candidate, prompts, max_new_tokens=12)
    assert not probe.differ_beyond_ties, probe


def test_an_int8_cache_that_dropped_its_scales_is_caught(monkeypatch):
    """The check above can fail: a cache read without its scales (every value off by its scale) breaks the guard."""
    from overdrive.generate import decoder as decoder_mod

    decoder = Decoder.from_hf(_hf())
    prompts = _prompts(8, seed=5)
    reference = Generator(decoder, max_batch_size=8)
    original = decoder_mod._store

    def unscaled(cache, scales, slots, x, dtype):
        out = original(cache, scales, slots, x, dtype)
        return cache.to(dtype) if scales is not None else out

    monkeypatch.setattr(decoder_mod, "_store", unscaled)
    fid = judge_generation(reference, Generator(decoder, max_batch_size=8, cache_dtype=torch.int8), prompts,
                           max_new_tokens=12)
    assert fid.diverged_beyond_ties > 0 or fid.mean_kl > 1e-2
