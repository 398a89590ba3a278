"""Structured channel pruning on the structures pruning tools break on.

Each case builds a small model, prunes half the channels with `prune-channels`, and asserts that
the pruned model runs, returns the original output shape, and really has fewer parameters.
Index-preserving cases also check that the pruned model computes what the unpruned one computes
with the removed channels masked to zero. GroupNorm nets lose whole groups; recurrent layers,
which the dependency graph does not support, are named when they stop pruning. Recovery and
checkpoints: test_pruning_recovery.py.
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
    with pytest.raises(RuntimeError, match="nothing could be pruned at ratio 0.5: kept on purpose: 'head', 'a', 'g'"):
        get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(ignored=("a", "g")),
                                              workload=workload, device=CPU)


def test_a_grouped_convs_inputs_lose_as_many_channels_from_each_group():
    # a (32 channels) feeds a conv of 4 groups of 8 inputs: half of 32 rounded to 8 is 16, 4 from each group
    # (Torch-Pruning's own rounding counted 4 per group against all 32 channels and pruned nothing).
    torch.manual_seed(0)
    workload = _workload(Grouped())
    pruned = get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(ignored=("g",)),
                                                   workload=workload, device=CPU)
    assert pruned.a.out_channels == 16 and pruned.g.in_channels == 16 and pruned.g.groups == 4
    kept = _kept_rows(pruned.a.weight, workload.model.a.weight)
    assert [sum(1 for k in kept if k // 8 == group) for group in range(4)] == [4, 4, 4, 4]


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


def _assert_equals_masking(pruned, model, layer: str, kept: list[int], workload) -> None:
    """The pruned model computes what the unpruned one does with `layer`'s other output channels zeroed."""
    mask = torch.zeros(getattr(model, layer).weight.shape[0])
    mask[kept] = 1.0
    masked = factory_copy(model)
    getattr(masked, layer).register_forward_hook(lambda _m, _i, out: out * mask.view(1, -1, 1, 1))
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), masked(x), rtol=1e-5, atol=1e-5)


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
    _assert_equals_masking(pruned, model, "conv", kept, workload)


class GroupNormNet(nn.Module):
    """conv → GroupNorm(8 groups) → ReLU, twice: 32 channels in groups of 4, then 64 in groups of 8."""

    def __init__(self):
        super().__init__()
        self.conv1, self.gn1 = nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32)
        self.conv2, self.gn2 = nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.gn1(self.conv1(x)))  # [B, 32, H, W]
        x = torch.relu(self.gn2(self.conv2(x)))  # [B, 64, H, W]
        return self.head(x.mean((2, 3)))


def _group_norm_workload() -> Workload:
    torch.manual_seed(0)
    model = GroupNormNet()
    with torch.no_grad():  # non-trivial affine parameters, so a wrong slice would show
        for norm in (model.gn1, model.gn2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return _workload(model)


@pytest.mark.parametrize("global_pruning", [False, True])
def test_group_norm_nets_lose_whole_groups_rounded_to_8(global_pruning):
    workload = _group_norm_workload()
    pruned = get_technique("prune-channels").apply(
        factory_copy(workload.model), PruneChannelsConfig(ratio=0.5, round_to=8, global_pruning=global_pruning),
        workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    for conv, norm, size in ((pruned.conv1, pruned.gn1, 4), (pruned.conv2, pruned.gn2, 8)):
        assert conv.out_channels % 8 == 0 and norm.num_channels == conv.out_channels
        assert norm.num_channels == norm.num_groups * size  # each kept group keeps its channels
    assert pruned.conv1.out_channels + pruned.conv2.out_channels < 32 + 64
    if not global_pruning:
        assert (pruned.conv1.out_channels, pruned.conv2.out_channels) == (16, 32)
    x = torch.stack(workload.samples)
    with torch.no_grad():
        assert pruned(x).shape == (8, 10) and torch.isfinite(pruned(x)).all()
    assert report["params_after"] < report["params_before"] and "left_unpruned" not in report


def test_group_norm_pruning_agrees_with_masking_the_removed_groups():
    # whole groups go, so the kept groups normalise over the same channels: exact, not approximate
    workload = _group_norm_workload()
    model = workload.model
    pruned = get_technique("prune-channels").apply(factory_copy(model), PruneChannelsConfig(ratio=0.5, ignored=("conv2",)),
                                                   workload=workload, device=CPU)
    kept = _kept_rows(pruned.conv1.weight, model.conv1.weight)
    assert len(kept) == 16 and pruned.gn1.num_groups == 4
    assert all(sum(1 for k in kept if k // 4 == g) in (0, 4) for g in range(8))  # whole groups of 4
    _assert_equals_masking(pruned, model, "gn1", kept, workload)


def test_group_norm_pruned_weights_reload_into_a_fresh_model(tmp_path):
    workload = _group_norm_workload()
    technique = get_technique("prune-channels")
    pruned = technique.apply(factory_copy(workload.model), PruneChannelsConfig(ratio=0.5), workload=workload, device=CPU)
    save_checkpoint(pruned, tmp_path / "gn.pt", "prune-channels")
    reloaded = technique.apply(factory_copy(workload.model), PruneChannelsConfig(checkpoint=str(tmp_path / "gn.pt")),
                               workload=workload, device=CPU)
    assert (reloaded.gn1.num_groups, reloaded.gn2.num_groups) == (pruned.gn1.num_groups, pruned.gn2.num_groups)
    x = torch.stack(workload.samples)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), pruned(x))


class EmbeddingLSTM(nn.Module):
    """token ids [B, S] → Embedding → LSTM → last step → Linear head [B, 5]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.rnn = nn.LSTM(32, 32, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))  # [B, S, 32]
        return self.head(h[:, -1])


class EmbeddingLinearLSTM(nn.Module):
    """Embedding → Linear 'pre' (feeds the LSTM) → LSTM → Linear 'mid' → ReLU → Linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.pre = nn.Linear(32, 32)
        self.rnn = nn.LSTM(32, 32, batch_first=True)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, ids):
        h, _ = self.rnn(self.pre(self.emb(ids)))
        return self.head(torch.relu(self.mid(h[:, -1])))


def _token_workload(model: nn.Module) -> Workload:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 6), generator=g)
    return Workload(name="tokens", model=model.eval(), samples=list(ids), collate=lambda s: (torch.stack(s),),
                    fidelity=logits_fidelity, fidelity_key="min_cosine", default_batch_size=4, real_weights=False)


def test_an_lstm_model_is_refused_naming_the_lstm_not_with_an_index_error():
    torch.manual_seed(0)
    workload = _token_workload(EmbeddingLSTM())
    technique = get_technique("prune-channels")
    reason = technique.unsupported_reason(workload, CPU)
    assert reason and "nn.LSTM 'rnn' is not supported by the dependency graph" in reason and "nn.Linear 'head'" in reason
    with pytest.raises(RuntimeError) as info:  # applied anyway (a plan written before): the same cause, said plainly
        technique.apply(factory_copy(workload.model), PruneChannelsConfig(finetune_steps=0), workload=workload, device=CPU)
    assert "nn.LSTM 'rnn'" in str(info.value) and "IndexError" not in str(info.value)


def test_layers_coupled_to_an_lstm_stay_whole_and_the_rest_is_pruned():
    torch.manual_seed(0)
    workload = _token_workload(EmbeddingLinearLSTM())
    technique = get_technique("prune-channels")
    assert technique.unsupported_reason(workload, CPU) is None
    pruned = technique.apply(factory_copy(workload.model), PruneChannelsConfig(finetune_steps=0), workload=workload, device=CPU)
    report = pruned.__dict__.pop("overdrive_report")
    assert pruned.pre.out_features == 32 and pruned.rnn.input_size == 32 and pruned.mid.out_features == 16
    assert "nn.LSTM 'rnn'" in report["left_unpruned"]["pre"]
    with torch.no_grad():
        assert pruned(torch.stack(workload.samples)).shape == (8, 5)


class NormalizedHead(nn.Module):
    """An embedding model: the output is the head's output L2-normalised, not the head's tensor itself."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 32, 3, padding=1)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        return nn.functional.normalize(self.head(torch.relu(self.conv(x)).mean((2, 3))), dim=-1)


def test_the_output_layer_is_found_through_ops_after_it():
    torch.manual_seed(0)
    workload = _workload(NormalizedHead())
    pruned = get_technique("prune-channels").apply(factory_copy(workload.model), PruneChannelsConfig(finetune_steps=0),
                                                   workload=workload, device=CPU)
    assert pruned.head.out_features == 16 and pruned.conv.out_channels == 16
    with torch.no_grad():
        assert pruned(torch.stack(workload.samples)).shape == (8, 16)
