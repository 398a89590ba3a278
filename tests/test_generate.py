"""The generation engine against Hugging Face `generate` on the same fp32 weights: the same greedy tokens
for each prompt alone and inside a batch of mixed lengths; seeded sampling the same alone and batched;
stop tokens, finish reasons and bad requests."""

from __future__ import annotations

import pytest
import torch

from overdrive.generate import Decoder, Generator, SamplingParams

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _hf(kind: str = "llama", **extra):
    """A small random causal LM of `kind` whose logits are peaked enough that fp32 summation order cannot
    flip a greedy token (weights drawn wider than the default initializer). "phi3-partial" rotates half of each
    head (as Phi-4-mini rotates three quarters); GPT-2 ties its LM head to the token embedding."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.25, tie_word_embeddings=False)
    if kind == "gpt2":
        config = transformers.GPT2Config(**{**dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                   initializer_range=0.25), **extra})
    elif kind.startswith("phi3"):
        rope = {"rope_type": "default", "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5 if kind == "phi3-partial" else 1.0}
        config = transformers.Phi3Config(**{**common, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                                            "rope_parameters": rope, **extra})
    else:
        config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[kind](**{**common, **extra})
    if kind == "mistral":
        config.sliding_window = None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(2, 12, (), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _hf_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Hugging Face `generate`, greedy, each prompt alone (no padding at all)."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False)
        out.append(y[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "phi3", "phi3-partial", "gpt2"])
def test_greedy_tokens_equal_hugging_face_generate_alone_and_in_a_batch_of_mixed_lengths(kind):
    hf = _hf(kind)
    prompts = _prompts(6)
    expected = _hf_greedy(hf, prompts, new=12)
    generator = Generator(Decoder.from_hf(hf), max_batch_size=8)
    params = SamplingParams(max_new_tokens=12)
    alone = [generator.generate([p], params)[0].token_ids for p in prompts]
    batched = [c.token_ids for c in generator.generate(prompts, params)]
    assert alone == expected
    assert batched == expected
    assert len({len(p) for p in prompts}) > 2  # the batch really mixes lengths


@pytest.mark.parametrize("kind", ["llama", "phi3-partial", "gpt2"])
def test_the_decoder_gives_hugging_faces_logits(kind):
    _assert_same_logits(_hf(kind))


def _assert_same_logits(hf) -> None:
    """The decoder's logits over one prompt, prefilled at once, against the Hugging Face model's."""
    from overdrive.generate import KVCache

    decoder = Decoder.from_hf(hf)
    ids = torch.tensor([_prompts(1)[0]])
    t = ids.shape[1]
    slots = torch.arange(t)
    mask = (slots[None, :, None] >= slots[None, None, :])[:, None]
    ours = decoder(ids, slots[None], KVCache(decoder.config, 1, t, device="cpu", dtype=torch.float32), slots, mask)
    torch.testing.assert_close(ours, hf(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch():
    generator = Generator(Decoder.from_hf(_hf()), max_batch_size=8)
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=100 + i) for i in range(4)]
    batched = [c.token_ids for c in generator.generate(prompts, params)]
    alone = [generator.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert batched == alone
    again = generator.generate(prompts[:1], SamplingParams(max_new_tokens=10, temperature=0.8, seed=101))
    other = generator.generate(prompts[:1], SamplingParams(max_new_tokens=10, temperature=0.8, seed=102))
    assert again[0].token_ids != other[0].token_ids  # the seed decides
    top1 = generator.generate(prompts[:1], SamplingParams(max_new_tokens=10, temperature=5.0, top_k=1, seed=7))
    greedy = generator.generate(prompts[:1], SamplingParams(max_new_tokens=10))
    assert top1[0].token_ids == greedy[0].token_ids  # top-k 1 is greedy at any temperature


def test_stop_tokens_and_max_tokens_give_finish_reasons():
    generator = Generator(Decoder.from_hf(_hf()))
    prompt = _prompts(1)[0]
    (free,) = generator.generate([prompt], SamplingParams(max_new_tokens=8))
    assert free.finish_reason == "length" and free.completion_tokens == 8 and free.prompt_tokens == len(prompt)
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    (stopped,) = generator.generate([prompt], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    # In a batch, a sequence that stops early leaves the others' tokens as they were.
    mates = generator.generate([prompt, *_prompts(2, seed=5)], SamplingParams(max_new_tokens=8, stop_token_ids=(stop,)))
    assert mates[0].token_ids == stopped.token_ids


@pytest.mark.parametrize("prompt,params,message", [
    ([], SamplingParams(), "empty prompt"),
    ([VOCAB], SamplingParams(), "token ids must be in"),
    ("text", SamplingParams(), "needs a tokenizer"),
    ([1, 2], SamplingParams(max_new_tokens=200), "exceeds the model's 128 positions"),
])
def test_bad_requests_are_refused_before_any_work(prompt, params, message):
    generator = Generator(Decoder.from_hf(_hf()))
    with pytest.raises(ValueError, match=message):
        generator.generate([prompt], params)


@pytest.mark.parametrize("kwargs,message", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0}, "top_p")])
def test_bad_sampling_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_models_outside_the_families_are_refused_by_name():
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="this model is 'gpt_neox'"):
        Decoder.from_hf(neox)


@pytest.mark.parametrize("kind, extra, message", [
    ("gpt2", {"activation_function": "relu"}, "activation 'relu' is not supported"),
    ("gpt2", {"add_cross_attention": True}, "cross-attention"),
    ("phi3", {"sliding_window": 32}, "sliding-window attention"),
    ("phi3", {"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_settings_the_decoder_would_not_follow_are_refused(kind, extra, message):
    """Each would otherwise load and answer wrongly (a GELU read as SiLU, a window ignored, ...)."""
    with pytest.raises(ValueError, match=message):
        Decoder.from_hf(_hf(kind, **extra))


def test_gpt2_scaled_by_layer_gives_hugging_faces_logits():
    """`scale_attn_by_inverse_layer_idx` (as some GPT-2 descendants train with): layer i's scores over i + 1."""
    hf = _hf("gpt2", scale_attn_by_inverse_layer_idx=True)
    assert Decoder.from_hf(hf).config.attention_scales == (0.25, 0.125)
    _assert_same_logits(hf)


def test_the_compiled_decode_step_gives_the_eager_tokens_and_records_its_timings():
    hf = _hf()
    prompts = _prompts(5, seed=11)
    params = SamplingParams(max_new_tokens=6)
    eager = Generator(Decoder.from_hf(hf), max_batch_size=4)
    compiled = Generator(Decoder.from_hf(hf), max_batch_size=4, compile=True)
    torch._dynamo.reset()
    expected = [c.token_ids for c in eager.generate(prompts, params)]
    assert [c.token_ids for c in compiled.generate(prompts, params)] == expected
    first, second = compiled.timings  # batches of 4 and 1
    assert (first.batch_size, second.batch_size) == (4, 1)
    assert first.prompt_tokens == sum(len(p) for p in prompts[:4]) and first.new_tokens == 4 * 6
    assert first.prefill_s > 0 and len(first.step_s) == 5 and all(s > 0 for s in first.step_s)
    torch._dynamo.reset()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", ["rows_mm", "reduction"])
def test_project_is_the_layer_eager_and_its_few_row_kernels_under_compile(bias, kernel, monkeypatch):
    """`decoder.project`: eager, bit for bit the layer's own call; compiled, every row count up to ROWS and beyond
    it within float32 summation error of `F.linear` (`rows_mm.float_rows_mm`, or the reduction where it is not
    built: a wrong index or a dropped bias would be far off), in the same shape; a layer that is not a plain
    `nn.Linear` (a quantised form, a subclass) or has a hook is called as it is."""
    from overdrive.generate import rows_mm
    from overdrive.generate.decoder import ROWS, project

    if kernel == "rows_mm" and not rows_mm.available()[0]:
        pytest.skip(f"overdrive's row kernels: {rows_mm.available()[1]}")
    if kernel == "reduction":
        monkeypatch.setattr(rows_mm, "FLOAT_OP", None)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = torch.nn.Linear(200, 70, bias=bias)
    compiled = torch.compile(lambda x: project(layer, x), dynamic=False)
    with torch.no_grad():
        for shape in [(1, 1, 200), (1, 200), (3, 1, 200), (ROWS, 1, 200), (ROWS + 4, 1, 200), (2, 5, 200)]:
            x = torch.randn(shape)
            expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert torch.equal(project(layer, x), expected)
            out = compiled(x)
            assert out.shape == expected.shape
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)

        class Doubled(torch.nn.Linear):
            def forward(self, x):
                return 2 * super().forward(x)

        doubled = Doubled(200, 70, bias=bias)
        hooked = torch.nn.Linear(200, 70, bias=bias)
        hooked.register_forward_hook(lambda module, args, out: out + 1)
        x = torch.randn(1, 1, 200)
        for other in (doubled, hooked):
            torch.testing.assert_close(torch.compile(lambda x: project(other, x), dynamic=False)(x), other(x))
    torch._dynamo.reset()


def test_the_float_row_kernel_is_float32_products_whose_rows_do_not_depend_on_their_batch_mates():
    """`rows_mm.float_rows_mm` against float64 products within float32 summation error, over shapes that leave
    every tail (in features not a multiple of 8, out features not of 3, rows not of 4); each row's bits the same
    alone as among 1 to 70 rows; empty inputs, gradients; bad calls refused. Under torch.compile through `project`, a row's output alone and
    in a batch of 70 are the same bits."""
    from overdrive.generate import rows_mm
    from overdrive.generate.decoder import project

    ok, why = rows_mm.available()
    if not ok:
        pytest.skip(f"overdrive's row kernels: {why}")
    torch.manual_seed(0)
    for out_f, in_f in [(70, 200), (1, 7), (2, 13), (5, 768), (3, 8), (4, 1)]:
        weight, x = torch.randn(out_f, in_f), torch.randn(70, in_f)
        whole = rows_mm.FLOAT_OP(x, weight)
        torch.testing.assert_close(whole, (x.double() @ weight.double().t()).float(), rtol=1e-5, atol=1e-5)
        for rows in (1, 2, 3, 4, 5, 9, 33):
            assert torch.equal(rows_mm.FLOAT_OP(x[:rows], weight), whole[:rows]), (out_f, in_f, rows)
        assert torch.equal(rows_mm.FLOAT_OP(x[7:8], weight), whole[7:8])
    assert rows_mm.FLOAT_OP(torch.zeros(0, 8), torch.zeros(3, 8)).shape == (0, 3)
    assert torch.equal(rows_mm.FLOAT_OP(torch.ones(2, 0), torch.ones(3, 0)), torch.zeros(2, 3))
    x, weight = torch.randn(5, 13, requires_grad=True), torch.randn(7, 13, requires_grad=True)
    grad = torch.randn(5, 7)
    rows_mm.FLOAT_OP(x, weight).backward(grad)  # its backward: the products of F.linear's
    torch.testing.assert_close(x.grad, grad @ weight.detach())
    torch.testing.assert_close(weight.grad, grad.t() @ x.detach())
    with pytest.raises(RuntimeError, match=r"takes float32 x \[M, in\] on the CPU, got double"):
        rows_mm.FLOAT_OP(torch.zeros(1, 8, dtype=torch.float64), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="takes float32 x and weight, got float, double"):
        rows_mm.FLOAT_OP(torch.zeros(1, 8), torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"got shapes \[1, 9\], \[3, 8\]"):
        rows_mm.FLOAT_OP(torch.zeros(1, 9), torch.zeros(3, 8))
    layer = torch.nn.Linear(96, 40)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: project(layer, x), dynamic=False)
    with torch.no_grad():
        x = torch.randn(rows_mm.FLOAT_ROWS, 96)
        together = compiled(x)
        assert all(torch.equal(compiled(x[i:i + 1]), together[i:i + 1]) for i in (0, 5, rows_mm.FLOAT_ROWS - 1))
    x = torch.randn(6, 96)  # with gradients asked for: a differentiable path (the op has no backward)
    compiled(x).sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0)[None].expand(40, 96), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


@pytest.mark.parametrize("form", ["decode_attention", "written-out"])
@pytest.mark.parametrize("heads,kv,scale", [(4, 4, None), (8, 2, 0.3)])
def test_attend_for_one_query_token_under_compile_is_sdpa(heads, kv, scale, form, monkeypatch):
    """`decoder.attend` compiled at one query token (`rows_mm.decode_attention` where built, eager too, else written
    out; eager then SDPA) against `F.scaled_dot_product_attention` with grouped key/value heads: rows of 1 to 5 batch-mates, each with its
    own masked-out slots (padding, unused cache), one with none to attend to (a batch's padding row: zeros, as SDPA
    gives, not NaN)."""
    from overdrive.generate import rows_mm
    from overdrive.generate.decoder import attend

    if form == "decode_attention" and not rows_mm.available()[0]:
        pytest.skip(f"overdrive's row kernels: {rows_mm.available()[1]}")
    if form == "written-out":
        monkeypatch.setattr(rows_mm, "ATTENTION_OP", None)
    torch._dynamo.reset()
    torch.manual_seed(0)
    b, s, d = 5, 40, 16
    q, keys, values = torch.randn(b, heads, 1, d), torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool)
    for row in range(b):
        mask[row, ..., : 3 * row] = False  # left padding
        mask[row, ..., s - row:] = False  # slots not written yet
    mask[3] = False
    expected = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                                enable_gqa=heads != kv)
    compiled = torch.compile(attend, dynamic=False, fullgraph=True)
    with torch.no_grad():
        out = compiled(q, keys, values, mask, scale)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        eager = attend(q, keys, values, mask, scale)
        if form == "written-out":
            assert torch.equal(eager, expected)  # eager without the kernel: SDPA itself
        else:  # eager with it: the kernel, as compiled
            assert torch.equal(eager, out)
    torch._dynamo.reset()


def test_the_decode_attention_kernel_gives_a_row_the_same_bits_whatever_its_padding_and_batch_mates():
    """`rows_mm.decode_attention`: a row's keys and values moved to other slots of a longer cache (as left padding
    moves them when a longer prompt joins the batch), among other rows, give the same bits; head sizes not a
    multiple of 8 and beyond 64 (the tails), one key/value head for all; bad calls refused."""
    from overdrive.generate import rows_mm

    ok, why = rows_mm.available()
    if not ok:
        pytest.skip(f"overdrive's row kernels: {why}")
    torch.manual_seed(0)
    for heads, kv, slots, d in [(12, 4, 70, 64), (4, 1, 9, 20), (6, 3, 33, 136)]:
        q, keys, values = torch.randn(3, heads, d), torch.randn(3, kv, slots, d), torch.randn(3, kv, slots, d)
        mask = torch.rand(3, slots) < 0.7
        alone = rows_mm.ATTENTION_OP(q[1:2], keys[1:2], values[1:2], mask[1:2], 0.2)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[1:2, :, None], keys[1:2], values[1:2], attn_mask=mask[1:2, None, None], scale=0.2,
            enable_gqa=heads != kv)[:, :, 0]
        torch.testing.assert_close(alone, expected, rtol=1e-5, atol=1e-5)
        shift, longer = 11, slots + 17
        moved_k, moved_v = torch.randn(4, kv, longer, d), torch.randn(4, kv, longer, d)
        moved_mask = torch.rand(4, longer) < 0.5
        moved_mask[2] = False
        moved_mask[2, shift:shift + slots] = mask[1]
        moved_k[2, :, shift:shift + slots], moved_v[2, :, shift:shift + slots] = keys[1], values[1]
        batch_q = torch.randn(4, heads, d)
        batch_q[2] = q[1]
        assert torch.equal(rows_mm.ATTENTION_OP(batch_q, moved_k, moved_v, moved_mask, 0.2)[2:3], alone)
    with pytest.raises(RuntimeError, match="takes float32 q, keys, values and a bool mask"):
        rows_mm.ATTENTION_OP(q.double(), keys, values, mask, 0.2)
    with pytest.raises(RuntimeError, match=r"H a multiple of kv"):
        rows_mm.ATTENTION_OP(torch.randn(3, 5, d), keys, values, mask, 0.2)


def test_pydoc_lm_holds_out_its_prompts_trains_from_a_seed_and_is_kept_in_the_cache(monkeypatch):
    """The recipe at toy size (the real one trains for minutes, once): the held-out sentences are never trained
    on, two trainings from the seed give the same weights, and a second build reads the cache."""
    from overdrive.workloads import pydoc_lm

    train, held_out = pydoc_lm.split()
    assert held_out and not set(train) & set(held_out)
    monkeypatch.setattr(pydoc_lm, "STEPS", 2)
    monkeypatch.setattr(pydoc_lm, "SHAPE", {**pydoc_lm.SHAPE, "hidden_size": 32, "intermediate_size": 64,
                                             "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
    lines: list[str] = []
    first = pydoc_lm.build_pydoc_lm(log=lines.append)
    assert any("training the tokenizer and the model" in line for line in lines)
    lines.clear()
    second = pydoc_lm.build_pydoc_lm(log=lines.append)
    assert not lines and second.facts == first.facts  # from the cache
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)
    assert 1 < first.facts["held_out_perplexity"] < 2 * len(first.tokenizer)
    prompt = held_out[0][:30]
    assert first.tokenizer.decode(first.tokenizer(prompt)["input_ids"]) == prompt  # byte-level: lossless
    (completion,) = Generator(Decoder.from_hf(first.model), first.tokenizer).generate(
        [prompt], SamplingParams(max_new_tokens=4))
    assert completion.text is not None and completion.completion_tokens == 4
