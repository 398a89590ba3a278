"""A user's own Hugging Face causal LM: from Python (`overdrive.optimize(model, tokenizer=, prompts=)`) and as a
`package.module:factory` through optimize, bench and run; what does not fit is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import overdrive
from overdrive import cli
from overdrive.core.errors import ConfigError, WorkloadError
from overdrive.generate import Decoder, SamplingParams
from overdrive.generate.plan import GenerationPlan, build_generator
from tests.fixtures import lm_models

PROMPTS = ["A list is", "The dictionary maps", "Return the value of", "An iterator"]


def _optimize_built(config_overrides: dict, **kwargs):
    model, tok = lm_models.build(**config_overrides)
    return overdrive.optimize(model, tokenizer=tok, prompts=PROMPTS, device="cpu", **kwargs)


def test_a_causal_lm_passed_in_python_is_optimized_for_generation_on_your_prompts(tmp_path):
    model, tok = lm_models.build()
    model.train()  # as a user may hand it over mid-training: judged in eval mode, on a copy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = overdrive.optimize(model, tokenizer=tok, prompts=PROMPTS, techniques=["kv-int8"], max_new_tokens=4,
                                device="cpu", out=tmp_path)
    rows = {r.technique: r for r in result.rows}
    assert result.rows[0].status == "baseline" and rows["kv-int8"].fidelity is not None  # judged
    assert result.workload.facts["prompts"] == "4 of yours"
    assert result.plan.workload == "<python causal LM LlamaForCausalLM>"
    assert (tmp_path / "LlamaForCausalLM" / "plan.json").exists()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # your model is not changed
    assert model.training  # nor its mode, and the user is told how it was judged
    assert any("training mode" in w for w in result.warnings)
    assert result.table[1]["technique"] == "kv-int8" and result.table[1]["kept"] == (rows["kv-int8"].status == "kept")
    model.eval()
    # the generator it returns is the plan's, on the model as given
    params = SamplingParams(max_new_tokens=4)
    again = build_generator(model, tok, result.plan.steps, device="cpu")
    assert [o.token_ids for o in result.generator.generate(PROMPTS[:2], params)] == \
        [o.token_ids for o in again.generate(PROMPTS[:2], params)]
    # without sampling params, the plan's generator answers as the plan was timed (4 new tokens), and would end
    # at the end-of-text token, as Hugging Face's generate does
    defaults = result.generator.defaults
    assert defaults.max_new_tokens == 4 and defaults.stop_token_ids == (tok.eos_token_id,)
    assert [len(c.token_ids) <= 4 for c in result.generator.generate(PROMPTS[:2])] == [True, True]
    from overdrive.generate import Generator

    assert Generator(Decoder.from_hf(model), tok).defaults.stop_token_ids == (tok.eos_token_id,)  # as HF's generate
    # a plan of a model passed in Python cannot be rebuilt by name: run says how to use it
    with pytest.raises(WorkloadError, match="passed in Python"):
        from overdrive.workloads.generation import create_generation_workload

        create_generation_workload(result.plan.workload)


def test_a_gpt2_generates_as_hugging_face_does_and_goes_through_the_int8_search_and_the_guard():
    """GPT-2's Conv1D weights (stored transposed), learned positions and tied head: through optimize's guard,
    and through the per-layer int8 search (called directly: at this toy size int8 is slower than fp32, so
    optimize rightly does not try it)."""
    from overdrive.generate.quantize import linear_names, search_layers

    model, tok = lm_models.gpt2()
    result = overdrive.optimize(model, tokenizer=tok, prompts=PROMPTS, techniques=["kv-int8"], max_new_tokens=6,
                                device="cpu")
    assert {r.technique: r for r in result.rows}["kv-int8"].fidelity is not None
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            pad_token_id=tok.eos_token_id, eos_token_id=None)[0, ids.shape[1]:].tolist()
    plain = build_generator(model, tok, [], device="cpu")
    assert plain.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))[0].token_ids == theirs
    decoder = Decoder.from_hf(model)
    texts = [tok(p).input_ids for p in PROMPTS]
    chosen, sensitivity, kl = search_layers(decoder, texts, max_mean_kl=1.0)
    assert chosen == linear_names(decoder) and len(chosen) == 7  # q, k, v, o, up, down and the tied head
    assert 0 < kl < 1e-2 and all(v > 0 for v in sensitivity.values())


@pytest.mark.parametrize("spec, parameters", [("gpt2-small-random", 124_439_808), ("llama-125m-random", 124_668_672)])
def test_the_random_weight_built_ins_are_real_shapes_labelled_speed_only(spec, parameters):
    from overdrive.generate import KVCache
    from overdrive.workloads.generation import create_generation_workload, is_generation_workload

    workload = create_generation_workload(spec, num_prompts=4)
    assert is_generation_workload(spec) and not workload.real_weights
    assert workload.facts["parameters"] == parameters and "speed only" in workload.facts["weights"]
    assert len(workload.prompts) == 4 and max(max(x) for x in workload.prompts) < workload.model.config.vocab_size
    decoder = Decoder.from_hf(workload.model)  # the decoder takes it, and gives its logits
    ids = torch.tensor([workload.prompts[0]])
    t = ids.shape[1]
    slots = torch.arange(t)
    mask = (slots[None, :, None] >= slots[None, None, :])[:, None]
    with torch.no_grad():
        ours = decoder(ids, slots[None], KVCache(decoder.config, 1, t, device="cpu", dtype=torch.float32), slots, mask)
        theirs = workload.model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_a_factory_of_a_causal_lm_goes_through_optimize_bench_and_run(tmp_path, capsys):
    spec = "tests.fixtures.lm_models:build"
    assert cli.main(["optimize", spec, "--device", "cpu", "--techniques", "kv-int8", "--max-new-tokens", "4",
                     "--out", str(tmp_path)]) == 0
    folder = tmp_path / "lm_models"  # named as any factory's folder is
    plan = GenerationPlan.load(folder / "plan.json")
    assert plan.workload == spec and "kv-int8" in capsys.readouterr().out
    assert cli.main(["bench", spec, "--plan", str(folder / "plan.json"), "--batch-sizes", "1", "--new-tokens", "4",
                     "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert "tokens/s" in capsys.readouterr().out
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    assert cli.main(["run", str(folder / "plan.json"), "--input", str(source), "--output", str(out),
                     "--max-new-tokens", "4", "--device", "cpu"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model, tok = lm_models.build()
    gen = build_generator(model, tok, plan.steps, device="cpu")
    expected = [gen.generate([p], SamplingParams(max_new_tokens=4, stop_token_ids=tok.eos_token_id))[0].token_ids
                for p in PROMPTS]
    assert [r["token_ids"] for r in rows] == expected


def test_a_text_encoder_factory_still_takes_the_one_pass_path():
    from overdrive.workloads.generation import is_generation_workload
    from overdrive.workloads.user import build_from_import_path

    assert not is_generation_workload("tests.fixtures.hf_models:bert_classifier")
    assert build_from_import_path("tests.fixtures.hf_models:bert_classifier").is_text  # built from the kept call


@pytest.mark.parametrize("call, error, message", [
    (lambda: overdrive.optimize(lm_models.build()[0], prompts="A list is", tokenizer=lm_models.tokenizer()),
     ConfigError, "a non-empty list of non-empty strings"),
    (lambda: overdrive.optimize(torch.nn.Linear(2, 2), tokenizer=lm_models.tokenizer()), ConfigError,
     "for a Hugging Face causal LM"),
    (lambda: overdrive.optimize(lm_models.build()[0], prompts=["A list is"]), ConfigError, "needs its tokenizer"),
    (lambda: overdrive.optimize(*lm_models.gpt2(), tokenizer=lm_models.tokenizer()), ConfigError,
     "for a one-pass model, not a causal LM"),
    (lambda: overdrive.optimize(lm_models.gpt_neox(), tokenizer=lm_models.tokenizer()), WorkloadError,
     "takes the llama, mistral, qwen2, phi3, gpt2 families; this model is 'gpt_neox'"),
    (lambda: overdrive.optimize("pydoc-lm", prompts=["A list is"]), ConfigError, "brings its own"),
    # a setting overdrive's decoder would ignore and answer wrongly with (GELU in place of SiLU)
    (lambda: _optimize_built({"hidden_act": "gelu"}), WorkloadError,
     "activation 'gelu' is not supported"),
    (lambda: _optimize_built({"attention_bias": True}), WorkloadError,
     "attention biases on a llama model"),
    (lambda: _optimize_built({"vocab_size": 100}), WorkloadError,
     "beyond the model's vocabulary of 100"),
    (lambda: _optimize_built({"max_position_embeddings": 16}, max_new_tokens=16), ConfigError,
     "exceed the model's context of 16"),
    (lambda: _optimize_built({}, max_new_tokens=0), ConfigError, "max_new_tokens=0: expected a positive integer"),
    (lambda: _optimize_built({"max_position_embeddings": 4}, max_new_tokens=2), ConfigError,
     "fills the model's context of 4 positions by itself"),
    (lambda: build_generator(lm_models.build()[0], None, [{"name": "nonsense"}]), ConfigError,
     "unknown generation steps \\['nonsense'\\]"),
    (lambda: build_generator(lm_models.build()[0], None, [{"name": "kv-int8", "bogus": 3}]), ConfigError,
     "the step 'kv-int8' takes no \\['bogus'\\]"),
    (lambda: build_generator(lm_models.build()[0], None, [{"name": "prompt-lookup"},
                                                         {"name": "draft-model", "layers": [0], "steps": 0}]),
     ConfigError, "one speculative step, this one holds \\['prompt-lookup', 'draft-model'\\]"),
    (lambda: build_generator(lm_models.build()[0], None, [{"name": "draft-model", "layers": "0", "steps": 0}]),
     ConfigError, "needs the target's \"layers\" it keeps"),
    (lambda: build_generator(lm_models.build()[0], None, [{"name": "draft-model", "layers": [0], "steps": -1}]),
     ConfigError, "needs its distillation \"steps\""),
    (lambda: build_generator(lm_models.build(vocab_size=100)[0], lm_models.tokenizer(), []).generate(
        ["The dictionary maps keys"]), ValueError,
     "beyond the model's vocabulary of 100"),
    (lambda: Decoder.from_hf(lm_models.gpt2()[0].transformer), ValueError, "not the bare model"),
], ids=["prompts-a-string", "not-an-lm", "no-tokenizer", "example-inputs", "gpt-neox", "builtin-with-prompts",
        "gelu", "attention-bias", "small-vocabulary", "small-context", "zero-new-tokens", "prompt-fills-context",
        "unknown-step",
        "step-setting", "two-drafters", "draft-layers", "draft-steps", "text-beyond-vocabulary", "bare-gpt2"])
def test_what_does_not_fit_is_refused_by_name(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_sampling_setting_that_is_not_a_number_is_named(field):
    with pytest.raises(ValueError, match=f"{field} must be a number, got 'hot'"):
        SamplingParams(**{field: "hot"})
