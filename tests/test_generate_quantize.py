"""Low-precision weights for the decoder: each form's arithmetic, its rows independent of their batch-mates,
the per-layer search against the KL budget, and a tied LM head converted without touching the embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.generate import Decoder, Generator, SamplingParams
from overdrive.generate.fidelity import judge_generation
from overdrive.generate.quantize import (FORMS, Int4WeightLinear, Int8WeightLinear, convert_linear, copy_decoder, holds,
                                         linear_names, mean_kl, pick_form, quantize_linears, search_layers)
from tests.test_generate import _hf, _prompts

pytest.importorskip("transformers")


@pytest.mark.parametrize("kernel", ["int8pack", "dequantize"])
def test_the_int8_layer_is_the_float_layer_to_int8_rounding(kernel):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    layer = Int8WeightLinear(linear, kernel)
    assert layer.weight_int8.dtype == torch.int8 and layer.weight_int8.shape == (48, 64) and layer.scale.shape == (48,)
    x = torch.randn(3, 5, 64)
    got, want = layer(x), linear(x)
    assert got.shape == (3, 5, 48)
    # each weight moves by at most half a step (absmax / 254 of its row): the output by at most Σ|x|·step/2
    bound = (x.abs() @ (linear.weight.abs().amax(1, keepdim=True) / 254).expand(-1, 64).T)
    assert ((got - want).abs() <= bound + 1e-5).all()
    other = Int8WeightLinear(linear, "dequantize" if kernel == "int8pack" else "int8pack")
    torch.testing.assert_close(layer(x), other(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kernel must be one of"):
        Int8WeightLinear(linear, "int4")


def _rows_mm_or_skip():
    from overdrive.generate import rows_mm

    ok, why = rows_mm.available()
    if not ok:
        pytest.skip(f"overdrive's int8 kernel: {why}")
    return rows_mm


def test_the_int8_kernel_gives_the_exact_integer_products_at_every_row_count_and_shape():
    """`rows_mm.int8_rows_mm` (this CPU's `rows_mm.ISA`) against int64 arithmetic: values at both int8 extremes
    (-128 included: VNNI's u8 offset; AVX2's int16 pairs at their largest, 2 · 128²; and activations without -128,
    AVX2's vpmaddubsw form, its pairs at their largest, 2 · 128 · 127), inputs not a multiple of 64
    or 32 (the tails), fewer outputs than a block, a sum beyond 2²⁴; bad calls refused."""
    rows_mm = _rows_mm_or_skip()
    torch.manual_seed(0)
    for out_f, in_f in [(768, 768), (70, 200), (5, 63), (1, 1), (33, 4100), (3, 65), (2, 128)]:
        weight = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)
        weight[0], weight[-1] = 127, -128
        sums = weight.sum(1, dtype=torch.int32)
        for rows in (1, 2, 3, 4, 5, 8, 13):
            x = torch.randint(-128, 128, (rows, in_f), dtype=torch.int8)
            x[0] = -128
            assert torch.equal(rows_mm.OP(x, weight, sums), (x.long() @ weight.long().t()).int()), (out_f, in_f, rows)
            x[x == -128] = -127  # no -128 in the activations: AVX2's vpmaddubsw form, against weights of -128 too
            assert torch.equal(rows_mm.OP(x, weight, sums), (x.long() @ weight.long().t()).int()), (out_f, in_f, rows)
    weight = torch.zeros(3, 8, dtype=torch.int8)
    sums = weight.sum(1, dtype=torch.int32)
    assert rows_mm.OP(torch.zeros(0, 8, dtype=torch.int8), weight, sums).shape == (0, 3)
    empty = torch.zeros(3, 0, dtype=torch.int8)
    assert torch.equal(rows_mm.OP(torch.zeros(2, 0, dtype=torch.int8), empty, torch.zeros(3, dtype=torch.int32)),
                       torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"weight_sums \[out\], got shapes \[3, 8\], \[3, 1\]"):
        rows_mm.OP(torch.zeros(1, 8, dtype=torch.int8), weight, sums[:, None])
    with pytest.raises(RuntimeError, match="takes int8 x, got float"):
        rows_mm.OP(torch.zeros(1, 8), weight, sums)
    with pytest.raises(RuntimeError, match=r"got shapes \[1, 9\], \[3, 8\]"):
        rows_mm.OP(torch.zeros(1, 9, dtype=torch.int8), weight, sums)
    wide = torch.zeros(1, rows_mm.MAX_IN + 1, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="could overflow its int32 sums"):
        rows_mm.OP(wide, wide, torch.zeros(1, dtype=torch.int32))


def test_the_fused_int8_linear_gives_the_bits_of_the_layers_own_arithmetic():
    """`rows_mm.int8_rows_linear` (the activations' rounding, the exact product, both scales and the bias in one
    call) against `Int8RowwiseLinear`'s operations in PyTorch: the same bits at every row count and shape, with
    rows at the rounding's ties and at zero, weights at -128; a row holding NaN or inf gives NaN, not numbers."""
    from overdrive.generate.quantize import _int8_rows

    rows_mm = _rows_mm_or_skip()
    torch.manual_seed(0)
    for out_f, in_f in [(768, 768), (70, 200), (5, 63), (1, 1), (33, 4100)]:
        weight = torch.randint(-128, 128, (out_f, in_f), dtype=torch.int8)
        weight[-1] = -128
        sums, scale, bias = weight.sum(1, dtype=torch.int32), torch.rand(out_f) / 100, torch.randn(out_f)
        for rows in (1, 2, 5, 13, 40):  # 40: the rounding and rescaling split across threads
            x = torch.randn(rows, in_f) * 4
            x[0] = 0.0
            if rows > 1:  # halves of the row's step: round half to even, as torch.round
                x[1] = torch.arange(in_f) % 7 - 3.5
                x[1, 0] = 127.0
            qx, sx = _int8_rows(x)
            plain = (qx.long() @ weight.long().t()).int().float() * sx[:, None] * scale[None, :]
            assert torch.equal(rows_mm.LINEAR_OP(x, weight, sums, scale, None), plain), (out_f, in_f, rows)
            assert torch.equal(rows_mm.LINEAR_OP(x, weight, sums, scale, bias), plain + bias), (out_f, in_f, rows)
    x = torch.randn(4, 200)
    x[1, 5], x[2, 7] = float("nan"), float("-inf")
    y = rows_mm.LINEAR_OP(x, weight[:, :200].contiguous(), sums, scale, bias)
    assert y[[1, 2]].isnan().all() and y[[0, 3]].isfinite().all()
    assert rows_mm.LINEAR_OP(torch.zeros(0, 200), weight[:, :200], sums, scale, None).shape == (0, out_f)
    with pytest.raises(RuntimeError, match=r"takes float32 x \[M, in\] on the CPU, got double"):
        rows_mm.LINEAR_OP(x.double(), weight[:, :200], sums, scale, None)
    with pytest.raises(RuntimeError, match="takes float32 x, scale and bias, got float, double"):
        rows_mm.LINEAR_OP(x, weight[:, :200], sums, scale.double(), None)
    with pytest.raises(RuntimeError, match="as many weights, weight_sums and scales, got 1, 2, 1"):
        rows_mm.LINEARS_OP(x, [weight[:, :200]], [sums, sums], [scale])
    with pytest.raises(RuntimeError, match="takes float32 x, scale and bias, got float, float, double"):
        rows_mm.LINEAR_OP(x, weight[:, :200], sums, scale, bias.double())
    with pytest.raises(RuntimeError, match=r"got shapes \[4, 200\], \[33, 200\], \[33\], \[3\]"):
        rows_mm.LINEAR_OP(x, weight[:, :200].contiguous(), sums, scale, bias[:3])
    with pytest.raises(RuntimeError, match=r"scale \[out\], bias \[out\], got shapes"):
        rows_mm.LINEAR_OP(x, weight[:, :200], sums, scale[:3], None)


def test_int8_rowwise_keeps_its_dtype_and_leaves_the_kernel_when_gradients_are_asked_for():
    """A bfloat16 x through a layer with a float32 bias answers in bfloat16 (x's dtype, as documented); x asking for
    gradients takes the layer's PyTorch path (the op has no backward), with the same values."""
    import warnings

    from overdrive.generate.quantize import Int8RowwiseLinear

    _rows_mm_or_skip()
    torch.manual_seed(0)
    layer = Int8RowwiseLinear(nn.Linear(64, 16))
    assert layer(torch.randn(2, 64).bfloat16()).dtype == torch.bfloat16
    x = torch.randn(2, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "autograd kernel was not registered" warning
        asked = layer(x.clone().requires_grad_())
    assert torch.equal(asked.detach(), layer(x))


def test_projections_of_one_x_in_one_kernel_call_give_each_layers_own_bits():
    """`decoder.project_many` (a layer's q, k, v; gate and up) in one call of `rows_mm.int8_rows_linears` or
    `rows_mm.float_rows_mms`: each output the same bits as its layer called alone, with biases, at 1 and 5 rows,
    eager and compiled; mixed forms and a layer with a hook go layer by layer (the hook runs)."""
    from overdrive.generate.decoder import project, project_many
    from overdrive.generate.quantize import Int8RowwiseLinear

    rows_mm = _rows_mm_or_skip()
    torch.manual_seed(0)
    plain = (nn.Linear(96, 40), nn.Linear(96, 7, bias=False), nn.Linear(96, 100))
    rowwise = tuple(Int8RowwiseLinear(layer) for layer in plain)
    x = torch.randn(5, 1, 96)
    torch._dynamo.reset()
    with torch.no_grad():
        for layers in (plain, rowwise):
            compiled_many = torch.compile(lambda x: project_many(layers, x), dynamic=False, fullgraph=True)
            compiled_one = torch.compile(lambda x: [project(layer, x) for layer in layers], dynamic=False,
                                         fullgraph=True)
            for rows in (1, 5):
                for got, expected in zip(compiled_many(x[:rows]), compiled_one(x[:rows])):
                    assert torch.equal(got, expected), (type(layers[0]).__name__, rows)
        for got, layer in zip(project_many(rowwise, x), rowwise):  # eager: the kernel too
            assert torch.equal(got, layer(x))
        with torch.no_grad():
            ys = rows_mm.FLOATS_OP(x[:, 0], [layer.weight for layer in plain])
        assert all(torch.equal(y, rows_mm.FLOAT_OP(x[:, 0], layer.weight)) for y, layer in zip(ys, plain))
        mixed = (rowwise[0], plain[1])
        assert all(torch.equal(got, layer(x)) for got, layer in zip(project_many(mixed, x), mixed))
        calls = []
        rowwise[1].register_forward_hook(lambda module, args, out: calls.append(1))
        assert all(torch.equal(got, layer(x)) for got, layer in zip(project_many(rowwise, x), rowwise))
        assert len(calls) == 2  # once in project_many, once in the comparison
    torch._dynamo.reset()


def test_int8_rowwise_keeps_its_kernel_sums_through_a_loaded_state_dict_and_takes_empty_inputs():
    """`weight_sums` is derived (not in the state dict): loading another layer's weights must recompute it, or
    every call of ≤ 4 rows (the VNNI kernel's) would be off while larger calls (`_int_mm`) were right. A call of no
    rows gives an empty answer, as `_int_mm`'s path does."""
    from overdrive.generate.quantize import Int8RowwiseLinear

    _rows_mm_or_skip()
    torch.manual_seed(0)
    first, second = Int8RowwiseLinear(nn.Linear(100, 37)), Int8RowwiseLinear(nn.Linear(100, 37))
    first.load_state_dict(second.state_dict())
    x = torch.randn(3, 100)
    assert torch.equal(first(x), second(x)) and torch.equal(first(x), second(torch.cat([x] * 6))[:3])
    assert first(torch.randn(0, 100)).shape == (0, 37) and first(torch.randn(2, 0, 100)).shape == (2, 0, 37)


def test_a_failed_int8_kernel_build_is_said_and_int8_rowwise_keeps_the_exact_products(monkeypatch):
    import torch.utils.cpp_extension

    from overdrive.generate import rows_mm
    from overdrive.generate.quantize import Int8RowwiseLinear

    def broken(**kwargs):
        raise RuntimeError("Error building extension 'overdrive_int8_vnni'\nninja: build stopped")

    monkeypatch.setattr(rows_mm, "OP", None)
    monkeypatch.setattr(rows_mm, "_STATE", rows_mm._UNBUILT)
    monkeypatch.setattr(rows_mm, "_cpu_isa", lambda: "avx2")
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", broken)
    torch.manual_seed(0)
    linear = nn.Linear(64, 24)
    with pytest.warns(RuntimeWarning, match="avx2 row kernels are not used: its build failed.*ninja: build stopped"):
        layer = Int8RowwiseLinear(linear)
    assert rows_mm.available() == (False, rows_mm._STATE) and rows_mm.OP is None
    x = torch.randn(3, 64)
    assert torch.equal(layer(x[:1]), layer(torch.cat([x[:1]] * 17))[:1])  # _int_mm at 1 row and at 17


@pytest.mark.parametrize("kernel", ["rows_mm", "spans"])
def test_int8_rowwise_few_row_kernels_give_the_bits_of_int_mm(kernel, monkeypatch):
    """At up to `rows_mm.ROWS` rows (4 with VNNI, all on AVX2) the layer's products are `rows_mm.int8_rows_mm`'s,
    eager or compiled; without it, under torch.compile a one-row call is exact float32 spans of int8 products; more
    rows `_int_mm`: all are the exact integer dot products, so a row's output is the same bits whichever its call's
    row count picked, and the same as eager's. Rows of the weights and of x near the int8 extremes: sums of 2,048
    products near 127² (beyond 2²⁴, where float32 stops holding integers exactly) check that the spans are short
    enough."""
    from overdrive.generate import rows_mm
    from overdrive.generate.quantize import COMPILE_OPTIONS, EXACT_SPAN, Int8RowwiseLinear

    if kernel == "rows_mm":
        _rows_mm_or_skip()
    else:
        monkeypatch.setattr(rows_mm, "OP", None)
    torch._dynamo.reset()
    torch.manual_seed(0)
    for in_f in (2048, 3 * EXACT_SPAN // 2, 64):
        linear = nn.Linear(in_f, 96, bias=True)
        with torch.no_grad():  # 32 rows of int8 values 114..127, of mixed parity: sums odd and beyond 2²⁴
            linear.weight[:32] = torch.empty(32, in_f).uniform_(0.9, 1.0)
            linear.weight[:32, 0] = 1.0
        layer = Int8RowwiseLinear(linear)
        x = torch.randn(5, 1, in_f)
        x[0] = 1.0
        with torch.no_grad():
            eager = layer(x)
            compiled = torch.compile(layer, dynamic=False, options=COMPILE_OPTIONS)
            for rows in (1, 3, 5):
                assert torch.equal(compiled(x[:rows]), eager[:rows]), (in_f, rows)
                assert torch.equal(layer(x[:rows]), eager[:rows]), (in_f, rows)
            assert all(torch.equal(compiled(x[i:i + 1]), eager[i:i + 1]) for i in range(5))
        assert (eager - linear(x)).abs().max() < 0.05 * linear(x).abs().max()
    torch._dynamo.reset()


def test_int8_rowwise_beyond_the_kernels_rows_through_exact_float_spans_gives_the_bits_of_int_mm(monkeypatch):
    """On an AVX2 CPU a call of more than `rows_mm.ROWS` rows (a prefill) is float32 GEMMs over spans of
    `EXACT_SPAN` inputs, each span's sums integers of at most 2²⁴ (exact in any order), added in int32: the same bits
    as `_int_mm`'s, at the int8 extremes (-128 too: 1,024 · 128² = 2²⁴ exactly) and with spans of two lengths."""
    from overdrive.generate import rows_mm
    from overdrive.generate.quantize import EXACT_SPAN, Int8RowwiseLinear

    torch.manual_seed(0)
    for in_f in (2 * EXACT_SPAN, 3 * EXACT_SPAN // 2 + 7, 64):
        layer = Int8RowwiseLinear(nn.Linear(in_f, 40))
        layer.weight_int8[:8] = -128
        layer.weight_int8[8:16] = 127
        x = torch.randn(9, in_f)
        x[:3] = -1.0  # rows of -127 after rounding
        monkeypatch.setattr(rows_mm, "OP", None)
        monkeypatch.setattr(rows_mm, "LARGE", "_int_mm")
        expected = layer(x)
        monkeypatch.setattr(rows_mm, "LARGE", "float-spans")
        assert torch.equal(layer(x), expected), in_f
        assert torch.equal(layer(x[4:5]), expected[4:5]), in_f


def test_the_int4_layer_is_the_float_layer_rounded_to_16_levels_per_group_of_64():
    torch.manual_seed(0)
    linear = nn.Linear(128, 32, bias=True)
    layer = Int4WeightLinear(linear)
    assert layer.weight_int4.dtype == torch.uint8 and layer.weight_int4.numel() == 32 * 128 // 2  # two to a byte
    groups = linear.weight.detach().reshape(32, 2, 64)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (high - low) / 15
    rounded = (low + torch.round((groups - low) / step) * step).reshape(32, 128)  # written out, apart from the code
    assert ((rounded - linear.weight).abs() <= step.expand(-1, -1, 64).reshape(32, 128) / 2 + 1e-6).all()
    x = torch.randn(5, 3, 128)
    torch.testing.assert_close(layer(x), x @ rounded.T + linear.bias, rtol=1e-4, atol=1e-4)
    for shape, message in (((100, 32), "in features a multiple of 64"), ((64, 10), "out features a multiple of 16")):
        odd = nn.Linear(*shape)
        assert not holds("int4-weight", odd)
        with pytest.raises(ValueError, match=message):
            Int4WeightLinear(odd)


def test_a_form_that_cannot_hold_a_layer_leaves_it_in_float32_and_says_so():
    decoder = Decoder.from_hf(_hf(vocab_size=100))  # an LM head of 100 outputs: not a multiple of 16
    held = linear_names(decoder, "int4-weight")
    assert "lm_head" not in held and len(held) == len(linear_names(decoder)) - 1
    assert quantize_linears(copy_decoder(decoder), form="int4-weight") == held
    names, sensitivity, _ = search_layers(decoder, _prompts(4, seed=5), max_mean_kl=1.0, form="int4-weight")
    assert names == held and set(sensitivity) == set(held)
    _, timings = pick_form([(100, 64), (48, 64)], forms=["int4-weight"], repeats=2)
    assert 0 < timings["int4-weight"] < float("inf")  # the (100, 64) layer counted at float32's time
    _, timings = pick_form([(100, 64)], forms=["int4-weight"], repeats=2)
    assert timings["int4-weight"] == float("inf")  # it holds none of them


def test_quantizing_every_layer_keeps_greedy_tokens_on_a_peaked_model_and_names_are_checked():
    decoder = Decoder.from_hf(_hf())
    int8 = copy_decoder(decoder)
    names = quantize_linears(int8)
    assert names == linear_names(decoder) and not linear_names(int8)
    fid = judge_generation(Generator(decoder, max_batch_size=8), Generator(int8, max_batch_size=8), _prompts(8),
                           max_new_tokens=8)
    assert fid.mean_kl < 0.05 and fid.breaks(max_diverged_share=0.25) is None, fid
    with pytest.raises(KeyError, match="not linear layers"):
        quantize_linears(copy_decoder(decoder), ["model.norm"])


def test_the_search_keeps_the_budget_and_takes_everything_when_it_is_loose():
    decoder = Decoder.from_hf(_hf())
    texts = _prompts(6, seed=5)
    none, sensitivity, kl = search_layers(decoder, texts, max_mean_kl=0.0)
    assert none == [] and kl == 0.0 and set(sensitivity) == set(linear_names(decoder))
    everything, _, kl_all = search_layers(decoder, texts, max_mean_kl=1.0)
    assert everything == linear_names(decoder) and kl_all > 0
    budget = sorted(sensitivity.values())[len(sensitivity) // 2]  # about half the layers' worth
    some, _, kl_some = search_layers(decoder, texts, max_mean_kl=budget)
    assert 0 < len(some) < len(everything) and kl_some <= budget
    trial = copy_decoder(decoder)
    quantize_linears(trial, some)
    assert mean_kl(decoder, trial, texts) == pytest.approx(kl_some)
    assert min(sensitivity, key=sensitivity.get) in some  # the least sensitive goes first


def test_a_tied_head_is_quantized_apart_from_the_embedding():
    decoder = Decoder.from_hf(_hf(tie_word_embeddings=True))
    assert decoder.lm_head.weight is decoder.model.embed_tokens.weight
    embedding = decoder.model.embed_tokens.weight.detach().clone()
    int8 = copy_decoder(decoder)
    assert int8.lm_head.weight is int8.model.embed_tokens.weight
    quantize_linears(int8, ["lm_head"])
    assert isinstance(int8.lm_head, Int8WeightLinear) and torch.equal(int8.model.embed_tokens.weight, embedding)
    out = Generator(int8).generate([[3, 4, 5]], SamplingParams(max_new_tokens=4))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("form", FORMS)
def test_each_form_is_close_to_the_float_layer_and_its_rows_do_not_depend_on_their_batch_mates(form):
    """Every form, where offered; fp16-weight where FBGEMM's rows depend on their call's row count (an AVX2 CPU) is
    refused, and says why, rather than offered."""
    from overdrive.generate.quantize import fp16_rows_refusal

    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    if form == "fp16-weight" and fp16_rows_refusal() is not None:
        assert not holds(form, linear) and "different bits at different row counts" in fp16_rows_refusal()
        with pytest.raises(ValueError, match="not offered here: .*batch-mates"):
            convert_linear(linear, form)
        return
    layer = convert_linear(linear, form)
    x = torch.randn(16, 64)
    x[3] *= 50  # one loud row: a shared activation scale would crush the others
    got, want = layer(x), linear(x)
    # 16 levels per group of 64 weights for int4 (its arithmetic: the test above); 256 per row for int8
    assert torch.nn.functional.cosine_similarity(got, want).min() > (0.99 if form == "int4-weight" else 0.999)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(16)])
    assert torch.equal(alone, got) or torch.allclose(alone, got, rtol=1e-6, atol=1e-6)
    assert layer(x[None]).shape == (1, 16, 48)


def test_forms_are_checked():
    with pytest.raises(ValueError, match="form must be one of"):
        convert_linear(nn.Linear(4, 4), "int4")
    with pytest.raises(ValueError, match="CPU kernel for float32"):
        convert_linear(nn.Linear(4, 4).to(torch.bfloat16), "fp16-weight")


@pytest.mark.parametrize("compiled", [False, True])
def test_pick_form_times_every_form_on_the_shapes_given(compiled):
    choice, timings = pick_form([(32, 16), (48, 16), (32, 16)], repeats=2, compiled=compiled)
    assert choice in (*FORMS, None) and set(timings) == {"float32", *FORMS}
    assert all(t > 0 for t in timings.values())
    if choice is not None:
        assert timings[choice] == min(timings[f] for f in FORMS) < timings["float32"]
    if compiled:  # FBGEMM's packed fp16 weight is opaque to torch.compile: said, not timed eager in its place
        assert timings["fp16-weight"] == float("inf")


def test_pick_form_times_float32_compiled_through_project_as_the_decode_step_runs_it(monkeypatch):
    """A compiled step runs a plain float layer through `decoder.project` (a reduction at ≤ 4 rows): timing
    `aten.mm` in its place would make every form look faster against float32 than it is."""
    from overdrive.generate import quantize

    traced = []
    real = quantize.project
    monkeypatch.setattr(quantize, "project", lambda linear, x: (traced.append(tuple(x.shape)), real(linear, x))[1])
    torch._dynamo.reset()
    quantize.pick_form([(32, 16)], repeats=1, forms=("int8-rowwise",), compiled=True)
    assert (1, 16) in traced
    torch._dynamo.reset()


def test_pick_form_times_layers_from_memory_when_the_model_outgrows_the_cache(monkeypatch):
    """A decode step streams every weight from memory once the model's weights exceed the last-level cache: then
    each shape is timed over a sweep of distinct copies filling twice the cache (a shape timed alone and repeated
    would stay cached and favour the form with more bytes); a model that fits is timed on one layer, as it runs."""
    from overdrive.generate import quantize

    seen: dict[type, set[int]] = {}
    real = quantize._call
    monkeypatch.setattr(quantize, "_call", lambda layer, x: (seen.setdefault(type(layer), set()).add(id(layer)),
                                                             real(layer, x))[1])
    monkeypatch.setattr(quantize, "last_level_cache_bytes", lambda: 64 << 10)  # 64 KiB
    quantize.pick_form([(64, 64)] * 3, repeats=2, forms=("int8-rowwise",))  # 48 KiB of float32: fits
    assert {t: len(ids) for t, ids in seen.items()} == {nn.Linear: 1, quantize.Int8RowwiseLinear: 1}
    seen.clear()
    quantize.pick_form([(64, 64)] * 5, repeats=2, forms=("int8-rowwise",))  # 80 KiB: does not
    assert {t: len(ids) for t, ids in seen.items()} == {nn.Linear: 8, quantize.Int8RowwiseLinear: 8}  # 128 KiB / 16


def test_the_last_level_cache_is_read_from_sysfs_or_a_fallback(monkeypatch, tmp_path):
    from overdrive.generate import quantize

    assert quantize.last_level_cache_bytes() >= 1 << 20
    for index, size in enumerate(("32K", "1024K", "16384K")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(quantize, "_CACHE_DIR", tmp_path)
    assert quantize.last_level_cache_bytes() == 16 << 20
    monkeypatch.setattr(quantize, "_CACHE_DIR", tmp_path / "absent")
    assert quantize.last_level_cache_bytes() == quantize._CACHE_FALLBACK


@pytest.mark.parametrize("form,compiled", [(f, False) for f in FORMS] + [("int8-weight", True), ("int8-rowwise", True)])
def test_a_decoder_in_each_form_gives_a_prompt_the_same_tokens_alone_and_in_a_batch(form, compiled):
    from overdrive.generate.fidelity import batch_invariance

    decoder = copy_decoder(Decoder.from_hf(_hf()))
    quantize_linears(decoder, form=form)
    probe = batch_invariance(Generator(decoder, max_batch_size=8, compile=compiled), _prompts(8), max_new_tokens=10)
    assert probe.breaks() is None, probe
