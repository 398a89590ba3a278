"""Unstructured pruning (size only) and 2:4 semi-structured sparsity (CUDA cc ≥ 8.0 only)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive.core.workload import Workload, logits_fidelity
from overdrive.techniques import get_technique
from overdrive.techniques import describe_report as describe
from overdrive.techniques.pruning.unstructured import PruneUnstructuredConfig, weight_sparsity
from overdrive.techniques.sparsity import semi_structured
from overdrive.techniques.sparsity.semi_structured import SemiStructuredLinear, Sparsity24Config, mask_2_to_4
from overdrive.techniques.compose import build
from tests.conftest import make_conv_workload, make_text_workload, requires_cuda

CPU = torch.device("cpu")


@pytest.mark.parametrize("global_pruning", [True, False])
def test_unstructured_zeroes_the_smallest_weights_and_reports_size_only(global_pruning):
    workload = make_conv_workload()
    reports = []
    steps = [(PruneUnstructuredConfig(ratio=0.6, global_pruning=global_pruning,
                                                                            finetune_steps=0))]
    model, _ = build(workload, steps, CPU, reports)
    head = model.head.weight
    assert (head != 0).all()  # the output layer is left alone
    body = torch.cat([model.conv1.weight.flatten(), model.conv2.weight.flatten()])
    assert abs((body == 0).float().mean().item() - 0.6) < 0.02
    if not global_pruning:
        assert abs((model.conv1.weight == 0).float().mean().item() - 0.6) < 0.02
    assert not any(hasattr(m, "weight_orig") for m in model.modules())  # masks made permanent
    (report,) = reports
    assert report["params_after"] == report["params_before"] and report["weight_sparsity"] > 0.5
    assert report["compressed_weight_bytes_after"] < report["compressed_weight_bytes_before"]
    assert "not faster" in describe(report, "min_cosine")


def test_unstructured_masks_hold_through_the_recovery_fine_tune():
    workload = make_conv_workload(num_samples=32)
    workload.train_samples, workload.train_labels = workload.samples, workload.labels
    model = get_technique("prune-unstructured").apply(copy.deepcopy(workload.model),
                                                      PruneUnstructuredConfig(ratio=0.5, finetune_steps=20),
                                                      workload=workload, device=CPU)
    report = model.__dict__.pop("overdrive_report")
    assert report["fine_tune"]["steps"] == 20
    assert weight_sparsity(model) == pytest.approx(report["weight_sparsity"]) and report["weight_sparsity"] > 0.45


def test_an_undone_recovery_keeps_the_masked_weights_before_it():
    workload = make_conv_workload(num_samples=32)
    workload.train_samples, workload.labels = workload.samples, None  # distillation, judged on min_cosine
    config = PruneUnstructuredConfig(ratio=0.5, finetune_steps=10, learning_rate=100.0)  # made to diverge
    model = get_technique("prune-unstructured").apply(copy.deepcopy(workload.model), config, workload=workload, device=CPU)
    report = model.__dict__.pop("overdrive_report")
    assert report["recovery"]["kept"] is False and report["final"] == report["after_pruning"]
    assert weight_sparsity(model) == pytest.approx(report["weight_sparsity"]) and report["weight_sparsity"] > 0.45
    from overdrive.techniques.pruning.recovery import evaluate

    reference, _ = evaluate(workload.model, workload, CPU)
    assert evaluate(model, workload, CPU, reference)[1]["min_cosine"] == pytest.approx(report["after_pruning"]["min_cosine"])


def test_mask_2_to_4_keeps_the_two_largest_of_every_four():
    weight = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -0.1, 0.0]])
    assert mask_2_to_4(weight).tolist() == [[False, True, True, False, True, True, False, False]]
    random = torch.randn(64, 128)
    assert (mask_2_to_4(random).reshape(64, 32, 4).sum(-1) == 2).all()
    with pytest.raises(ValueError, match="divisible by 4"):
        mask_2_to_4(torch.randn(4, 6))


def test_sparsity_24_is_listed_as_unsupported_on_cpu():
    reason = get_technique("sparsity-2:4").unsupported_reason(make_text_workload(), CPU)
    assert reason == "runs on cuda only"


def _mlp_workload(model: nn.Module, in_features: int, num_samples: int, batch_size: int, device=CPU) -> Workload:
    torch.manual_seed(0)
    samples = list(torch.randn(num_samples, in_features))
    return Workload(name="mlp", model=model.eval().to(device), samples=samples, collate=lambda s: (torch.stack(s),),
                    fidelity=logits_fidelity, fidelity_key="min_cosine", default_batch_size=batch_size, real_weights=False)


class DenseMasked(nn.Module):
    """The dense reference of a 2:4 layer: the same masked weight, dense, in the same half dtype and casts
    as `SemiStructuredLinear` (input cast to `dtype`, output cast back)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter((linear.weight.detach() * mask_2_to_4(linear.weight)).to(dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)

    def forward(self, x):
        return nn.functional.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def _masked_reference(model: nn.Module, layers: list[str], dtype: torch.dtype | None) -> nn.Module:
    """`model` with `layers` 2:4-masked: dense fp32 (dtype None) or `DenseMasked` in `dtype`."""
    reference = copy.deepcopy(model)
    for name in layers:
        linear = reference.get_submodule(name)
        if dtype is None:
            with torch.no_grad():
                linear.weight.mul_(mask_2_to_4(linear.weight))
        else:
            setattr(reference, name, DenseMasked(linear, dtype))
    return reference


def test_the_gate_converts_only_layers_measured_faster(monkeypatch):
    """The per-layer speed gate on the CPU, with the sparse kernel replaced by its dense masked form and
    timings given: layer 0 is 2× faster sparse (converted), layer 2 is not (stays dense), the head is
    never a candidate; the result computes what the dense model with layer 0 masked computes."""
    technique = get_technique("sparsity-2:4")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    workload = _mlp_workload(model, 16, num_samples=24, batch_size=8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda weight: weight)  # dense stand-in
    timings_ms = {(False, 16): 2.0, (True, 16): 1.0, (False, 32): 1.0, (True, 32): 1.0}  # (sparse?, in_features)
    monkeypatch.setattr(semi_structured, "_time_ms",
                        lambda fn, x, iterations: timings_ms[(isinstance(fn, SemiStructuredLinear), fn.in_features)])
    sparse = technique.apply(copy.deepcopy(model), Sparsity24Config(), workload=workload, device=CPU)
    report = sparse.__dict__.pop("overdrive_report")
    assert report["converted"] == 1 and [e["layer"] for e in report["layers"]] == ["0", "2"]
    assert not report["layers"][0]["kept_dense"] and report["layers"][0]["gain"] == 2.0
    assert report["layers"][1]["kept_dense"] and "sparse not faster: 1.00×" in report["layers"][1]["reason"]
    assert isinstance(sparse[0], SemiStructuredLinear) and type(sparse[2]) is nn.Linear and type(sparse[4]) is nn.Linear
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), _masked_reference(model, ["0"], torch.bfloat16)(x), rtol=0, atol=0)
        cosine = nn.functional.cosine_similarity(sparse(x), _masked_reference(model, ["0"], None)(x), dim=-1)
        assert cosine.min() > 0.999  # bf16 against fp32, both 2:4-masked
        assert not torch.allclose(sparse(x), model(x), atol=1e-3)  # the mask is really applied
    assert "1 of 2 Linear layers made 2:4 sparse (bfloat16); kept dense: 2 (sparse not faster" in describe(report, "min_cosine")


def test_the_gate_refuses_when_no_layer_is_faster(monkeypatch):
    technique = get_technique("sparsity-2:4")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    workload = _mlp_workload(model, 16, num_samples=8, batch_size=8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda weight: weight)
    monkeypatch.setattr(semi_structured, "_time_ms", lambda fn, x, iterations: 1.0)
    with pytest.raises(RuntimeError, match=r"no layer is 1.05× faster sparse at these shapes \(0 1.00×; all stay dense\)"):
        technique.apply(copy.deepcopy(model), Sparsity24Config(), workload=workload, device=CPU)


def test_sparsity_24_reason_for_a_program_comes_from_its_graph(monkeypatch):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    program = torch.export.export(model, (torch.randn(2, 16),)).module()
    workload = _mlp_workload(model, 16, num_samples=8, batch_size=2)
    workload.model = program
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    reason = get_technique("sparsity-2:4").applicability(workload, torch.device("cuda"))
    assert reason and "runs 2 aten.linear ops in its graph, not as nn.Linear modules" in reason


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))


@requires_cuda
@pytest.mark.cuda
def test_sparsity_24_converts_layers_and_matches_the_dense_masked_model_on_a_gpu():
    """The gate forced open (min_layer_gain tiny): both hidden Linears must be converted to 2:4 sparse
    tensors, and the model must compute what the dense model with the same 2:4 masks computes."""
    device = torch.device("cuda")
    technique = get_technique("sparsity-2:4")
    wide = _wide_mlp()
    workload = _mlp_workload(wide, 1024, num_samples=512, batch_size=512, device=device)
    reason = technique.unsupported_reason(workload, device)
    if reason:
        pytest.skip(reason)
    reports = []
    model, _ = build(workload, [Sparsity24Config(min_layer_gain=1e-6, timing_iterations=3)], device, reports)
    (report,) = reports
    assert report["converted"] == 2 and [e["layer"] for e in report["layers"]] == ["0", "2"]  # the head is never one
    from torch.sparse import SparseSemiStructuredTensor

    for name in ("0", "2"):
        assert isinstance(model.get_submodule(name), SemiStructuredLinear)
        assert isinstance(model.get_submodule(name).weight, SparseSemiStructuredTensor)
    dtype = getattr(torch, report["dtype"])
    x = torch.stack(workload.samples[:64]).to(device)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (64, 10) and out.dtype == torch.float32
        # Same masks, same half dtype, dense kernels: only the summation order differs (fp32 accumulation,
        # one rounding to bf16/fp16 per layer): within 1e-2 absolute and relative (outputs are about 0.1-1).
        torch.testing.assert_close(out, _masked_reference(wide, ["0", "2"], dtype)(x), rtol=1e-2, atol=1e-2)
        cosine = nn.functional.cosine_similarity(out, _masked_reference(wide, ["0", "2"], None)(x), dim=-1)
        assert cosine.min() > 0.999  # against the fp32 dense masked model


@requires_cuda
@pytest.mark.cuda
def test_sparsity_24_gate_reports_each_layers_measured_gain_on_a_gpu():
    """The gate shut (a 10⁶× bar): nothing is converted, and the refusal gives each layer's measured gain."""
    device = torch.device("cuda")
    technique = get_technique("sparsity-2:4")
    workload = _mlp_workload(_wide_mlp(), 1024, num_samples=512, batch_size=512, device=device)
    reason = technique.unsupported_reason(workload, device)
    if reason:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match=r"no layer is 1e\+06× faster sparse at these shapes \(0 \d+\.\d\d×, 2 \d+\.\d\d×;"):
        technique.apply(copy.deepcopy(workload.model), Sparsity24Config(min_layer_gain=1e6, timing_iterations=3),
                        workload=workload, device=device)


class ScaledLinear(nn.Linear):
    """A user's Linear subclass whose forward differs from nn.Linear's (here: doubled)."""

    def forward(self, x):
        return super().forward(x) * 2


def test_a_linear_subclass_is_never_swapped_for_a_plain_sparse_linear(monkeypatch):
    """Swapping it would drop its own forward (the doubling) without a word; it stays as it is."""
    technique = get_technique("sparsity-2:4")
    model = nn.Sequential(ScaledLinear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    workload = _mlp_workload(model, 16, num_samples=8, batch_size=8)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.sparse, "to_sparse_semi_structured", lambda weight: weight)
    monkeypatch.setattr(semi_structured, "_time_ms", lambda fn, x, iterations: 1.0 if isinstance(fn, SemiStructuredLinear) else 2.0)
    sparse = technique.apply(copy.deepcopy(model), Sparsity24Config(), workload=workload, device=CPU)
    report = sparse.__dict__.pop("overdrive_report")
    assert [e["layer"] for e in report["layers"]] == ["2"] and type(sparse[0]) is ScaledLinear
    x = torch.stack(workload.samples)
    with torch.no_grad():
        cosine = nn.functional.cosine_similarity(sparse(x), _masked_reference(model, ["2"], None)(x), dim=-1)
    assert cosine.min() > 0.999
