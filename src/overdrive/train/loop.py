"""`overdrive train`: the training loop with mixed precision, gradient accumulation, activation
checkpointing, torch.compile, and data / model parallelism on torch.distributed.

Objectives (from the workload, as in pruning's recovery fine-tune, `overdrive.train.fine_tune`):
cross-entropy on the training labels when the workload has them (digits-cnn), otherwise
distillation toward a frozen copy of the starting model (MSE plus cosine distance between the
outputs; minilm), with the student in train mode (dropout on).

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
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.devices import resolve_device
from overdrive.core.errors import UserError, one_line
from overdrive.core.measure import peak_memory, reset_peak_memory
from overdrive.core.workload import Workload
from overdrive.train import parallel
from overdrive.train.fine_tune import _lr_lambda, frozen_copy, training_precision
from overdrive.train.parallel import DistEnv, ParallelConfigError, ParallelDims


@dataclass(kw_only=True)
class TrainConfig:
    """What to train and how. Batch sizes count rows; times are seconds.

    Attributes:
        batch_size: rows per forward pass on each rank (the micro-batch); the global batch of
            one optimizer step is batch_size × grad_accum × data-parallel ranks.
        steps: optimizer steps; None to derive them from `epochs`.
        epochs: passes over the training samples (steps = ceil(epochs × samples / global batch)).
        grad_accum: micro-batches whose gradients are summed before each optimizer step.
        learning_rate: peak AdamW learning rate (linear warm-up over 10% of steps, cosine decay).
        precision: "fp32", "bf16", "fp16" (CUDA, with a gradient scaler) or "auto".
        checkpoint_activations: recompute each block's activations in backward.
        compile: torch.compile the model.
        dims: the parallel layout (strategy and world size).
        seed: data order and initial RNG state.
        collective_timeout_s: a collective that waits longer fails, naming the rank.
        save_dir: where checkpoints go, as SAVE_DIR/step-N (None: no checkpoints).
        save_every: also save every this many steps (0: only at the end).
        resume_dir: a checkpoint (or a save_dir: its newest) to continue from: model, optimizer
            with its step, data position. The learning-rate schedule is that of `steps`.
        stop_after: end this run after this step (a planned interruption; 0: run to `steps`).
    """

    workload: str
    device: str = "auto"
    batch_size: int | None = None
    steps: int | None = None
    epochs: float | None = None
    grad_accum: int = 1
    learning_rate: float = 1e-4
    precision: str = "fp32"
    checkpoint_activations: bool = False
    compile: bool = False
    dims: ParallelDims = field(default_factory=lambda: ParallelDims(strategy="none", world_size=1))
    seed: int = 0
    collective_timeout_s: float = 600.0
    save_dir: str | None = None
    save_every: int = 0
    resume_dir: str | None = None
    stop_after: int = 0


@dataclass(kw_only=True)
class TrainSummary:
    """What a run did, written to OUT/<workload>/train/summary.json by rank 0.

    samples_per_s counts global rows per second over the steps after the first 20% (at least
    one step is skipped: it holds compilation and first-use costs). peak_memory_bytes is the
    largest over ranks: the CUDA allocator's peak, or on CPU the process RSS high-water mark.
    step_memory_bytes is that peak less the memory in use when the first step began (model,
    optimizer and libraries loaded): what the steps themselves added (activations, gradients,
    optimizer state), the figure activation checkpointing reduces.
    """

    workload: str
    strategy: str
    world_size: int
    precision: str
    checkpoint_activations: bool
    compile: bool
    steps: int
    start_step: int
    global_batch_size: int
    samples_per_s: float
    seconds: float
    peak_memory_bytes: int | None
    peak_memory_kind: str
    step_memory_bytes: int
    first_loss: float
    last_loss: float
    losses: list[float]
    objective: str
    device: str
    pipeline: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# -- data -----------------------------------------------------------------------------------------


class SampleStream:
    """Training-sample indices as one seeded sequence of permutations: position p is row
    p mod n of permutation p // n (each seeded with `seed` and its epoch)."""

    def __init__(self, num_samples: int, seed: int):
        self.n, self.seed = num_samples, seed
        self._cache: dict[int, list[int]] = {}

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._cache:
            self._cache = {epoch: torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 100_003 + epoch)).tolist()}
        return self._cache[epoch]

    def take(self, start: int, count: int) -> list[int]:
        return [self._permutation(p // self.n)[p % self.n] for p in range(start, start + count)]


def micro_batch_indices(stream: SampleStream, position: int, *, batch_size: int, grad_accum: int, dp: int,
                        dp_rank: int, micro: int) -> list[int]:
    """Rows of data-parallel rank `dp_rank`'s micro-step `micro` in the step starting at `position`."""
    return stream.take(position + (micro * dp + dp_rank) * batch_size, batch_size)


# -- objective ------------------------------------------------------------------------------------


class Objective:
    """The loss for a batch of training rows: cross-entropy on labels, or distillation.

    Distillation toward `teacher`: MSE between output and teacher rows plus the mean cosine
    distance (1 − cos), as in `overdrive.train.fine_tune.fine_tune`.
    """

    def __init__(self, workload: Workload, teacher: nn.Module | None):
        self.workload, self.teacher = workload, teacher
        self.classification = workload.train_labels is not None
        self.name = "cross-entropy on the training labels" if self.classification else \
            "distillation (MSE + cosine) toward the frozen starting model"

    def target(self, indices: list[int], inputs: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
        if self.classification:
            return self.workload.train_labels[indices].to(device)
        with torch.no_grad():
            return self.teacher(*inputs).float()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        output = output.float()
        if self.classification:
            return nn.functional.cross_entropy(output, target)
        cosine = nn.functional.cosine_similarity(output.flatten(1), target.flatten(1), dim=-1)
        return nn.functional.mse_loss(output, target) + (1.0 - cosine).mean()


# -- checkpoints ----------------------------------------------------------------------------------


KEEP_CHECKPOINTS = 2
SUMMARY_ENV = "OVERDRIVE_TRAIN_SUMMARY"


def save_checkpoint(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int, position: int,
                    env: DistEnv) -> Path:
    """Save model, optimizer (with its step counts) and the data position to ROOT/step-N with
    torch.distributed.checkpoint: each rank writes its own shards, and the checkpoint loads at
    any world size and strategy (DCP reshards on load). Written to a .tmp folder and renamed,
    so an interrupted save leaves the earlier checkpoints intact; the newest KEEP_CHECKPOINTS stay.

    Returns:
        The checkpoint folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier(env)
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state,
                  "train": {"step": torch.tensor(step), "position": torch.tensor(position)}}, checkpoint_id=str(tmp))
    _barrier(env)
    if env.is_main:
        (tmp / "train_state.json").write_text(json.dumps({"step": step, "position": position, "world_size": env.world_size}))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        for old in _checkpoints(root)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
    _barrier(env)
    return path


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step-*") if (p / ".metadata").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder itself, or the newest ROOT/step-N under a --save folder.

    Raises:
        UserError: neither is there.
    """
    if (path / ".metadata").exists():
        return path
    found = _checkpoints(path) if path.is_dir() else []
    if not found:
        raise UserError(f"--resume {path}: no checkpoint there (expected a step-N folder written by --save)")
    return found[-1]


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Restore a `save_checkpoint` into this (possibly differently parallelized) model.

    Args:
        path: a checkpoint folder, or a --save folder (its newest checkpoint is used).

    Returns:
        (step, data position).

    Raises:
        UserError: no checkpoint at `path`, or one whose parameters do not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = resolve_checkpoint(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "train": {"step": torch.tensor(0), "position": torch.tensor(0)}}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise UserError(f"--resume {path}: the checkpoint does not fit this model: {one_line(exc)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["train"]["step"]), int(state["train"]["position"])


def _current_memory(device: torch.device) -> int:
    """Bytes in use now: the CUDA allocator's, or the process RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _barrier(env: DistEnv) -> None:
    if dist.is_initialized():
        dist.barrier()


# -- the run --------------------------------------------------------------------------------------


def _dtype(precision: str) -> torch.dtype | None:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def _inputs(workload: Workload, indices: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The model inputs for these training samples, on `device`."""
    return tuple(t.to(device, non_blocking=True) for t in workload.collate([workload.train_samples[i] for i in indices]))


def _freeze_unreached(model: nn.Module, workload: Workload, objective: "Objective", device: torch.device) -> list[str]:
    """Turn off gradients for parameters the objective never reaches (e.g. a BERT pooler under
    mean pooling), found with one forward and backward pass over two training rows: DDP would
    otherwise wait for their gradients forever. Returns their names."""
    idx = list(range(min(2, len(workload.train_samples))))
    inputs = _inputs(workload, idx, device)
    objective(model(*inputs), objective.target(idx, inputs, device)).backward()
    frozen = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    for name, p in model.named_parameters():
        p.grad = None
        if name in frozen:
            p.requires_grad_(False)
    return frozen


def _pipeline_stage(model: nn.Module, workload: Workload, config: TrainConfig, env: DistEnv, batch_size: int) -> nn.Module:
    """This rank's stage, cut at the user's split points or at ones balancing measured block costs."""
    from overdrive.train import pipeline

    dims = config.dims
    points = list(dims.split_points or [])
    try:
        if not points:
            micro = max(1, batch_size // dims.num_microbatches)
            inputs = _inputs(workload, list(range(min(micro, len(workload.train_samples)))), env.device)
            costs = torch.tensor(pipeline.measure_block_costs(model, inputs), dtype=torch.float64, device=env.device)
            dist.all_reduce(costs)  # every rank must cut at the same points
            points = pipeline.balanced_split((costs / env.world_size).cpu().tolist(), dims.pp)
        stage, owned = pipeline.build_stage_module(model, env.rank, points)
    except ValueError as exc:
        raise UserError(f"--strategy pipeline: {exc}") from None
    stage.split_points, stage.owned_blocks = points, owned
    return stage.to(env.device)


def _build(workload: Workload, config: TrainConfig, env: DistEnv, precision: str, batch_size: int):
    """The parallelized model, its objective and optimizer, in the order parallel.py states."""
    model = workload.model.to(env.device)
    teacher = None if workload.train_labels is not None else frozen_copy(model)
    objective = Objective(workload, teacher)
    dims = config.dims
    model.train()
    _freeze_unreached(model, workload, objective, env.device)
    if dims.strategy == "pipeline":
        model = workload.model = _pipeline_stage(model, workload, config, env, batch_size)  # the rank trains its stage
    if dims.strategy == "tensor-parallel":
        try:
            parallel.apply_tensor_parallel(model, env)
        except ValueError as exc:
            raise UserError(f"--strategy tensor-parallel: {exc}") from None
    if config.checkpoint_activations:
        try:
            parallel.apply_activation_checkpointing(model)
        except ValueError as exc:
            raise UserError(f"--checkpoint-activations: {exc}") from None
    if config.compile:
        model.compile()
    if dims.strategy == "ddp":
        model = parallel.apply_ddp(model, env)
    elif dims.strategy == "fsdp":
        parallel.apply_fsdp(model, env, param_dtype=_dtype(precision))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # Fused AdamW (one kernel for all parameters) where torch has it: CUDA, and CPU for plain tensors.
    fused = env.device.type == "cuda" or dims.strategy in ("none", "ddp", "pipeline")
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0, **({"fused": True} if fused else {}))
    return model, objective, optimizer, params


def run_training(config: TrainConfig, env: DistEnv, *, workload: Workload | None = None,
                 progress=None, on_grads=None) -> TrainSummary:
    """Train on this rank; every rank of the job calls it with the same config.

    Args:
        config: the run.
        env: this process's place in the job (`parallel.init_distributed`).
        workload: the workload to train (default: built from `config.workload`); its model is
            trained in place (under pipeline parallelism it is replaced by this rank's stage).
        progress: called on rank 0 as progress(step, total_steps, loss, samples_per_s, peak_bytes).
        on_grads: called on every rank as on_grads(step, model) after the backward passes of a
            step, before clipping and the optimizer step (tests compare gradients with it).

    Returns:
        The TrainSummary (figures reduced over ranks).

    Raises:
        UserError: a configuration the model or device cannot run.
        RuntimeError: a collective timed out or another rank failed (the message names this rank).
    """
    from overdrive.workloads import create_workload

    workload = workload or create_workload(config.workload)
    if not workload.train_samples:
        raise UserError(f"workload {workload.name!r} has no training samples; a factory can return a Workload "
                        "with train_samples (and train_labels for classification)")
    dims = config.dims
    try:
        precision = training_precision(env.device, config.precision)
    except ValueError as exc:
        raise UserError(f"--precision: {exc}") from None
    if precision == "fp16" and dims.strategy == "fsdp":
        raise UserError("--precision fp16 with --strategy fsdp is not supported (its gradient scaler needs sharded "
                        "gradients); use --precision bf16")
    batch_size = config.batch_size or min(workload.default_batch_size, 32)
    runner = None
    if dims.strategy == "pipeline":
        if config.grad_accum != 1:
            raise UserError("--grad-accum with --strategy pipeline: the microbatches already accumulate; "
                            "raise --microbatches and --batch-size instead")
        if batch_size % dims.num_microbatches:
            raise UserError(f"--batch-size {batch_size} must be a multiple of the {dims.num_microbatches} pipeline "
                            "microbatches")
    dp_rank = env.rank if dims.dp > 1 else 0
    torch.manual_seed(config.seed + dp_rank)
    model, objective, optimizer, params = _build(workload, config, env, precision, batch_size)
    if dims.strategy == "pipeline":
        from overdrive.train.pipeline import PipelineRunner

        runner = PipelineRunner(model, dims, env, objective)
    global_batch = batch_size * config.grad_accum * dims.dp
    n = len(workload.train_samples)
    steps = config.steps or max(1, math.ceil((config.epochs or 1.0) * n / global_batch))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(steps))
    start_step, position = 0, 0
    if config.resume_dir:
        start_step, position = load_checkpoint(Path(config.resume_dir), model, optimizer)
        for _ in range(start_step):
            schedule.step()
        if start_step >= steps:
            raise UserError(f"--resume {config.resume_dir} is at step {start_step}; ask for more steps than that "
                            f"(--steps {start_step + steps})")
    stream = SampleStream(n, config.seed)
    reset_peak_memory(env.device)
    start_memory = _current_memory(env.device)
    autocast = _dtype(precision) if dims.strategy != "fsdp" else None  # FSDP casts through its policy
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    losses: list[float] = []
    times: list[float] = []
    is_ddp = dims.strategy == "ddp"
    end = min(steps, config.stop_after) if config.stop_after else steps
    for step in range(start_step, end):
        t0 = time.perf_counter()
        total = torch.zeros((), device=env.device)
        for micro in range(config.grad_accum if runner is None else 0):
            idx = micro_batch_indices(stream, position, batch_size=batch_size, grad_accum=config.grad_accum,
                                      dp=dims.dp, dp_rank=dp_rank, micro=micro)
            inputs = _inputs(workload, idx, env.device)
            target = objective.target(idx, inputs, env.device)
            last = micro == config.grad_accum - 1
            if dims.strategy == "fsdp":
                model.set_requires_gradient_sync(last)
            sync = model.no_sync() if is_ddp and not last else contextlib.nullcontext()
            with sync:
                with torch.autocast(env.device.type, dtype=autocast, enabled=autocast is not None):
                    loss = objective(model(*inputs), target) / config.grad_accum
                (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if runner:  # the schedule splits the batch into microbatches and runs forward and backward
            idx = stream.take(position, batch_size)
            inputs = _inputs(workload, idx, env.device)
            target = objective.target(idx, inputs, env.device) if runner.last else None
            with torch.autocast(env.device.type, dtype=autocast, enabled=autocast is not None):
                total = runner.step(inputs, target)
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
        objective=objective.name, device=str(env.device), pipeline=pipeline_stats,
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


# -- command line ---------------------------------------------------------------------------------


def config_from_args(args, world_size: int) -> TrainConfig:
    """The TrainConfig for parsed `overdrive train` arguments at `world_size` processes.

    Raises:
        UserError: degrees, microbatches or split points that cannot work (before any launch).
    """
    try:
        dims = ParallelDims(strategy=args.strategy, world_size=world_size, microbatches=args.microbatches,
                            schedule=args.schedule, split_points=tuple(args.split_points) if args.split_points else None)
    except ParallelConfigError as exc:
        raise UserError(str(exc)) from None
    return TrainConfig(
        workload=args.workload, device=args.device, batch_size=args.batch_size, steps=args.steps, epochs=args.epochs,
        grad_accum=args.grad_accum, learning_rate=args.lr, precision=args.precision,
        checkpoint_activations=args.checkpoint_activations, compile=args.compile, dims=dims, seed=args.seed,
        collective_timeout_s=args.collective_timeout_s,
        save_dir=args.save, save_every=args.save_every, resume_dir=args.resume,
    )


def _out_dir(args, workload_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", workload_name).strip("_") or "workload"  # as `optimize` names it
    return Path(args.out) / safe / "train"


def cmd_train(args, argv: list[str]) -> int:
    """`overdrive train`: launch with torchrun when --nproc > 1, else train in this process."""
    if parallel.launched_by_torchrun():
        return _rank_main(args)
    nproc = args.nproc or 1
    config = config_from_args(args, nproc)  # refuses bad degrees before launching anything
    resolve_device(config.device)
    if config.dims.world_size > 1 or config.dims.strategy != "none":  # a strategy needs a process group, even of 1
        if args.device in ("cuda", "auto") and torch.cuda.is_available() and torch.cuda.device_count() < nproc:
            raise UserError(f"--nproc {nproc} needs {nproc} GPUs; this machine has {torch.cuda.device_count()}")
        with tempfile.TemporaryDirectory(prefix="overdrive-train-") as tmp:
            summary_file = Path(tmp) / "summary.json"  # rank 0 hands its summary back through it
            code = parallel.launch(_without_nproc(argv), nproc, env={SUMMARY_ENV: str(summary_file)})
            if code != 0:
                sys.stderr.write(f"overdrive: error: training failed (torchrun exit code {code}; the failing rank's "
                                 "error is above)\n")
                return 1
            summary = TrainSummary(**json.loads(summary_file.read_text()))
    else:
        summary = _train_here(config, DistEnv(0, 0, 1, resolve_device(config.device)), args)
    _finish(args, config, summary)
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def _rank_main(args) -> int:
    world = int(os.environ["WORLD_SIZE"])
    if args.nproc and args.nproc != world:
        raise UserError(f"--nproc {args.nproc} differs from torchrun's world size {world}; drop --nproc under torchrun")
    config = config_from_args(args, world)
    env = parallel.init_distributed(resolve_device(config.device), timeout_s=config.collective_timeout_s)
    try:
        summary = _train_here(config, env, args)
    except Exception as exc:
        parallel.shutdown_distributed(barrier=False)
        if isinstance(exc, UserError):
            raise
        raise RuntimeError(f"rank {env.rank} of {env.world_size} failed: {one_line(exc)}") from exc
    parallel.shutdown_distributed()
    if env.is_main and SUMMARY_ENV not in os.environ:  # under the user's own torchrun, rank 0 prints the table
        _finish(args, config, summary)
    return 0


def _train_here(config: TrainConfig, env: DistEnv, args) -> TrainSummary:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from overdrive.core.report import format_bytes

    columns = (TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
    with Progress(*columns, disable=not env.is_main, transient=False) as bar:
        task = bar.add_task("train", total=None, stats="")

        def progress(step, total, loss, rate, peak):
            bar.update(task, completed=step, total=total,
                       stats=f"loss {loss:.4g} · {rate:,.0f} samples/s · peak {format_bytes(peak)}")

        summary = run_training(config, env, progress=progress)
    if env.is_main:
        out = _out_dir(args, summary.workload)
        out.mkdir(parents=True, exist_ok=True)
        text = json.dumps(summary.to_dict(), indent=1)
        (out / "summary.json").write_text(text)
        if os.environ.get(SUMMARY_ENV):
            Path(os.environ[SUMMARY_ENV]).write_text(text)
    return summary


def _finish(args, config: TrainConfig, summary: TrainSummary) -> None:
    """Print the run's table, with the fp32 single-process baseline when --compare."""
    from rich.table import Table

    from overdrive.core.report import format_bytes, make_console

    console = make_console()
    rows = [("this run", summary)]
    if args.compare:
        base_config = replace(config, dims=ParallelDims(strategy="none", world_size=1), precision="fp32",
                              checkpoint_activations=False, compile=False, save_dir=None, save_every=0, resume_dir=None,
                              batch_size=summary.global_batch_size // config.grad_accum, steps=summary.steps)
        with console.status("measuring the baseline: fp32, one process, same global batch and steps"):
            device = resolve_device(config.device)
            base = run_training(base_config, DistEnv(0, 0, 1, torch.device(device.type, 0) if device.type == "cuda" else device))
        rows.insert(0, ("baseline: fp32, 1 process", base))
    table = Table(title=f"overdrive train {summary.workload} — {summary.objective}")
    for col in ("run", "strategy × processes", "precision", "samples/s", "speedup", "peak memory", "step memory",
                "step memory ratio", "loss first → last"):
        table.add_column(col, justify="left" if col in ("run", "strategy × processes", "precision") else "right")
    first = rows[0][1]
    for label, s in rows:
        extras = [x for x, on in (("checkpointing", s.checkpoint_activations), ("compile", s.compile)) if on]
        table.add_row(label, f"{s.strategy} × {s.world_size}", " + ".join([s.precision, *extras]), f"{s.samples_per_s:,.1f}",
                      f"{s.samples_per_s / first.samples_per_s:.2f}×", format_bytes(s.peak_memory_bytes),
                      format_bytes(s.step_memory_bytes), f"{s.step_memory_bytes / max(1, first.step_memory_bytes):.2f}×",
                      f"{s.first_loss:.4g} → {s.last_loss:.4g}")
    console.print(table)
    console.print(f"global batch {summary.global_batch_size} rows, steps {summary.start_step}→{summary.steps}; "
                  f"peak memory is {summary.peak_memory_kind} (largest rank); step memory is what the steps added to it", highlight=False)
    if summary.pipeline:
        p = summary.pipeline
        console.print(f"pipeline: {p['stages']} stages split at block {p['split_points']}, {p['schedule']}, "
                      f"{p['microbatches']} microbatches; idle (bubble) fraction measured {p['bubble_fraction']:.3f} "
                      f"(per rank {', '.join(f'{b:.3f}' for b in p['bubble_fraction_per_rank'])}); GPipe's "
                      f"(p−1)/(m+p−1) = {p['gpipe_formula']:.3f}", highlight=False)
    if config.save_dir:
        console.print(f"checkpoints: {config.save_dir}/step-N", highlight=False)
