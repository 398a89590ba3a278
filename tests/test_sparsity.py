"""Unstructured pruning (size only) and 2:4 semi-structured sparsity (CUDA cc ≥ 8.0 only)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive.techniques import default_config, get_technique
from overdrive.techniques import describe_report as describe
from overdrive.techniques.pruning.unstructured import PruneUnstructuredConfig, weight_sparsity
from overdrive.techniques.sparsity.semi_structured import mask_2_to_4
from overdrive.tuning.plan import build
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


@requires_cuda
@pytest.mark.cuda
def test_sparsity_24_gates_each_layer_on_a_gpu():
    device = torch.device("cuda")
    technique = get_technique("sparsity-2:4")
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))
    from overdrive.core.workload import Workload, logits_fidelity

    samples = list(torch.randn(512, 1024))
    workload = Workload(name="wide-mlp", model=wide.eval(), samples=samples, collate=lambda s: (torch.stack(s),),
                        fidelity=logits_fidelity, fidelity_key="min_cosine", default_batch_size=512, real_weights=False)
    reason = technique.unsupported_reason(workload, device)
    if reason:
        pytest.skip(reason)
    reports = []
    try:
        model, _ = build(workload, [default_config("sparsity-2:4")], device, reports)
    except RuntimeError as exc:
        assert "no layer is faster sparse" in str(exc)  # an honest outcome of the gate
        return
    (report,) = reports
    assert {e["layer"] for e in report["layers"]} == {"0", "2"}  # the output layer is never a candidate
    for entry in report["layers"]:
        assert entry["kept_dense"] == (entry.get("gain", 0) < 1.05)
    x = torch.stack(samples[:16]).to(device)
    with torch.no_grad():
        assert model(x).shape == (16, 10) and model(x).dtype == torch.float32
