"""The fine-tune loop (`overdrive.train.fine_tune`): both objectives reduce their loss; bad arguments are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from overdrive.train.fine_tune import fine_tune, frozen_copy, training_precision
from tests.conftest import make_conv_workload, make_text_workload

CPU = torch.device("cpu")


def _text_with_training_data():
    workload = make_text_workload()
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 30, (200,), generator=g).tolist()
    workload.train_samples = [torch.randint(1, 50, (n,), generator=g).tolist() for n in lengths]
    return workload


def _eval_mse(student, teacher, workload):
    inputs = workload.collate(workload.samples)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(student(*inputs), teacher(*inputs)).item()


def test_distillation_pulls_a_perturbed_student_back_to_its_teacher():
    workload = _text_with_training_data()
    teacher = frozen_copy(workload.model)
    student = copy.deepcopy(workload.model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in student.encoder.encoder.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    before = _eval_mse(student, teacher, workload)
    report = fine_tune(student, workload, device=CPU, steps=80, learning_rate=1e-3, batch_size=16, teacher=teacher,
                       precision="fp32")
    after = _eval_mse(student, teacher, workload)
    assert after < 0.5 * before, (before, after)  # measured on evaluation samples it never trained on
    assert report.objective.startswith("distillation") and report.steps == 80 and report.precision == "fp32"
    assert not student.training and all(not p.requires_grad for p in teacher.parameters())


def test_cross_entropy_learns_the_training_labels():
    workload = make_conv_workload(num_samples=64)
    inputs = workload.collate(workload.samples)
    workload.labels = inputs[0].mean((2, 3)).argmax(1)  # a learnable task: the brightest input channel
    workload.train_samples, workload.train_labels = workload.samples, workload.labels

    def loss():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(workload.model(*inputs), workload.labels).item()

    before = loss()
    report = fine_tune(workload.model, workload, device=CPU, steps=100, learning_rate=1e-2, batch_size=16)
    assert loss() < 0.5 * before and report.objective.startswith("cross-entropy")
    assert report.precision in ("bf16 autocast", "fp32") and report.seconds > 0


def test_bad_arguments_are_refused():
    workload = make_text_workload()
    with pytest.raises(ValueError, match="no training samples"):
        fine_tune(workload.model, workload, device=CPU, steps=1, learning_rate=1e-3)
    workload = _text_with_training_data()
    with pytest.raises(ValueError, match="teacher"):
        fine_tune(workload.model, workload, device=CPU, steps=1, learning_rate=1e-3)
    with pytest.raises(ValueError, match="positive"):
        fine_tune(workload.model, workload, device=CPU, steps=0, learning_rate=1e-3, teacher=workload.model)
    with pytest.raises(ValueError, match="CUDA"):
        training_precision(CPU, "fp16")
    with pytest.raises(ValueError, match="precision"):
        training_precision(CPU, "int4")
