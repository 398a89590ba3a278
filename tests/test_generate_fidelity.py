"""The guard's figures for generation: a faithful candidate reads zero; a planted KV-cache bug (a cache slot
of one sequence written with another's keys and values) is caught in a batch of mixed lengths; a lossy one
shows in KL and perplexity; near ties are counted apart."""

from __future__ import annotations

import math

import pytest
import torch

from overdrive.generate import Decoder, Generator
from overdrive.generate.fidelity import (GenerationFidelity, batch_invariance, batched_sequence_logits,
                                         judge_generation, perplexity, sequence_logits)
from tests.test_generate import _hf, _prompts

pytest.importorskip("transformers")


class _LeakyDecoder(Decoder):
    """Decode steps write row 0's keys and values into row 1's slot as well: sequence 1 reads sequence 0's cache."""

    def forward(self, tokens, positions, cache, slots, mask, last_only=False):
        logits = super().forward(tokens, positions, cache, slots, mask, last_only)
        if tokens.shape[1] == 1 and tokens.shape[0] > 1:
            for keys, values in zip(cache.keys, cache.values):
                keys[1, :, slots] = keys[0, :, slots]
                values[1, :, slots] = values[0, :, slots]
        return logits


def _copy(decoder: Decoder, cls=Decoder) -> Decoder:
    other = cls(decoder.config)
    other.load_state_dict(decoder.state_dict())
    return other.eval()


@pytest.fixture(scope="module")
def reference():
    return Generator(Decoder.from_hf(_hf()), max_batch_size=8)


def test_the_same_model_reads_zero(reference):
    candidate = Generator(_copy(reference.model), max_batch_size=8)
    held_out = _prompts(4, seed=7)
    fid = judge_generation(reference, candidate, _prompts(8), max_new_tokens=10, held_out=held_out)
    assert fid.diverged == fid.diverged_beyond_ties == 0 and fid.first_divergence == [None] * 8
    assert 0 <= fid.mean_kl < 1e-6 and fid.perplexity_change == pytest.approx(0, abs=1e-5)
    assert fid.tokens == 80 and fid.breaks() is None


def test_a_cache_slot_shared_by_two_sequences_is_caught_in_a_batch(reference):
    candidate = Generator(_copy(reference.model, _LeakyDecoder), max_batch_size=8)
    prompts = _prompts(8)
    fid = judge_generation(reference, candidate, prompts, max_new_tokens=10)
    assert fid.first_divergence[1] is not None and fid.diverged_beyond_ties >= 1, fid
    assert all(at is None for i, at in enumerate(fid.first_divergence) if i != 1)  # only the leaked-into row
    assert "greedy tokens changed on" in fid.breaks()
    alone = judge_generation(reference, candidate, prompts[1:2], max_new_tokens=10)  # batch 1: nothing to leak
    assert alone.diverged == 0


def test_lossy_weights_show_in_kl_and_perplexity(reference):
    noisy = _copy(reference.model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in noisy.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.abs().mean())
    fid = judge_generation(reference, Generator(noisy, max_batch_size=8), _prompts(8), max_new_tokens=10,
                           held_out=_prompts(4, seed=7))
    assert fid.mean_kl > 1e-3 and fid.max_kl >= fid.mean_kl
    assert fid.perplexity_change != 0
    assert "mean KL" in (fid.breaks(max_diverged_share=1.0, max_mean_kl=1e-4) or "")
    assert fid.diverged >= fid.diverged_beyond_ties


def test_near_ties_are_counted_apart_and_non_finite_figures_break():
    fid = GenerationFidelity(prompts=4, tokens=40, diverged=2, diverged_beyond_ties=0, first_divergence=[3, None, 5, None],
                             mean_kl=1e-4, max_kl=1e-3)
    assert fid.breaks() is None
    fid.diverged_beyond_ties = 1
    assert "1 of 4 prompts" in fid.breaks() and "1 more at near ties" in fid.breaks()
    assert fid.breaks(max_diverged_share=0.25) is None
    fid.mean_kl = math.nan
    assert "non-finite" in fid.breaks(max_diverged_share=1.0)


def test_sequence_logits_are_the_decoders_and_perplexity_is_their_likelihood(reference):
    ids = _prompts(1)[0]
    logits = sequence_logits(reference.model, ids)
    assert logits.shape == (len(ids), reference.model.config.vocab_size) and logits.dtype == torch.float32
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert perplexity(reference.model, [ids]) == pytest.approx(math.exp(float(nll)), rel=1e-5)
    with pytest.raises(ValueError, match="at least one text"):
        perplexity(reference.model, [[5]])


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_batched_sequence_logits_are_each_texts_own_whatever_its_padding(kind):
    """Texts of mixed lengths, right-padded into groups of 3: each row's logits are its own (RoPE and learned
    positions alike), to the summation order of a larger GEMM."""
    decoder = Decoder.from_hf(_hf(kind))
    texts = _prompts(7, seed=5)
    assert len({len(t) for t in texts}) > 2
    for alone, batched in zip((sequence_logits(decoder, t) for t in texts), batched_sequence_logits(decoder, texts, 3)):
        assert batched.shape == alone.shape
        torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


class _PerTensorInt8(torch.nn.Module):
    """FBGEMM's dynamic int8 linear: one activation scale for the whole call, shared by every row in it."""

    def __init__(self, linear):
        super().__init__()
        self.inner = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                            dtype=torch.qint8)

    def forward(self, x):
        return self.inner(x)


def test_a_form_whose_rows_share_an_activation_scale_is_caught_by_the_batch_probe(reference):
    assert batch_invariance(reference, _prompts(8), max_new_tokens=10).breaks() is None
    shared = _copy(reference.model)
    for block in shared.model.layers:
        block.mlp.down_proj = _PerTensorInt8(block.mlp.down_proj)
    shared.lm_head = _PerTensorInt8(shared.lm_head)
    probe = batch_invariance(Generator(shared, max_batch_size=8), _prompts(8), max_new_tokens=10)
    assert probe.differ_beyond_ties and "depends on its batch-mates" in probe.breaks(), probe
