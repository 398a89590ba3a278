"""Structured channel pruning on the structures pruning tools break on.

Each case builds a small model, prunes half the channels with `prune-channels`, and asserts that
the pruned model runs, returns the original output shape, and really has fewer parameters.
Index-preserving cases also check that the pruned model computes what the unpruned one computes
with the removed channels masked to zero. The real-data recovery test is at the end.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overdrive.core.workload import Workload, logits_fidelity
from overdrive.techniques import get_technique
from overdrive.techniques.pruning.channels import PruneChannelsConfig
from overdrive.techniques.pruning.recovery import num_parameters, save_checkpoint

CPU = torch.device("cpu")


class Residual(nn.Module):
    """A residual add coupling two convs: both must keep the same channels."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.body(h)
        return self.head(h.mean((2, 3)))


class ConcatSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 32, 3, padding=1)
        self.b = nn.Conv2d(64, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.a(x)
        return self.head(self.b(torch.cat([h, h], dim=1)).mean((2, 3)))


class ChunkConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 32, 3, padding=1)
        self.c = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        left, right = self.a(x).chunk(2, dim=1)  # [B, 16, H, W] each
        h = torch.cat([left, self.c(x)], dim=1) + torch.cat([right, right], dim=1)
        return self.head(self.b(h).mean((2, 3)))


class LinearToConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32 * 4 * 4)
        self.conv = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.fc(x.flatten(1)[:, :16]).view(-1, 32, 4, 4)  # [B, 32, 4, 4]
        return self.head(self.conv(h).mean((2, 3)))


class DepthwiseResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.stem(x)
        h = h + self.pw(self.dw(h))
        return self.head(h.mean((2, 3)))


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 32, 3, padding=1)
        self.g = nn.Conv2d(32, 64, 3, padding=1, groups=4)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.g(self.a(x)).mean((2, 3)))


class MaskMultiply(nn.Module):
    """A 1-channel mask broadcast over features, from a single-output-channel conv."""

    def __init__(self):
        super().__init__()
        self.features = nn.Conv2d(3, 32, 3, padding=1)
        self.mask = nn.Conv2d(3, 1, 1)
        self.post = nn.Conv2d(32, 32, 1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.features(x) * torch.sigmoid(self.mask(x))  # [B, 32, H, W] * [B, 1, H, W]
        return self.head(self.post(h).mean((2, 3)))


class SharedWeight(nn.Module):
    """One conv module called twice: the same weight serves two places in the graph."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.shared = nn.Conv2d(32, 32, 3, padding=1)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.stem(x)
        h = self.shared(torch.relu(self.shared(h)))
        return self.head(h.mean((2, 3)))


def _workload(model: nn.Module) -> Workload:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(8, 3, 8, 8, generator=g)
    return Workload(name="prune-case", model=model.eval(), samples=list(images), collate=lambda s: (torch.stack(s),),
                    fidelity=logits_fidelity, fidelity_key="min_cosine", default_batch_size=4, real_weights=False)


CASES = [Residual, ConcatSelf, ChunkConcat, LinearToConv, DepthwiseResidual, Grouped, MaskMultiply, SharedWeight]


@pytest.mark.parametrize("factory", CASES, ids=[c.__name__ for c in CASES])
def test_pruned_model_runs_keeps_output_shape_and_shrinks(factory):
    torch.manual_seed(0)
    workload = _workload(factory())
    technique = get_technique("prune-channels")
    assert technique.unsupported_reason(workload, CPU) is None
    before = num_parameters(workload.model)
    x = torch.stack(workload.samples[:4])
    pruned = technique.apply(factory_copy(workload.model), PruneChannelsConfig(ratio=0.5), workload=workload, device=CPU)
    with torch.no_grad():
        out = pruned(x)
    assert out.shape == (4, 10)
    assert num_parameters(pruned) < 0.8 * before
    assert pruned.head.out_features == 10  # the classifier head is never pruned


def factory_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def test_channel_counts_are_rounded_and_the_chain_count_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 40, 3, padding=1), nn.ReLU(), nn.Conv2d(40, 40, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(40, 10))
    workload = _workload(model)
    pruned = get_technique("prune-channels").apply(factory_copy(model), PruneChannelsConfig(ratio=0.5, round_to=8),
                                                   workload=workload, device=CPU)
    widths = [m.out_channels for m in pruned.modules() if isinstance(m, nn.Conv2d)]
    assert all(w % 8 == 0 for w in widths) and all(w < 40 for w in widths)
    c1, c2 = widths
    expected = (3 * 9 * c1 + c1) + (c1 * 9 * c2 + c2) + (c2 * 10 + 10)
    assert num_parameters(pruned) == expected


def test_repeated_pruning_keeps_shrinking():
    torch.manual_seed(0)
    workload = _workload(Residual())
    model = factory_copy(workload.model)
    counts = [num_parameters(model)]
    for _ in range(3):
        model = get_technique("prune-channels").apply(model, PruneChannelsConfig(ratio=0.3, round_to=1),
                                                      workload=workload, device=CPU)
        counts.append(num_parameters(model))
    assert counts == sorted(counts, reverse=True) and len(set(counts)) == 4


def test_named_layers_are_left_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    workload = _workload(model)
    pruned = get_technique("prune-channels").apply(factory_copy(model), PruneChannelsConfig(ratio=0.5, ignored=("2",)),
                                                   workload=workload, device=CPU)
    assert pruned[2].out_channels == 32 and pruned[0].out_channels == 16  # only its inputs shrink


def test_unprunable_structure_is_refused_with_a_reason():
    workload = _workload(Grouped())
    with pytest.raises(RuntimeError, match="nothing could be pruned"):
        get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(ignored=("g",)),
                                              workload=workload, device=CPU)


def test_config_validation():
    with pytest.raises(ValueError):
        PruneChannelsConfig(ratio=1.0)
    with pytest.raises(ValueError):
        PruneChannelsConfig(round_to=0)
    assert PruneChannelsConfig.from_dict(PruneChannelsConfig(ignored=("a",)).to_dict()).ignored == ("a",)


def test_chunk_then_concat_leaves_the_coupled_layers_alone_and_says_why():
    # Torch-Pruning 1.6 mis-indexes this group (IndexError); the technique prunes the rest.
    torch.manual_seed(0)
    workload = _workload(ChunkConcat())
    pruned = get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(ratio=0.5),
                                                   workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    assert set(report["left_unpruned"]) == {"a", "c"} and "IndexError" in report["left_unpruned"]["a"]
    assert (pruned.a.out_channels, pruned.c.out_channels, pruned.b.out_channels) == (32, 16, 16)


def _kept_rows(pruned: torch.Tensor, original: torch.Tensor) -> list[int]:
    """Indices of `original`'s rows that `pruned`'s rows are (pruning keeps rows unchanged)."""
    flat_p, flat_o = pruned.flatten(1), original.flatten(1)
    return [int((flat_o == row).all(1).nonzero()[0]) for row in flat_p]


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(32)
        self.post = nn.Conv2d(32, 16, 1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.post(torch.relu(self.bn(self.conv(x))))
        return self.head(h.mean((2, 3)))


def test_batchnorm_after_a_pruned_conv_agrees_with_masking():
    torch.manual_seed(0)
    model = ConvBN()
    with torch.no_grad():  # non-trivial statistics, so a wrong BN slice would show
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.5, 0.5)
    workload = _workload(model)
    pruned = get_technique("prune-channels").apply(factory_copy(model), PruneChannelsConfig(ratio=0.5, ignored=("post",)),
                                                   workload=workload, device=CPU)
    kept = _kept_rows(pruned.conv.weight, model.conv.weight)
    assert len(kept) == 16 and pruned.bn.num_features == 16
    torch.testing.assert_close(pruned.bn.running_mean, model.bn.running_mean[kept])
    mask = torch.zeros(32)
    mask[kept] = 1.0
    masked = factory_copy(model)
    masked.bn.register_forward_hook(lambda _m, _i, out: out * mask.view(1, -1, 1, 1))  # removed channels → 0
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), masked(x), rtol=1e-5, atol=1e-5)


def test_linear_reshaped_into_conv_channels_stays_whole_and_the_conv_agrees_with_masking():
    # Torch-Pruning does not cut through the Linear → view → conv reshape: the Linear keeps all
    # its rows (safe), and the conv after it is pruned consistently.
    torch.manual_seed(0)
    model = LinearToConv()
    workload = _workload(model)
    pruned = get_technique("prune-channels").apply(factory_copy(model), PruneChannelsConfig(ratio=0.5),
                                                   workload=workload, device=CPU)
    assert pruned.fc.out_features == 32 * 16 and pruned.conv.in_channels == 32
    kept = _kept_rows(pruned.conv.weight, model.conv.weight)
    assert len(kept) == 16
    mask = torch.zeros(32)
    mask[kept] = 1.0
    masked = factory_copy(model)
    masked.conv.register_forward_hook(lambda _m, _i, out: out * mask.view(1, -1, 1, 1))
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), masked(x), rtol=1e-5, atol=1e-5)


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
