"""Pruning's recovery and checkpoints: prune → check → recover keeps the better weights, and says which;
pruned weights reload into a fresh model; bad checkpoints are refused plainly; real digits recover."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.core.workload import Workload
from overdrive.techniques import get_technique
from overdrive.techniques.pruning.channels import PruneChannelsConfig
from overdrive.techniques.pruning.recovery import num_parameters, save_checkpoint
from tests.test_pruning import CPU, Residual, _workload, factory_copy


def test_pruned_weights_reload_into_a_fresh_model(tmp_path):
    torch.manual_seed(0)
    workload = _workload(Residual())
    technique = get_technique("prune-channels")
    pruned = technique.apply(factory_copy(workload.model), PruneChannelsConfig(ratio=0.5, global_pruning=True),
                             workload=workload, device=CPU)
    path = tmp_path / "pruned.pt"
    save_checkpoint(pruned, path, "prune-channels")
    reloaded = technique.apply(factory_copy(workload.model), PruneChannelsConfig(checkpoint=str(path)),
                               workload=workload, device=CPU)
    assert "checkpoint" in reloaded.__dict__.pop("overdrive_report")["source"]
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), pruned(x))
    assert num_parameters(reloaded) == num_parameters(pruned)


def test_bad_checkpoints_are_refused_plainly(tmp_path):
    workload = _workload(Residual())

    def load(path):
        return get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(checkpoint=str(path)),
                                                     workload=workload, device=CPU)

    save_checkpoint(nn.Linear(3, 3), tmp_path / "other.pt", "prune-channels")
    with pytest.raises(RuntimeError, match="do not fit this model"):
        load(tmp_path / "other.pt")
    save_checkpoint(workload.model, tmp_path / "unpruned.pt", "prune-channels")
    with pytest.raises(RuntimeError, match="holds no pruned layer"):
        load(tmp_path / "unpruned.pt")
    save_checkpoint(workload.model, tmp_path / "foreign.pt", "prune-unstructured")
    with pytest.raises(RuntimeError, match="written by 'prune-unstructured', not 'prune-channels'"):
        load(tmp_path / "foreign.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    with pytest.raises(RuntimeError, match="cannot be read as a torch file"):
        load(tmp_path / "garbage.pt")
    torch.save({"weight": torch.zeros(1)}, tmp_path / "plain.pt")
    with pytest.raises(RuntimeError, match="not a checkpoint written by `overdrive optimize`"):
        load(tmp_path / "plain.pt")
    with pytest.raises(RuntimeError, match="does not exist"):
        load(tmp_path / "missing.pt")


def test_taylor_importance_needs_labelled_training_data():
    workload = _workload(Residual())
    with pytest.raises(ValueError, match="labelled training samples"):
        get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(importance="taylor"),
                                              workload=workload, device=CPU)


@pytest.mark.parametrize("importance", ["l2", "taylor"])
def test_recovery_on_real_digits_restores_accuracy(importance, tmp_path, monkeypatch):
    """Half the channels of the real digits CNN: accuracy collapses, then the fine-tune on the
    training split brings it back within 1.5 points of the unpruned model on the held-out images."""
    from overdrive.workloads import create_workload

    workload = create_workload("digits-cnn")
    pruned = get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(importance=importance),
                                                   workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    before = report["before"]["accuracy_pct"]
    assert report["after_pruning"]["accuracy_pct"] < before - 10
    assert report["after_recovery"]["accuracy_pct"] >= before - 1.5
    assert report["recovery"]["kept"] and report["recovery"]["figure"] == "accuracy_pct"
    assert report["params_after"] < 0.3 * report["params_before"]
    assert report["flops_per_sample_after"] < 0.3 * report["flops_per_sample_before"]
    assert report["fine_tune"]["steps"] == 300 and report["fine_tune"]["last_loss"] < report["fine_tune"]["first_loss"]


def _distillation_workload() -> Workload:
    """`Residual` without labels: recovery distils toward the unpruned model, judged on min_cosine."""
    torch.manual_seed(0)
    workload = _workload(Residual())
    g = torch.Generator().manual_seed(1)
    workload.train_samples = list(torch.randn(64, 3, 8, 8, generator=g))
    return workload


def test_a_recovery_that_hurts_is_undone_and_the_report_says_so():
    workload = _distillation_workload()
    technique = get_technique("prune-channels")
    config = PruneChannelsConfig(ratio=0.5, finetune_steps=20, learning_rate=50.0)  # a fine-tune made to diverge
    pruned = technique.apply(factory_copy(workload.model), config, workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    after_pruning, after_recovery = report["after_pruning"]["min_cosine"], report["after_recovery"]["min_cosine"]
    assert not after_recovery >= after_pruning  # the fine-tune did hurt (or diverged to NaN)
    assert report["recovery"] == {"kept": False, "figure": "min_cosine", "before": after_pruning,
                                  "after": report["after_recovery"]["min_cosine"]}
    assert report["final"] == report["after_pruning"]
    # the returned weights are the ones before recovery: they score what was measured right after pruning
    from overdrive.techniques.pruning.recovery import evaluate

    reference, _ = evaluate(workload.model, workload, CPU)
    assert evaluate(pruned, workload, CPU, reference)[1]["min_cosine"] == pytest.approx(after_pruning, abs=1e-6)
    line = technique.describe_report(report, "min_cosine")
    assert f"recovery lowered min_cosine {after_pruning:.4f} → " in line and "kept the weights before recovery" in line


def test_a_recovery_that_helps_is_kept_and_the_report_says_so():
    workload = _distillation_workload()
    technique = get_technique("prune-channels")
    pruned = technique.apply(factory_copy(workload.model), PruneChannelsConfig(ratio=0.5, finetune_steps=40),
                             workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    assert report["after_recovery"]["min_cosine"] > report["after_pruning"]["min_cosine"]
    assert report["recovery"]["kept"] and report["final"] == report["after_recovery"]
    from overdrive.techniques.pruning.recovery import evaluate

    reference, _ = evaluate(workload.model, workload, CPU)
    assert evaluate(pruned, workload, CPU, reference)[1]["min_cosine"] == pytest.approx(report["after_recovery"]["min_cosine"])
    assert "recovery raised min_cosine" in technique.describe_report(report, "min_cosine")


def test_recovery_is_judged_on_the_task_metric_first():
    from overdrive.techniques.pruning.recovery import judge_recovery

    workload = _workload(Residual())
    workload.labels = torch.zeros(len(workload.samples), dtype=torch.int64)
    better_accuracy = judge_recovery({"accuracy_pct": 50.0, "min_cosine": 0.9}, {"accuracy_pct": 62.5, "min_cosine": 0.8},
                                     workload)
    assert better_accuracy == {"kept": True, "figure": "accuracy_pct", "before": 50.0, "after": 62.5}
    tie = judge_recovery({"accuracy_pct": 50.0, "min_cosine": 0.9}, {"accuracy_pct": 50.0, "min_cosine": 0.8}, workload)
    assert tie == {"kept": False, "figure": "min_cosine", "before": 0.9, "after": 0.8}
    diverged = judge_recovery({"accuracy_pct": 50.0, "min_cosine": 0.9}, {"accuracy_pct": float("nan"), "min_cosine": 0.95},
                              workload)
    assert not diverged["kept"] and diverged["figure"] == "accuracy_pct"
