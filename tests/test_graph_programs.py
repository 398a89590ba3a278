"""Techniques on torch.export programs (.pt2): reasons read from the graph, folds and layouts that keep the math.

A program loaded with `torch.export.load(...).module()` (what `overdrive optimize model.pt2` runs) is an
fx graph of aten ops: its convolutions are `aten.conv2d` calls, not nn.Conv2d modules. Every reason a
technique gives must be true of that graph, and what applies must keep the outputs.
"""

from __future__ import annotations

import dataclasses

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from overdrive.core.graph_ops import count_ops, op_name
from overdrive.core.measure import measure
from overdrive.techniques import default_config, get_technique, list_techniques
from overdrive.techniques.pruning.recovery import num_parameters
from overdrive.techniques.compose import build
from overdrive.workloads.user import build_from_file
from tests.conftest import TinyConvNet, _randomise_bn

CPU = torch.device("cpu")
# Claims that are false of a program that runs convolutions, batch norms and a linear as aten ops.
FALSE_CLAIMS = re.compile(r"has no (BatchNorm|2-D convolutions|conv or Linear|nn\.Linear)")


def _program(tmp_path_factory, model: nn.Module, shape: tuple[int, ...], name: str):
    """`model` exported with torch.export, saved and loaded back as `overdrive` loads a .pt2."""
    torch.manual_seed(0)
    program = torch.export.export(model.eval(), (torch.randn(*shape),))
    path = Path(tmp_path_factory.mktemp("pt2")) / f"{name}.pt2"
    torch.export.save(program, str(path))
    return build_from_file(path, input_shape=None, input_dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny_program(tmp_path_factory):
    """conftest's TinyConvNet (conv-BN-ReLU ×2 with non-trivial statistics, Linear head) as a .pt2."""
    torch.manual_seed(0)
    return _program(tmp_path_factory, _randomise_bn(TinyConvNet()), (4, 3, 16, 16), "tiny")


@pytest.fixture(scope="module")
def resnet_program(tmp_path_factory):
    from torchvision.models import resnet18

    torch.manual_seed(0)
    model = resnet18(num_classes=10)
    g = torch.Generator().manual_seed(1)
    for m in model.modules():  # non-trivial statistics, so a wrong fold would show
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return _program(tmp_path_factory, model, (2, 3, 32, 32), "resnet18")


def test_the_loaded_program_is_a_graph_of_aten_ops(tiny_program, resnet_program):
    assert not any(isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.Linear)) for m in tiny_program.model.modules())
    assert count_ops(tiny_program.model, "conv2d") == 2 and count_ops(tiny_program.model, "batch_norm") == 2
    assert count_ops(resnet_program.model, "conv2d") == 20 and count_ops(resnet_program.model, "batch_norm") == 20


def test_every_reason_for_a_program_is_true_of_its_graph(resnet_program):
    reasons = {t.name: t.unsupported_reason(resnet_program, CPU) for t in list_techniques()}
    for name, reason in reasons.items():
        assert not (reason and FALSE_CLAIMS.search(reason)), f"{name}: {reason}"
    assert reasons["bn-fold"] is None and reasons["channels-last"] is None  # both work on the graph
    assert "runs 1 aten.linear op in its graph, not as nn.Linear modules" in reasons["int8-dynamic"]
    for name in ("prune-channels", "prune-unstructured"):
        assert "20 aten.conv2d and 1 aten.linear ops" in reasons[name] and "torch.export program" in reasons[name]
    for name in ("prune-heads", "prune-ffn"):
        assert reasons[name].startswith("not applicable: the program calls no aten.scaled_dot_product_attention"), reasons[name]


@pytest.mark.parametrize("technique", [t for t in list_techniques()], ids=lambda t: t.name)
def test_what_applies_to_a_program_keeps_its_outputs(technique, tiny_program):
    workload = tiny_program
    if technique.unsupported_reason(workload, CPU):
        pytest.skip("does not apply to this program (reasons: test_every_reason_for_a_program_is_true_of_its_graph)")
    indices = list(range(len(workload.samples)))
    reference_model, _ = build(workload, [], CPU)
    _, reference = measure(reference_model, workload, device=CPU, batch_size=workload.default_batch_size, indices=indices,
                           min_timed_calls=1, min_timed_s=0.0)
    model, policy = build(workload, [default_config(technique.name)], CPU)
    m, out = measure(model, workload, device=CPU, batch_size=workload.default_batch_size, indices=indices, policy=policy,
                     reference=reference, min_timed_calls=1, min_timed_s=0.0)
    if technique.lossless:
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    else:
        assert m.fidelity["min_cosine"] >= 0.99, m.fidelity


@pytest.mark.parametrize("fixture", ["tiny_program", "resnet_program"])
def test_bn_fold_folds_the_programs_batch_norms_into_its_convs(fixture, request):
    workload = request.getfixturevalue(fixture)
    num_bn = count_ops(workload.model, "batch_norm")
    model, _ = build(workload, [default_config("bn-fold")], CPU)
    assert count_ops(model, "batch_norm") == 0 and count_ops(model, "conv2d") == count_ops(workload.model, "conv2d")
    assert num_parameters(model) < num_parameters(workload.model)  # the BatchNorm weights are gone, not just unread
    x = workload.collate(list(workload.samples[:workload.default_batch_size]))
    with torch.no_grad():
        torch.testing.assert_close(model(*x), workload.model(*x), rtol=1e-4, atol=1e-5)
    assert num_bn > 0


def test_channels_last_changes_the_programs_weight_layout_and_keeps_its_outputs(resnet_program):
    model, _ = build(resnet_program, [default_config("channels-last")], CPU)
    weights = [node.args[1].target for node in model.inner.graph.nodes
               if node.op == "call_function" and op_name(node.target) == "conv2d"]
    assert len(weights) == 20
    for target in weights:
        assert model.inner.get_parameter(target).is_contiguous(memory_format=torch.channels_last), target
    x = resnet_program.collate(list(resnet_program.samples[:resnet_program.default_batch_size]))
    with torch.no_grad():
        torch.testing.assert_close(model(*x), resnet_program.model(*x), rtol=1e-4, atol=1e-5)


class BNAfterReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.bn(torch.relu(self.conv(x))).mean((2, 3)))


def test_bn_fold_says_why_a_programs_batch_norms_cannot_fold(tmp_path_factory):
    after_relu = _program(tmp_path_factory, BNAfterReLU(), (2, 3, 8, 8), "after-relu")
    reason = get_technique("bn-fold").unsupported_reason(after_relu, CPU)
    assert reason and "none of the program's 1 aten.batch_norm ops directly follows an aten.conv" in reason
    torch.manual_seed(0)
    trained = torch.export.export(TinyConvNet().train(), (torch.randn(4, 3, 16, 16),))
    train_mode = dataclasses.replace(after_relu, model=trained.module())  # a program still in training mode
    reason = get_technique("bn-fold").unsupported_reason(train_mode, CPU)
    assert reason and "exported in training mode" in reason
    path = Path(tmp_path_factory.mktemp("pt2")) / "train.pt2"
    torch.export.save(trained, str(path))
    loaded = build_from_file(path, input_shape=None, input_dtype=torch.float32)  # switched to eval ops, and says so
    assert any("training mode" in note for note in loaded.notes)
    assert get_technique("bn-fold").unsupported_reason(loaded, CPU) is None
