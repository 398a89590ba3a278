"""The one training loop: `overdrive train`, and pruning's recovery fine-tune (`fine_tune`).

Mixed precision, gradient accumulation, activation checkpointing, torch.compile, and data /
model parallelism on torch.distributed. The loss is `overdrive.train.objective.Objective`:
cross-entropy on the training labels when the workload has them (digits-cnn), otherwise
distillation toward a frozen teacher (by default a copy of the starting model; minilm).
`TrainConfig.train_mode` says whether the model trains in train mode (dropout on; the
default for `train`) or eval mode (pruning's distillation recovery).

AdamW (fused where torch has it) with `warmup_cosine` learning rates; gradients clipped to a
total norm of 1.0; bf16 autocast, or fp16 with a gradient scaler on CUDA.

Data: one seeded stream of permutations of the training samples (permutation e for epoch e).
Each optimizer step takes the next dp × batch_size × grad_accum rows of it; data-parallel rank
r's micro-step m gets rows [(m·dp + r)·B, (m·dp + r + 1)·B) of them. So every rank runs the same
number of steps and micro-steps whatever the dataset size (an even split; no rank ever waits
for one with more batches), the ranks' shards are disjoint, and the data position is one
number (rows consumed) that also means the same thing at another world size on resume.

Seeds: the stream's permutations use `seed` on every rank; dropout uses seed + dp rank, so
data-parallel replicas draw different masks and tensor-parallel ranks (one replica) the same.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.errors import ConfigError, arg
from overdrive.core.memory import peak_memory, reset_peak_memory
from overdrive.core.workload import Workload
from overdrive.train import parallel
from overdrive.train.checkpoint import load_checkpoint, save_checkpoint
from overdrive.train.agreement import adopt_rank0_weights, check_same_batch
from overdrive.train.config import TrainConfig, TrainSummary, autocast_dtype, check_runnable, warmup_cosine
from overdrive.train.data import SampleStream, micro_batch_indices, train_inputs
from overdrive.train.launch import DistEnv
from overdrive.train.objective import Objective, frozen_copy
from overdrive.train.parallel import ParallelDims
from overdrive.train.probe import (NUM_PROBE_BATCHES, ParameterUse, UnreachedGrads, plan_parameter_use,
                                   probe_parameter_use)


def _current_memory(device: torch.device) -> int:
    """Bytes in use now: the CUDA allocator's, or the process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _probe_parameter_use(model: nn.Module, workload: Workload, objective: Objective, config: TrainConfig, env: DistEnv,
                         stream: SampleStream, batch_size: int, dp_rank: int) -> ParameterUse:
    """Probe this rank's first micro-batches (`overdrive.train.probe`), sum the counts over the
    ranks, freeze the parameters no batch reached, and say what DDP / FSDP must do."""
    dims = config.dims
    if config.find_unused_parameters or dims.strategy not in ("ddp", "fsdp"):
        return plan_parameter_use({}, num_probes=0, strategy=dims.strategy, requested=config.find_unused_parameters)
    global_batch = batch_size * config.grad_accum * dims.dp
    batches = [micro_batch_indices(stream, k // config.grad_accum * global_batch, batch_size=batch_size,
                                   grad_accum=config.grad_accum, dp=dims.dp, dp_rank=dp_rank, micro=k % config.grad_accum)
               for k in range(NUM_PROBE_BATCHES)]
    counts = probe_parameter_use(model, workload, objective, batches, env.device)
    if dist.is_initialized():
        box = torch.tensor(list(counts.values()), dtype=torch.int64, device=env.device)
        dist.all_reduce(box)
        counts = dict(zip(counts, box.tolist(), strict=True))
    use = plan_parameter_use(counts, num_probes=NUM_PROBE_BATCHES * dims.dp, strategy=dims.strategy,
                             requested=config.find_unused_parameters)
    for name, p in model.named_parameters():
        if name in use.frozen:
            p.requires_grad_(False)
    return use


def _same_batch_tensors(idx: list[int], inputs: tuple[torch.Tensor, ...], objective: Objective) -> list[torch.Tensor]:
    """What ranks of one replica must agree on: the sample indices, the inputs, and the labels
    (a teacher's outputs are not compared: they follow from the inputs and the weights)."""
    tensors = [torch.tensor(idx, dtype=torch.int64, device=inputs[0].device), *inputs]
    if objective.classification:
        tensors.append(objective.workload.train_labels[idx].to(inputs[0].device))
    return tensors


def _pipeline_stage(model: nn.Module, workload: Workload, config: TrainConfig, env: DistEnv, batch_size: int) -> nn.Module:
    """This rank's stage, cut at the user's split points or at ones balancing measured block costs."""
    from overdrive.train import pipeline

    dims = config.dims
    points = list(dims.split_points or [])
    try:
        if not points:
            micro = max(1, batch_size // dims.num_microbatches)
            inputs = train_inputs(workload, list(range(min(micro, len(workload.train_samples)))), env.device)
            costs = torch.tensor(pipeline.measure_block_costs(model, inputs), dtype=torch.float64, device=env.device)
            dist.all_reduce(costs)  # every rank must cut at the same points
            points = pipeline.balanced_split((costs / env.world_size).cpu().tolist(), dims.pp)
        stage, owned = pipeline.build_stage_module(model, env.rank, points)
    except ValueError as exc:
        raise ConfigError(f"{arg('strategy', 'pipeline')}: {exc}") from None
    stage.split_points, stage.owned_blocks = points, owned
    return stage.to(env.device)


def _build(workload: Workload, config: TrainConfig, env: DistEnv, precision: str, batch_size: int,
           objective: Objective | None, stream: SampleStream, dp_rank: int):
    """The parallelized model, its objective, optimizer and trainable parameters, the probe's
    `ParameterUse`, and notes on what was decided here; in the order parallel.py states."""
    model = workload.model.to(env.device)
    notes = []
    # before the teacher is copied and anything is split or sharded
    if config.dims.strategy != "none" and dist.is_initialized() and adopt_rank0_weights(model):
        notes.append("the ranks' starting weights differed (a factory that reads RANK, or initialises without a seed); "
                     "every rank starts from rank 0's")
    if objective is None:
        objective = Objective(workload, None if workload.train_labels is not None else frozen_copy(model))
    dims = config.dims
    model.train(config.train_mode)
    # one process, pipeline and tensor parallelism need no probe: AdamW skips parameters without gradients
    use = _probe_parameter_use(model, workload, objective, config, env, stream, batch_size, dp_rank)
    if dims.strategy == "pipeline":
        model = workload.model = _pipeline_stage(model, workload, config, env, batch_size)  # the rank trains its stage
    if dims.strategy == "tensor-parallel":
        try:
            parallel.apply_tensor_parallel(model, env)
        except ValueError as exc:
            raise ConfigError(f"{arg('strategy', 'tensor-parallel')}: {exc}") from None
    if config.checkpoint_activations:
        try:
            parallel.apply_activation_checkpointing(model)
        except ValueError as exc:
            raise ConfigError(f"{arg('checkpoint_activations')}: {exc}") from None
    if config.compile:
        model.compile()
    if dims.strategy == "ddp":
        model = parallel.apply_ddp(model, env, find_unused_parameters=use.find_unused_parameters)
    elif dims.strategy == "fsdp":
        try:
            parallel.apply_fsdp(model, env, param_dtype=autocast_dtype(precision), reduce_unused=use.find_unused_parameters)
        except ValueError as exc:
            raise ConfigError(f"{arg('strategy', 'fsdp')}: {exc}") from None
    model.train(config.train_mode)
    params = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW (one kernel for all parameters) where torch has it: CUDA, and CPU for plain tensors.
    fused = env.device.type == "cuda" or dims.strategy in ("none", "ddp", "pipeline")
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, **({"fused": True} if fused else {}))
    return model, objective, optimizer, params, use, notes + ([use.note] if use.note else [])


def run_training(config: TrainConfig, env: DistEnv, *, workload: Workload | None = None,
                 objective: Objective | None = None, progress=None, on_grads=None) -> TrainSummary:
    """Train on this rank; every rank of the job calls it with the same config.

    Args:
        config: the run.
        env: this process's place in the job (`parallel.init_distributed`).
        workload: the workload to train (default: built from `config.workload`); its model is
            trained in place (under pipeline parallelism it is replaced by this rank's stage).
        objective: the loss (default: cross-entropy on the workload's labels, or distillation
            toward a frozen copy of its model); entered as a context manager around the steps.
        progress: called on rank 0 as progress(step, total_steps, loss, samples_per_s, peak_bytes).
        on_grads: called on every rank as on_grads(step, model) after the backward passes of a
            step, before clipping and the optimizer step (tests compare gradients with it).

    Returns:
        The TrainSummary (figures reduced over ranks).

    Raises:
        ConfigError: a configuration the model or device cannot run.
        RuntimeError: a collective timed out or another rank failed (the message names this rank).
    """
    from overdrive.workloads import create_workload

    workload = workload or create_workload(config.workload)
    if not workload.train_samples:
        raise ConfigError(f"workload {workload.name!r} has no training samples; a factory can return a Workload "
                        "with train_samples (and train_labels for classification)")
    dims = config.dims
    precision = check_runnable(config, env.device)
    batch_size = config.batch_size_for(workload.default_batch_size)
    dp_rank = env.rank if dims.dp > 1 else 0
    torch.manual_seed(config.seed + dp_rank)
    n = len(workload.train_samples)
    stream = SampleStream(n, config.seed)
    model, objective, optimizer, params, use, notes = _build(workload, config, env, precision, batch_size, objective,
                                                             stream, dp_rank)
    runner = None
    if dims.strategy == "pipeline":
        from overdrive.train.pipeline import PipelineRunner

        runner = PipelineRunner(model, dims, env, objective)
    check_batches = dims.strategy in ("tensor-parallel", "pipeline") and dist.is_initialized()
    global_batch = batch_size * config.grad_accum * dims.dp
    steps = config.steps or max(1, math.ceil((config.epochs or 1.0) * n / global_batch))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    start_step, position = 0, 0
    if config.resume_dir:
        start_step, position = load_checkpoint(Path(config.resume_dir), model, optimizer)
        for _ in range(start_step):
            schedule.step()
        if start_step >= steps:
            raise ConfigError(f"{arg('resume_dir', config.resume_dir)} is at step {start_step}; ask for more steps than that "
                            f"({arg('steps', start_step + steps)})")
    reset_peak_memory(env.device)
    start_memory = _current_memory(env.device)
    autocast = autocast_dtype(precision) if dims.strategy != "fsdp" else None  # FSDP casts through its policy
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    losses: list[float] = []
    times: list[float] = []
    is_ddp = dims.strategy == "ddp"
    end = min(steps, config.stop_after) if config.stop_after else steps
    # FSDP2 reduces zeros for what no rank reached; drop them so AdamW skips those parameters, as one process would
    unreached = None
    if dims.strategy == "fsdp" and use.find_unused_parameters:  # asked for without a probe: watch every parameter
        unreached = UnreachedGrads(model, use.varying or [name for name, p in model.named_parameters() if p.requires_grad])
    with objective:  # hint hooks on while the steps run
        for step in range(start_step, end):
            t0 = time.perf_counter()
            total = torch.zeros((), device=env.device)
            for micro in range(config.grad_accum if runner is None else 0):
                idx = micro_batch_indices(stream, position, batch_size=batch_size, grad_accum=config.grad_accum,
                                          dp=dims.dp, dp_rank=dp_rank, micro=micro)
                inputs = train_inputs(workload, idx, env.device)
                last = micro == config.grad_accum - 1
                if dims.strategy == "fsdp":
                    model.set_requires_gradient_sync(last)
                sync = model.no_sync() if is_ddp and not last else contextlib.nullcontext()
                if check_batches:  # the ranks of one replica must hold the same rows, before the model's collectives
                    check_same_batch(_same_batch_tensors(idx, inputs, objective), step=step, strategy=dims.strategy)
                with sync:
                    with torch.autocast(env.device.type, dtype=autocast, enabled=autocast is not None):
                        target = objective.target(idx, inputs, env.device)  # the teacher also runs in autocast
                        loss = objective(model(*inputs), target) / config.grad_accum
                    (scaler.scale(loss) if scaler else loss).backward()
                total += loss.detach()
            if runner:  # the schedule splits the batch into microbatches and runs forward and backward
                idx = stream.take(position, batch_size)
                inputs = train_inputs(workload, idx, env.device)
                if check_batches:  # the first stage feeds these rows; the last computes their targets
                    check_same_batch(_same_batch_tensors(idx, inputs, objective), step=step, strategy=dims.strategy)
                with torch.autocast(env.device.type, dtype=autocast, enabled=autocast is not None):
                    target = objective.target(idx, inputs, env.device) if runner.last else None
                    total = runner.step(inputs, target)
            if unreached:
                unreached.drop(env.device)
            if scaler:
                scaler.unscale_(optimizer)
            if on_grads:
                on_grads(step, model)
            parallel.clip_grad_norm(params, 1.0, group=dist.group.WORLD if runner else None)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            position += global_batch
            if dims.dp > 1:
                dist.all_reduce(total)
                total /= dims.dp
            losses.append(total.item())  # also synchronizes the device, so the step time is real
            times.append(time.perf_counter() - t0)
            if config.save_dir and config.save_every and (step + 1) % config.save_every == 0 and step + 1 < end:
                save_checkpoint(Path(config.save_dir), model, optimizer, step=step + 1, position=position, env=env)
            if progress and env.is_main:
                progress(step + 1, steps, losses[-1], global_batch / times[-1], peak_memory(env.device)[0])
    if config.save_dir:
        save_checkpoint(Path(config.save_dir), model, optimizer, step=end, position=position, env=env)
    peak, kind = peak_memory(env.device)
    added = max(0, (peak or 0) - start_memory)
    if dist.is_initialized():
        box = torch.tensor([peak or 0, added], device=env.device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        peak, added = (int(v) for v in box.tolist())
    skip = max(1, len(times) // 5) if len(times) > 1 else 0
    measured = times[skip:]
    tenth = max(1, len(losses) // 10)
    pipeline_stats = None
    if runner:
        pipeline_stats = _pipeline_stats(model, runner, dims, env)
        runner.close()
    return TrainSummary(
        workload=workload.name, strategy=dims.strategy, world_size=env.world_size, precision=precision,
        checkpoint_activations=config.checkpoint_activations, compile=config.compile, steps=end, start_step=start_step,
        global_batch_size=global_batch, samples_per_s=global_batch * len(measured) / sum(measured),
        seconds=sum(times), peak_memory_bytes=peak, peak_memory_kind=kind, step_memory_bytes=added,
        first_loss=sum(losses[:tenth]) / tenth, last_loss=sum(losses[-tenth:]) / tenth, losses=losses,
        objective=objective.name, device=str(env.device), pipeline=pipeline_stats, frozen_parameters=use.frozen,
        find_unused_parameters=use.find_unused_parameters, notes=notes,
    )


def _pipeline_stats(stage: nn.Module, runner, dims: ParallelDims, env: DistEnv) -> dict:
    """Split points and the bubble: each rank's idle fraction of the schedule's steps,
    1 − compute / schedule time (NaN when every step had a new shape), next to GPipe's
    (p − 1)/(m + p − 1) for equal stages."""
    fraction = 1.0 - runner.steady_busy_s / runner.steady_schedule_s if runner.steady_schedule_s else float("nan")
    idle = torch.tensor([fraction], dtype=torch.float64, device=env.device)
    gathered = [torch.zeros_like(idle) for _ in range(env.world_size)]
    dist.all_gather(gathered, idle)
    p, m = dims.pp, dims.num_microbatches
    return {"schedule": dims.schedule, "stages": p, "microbatches": m, "split_points": list(stage.split_points),
            "bubble_fraction_per_rank": [round(g.item(), 4) for g in gathered],
            "bubble_fraction": sum(g.item() for g in gathered) / len(gathered),
            "gpipe_formula": (p - 1) / (m + p - 1)}
