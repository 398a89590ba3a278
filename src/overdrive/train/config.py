"""What a training run is asked to do (`TrainConfig`) and what it did (`TrainSummary`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from overdrive.core import devices
from overdrive.core.errors import ConfigError, arg
from overdrive.train.parallel import ParallelDims

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
# Strategies whose gradients torch's GradScaler cannot unscale soundly, and why.
FP16_REFUSED = {
    "fsdp": "its gradient scaler needs sharded gradients",
    "pipeline": "each stage's gradient scaler would see only its own stage's overflows, so stages could skip different steps",
    "tensor-parallel": "the gradient scaler cannot unscale split (DTensor) and replicated gradients together; the first "
                       "step would fail",
}


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
        precision: "fp32", "bf16", "fp16" (CUDA, with a gradient scaler; DDP or one process only:
            see FP16_REFUSED) or "auto".
        checkpoint_activations: recompute each block's activations in backward.
        compile: torch.compile the model.
        train_mode: the model in train mode while it trains (dropout on, BatchNorm on batch
            statistics). False keeps it in eval mode: pruning's distillation recovery does this,
            so the student learns to match the deterministic teacher it is judged against.
        dims: the parallel layout (strategy and world size).
        find_unused_parameters: DDP and FSDP only: reduce a zero gradient for each parameter a
            rank did not reach in a step (DDP's `find_unused_parameters`, FSDP2's
            `set_reduce_scatter_unused_params`), needed when a branch depends on the data. None
            turns it on when the probe sees some parameters reached by some probe batches and not
            others; True also keeps every parameter trainable (nothing frozen); False refuses a
            run whose probe sees use vary.
        seed: data order and initial RNG state.
        collective_timeout_s: a collective that waits longer fails, naming the rank.
        save_dir: where checkpoints go, as SAVE_DIR/step-N (None: no checkpoints).
        save_every: also save every this many steps (0: only at the end).
        resume_dir: a checkpoint (or a save_dir: its newest) to continue from: model, optimizer
            with its step, data position. The learning-rate schedule is that of `steps`.
        stop_after: end this run after this step (a planned interruption; 0: run to `steps`).

    Raises:
        ConfigError: values or combinations that cannot work, whatever the model (checked at
            construction, so the command line refuses them before launching any process).
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
    train_mode: bool = True
    dims: ParallelDims = field(default_factory=lambda: ParallelDims(strategy="none", world_size=1))
    seed: int = 0
    collective_timeout_s: float = 600.0
    save_dir: str | None = None
    save_every: int = 0
    resume_dir: str | None = None
    stop_after: int = 0
    find_unused_parameters: bool | None = None

    def __post_init__(self):
        strategy = self.dims.strategy
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{arg('precision', self.precision)}: precision must be auto, bf16, fp16 or fp32")
        for name in ("steps", "batch_size", "epochs", "learning_rate", "grad_accum", "collective_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{arg(name, value)} must be positive")
        for name in ("save_every", "stop_after"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{arg(name, getattr(self, name))} must be ≥ 0")
        if self.save_every and not self.save_dir:
            raise ConfigError(f"{arg('save_every', self.save_every)} needs {arg('save_dir')} (the folder checkpoints go to)")
        if self.precision == "fp16" and strategy in FP16_REFUSED:
            why = FP16_REFUSED[strategy]
            raise ConfigError(f"{arg('precision', 'fp16')} with {arg('strategy', strategy)} is not supported ({why}); "
                              f"use {arg('precision', 'bf16')}, which needs no scaler")
        if strategy == "pipeline":
            if self.grad_accum != 1:
                raise ConfigError(f"{arg('grad_accum')} with {arg('strategy', 'pipeline')}: the microbatches already "
                                  f"accumulate; raise {arg('microbatches')} and {arg('batch_size')} instead")
            if self.batch_size is not None and self.batch_size % self.dims.num_microbatches:
                raise ConfigError(f"{arg('batch_size', self.batch_size)} must be a multiple of the "
                                  f"{self.dims.num_microbatches} pipeline microbatches")
        if self.find_unused_parameters and strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"{arg('find_unused_parameters')} applies to {arg('strategy', 'ddp')} and "
                              f"{arg('strategy', 'fsdp')}, whose ranks reduce gradients of different batches; under "
                              f"{arg('strategy', strategy)} there is nothing to find")

    def batch_size_for(self, default_batch_size: int) -> int:
        """Rows per forward pass: `batch_size`, else the workload's default capped at 32 (under
        pipeline parallelism rounded down to a multiple of the microbatches, at least one each)."""
        if self.batch_size is not None:
            return self.batch_size
        size = min(default_batch_size, 32)
        if self.dims.strategy == "pipeline":
            m = self.dims.num_microbatches
            size = max(m, size // m * m)
        return size


def check_runnable(config: TrainConfig, device: torch.device) -> str:
    """What `TrainConfig` cannot check alone: the precision on this device, and the checkpoint to
    resume from. The command line runs it before launching; `run_training` again on every rank.

    Returns:
        The precision to train in (`training_precision`).

    Raises:
        ConfigError: fp16 on a device without CUDA, or no checkpoint at `resume_dir`.
    """
    from pathlib import Path

    from overdrive.files.checkpoint import resolve_checkpoint

    precision = training_precision(device, config.precision, strategy=config.dims.strategy)
    if config.resume_dir:
        resolve_checkpoint(Path(config.resume_dir))
    return precision


@dataclass(kw_only=True)
class TrainSummary:
    """What a run did, written to OUT/<workload>/train/summary.json by rank 0.

    samples_per_s counts global rows per second over the steps after the first 20% (at least
    one step is skipped: it holds compilation and first-use costs). peak_memory_bytes is the
    largest over ranks: the CUDA allocator's peak, or on CPU the process RSS high-water mark.
    step_memory_bytes is that peak less the memory in use when the first step began (model,
    optimizer and libraries loaded): what the steps themselves added (activations, gradients,
    optimizer state), the figure activation checkpointing reduces. frozen_parameters: those no
    probe batch reached, trained by no step (`overdrive.train.probe`); notes: what the run
    turned on or off by itself, and why.
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
    frozen_parameters: list[str] = field(default_factory=list)
    find_unused_parameters: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def training_precision(device: torch.device, requested: str = "auto", *, strategy: str = "none") -> str:
    """The autocast dtype name to train with: "bf16", "fp16" or "fp32".

    "auto" picks bf16 on a GPU that supports it (fp16 on one that does not, except under the
    strategies of FP16_REFUSED, which cannot scale fp16 gradients: fp32 there) and on a CPU with
    AVX512-BF16 instructions; fp32 elsewhere (emulated bf16 would be slower than fp32). fp16
    trains on CUDA only: CPUs have no fast fp16 matrix multiply.

    Raises:
        ConfigError: an unknown name, or fp16 asked for on a device without CUDA.
    """
    if requested not in PRECISIONS:
        raise ConfigError(f"{arg('precision', requested)}: precision must be auto, bf16, fp16 or fp32")
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError(f"{arg('precision', 'fp16')} needs a CUDA device (CPUs have no fast fp16 matrix multiply; "
                          f"this run is on {device.type}); use {arg('precision', 'bf16')} or {arg('precision', 'auto')}")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32" if strategy in FP16_REFUSED else "fp16"
    return "bf16" if devices.cpu_has_native_bf16() else "fp32"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The torch.autocast dtype of a `training_precision` name; None for fp32 (no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def warmup_cosine(steps: int):
    """The learning-rate factor per step for `torch.optim.lr_scheduler.LambdaLR`: linear
    warm-up over the first 10% of `steps` (at least one), then cosine decay to zero."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor
