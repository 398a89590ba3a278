"""The decode roofline: the bytes a decode step reads (weights at their storage dtype, the embedding only when
tied to the head, the KV cache's slots) and the share of the bandwidth limit."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, Generator, SamplingParams
from overdrive.generate.quantize import copy_decoder, quantize_linears
from overdrive.generate.roofline import decode_roofline, kv_bytes_per_step, weight_bytes_per_step
from tests.test_generate import _hf

pytest.importorskip("transformers")


def _expected_fp32(decoder: Decoder) -> int:
    c = decoder.config
    per_layer = (c.hidden_size * c.num_heads * c.head_dim * 2 + c.hidden_size * c.num_kv_heads * c.head_dim * 2
                 + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)  # q, o, k, v; MLP; two norms
    return 4 * (c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size) + 4 * (c.head_dim // 2)  # + inv_freq


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_every_weight_once_and_the_embedding_only_as_the_head(tied):
    decoder = Decoder.from_hf(_hf(tie_word_embeddings=tied))
    assert weight_bytes_per_step(decoder) == _expected_fp32(decoder)


def test_gpt2_reads_every_weight_and_bias_once_and_no_position_embedding():
    """Learned positions: one row per sequence a step, as the token embedding (here tied, so read as the head)."""
    decoder = Decoder.from_hf(_hf("gpt2"))
    c = decoder.config
    per_layer = (4 * c.hidden_size * c.hidden_size + 4 * c.hidden_size  # q, k, v, o and their biases
                 + 2 * c.hidden_size * c.intermediate_size + c.intermediate_size + c.hidden_size  # up, down, biases
                 + 4 * c.hidden_size)  # two LayerNorms, weight and bias
    expected = 4 * (c.num_layers * per_layer + 2 * c.hidden_size + c.vocab_size * c.hidden_size)
    assert weight_bytes_per_step(decoder) == expected + 4 * (c.head_dim // 2)  # + the (unused) inv_freq buffer


@pytest.fixture
def fp16_offered(monkeypatch):
    """FBGEMM's fp16 form offered whatever this CPU's row-count probe says (the bytes counted do not depend on it)."""
    from overdrive.generate import quantize

    monkeypatch.setattr(quantize, "_FP16_ROWS", [None])


def test_low_precision_weights_are_counted_at_their_storage_dtype(fp16_offered):
    decoder = Decoder.from_hf(_hf())
    fp32 = weight_bytes_per_step(decoder)
    for form, low, high in (("int8-weight", 0.25, 0.32), ("int8-rowwise", 0.25, 0.32), ("fp16-weight", 0.5, 0.55),
                            ("int4-weight", 0.15, 0.19)):  # half a byte, and a scale and zero point per 64
        converted = copy_decoder(decoder)
        quantize_linears(converted, form=form)
        assert low * fp32 <= weight_bytes_per_step(converted) <= high * fp32, form


def test_the_kv_cache_and_the_share():
    decoder = Decoder.from_hf(_hf())
    c = decoder.config
    assert kv_bytes_per_step(decoder, batch_size=3, slots=10, dtype=torch.float32) == \
        2 * c.num_layers * 3 * c.num_kv_heads * 10 * c.head_dim * 4
    generator = Generator(decoder)
    generator.generate([[1, 2, 3]], SamplingParams(max_new_tokens=5))
    (t,) = generator.timings
    assert t.slots == 8
    point = decode_roofline(decoder, batch_size=1, slots=t.slots, cache_dtype=torch.float32, steps_per_s=100.0,
                            peak_bytes_per_s=1e10)
    assert point.achieved_bytes_per_s == (point.weight_bytes + point.kv_bytes) * 100.0
    assert point.share == pytest.approx(point.achieved_bytes_per_s / 1e10) and "of the bandwidth limit" in point.describe()
    measured = decode_roofline(decoder, batch_size=1, slots=8, cache_dtype=torch.float32, steps_per_s=1.0)
    assert measured.peak_bytes_per_s > 1e8  # this machine's read bandwidth, measured


def _pass(generator: Generator, batch: int, new: int):
    prompts = [[3 + i, 5, 7, 11, 13][: 2 + i % 4] for i in range(batch)]
    return lambda: generator.generate(prompts, SamplingParams(max_new_tokens=new))


@pytest.mark.parametrize("compiled", [False, True])
def test_the_peak_memory_split_sees_the_kv_cache_and_what_else_a_pass_holds(compiled):
    """The CPU measurement (the allocations the profiler sees, in order) against what is known: a pass's peak holds
    at least its KV cache, grows with the batch by about the cache's growth, and sees a planted 32 MB buffer."""
    from overdrive.generate.memory import measure_pass, storage_bytes

    decoder = Decoder.from_hf(_hf(max_position_embeddings=1024))
    generator = Generator(decoder, max_batch_size=16, compile=compiled)
    splits = {}
    for batch in (1, 16):
        run = _pass(generator, batch, 48)
        run()  # compiles
        kv = kv_bytes_per_step(decoder, batch_size=batch, slots=generator.timings[-1].slots, dtype=torch.float32)
        splits[batch] = measure_pass(decoder, run, kv_cache_bytes=kv)
        assert splits[batch].kv_cache == kv and splits[batch].weights == storage_bytes(decoder)
        assert splits[batch].peak == splits[batch].weights + splits[batch].kv_cache + splits[batch].other
        assert splits[batch].source == "cpu_profiler"
    grew = splits[16].kv_cache + splits[16].other - splits[1].kv_cache - splits[1].other
    assert grew >= splits[16].kv_cache - splits[1].kv_cache
    planted = 32 << 20

    def with_a_buffer():
        held = torch.ones(planted // 4)
        _pass(generator, 16, 48)()
        return held

    more = measure_pass(decoder, with_a_buffer, kv_cache_bytes=splits[16].kv_cache)
    assert planted <= more.other - splits[16].other <= planted + (1 << 20)


def test_a_pass_whose_allocations_were_not_seen_is_refused():
    from overdrive.generate.memory import measure_pass

    decoder = Decoder.from_hf(_hf())
    with pytest.raises(RuntimeError, match="not all seen"):
        measure_pass(decoder, lambda: None, kv_cache_bytes=1 << 20)


def test_the_weights_in_the_memory_split_count_fp16_weights_packed_by_fbgemm(capfd, fp16_offered):
    """FBGEMM's packed fp16 weights are no parameter or buffer: counted at 2 bytes each. The profiler's native log lines
    (its start and stop; on a machine without a GPU an "ERROR" about the GPU count) do not reach the user."""
    from overdrive.generate.memory import measure_pass, storage_bytes

    decoder = Decoder.from_hf(_hf())
    linears = [m for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    fp16 = copy_decoder(decoder)
    quantize_linears(fp16, form="fp16-weight")
    assert storage_bytes(fp16) == storage_bytes(decoder) - 2 * sum(m.weight.numel() for m in linears)
    generator = Generator(fp16)
    run = _pass(generator, 2, 8)
    run()
    kv = kv_bytes_per_step(fp16, batch_size=2, slots=generator.timings[-1].slots, dtype=torch.float32)
    capfd.readouterr()
    assert measure_pass(fp16, run, kv_cache_bytes=kv).weights == storage_bytes(fp16)
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "gpuGetDeviceCount" not in err, err
