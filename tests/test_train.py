"""`overdrive train`: each strategy against a single-process reference at world size 2 (gloo,
spawned processes, one thread each), AMP and activation checkpointing, checkpoint round trips
across world sizes, and the failure cases (refused configs, uneven data, a hung or failing rank)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from overdrive.train.loop import SampleStream, micro_batch_indices
from overdrive.train.parallel import ParallelConfigError, ParallelDims, find_blocks
from tests.fixtures import train_models
from tests.fixtures.train_workers import REPO, assert_close, reference, spawn


# -- data layout ---------------------------------------------------------------------------------------


def test_data_parallel_shards_are_disjoint_and_cover_the_global_batch():
    stream = SampleStream(37, seed=3)
    step = sorted(i for r in range(2) for m in range(2) for i in micro_batch_indices(stream, 0, batch_size=4, grad_accum=2, dp=2, dp_rank=r, micro=m))
    assert step == sorted(stream.take(0, 16)) and len(set(step)) == 16
    # crossing an epoch boundary: the next permutation continues, every sample once per epoch
    epoch = stream.take(0, 37)
    assert sorted(epoch) == list(range(37)) and stream.take(37, 37) != epoch


# -- strategies against the single-process reference --------------------------------------------------


@pytest.mark.timeout(300)
def test_ddp_with_accumulation_matches_one_process(tmp_path):
    # 2 ranks × 4 rows × 2 micro-steps = the reference's 16 rows per step
    ddp = spawn("mlp", 2, tmp_path, steps=3, batch_size=4, grad_accum=2, dims=ParallelDims(strategy="ddp", world_size=2),
                learning_rate=1e-2)
    ref = reference("mlp", steps=3, batch_size=16, learning_rate=1e-2)
    assert ddp["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_close(ddp["grads"], ref["grads"], atol=1e-6)
    assert_close(ddp["params"], ref["params"], atol=1e-5)


@pytest.mark.timeout(300)
def test_fsdp_matches_one_process_on_a_transformer(tmp_path):
    fsdp = spawn("tiny_bert", 2, tmp_path, steps=3, batch_size=4, dims=ParallelDims(strategy="fsdp", world_size=2),
                 learning_rate=1e-2)
    ref = reference("tiny_bert", steps=3, batch_size=8, learning_rate=1e-2)
    assert fsdp["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert_close(fsdp["grads"], ref["grads"], atol=1e-5)
    assert_close(fsdp["params"], ref["params"], atol=1e-4)


@pytest.mark.timeout(300)
def test_tensor_parallel_matches_one_process(tmp_path):
    tp = spawn("tiny_bert", 2, tmp_path, steps=3, batch_size=8, dims=ParallelDims(strategy="tensor-parallel", world_size=2),
               learning_rate=1e-2)
    ref = reference("tiny_bert", steps=3, batch_size=8, learning_rate=1e-2)
    assert tp["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert_close(tp["grads"], ref["grads"], atol=1e-5)
    assert_close(tp["params"], ref["params"], atol=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_matches_one_process_on_a_transformer(tmp_path, schedule):
    pp = spawn("tiny_bert", 2, tmp_path, steps=3, batch_size=8, learning_rate=1e-2,
               dims=ParallelDims(strategy="pipeline", world_size=2, microbatches=4, schedule=schedule))
    ref = reference("tiny_bert", steps=3, batch_size=8, learning_rate=1e-2)
    assert pp["losses"] == pytest.approx(ref["losses"], rel=1e-4)
    assert_close(pp["grads"], ref["grads"], atol=1e-5)
    assert_close(pp["params"], ref["params"], atol=1e-4)
    stats = pp["summary"]["pipeline"]
    assert stats["split_points"] == [1] and stats["microbatches"] == 4  # 2 equal layers: one per stage
    assert len(stats["bubble_fraction_per_rank"]) == 2 and 0 < stats["bubble_fraction"] < 1


@pytest.mark.timeout(300)
def test_pipeline_of_a_sequential_at_given_split_points(tmp_path):
    pp = spawn("mlp", 2, tmp_path, steps=3, batch_size=8, learning_rate=1e-2,
               dims=ParallelDims(strategy="pipeline", world_size=2, microbatches=2, split_points=(3,)))
    ref = reference("mlp", steps=3, batch_size=8, learning_rate=1e-2)
    assert pp["summary"]["pipeline"]["split_points"] == [3]
    assert pp["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert_close(pp["params"], ref["params"], atol=1e-5)


def test_balanced_split_minimises_the_slowest_stage():
    from overdrive.train.pipeline import balanced_split

    assert balanced_split([1, 1, 1, 1], 2) == [2]
    assert balanced_split([4, 1, 1, 1, 1], 2) == [1]
    assert balanced_split([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # stage sums 6, 9, 6
    with pytest.raises(ValueError, match="cannot fill"):
        balanced_split([1], 2)


# -- precision and activation checkpointing ------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_gradients_and_losses():
    plain = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2)
    checkpointed = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2, checkpoint_activations=True)
    assert checkpointed["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert_close(checkpointed["grads"], plain["grads"], atol=1e-7)


def test_activation_checkpointing_of_a_sequential_keeps_parameter_names():
    workload = train_models.mlp()
    names = [n for n, _ in workload.model.named_parameters()]
    from overdrive.train.parallel import apply_activation_checkpointing

    assert apply_activation_checkpointing(workload.model) == 3  # Linear-ReLU, Linear-ReLU, Linear
    assert [n for n, _ in workload.model.named_parameters()] == names


def test_bf16_autocast_follows_the_fp32_loss_curve():
    fp32 = reference("tiny_bert", steps=12, batch_size=8, learning_rate=3e-3)
    bf16 = reference("tiny_bert", steps=12, batch_size=8, learning_rate=3e-3, precision="bf16")
    assert bf16["summary"]["precision"] == "bf16"
    assert bf16["losses"] != fp32["losses"]  # autocast really ran the matmuls in bf16
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=0.03)  # bf16 keeps 8 mantissa bits: ~0.4% per op
    assert sum(bf16["losses"][-4:]) < sum(bf16["losses"][:4])  # and it learns


def test_find_blocks_picks_the_transformer_layers():
    name, blocks = find_blocks(train_models.tiny_bert().model)
    assert name == "encoder.encoder.layer" and len(blocks) == 2


# -- checkpoints ---------------------------------------------------------------------------------------


def test_resume_continues_exactly_where_the_run_stopped(tmp_path):
    kwargs = dict(steps=6, batch_size=8, learning_rate=1e-2)
    straight = reference("mlp", **kwargs)
    ckpt = tmp_path / "ckpt"
    first = reference("mlp", **kwargs, save_dir=str(ckpt), stop_after=3)  # an interrupted run
    assert (ckpt / "step-3" / ".metadata").exists()
    second = reference("mlp", **kwargs, resume_dir=str(ckpt))  # the newest step-N under the --save folder
    assert second["summary"]["start_step"] == 3
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    assert_close(second["params"], straight["params"], atol=1e-6)


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    from overdrive.core.errors import ConfigError

    with pytest.raises(ConfigError, match="no checkpoint there"):
        reference("mlp", steps=2, batch_size=8, resume_dir=str(tmp_path))


@pytest.mark.timeout(300)
def test_checkpoint_moves_from_two_ranks_to_one_and_from_one_to_two(tmp_path):
    kwargs = dict(steps=4, batch_size=4, learning_rate=1e-2)
    straight = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2)
    # 2 → 1: FSDP (sharded parameters and optimizer state) stops after 2 steps; one process resumes
    two = tmp_path / "two"
    spawn("tiny_bert", 2, tmp_path, **kwargs, dims=ParallelDims(strategy="fsdp", world_size=2), save_dir=str(two), stop_after=2)
    one = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2, resume_dir=str(two))
    assert one["losses"] == pytest.approx(straight["losses"][2:], rel=1e-4)
    assert_close(one["params"], straight["params"], atol=1e-4)
    # 1 → 2: one process stops after 2 steps; DDP at 2 ranks resumes
    single = tmp_path / "single"
    reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2, save_dir=str(single), stop_after=2)
    ddp = spawn("tiny_bert", 2, tmp_path, **kwargs, dims=ParallelDims(strategy="ddp", world_size=2), resume_dir=str(single))
    assert ddp["summary"]["start_step"] == 2
    assert ddp["losses"] == pytest.approx(straight["losses"][2:], rel=1e-4)
    assert_close(ddp["params"], straight["params"], atol=1e-4)


@pytest.mark.timeout(300)
def test_pipeline_checkpoint_resumes_in_one_process(tmp_path):
    ckpt = tmp_path / "pp"
    spawn("tiny_bert", 2, tmp_path, steps=4, batch_size=8, learning_rate=1e-2, save_dir=str(ckpt), stop_after=2,
          dims=ParallelDims(strategy="pipeline", world_size=2, microbatches=2))
    straight = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2)
    resumed = reference("tiny_bert", steps=4, batch_size=8, learning_rate=1e-2, resume_dir=str(ckpt))
    assert resumed["losses"] == pytest.approx(straight["losses"][2:], rel=1e-4)
    assert_close(resumed["params"], straight["params"], atol=1e-4)


# -- refused before launch, and failures at run time ---------------------------------------------------


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "overdrive", "train", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("kwargs, message", [
    (dict(strategy="none", world_size=2), "runs one process"),
    (dict(strategy="pipeline", world_size=2, microbatches=1), "microbatches for 2 pipeline stages"),
    (dict(strategy="pipeline", world_size=1), "needs ≥ 2 stages"),
    (dict(strategy="pipeline", world_size=3, split_points=(2,)), "needs 2 increasing block indices"),
    (dict(strategy="ddp", world_size=2, microbatches=4), "pipeline only"),
    (dict(strategy="zero", world_size=2), "unknown strategy"),
])
def test_parallel_dims_refuse_what_cannot_work(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        ParallelDims(**kwargs)


def test_cli_refuses_bad_degrees_before_launching(tmp_path):
    start = time.monotonic()
    result = run_cli("tests.fixtures.train_models:mlp", "--device", "cpu", "--nproc", "1", "--strategy", "ddp", "--steps", "1",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr  # ddp at 1 process is allowed (the code path, no peers)
    from tests.fixtures.cli import cli_in_process

    result = cli_in_process("train", "tests.fixtures.train_models:mlp", "--device", "cpu", "--strategy", "none", "--nproc", "2")
    assert result.returncode == 2 and "runs one process" in result.stderr and "Traceback" not in result.stderr
    result = cli_in_process("train", "tests.fixtures.train_models:mlp", "--device", "cpu", "--strategy", "pipeline",
                            "--nproc", "2", "--microbatches", "1")
    assert result.returncode == 2 and "use --microbatches ≥ 2" in result.stderr
    assert time.monotonic() - start < 120


@pytest.mark.timeout(300)
def test_tensor_parallel_refuses_heads_it_cannot_split(tmp_path):
    result = run_cli("tests.fixtures.train_models:tiny_bert_3_heads", "--device", "cpu", "--nproc", "2",
                     "--strategy", "tensor-parallel", "--steps", "1", "--out", str(tmp_path))
    assert result.returncode != 0
    assert "must divide the 3 attention heads" in result.stderr


@pytest.mark.timeout(300)
def test_uneven_data_ranks_finish_together(tmp_path):
    # 37 samples, 2 ranks × 8 rows: no divisor; both ranks run every step (an even split of one stream)
    result = run_cli("tests.fixtures.train_models:mlp_37", "--device", "cpu", "--nproc", "2", "--epochs", "2",
                     "--batch-size", "8", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = __import__("json").loads((tmp_path / "mlp" / "train" / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["world_size"] == 2  # ceil(2 × 37 / 16)


@pytest.mark.timeout(300)
def test_a_hung_rank_becomes_an_error_naming_the_rank(tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "overdrive", "train", "tests.fixtures.train_models:straggler", "--device", "cpu",
                             "--nproc", "2", "--steps", "5", "--collective-timeout-s", "5", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=240,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "STRAGGLE_S": "120"})
    assert result.returncode != 0
    assert "rank 0 of 2 failed" in result.stderr
    assert time.monotonic() - start < 100  # the timeout fired; the straggler's 120 s sleep was cut short


@pytest.mark.timeout(300)
def test_one_rank_failing_stops_the_others(tmp_path):
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "overdrive", "train", "tests.fixtures.train_models:straggler", "--device", "cpu",
                             "--nproc", "2", "--steps", "5", "--out", str(tmp_path)],
                            cwd=REPO, capture_output=True, text=True, timeout=240,
                            env={**__import__("os").environ, "OMP_NUM_THREADS": "1", "RAISE_ON_RANK1": "1"})
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr and "rank 1 of 2 failed" in result.stderr
    assert time.monotonic() - start < 100  # not the 600 s collective timeout


# -- inference from the same split ------------------------------------------------------------------


@pytest.mark.parametrize("factory, rows", [("tiny_bert", 8), ("tiny_bert", 1), ("mlp", 7)])
def test_pipelined_model_equals_the_model(factory, rows):
    from overdrive.techniques.multi_device.pipelined_model import PipelinedModel

    workload = getattr(train_models, factory)()
    inputs = workload.collate(list(workload.train_samples[:rows]))
    cpu = torch.device("cpu")
    pipelined = PipelinedModel(workload.model, [cpu, cpu], microbatches=3, example=inputs)
    assert pipelined.split_points == [1 if factory == "tiny_bert" else pipelined.split_points[0]]
    with torch.no_grad():
        torch.testing.assert_close(pipelined(*inputs), workload.model(*inputs), atol=1e-5, rtol=1e-5)


def test_pipelined_model_refuses_one_device():
    from overdrive.techniques.multi_device.pipelined_model import PipelinedModel

    with pytest.raises(ValueError, match="≥ 2 stages"):
        PipelinedModel(train_models.mlp().model, [torch.device("cpu")])


def test_pipeline_parallel_technique_says_why_it_does_not_apply_here():
    from overdrive.techniques import get_technique

    reason = get_technique("pipeline-parallel").unsupported_reason(train_models.mlp(), torch.device("cpu"))
    assert reason == "runs on cuda only"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pipelined_model_on_the_gpu_equals_the_model():
    from overdrive.techniques.multi_device.pipelined_model import PipelinedModel

    workload = train_models.tiny_bert()
    gpu = torch.device("cuda", 0)
    devices = [torch.device("cuda", i % torch.cuda.device_count()) for i in range(2)]  # one GPU holds both stages
    model = workload.model.to(gpu)
    inputs = tuple(t.to(gpu) for t in workload.collate(list(workload.train_samples[:16])))
    pipelined = PipelinedModel(model, devices, microbatches=4, example=inputs)
    with torch.no_grad():
        torch.testing.assert_close(pipelined(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)
