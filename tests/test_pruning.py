"""Structured channel pruning on the structures pruning tools break on.

Each case builds a small model, prunes half the channels with `prune-channels`, and asserts that
the pruned model runs, returns the original output shape, and really has fewer parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overdrive.techniques import get_technique
from overdrive.techniques.prune_channels import PruneChannelsConfig, num_parameters
from overdrive.workloads.base import Workload, logits_fidelity

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


CHUNK_GAP = pytest.mark.xfail(strict=True, raises=RuntimeError,
                              reason="torch-pruning 1.6 fails on chunk-then-concat (IndexError in its importance); "
                                     "the technique reports it as a clear RuntimeError; issue 3 must handle it")
CASES = [Residual, ConcatSelf, pytest.param(ChunkConcat, marks=CHUNK_GAP), LinearToConv, DepthwiseResidual, Grouped,
         MaskMultiply, SharedWeight]


@pytest.mark.parametrize("factory", CASES, ids=[getattr(c, "__name__", None) or c.values[0].__name__ for c in CASES])
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
    import copy

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
