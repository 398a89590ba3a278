"""The fine-tune loop (`overdrive.train.fine_tune`): both objectives reduce their loss; bad arguments are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from overdrive.train.config import training_precision
from overdrive.train.fine_tune import fine_tune
from overdrive.train.objective import frozen_copy
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


def _modes_seen(model):
    """The train/eval mode of each forward of `model` itself (not of copies, which share the hook)."""
    seen = []
    model.register_forward_pre_hook(lambda module, _inputs: seen.append(module.training) if module is model else None)
    return seen


def test_fine_tune_is_the_train_loop_with_the_student_in_eval_mode_under_distillation():
    from overdrive.train.config import TrainConfig
    from overdrive.train.launch import DistEnv
    from overdrive.train.loop import run_training

    workload = _text_with_training_data()
    teacher = frozen_copy(workload.model)
    student = copy.deepcopy(workload.model)
    seen = _modes_seen(student)
    rng = torch.get_rng_state()
    student.encoder.embeddings.word_embeddings.weight.requires_grad_(False)  # the caller's choice survives
    report = fine_tune(student, workload, device=CPU, steps=3, learning_rate=1e-3, batch_size=8, teacher=teacher,
                       precision="fp32")
    assert report.steps == 3 and "unpruned model" in report.objective
    assert seen and not any(seen)  # no dropout: the student matches the deterministic teacher it is judged against
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's random stream is untouched
    assert not student.encoder.embeddings.word_embeddings.weight.requires_grad
    assert all(p.requires_grad for n, p in student.named_parameters() if "word_embeddings" not in n)

    seen = _modes_seen(workload.model)
    summary = run_training(TrainConfig(workload=workload.name, steps=2, batch_size=8), DistEnv(0, 0, 1, CPU),
                           workload=workload)
    assert summary.steps == 2 and all(seen)  # `train` keeps dropout on


def test_hints_add_the_layer_output_mse_only_while_the_objective_is_entered():
    from overdrive.train.objective import Objective

    workload = _text_with_training_data()
    teacher = frozen_copy(workload.model)
    student = copy.deepcopy(workload.model)
    layer = student.encoder.encoder.layer[0]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1)
    pair = (layer, teacher.encoder.encoder.layer[0])
    idx = list(range(8))
    inputs = workload.collate([workload.train_samples[i] for i in idx])
    plain = Objective(workload, teacher, cosine_weight=0.0)
    hinted = Objective(workload, teacher, hints=[pair], cosine_weight=0.0)
    with torch.no_grad():
        base = plain(student(*inputs), plain.target(idx, inputs, CPU)).item()
        with hinted:
            with_hint = hinted(student(*inputs), hinted.target(idx, inputs, CPU)).item()
        outside = hinted(student(*inputs), hinted.target(idx, inputs, CPU)).item()
    assert with_hint > base * 1.01 and outside == pytest.approx(base)
    assert not layer._forward_hooks and "1 layer outputs" in hinted.name


def test_one_process_training_freezes_nothing_the_first_rows_miss():
    """The reachability probe is for DDP; alone, a parameter the first rows never reach (here the
    BERT pooler under mean pooling) keeps requires_grad and is simply not updated."""
    from overdrive.train.config import TrainConfig
    from overdrive.train.launch import DistEnv
    from overdrive.train.loop import run_training

    workload = _text_with_training_data()
    pooler = workload.model.encoder.pooler.dense.weight
    before = pooler.detach().clone()
    run_training(TrainConfig(workload=workload.name, steps=2, batch_size=8), DistEnv(0, 0, 1, CPU), workload=workload)
    assert pooler.requires_grad and torch.equal(pooler.detach(), before)
    assert all(p.requires_grad for p in workload.model.parameters())
