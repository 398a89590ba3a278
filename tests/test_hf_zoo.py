"""Hugging Face models from Python as first-class citizens (issue 30): every architecture of
`tests.fixtures.hf_zoo.ZOO` (tiny configs, random weights, a dict example) exports to ONNX proved on
real rows, runs under ONNX Runtime, OpenVINO and bf16 + inference-mode, is called as the user's
model (`model(**inputs)`, the same output structure), and reloads with `overdrive.load` from its
plan to the same outputs. As timm's tests run over its registry: a new entry gets the battery."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch import nn

import overdrive
from overdrive.techniques import default_config
from overdrive.tuning.result import record_workload
from overdrive.tuning.plan import Plan
from overdrive.techniques.compose import build
from overdrive.workloads.signature import pick_output
from overdrive.workloads.structured import UserFacingModel, user_facing
from overdrive.workloads.user import workload_from_model
from tests.fixtures import hf_zoo

CPU = torch.device("cpu")
ARCHS = list(hf_zoo.ZOO)
PLANS = {"onnxruntime": ["onnxruntime"], "openvino": ["openvino"], "bf16+inference-mode": ["bf16", "inference-mode"]}
LOSSY = {"openvino", "bf16+inference-mode"}  # OpenVINO's CPU plugin runs bf16 where the CPU has it


@functools.lru_cache(maxsize=None)
def zoo(name: str):
    """(model, example, workload, the model's own output on the example), built once per architecture."""
    model, example = hf_zoo.create(name)
    with torch.no_grad():
        expected = model(**example)
    return model, example, workload_from_model(name, model, example), expected


def assert_same_outputs(got, expected, paths, *, lossy: bool) -> None:
    """`got` has `expected`'s type, and each judged output its shape, dtype and values (fp32: to float
    tolerance; lossy: cosine ≥ 0.99 per row)."""
    assert type(got) is type(expected)
    for path in paths:
        a, b = pick_output(got, path), pick_output(expected, path)
        assert a.shape == b.shape and a.dtype == b.dtype, (path, a.shape, b.shape)
        if lossy:
            cosine = nn.functional.cosine_similarity(a.reshape(len(a), -1).float(), b.reshape(len(b), -1).float())
            assert cosine.min() >= 0.99, (path, cosine)
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# OpenVINO converts from torch.export, decomposes and compiles: 4-9 s a model on 2 cores. It runs on every
# architecture in the full suite, and outside `-m "not slow"` on those that exercise a path of their own: varying
# dimensions (bert), the KV cache left unbuilt (gpt2), float inputs and two outputs side by side (wav2vec2).
OPENVINO_QUICK = {"bert", "gpt2", "wav2vec2"}
CASES = [pytest.param(name, plan, id=f"{name}-{plan}",
                      marks=[pytest.mark.slow] if plan == "openvino" and name not in OPENVINO_QUICK else [])
         for name in ARCHS for plan in PLANS]


@pytest.mark.parametrize(("name", "plan"), CASES)
def test_each_architecture_runs_under_each_plan_as_the_user_calls_it(name, plan):
    model, example, workload, expected = zoo(name)
    reports: list[dict] = []
    built = build(workload, [default_config(n) for n in PLANS[plan]], CPU, reports)[0]
    fast = user_facing(built, workload.model)
    assert isinstance(fast, UserFacingModel)
    with torch.no_grad():
        got = fast(**example)
        internal = built(*(example[n] for n in workload.input_names))  # overdrive's own form stays positional
    assert_same_outputs(got, expected, workload.output_names, lossy=plan in LOSSY)
    assert isinstance(internal, torch.Tensor) and len(internal) == len(next(iter(example.values())))
    if plan == "onnxruntime":  # exported by torch.export (not the TorchScript fallback), proved on real rows
        assert "dynamo export" in built.runtime, built.runtime
        assert reports and "rows" in reports[0]["export max |diff|"], reports
    if plan == "bf16+inference-mode":  # the wrappers take keywords too (they raised TypeError)
        with torch.no_grad():
            built(**example)


@pytest.mark.parametrize("name", ARCHS)
def test_a_plan_reloads_on_the_model_alone_to_the_same_outputs(name, tmp_path):
    """The plan records input names, shapes, the judged outputs and the varying dimensions, so
    `load(plan, model)` rebuilds the workload optimize measured (RoBERTa and ALBERT came back judging
    their token-level output as well, GPT-2 took the mask for its cache)."""
    _, example, workload, expected = zoo(name)
    plan = Plan(workload="<python test>", device="cpu", batch_size=len(next(iter(example.values()))),
                steps=[default_config("inference-mode")])
    record_workload(plan, workload)
    plan.save(tmp_path / "plan.json")
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert [i["name"] for i in saved["inputs"]] == list(example) and saved["outputs"] == workload.output_names
    fresh, _ = hf_zoo.create(name)  # the same seeded weights, never measured
    fast = overdrive.load(tmp_path / "plan.json", fresh)
    with torch.no_grad():
        got = fast(**example)
    assert_same_outputs(got, expected, workload.output_names, lossy=False)
    for path in {p for p, _ in _tensors(expected)} - set(workload.output_names):  # not carried: None, said in the docs
        assert _get(got, path) is None
    if name == "gpt2":  # GPT-2 ran without its cache (OpenVINO could not convert the cache's concatenation)
        assert workload.model.call_kwargs == {"use_cache": False} and any("use_cache=False" in n for n in workload.notes)
        assert got.past_key_values is None


def _tensors(out):
    from overdrive.workloads.signature import output_tensors

    return output_tensors(out)


def _get(out, path):
    try:
        return pick_output(out, path)
    except (KeyError, IndexError, AttributeError):
        return None


@pytest.mark.slow
def test_a_padded_bert_optimizes_from_python_and_reloads(tmp_path, monkeypatch):
    """The issue's session: a BERT given a right-padded dict example, with a runtime and both text techniques."""
    from overdrive.tuning.tuner import Tuner

    monkeypatch.setattr("overdrive.tuning.api.Tuner", functools.partial(Tuner, min_rounds=2, max_rounds=2, max_compare_s=2))
    model, example = hf_zoo.create("bert")
    techniques = ["onnxruntime", "length-bucketing", "remove-padding"]
    result = overdrive.optimize(model, example, techniques=techniques, sweep_batch_sizes=[], min_gain=0, device="cpu")
    alone = {row["technique"]: row for row in result.table if row["phase"] == "alone"}
    for name in techniques:  # each applied and measured: none failed, none "not applicable"
        assert alone[name]["reason"] == "" or not alone[name]["reason"].startswith(("failed", "skipped")), alone[name]
    assert result.plan.inputs[1] == {"name": "attention_mask", "shape": [hf_zoo.SEQ_LEN], "dtype": "int64"}
    assert result.plan.outputs == ["pooler_output"] and result.plan.dynamic_dims == {"input_ids": [1], "attention_mask": [1]}
    with torch.no_grad():
        expected = model(**example)
        assert_same_outputs(result.model(**example), expected, ["pooler_output"], lossy=False)
        reloaded = overdrive.load(result.save_plan(tmp_path), hf_zoo.create("bert")[0])(**example)
    assert_same_outputs(reloaded, expected, ["pooler_output"], lossy=False)
    assert reloaded.last_hidden_state is None  # token-level: not carried, as the docstring says


def test_padded_rows_are_cut_to_their_mask_and_the_text_techniques_apply():
    from overdrive.techniques import BatchingPolicy, get_technique

    _, example, workload, _ = zoo("bert")
    assert workload.dynamic_dims == {0: (1,), 1: (1,)}
    assert [workload.bucket_length(s) for s in workload.samples] == [12, 12, 7, 4]  # the mask's real token counts
    assert [len(s[0]) for s in workload.samples] == [12, 12, 7, 4] and not workload.is_text  # tensors in, as given
    for name in ("length-bucketing", "remove-padding"):
        assert get_technique(name).applicability(workload, CPU) is None, name
    assert BatchingPolicy(sort_by_length=True).order(workload, [0, 1, 2, 3]) == [0, 1, 2, 3]  # longest first, as run
    assert BatchingPolicy(sort_by_length=True).order(workload, [3, 2, 1, 0]) == [2, 3, 1, 0]
    built = build(workload, [default_config("remove-padding")], CPU)[0]
    inputs = workload.collate([workload.samples[i] for i in (3, 2)])  # padded to 7 per batch
    with torch.no_grad():
        torch.testing.assert_close(built(*inputs), workload.model(*inputs), rtol=1e-4, atol=1e-5)

    _, _, fixed, _ = zoo("distilbert")  # only a token-level output: the length stays fixed, and both say so
    for name in ("length-bucketing", "remove-padding"):
        assert "fixed shape" in get_technique(name).applicability(fixed, CPU)


class MaskedSum(nn.Module):
    """Token ids [B, S] (0 = padding) -> the sum of their embeddings [B, 8]: padding-free without a mask."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(20, 8, padding_idx=0)

    def forward(self, input_ids):
        return {"pooled": self.embedding(input_ids).sum(1)}


def test_without_an_attention_mask_the_text_techniques_say_why_not():
    from overdrive.techniques import get_technique

    torch.manual_seed(0)
    ids = torch.randint(1, 20, (4, 6))
    ids[2:, 3:] = 0
    workload = workload_from_model("masked-sum", MaskedSum().eval(), {"input_ids": ids})
    assert workload.dynamic_dims == {0: (1,)}
    assert [workload.bucket_length(s) for s in workload.samples] == [6, 6, 6, 6]  # no mask: no row is cut
    assert "given no attention_mask" in get_technique("remove-padding").applicability(workload, CPU)


def test_an_export_failure_names_its_cause():
    """torch.onnx wraps torch.export's error, whose own last line only points above: the cause is quoted."""
    from overdrive.files.onnx import quiet_export, reason
    from overdrive.workloads.signature import SignatureModel

    model = SignatureModel(MaskedSum().eval(), ["input_ids"], ["pooled"])
    batch = torch.export.Dim("batch")
    with pytest.raises(Exception) as caught, quiet_export():  # a spec for each of two inputs; the model takes one
        torch.onnx.export(model, (torch.ones(2, 3, dtype=torch.long),), dynamic_shapes=({0: batch}, {0: batch}),
                          dynamo=True)
    said = reason(caught.value)
    assert "Detected mismatch between the structure of `inputs` and `dynamic_shapes`" in said, said
    assert "error above" not in said and "stack trace" not in said


def test_int8_dynamic_on_swin_keeps_the_linears_it_cannot_swap():
    """torchvision's Swin reads its attention Linears' weights itself (F.linear(x, self.qkv.weight)):
    a quantized Linear's weight is a method, and the model raised TypeError; those stay fp32."""
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)  # swin_t's code at toy size: 2 stages of 1 block, 16 wide
    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4],
                            num_classes=10).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    workload = workload_from_model("swin", model, images)
    reports: list[dict] = []
    built = build(workload, [default_config("int8-dynamic")], CPU, reports)[0]
    with torch.no_grad():
        got, expected = built(images), model(images)
    assert nn.functional.cosine_similarity(got, expected).min() > 0.9
    assert "stay fp32 because the model reads their weights itself" in reports[0]["int8 Linear layers"]
    assert any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in built.modules())


def test_data_batches_may_be_dicts_as_a_tokenizer_returns_them():
    from overdrive.core.errors import WorkloadError

    model, example = hf_zoo.create("bert")
    short = {k: v[:, :8].clone() for k, v in hf_zoo.text_example(first_id=7).items()}  # another batch, another length
    workload = workload_from_model("bert", model, example, data=[example, short])
    assert len(workload.samples) == 8 and workload.rows_source == "data"
    assert [workload.bucket_length(s) for s in workload.samples] == [12, 12, 7, 4, 8, 8, 7, 4]
    with pytest.raises(WorkloadError, match="has keys \\['input_ids'\\]; expected \\['input_ids', 'attention_mask'\\]"):
        workload_from_model("bert", model, example, data=[{"input_ids": example["input_ids"]}])

