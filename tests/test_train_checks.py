"""`overdrive train` refusing what would give wrong numbers: flag combinations refused before
anything launches, ranks whose inputs differ (tensor parallel, pipeline), and parameters used on
only some forwards (the probe over several batches, DDP's find_unused_parameters)."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from overdrive.core.errors import ConfigError
from overdrive.train.config import TrainConfig, TrainSummary, training_precision
from overdrive.train.parallel import ParallelDims
from tests.fixtures import train_models
from tests.fixtures.train_workers import REPO, assert_close, reference, spawn

CPU = torch.device("cpu")


# -- flag errors: one line, exit 2, nothing launched ----------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch):
    """Any torchrun launch fails the test (the refusal must come first)."""
    from overdrive.train import launch

    def refuse(*args, **kwargs):
        raise AssertionError("torchrun was launched")

    monkeypatch.setattr(launch, "launch", refuse)


MLP = "tests.fixtures.train_models:mlp"


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "pipeline", "--grad-accum", "2"], "--grad-accum with --strategy pipeline"),
    (["--strategy", "pipeline", "--batch-size", "6", "--microbatches", "4"], "--batch-size 6 must be a multiple of the 4"),
    (["--precision", "fp16"], "--precision fp16 needs a CUDA device"),
    (["--strategy", "pipeline", "--precision", "fp16"], "--precision fp16"),
    (["--strategy", "fsdp", "--precision", "fp16"], "--precision fp16"),
    (["--strategy", "tensor-parallel", "--precision", "fp16"], "--precision fp16"),
    (["--save-every", "2"], "--save-every 2 needs --save"),
    (["--strategy", "pipeline", "--find-unused-parameters"], "--find-unused-parameters applies to --strategy ddp"),
    (["--strategy", "tensor-parallel", "--find-unused-parameters"], "--find-unused-parameters applies to --strategy ddp"),
])
def test_flag_errors_are_refused_before_launch(flags, message, no_launch, capsys, tmp_path):
    from overdrive.cli import main

    start = time.monotonic()
    code = main(["train", MLP, "--device", "cpu", "--nproc", "2", "--steps", "1", "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert time.monotonic() - start < 5


def test_resume_from_a_missing_folder_is_refused_before_launch(no_launch, capsys, tmp_path):
    from overdrive.cli import main

    code = main(["train", MLP, "--device", "cpu", "--nproc", "2", "--resume", str(tmp_path / "nothing")])
    err = capsys.readouterr().err
    assert code == 2 and "--resume" in err and "no checkpoint there" in err and len(err.strip().splitlines()) == 1, err


def test_a_flag_error_from_the_command_line_takes_seconds_not_a_launch(tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "overdrive", "train", MLP, "--device", "cpu", "--nproc", "2",
                             "--strategy", "pipeline", "--grad-accum", "2", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "torchrun" not in result.stderr and time.monotonic() - start < 20  # a launch alone takes longer


@pytest.mark.parametrize("kwargs, message", [
    (dict(grad_accum=2, dims=ParallelDims(strategy="pipeline", world_size=2)), "grad_accum with strategy='pipeline'"),
    (dict(batch_size=6, dims=ParallelDims(strategy="pipeline", world_size=2, microbatches=4)), "batch_size=6 must be"),
    (dict(precision="fp16", dims=ParallelDims(strategy="pipeline", world_size=2)), "use precision='bf16'"),
    (dict(precision="fp16", dims=ParallelDims(strategy="fsdp", world_size=2)), "use precision='bf16'"),
    (dict(precision="fp16", dims=ParallelDims(strategy="tensor-parallel", world_size=2)), "split (DTensor)"),
    (dict(precision="fp8"), "precision must be"),
    (dict(save_every=3), "save_every=3 needs save_dir"),
    (dict(find_unused_parameters=True), "find_unused_parameters applies to strategy='ddp'"),
    (dict(steps=0), "must be positive"),
])
def test_the_python_api_refuses_the_same_combinations(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(workload="mlp", **kwargs)


def test_fp16_on_a_cpu_is_refused_with_what_to_use_instead():
    with pytest.raises(ConfigError, match="needs a CUDA device") as info:
        training_precision(CPU, "fp16")
    assert "bf16" in str(info.value) and "precision='fp16'" in str(info.value)
    assert training_precision(CPU, "auto") in ("bf16", "fp32")  # auto never picks fp16 on a CPU


# -- ranks whose inputs differ --------------------------------------------------------------------------


def test_batch_fingerprint_sees_shapes_contents_and_row_order():
    from overdrive.train.agreement import batch_fingerprint

    x = torch.arange(12).reshape(3, 4)
    base = batch_fingerprint((x, torch.ones(3)))
    assert torch.equal(base, batch_fingerprint((x.clone(), torch.ones(3))))
    shape, content = base.tolist()
    assert batch_fingerprint((x.reshape(4, 3), torch.ones(3))).tolist()[0] != shape
    flipped = batch_fingerprint((x.flip(0), torch.ones(3))).tolist()
    assert flipped[0] == shape and flipped[1] != content  # the same rows in another order
    assert batch_fingerprint((x, torch.ones(3) + 1e-7)).tolist()[1] != content  # one ulp-sized change
    assert batch_fingerprint((x.float(), torch.ones(3))).tolist()[0] != shape  # dtype counts as shape


@pytest.mark.timeout(300)
@pytest.mark.parametrize("factory, seen", [("tiny_bert_rank_data", "different inputs"),
                                           ("tiny_bert_rank_lengths", "different input shapes")])
def test_tensor_parallel_refuses_ranks_whose_inputs_differ(tmp_path, factory, seen):
    with pytest.raises(Exception) as info:  # today: exit 0 with wrong losses, or a gloo abort on unequal shapes
        spawn(factory, 2, tmp_path, steps=2, batch_size=8, dims=ParallelDims(strategy="tensor-parallel", world_size=2))
    text = str(info.value)
    assert f"ranks 0 and 1 got {seen} at step 0" in text, text
    assert "reads RANK" in text and "unseeded" in text


@pytest.mark.timeout(300)
def test_pipeline_refuses_stages_whose_inputs_differ(tmp_path):
    with pytest.raises(Exception) as info:
        spawn("mlp_rank_data", 2, tmp_path, steps=2, batch_size=8, dims=ParallelDims(strategy="pipeline", world_size=2))
    assert "ranks 0 and 1 got different inputs at step 0" in str(info.value)


@pytest.mark.timeout(300)
def test_disagreeing_ranks_end_the_command_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "overdrive", "train", "tests.fixtures.train_models:mlp_rank_data",
                             "--device", "cpu", "--nproc", "2", "--strategy", "pipeline", "--steps", "2",
                             "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("overdrive: error:")]
    assert len(errors) == 1 and "ranks 0 and 1 got different inputs" in errors[0], result.stderr[-3000:]


@pytest.mark.timeout(300)
def test_every_rank_starts_from_rank_0s_weights(tmp_path):
    # today: stage 1 trains rank 1's weights, a model no single process would train
    pp = spawn("mlp_rank_weights", 2, tmp_path, steps=2, batch_size=8, learning_rate=1e-2,
               dims=ParallelDims(strategy="pipeline", world_size=2, microbatches=2, split_points=(3,)))
    ref = reference("mlp_rank_weights", steps=2, batch_size=8, learning_rate=1e-2)  # RANK unset: rank 0's weights
    assert pp["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_close(pp["params"], ref["params"], atol=1e-5)
    assert any("starting weights differed" in note for note in pp["summary"]["notes"])


# -- parameters used on only some forwards -------------------------------------------------------------


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [p.grad for p in model.parameters()]


def test_the_probe_leaves_no_trace():
    from overdrive.train.objective import Objective
    from overdrive.train.probe import probe_parameter_use

    workload = train_models.bn_dropout_mlp()
    model = workload.model.train()
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)  # a gradient the caller holds
    state, grads = _snapshot(model)
    rng = torch.get_rng_state()
    batches = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    counts = probe_parameter_use(model, workload, Objective(workload, None), batches, CPU)
    assert counts == {name: 4 for name, _ in model.named_parameters()}
    assert torch.equal(torch.get_rng_state(), rng)  # dropout drew nothing from the caller's generator
    after, after_grads = _snapshot(model)
    for key in state:  # BatchNorm's running statistics and its batch count are unchanged
        assert torch.equal(after[key], state[key]), key
    assert after_grads[0] is grads[0] and torch.equal(after_grads[0], torch.full_like(model[0].weight, 3.0))
    assert all(g is None for g in after_grads[1:])
    assert model.training and all(p.requires_grad for p in model.parameters())


def test_the_probe_counts_the_batches_that_reach_each_parameter():
    from overdrive.train.objective import Objective
    from overdrive.train.probe import probe_parameter_use

    workload = train_models.routed_mlp()
    rare = (torch.stack(workload.train_samples)[:, 0] > 1.0).tolist()
    with_rare = [i for i, r in enumerate(rare) if r][:1] + [i for i, r in enumerate(rare) if not r][:3]
    without = [i for i, r in enumerate(rare) if not r][3:7]
    counts = probe_parameter_use(workload.model.train(), workload, Objective(workload, None),
                                 [with_rare, without, without], CPU)
    assert counts["trunk.0.weight"] == 3 and counts["common.weight"] == 3
    assert counts["rare.weight"] == counts["rare.bias"] == 1 and counts["spare.weight"] == 0
    assert all(p.grad is None for p in workload.model.parameters())  # forward passes only


def test_parameter_use_decides_freezing_and_find_unused_parameters():
    from overdrive.train.probe import plan_parameter_use

    counts = {"trunk.weight": 8, "rare.weight": 3, "spare.weight": 0}
    auto = plan_parameter_use(counts, num_probes=8, strategy="ddp", requested=None)
    assert auto.frozen == ["spare.weight"] and auto.varying == ["rare.weight"] and auto.find_unused_parameters
    assert "rare.weight" in auto.note and "find_unused_parameters" in auto.note
    steady = plan_parameter_use({"trunk.weight": 8, "spare.weight": 0}, num_probes=8, strategy="ddp", requested=None)
    assert steady.frozen == ["spare.weight"] and not steady.find_unused_parameters
    asked = plan_parameter_use(counts, num_probes=8, strategy="ddp", requested=True)
    assert asked.frozen == [] and asked.find_unused_parameters  # the user knows: DDP finds them each step
    with pytest.raises(ConfigError, match="rare.weight"):
        plan_parameter_use(counts, num_probes=8, strategy="ddp", requested=False)
    for strategy in ("pipeline", "tensor-parallel"):  # one replica: every rank reaches the same parameters
        plan = plan_parameter_use(counts, num_probes=8, strategy=strategy, requested=None)
        assert plan.frozen == [] and not plan.find_unused_parameters


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, switch", [("ddp", "DDP's find_unused_parameters"),
                                              ("fsdp", "FSDP's reduce-scatter of unused parameters")])
def test_a_data_dependent_head_trains_as_in_one_process(tmp_path, strategy, switch):
    # step 0: rank 0's 4 rows reach `rare`, rank 1's do not; step 2: no rank reaches it (AdamW must skip it)
    run = spawn("routed_mlp", 2, tmp_path, steps=4, batch_size=4, learning_rate=1e-2,
                dims=ParallelDims(strategy=strategy, world_size=2))
    ref = reference("routed_mlp", steps=4, batch_size=8, learning_rate=1e-2)
    summary = run["summary"]
    assert summary["find_unused_parameters"] and summary["frozen_parameters"] == ["spare.bias", "spare.weight"]
    assert any(note.startswith(f"{switch} is on") and "rare.weight" in note for note in summary["notes"])
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    ref["params"] = {k: v for k, v in ref["params"].items() if not k.startswith("spare.")}
    run["params"] = {k: v for k, v in run["params"].items() if not k.startswith("spare.")}
    assert_close(run["params"], ref["params"], atol=1e-5)  # `rare` trained as in one process


@pytest.mark.timeout(300)
def test_ddp_at_one_process_equals_one_process_with_batchnorm_and_dropout(tmp_path):
    # the probe (DDP runs one) must not move BatchNorm's statistics or the dropout masks
    ddp = spawn("bn_dropout_mlp", 1, tmp_path, steps=3, batch_size=8, learning_rate=1e-2,
                dims=ParallelDims(strategy="ddp", world_size=1))
    ref = reference("bn_dropout_mlp", steps=3, batch_size=8, learning_rate=1e-2)
    # float noise only (the reference may run with another intra-op thread count); a moved BatchNorm
    # statistic or another dropout mask changes the loss in the third digit
    assert ddp["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_close(ddp["params"], ref["params"], atol=1e-6, rtol=1e-6)


def test_the_command_line_lists_frozen_parameters_and_says_what_it_turned_on(capsys):
    from types import SimpleNamespace

    from overdrive.cli.train import _finish

    summary = TrainSummary(
        workload="mlp", strategy="ddp", world_size=2, precision="fp32", checkpoint_activations=False, compile=False,
        steps=2, start_step=0, global_batch_size=8, samples_per_s=10.0, seconds=1.0, peak_memory_bytes=1 << 20,
        peak_memory_kind="RSS", step_memory_bytes=1 << 10, first_loss=1.0, last_loss=0.5, losses=[1.0, 0.5],
        objective="cross-entropy", device="cpu", frozen_parameters=["spare.bias", "spare.weight"],
        find_unused_parameters=True, notes=["DDP's find_unused_parameters is on: rare.weight was reached by some probe batches"])
    config = TrainConfig(workload="mlp", dims=ParallelDims(strategy="ddp", world_size=2))
    _finish(SimpleNamespace(compare=False), config, copy.deepcopy(summary))
    out = capsys.readouterr().out
    assert "frozen (reached by no probe batch): spare.bias, spare.weight" in " ".join(out.split())
    assert "find_unused_parameters is on" in out


def test_compare_runs_its_one_process_baseline_after_find_unused_parameters(capsys):
    from types import SimpleNamespace

    from overdrive.cli.train import _finish
    from overdrive.train.launch import DistEnv
    from overdrive.train.loop import run_training

    config = TrainConfig(workload="tests.fixtures.train_models:routed_mlp", device="cpu", steps=2, batch_size=4,
                         dims=ParallelDims(strategy="ddp", world_size=1), find_unused_parameters=True)
    summary = run_training(replace(config, dims=ParallelDims(strategy="none", world_size=1), find_unused_parameters=None),
                           DistEnv(0, 0, 1, CPU))
    _finish(SimpleNamespace(compare=True), config, summary)  # the baseline is one process: the option does not apply
    assert "baseline: fp32, 1 process" in capsys.readouterr().out
