"""What a training run is asked to do (`TrainConfig`) and what it did (`TrainSummary`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from overdrive.core import devices
from overdrive.train.parallel import ParallelDims


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
        train_mode: the model in train mode while it trains (dropout on, BatchNorm on batch
            statistics). False keeps it in eval mode: pruning's distillation recovery does this,
            so the student learns to match the deterministic teacher it is judged against.
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
    train_mode: bool = True
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


def training_precision(device: torch.device, requested: str = "auto") -> str:
    """The autocast dtype name to train with: "bf16", "fp16" or "fp32".

    "auto" picks bf16 on a GPU that supports it (fp16 on one that does not) and on a CPU with
    AVX512-BF16 instructions; fp32 elsewhere (emulated bf16 would be slower than fp32).

    Raises:
        ValueError: an unknown name, or fp16 asked for on a CPU.
    """
    if requested not in ("auto", "bf16", "fp16", "fp32"):
        raise ValueError(f"precision must be auto, bf16, fp16 or fp32, got {requested!r}")
    if requested == "fp16" and device.type != "cuda":
        raise ValueError("fp16 training needs a CUDA device (the gradient scaler is CUDA-only here)")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
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
