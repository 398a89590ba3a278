"""Pruning's recovery fine-tune: the training loop of `overdrive train` on one process.

`fine_tune` runs `overdrive.train.loop.run_training` on the pruned model with the one
`Objective`: cross-entropy on the workload's training labels with the model in train mode
(BatchNorm statistics adapt to the new widths), or, without labels, distillation toward the
unpruned model with the student in eval mode (no dropout), so it learns to match the
deterministic teacher it is judged against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from overdrive.core.workload import Workload


@dataclass(frozen=True, kw_only=True)
class FineTuneReport:
    """What a fine-tune did. Times in seconds; losses are means over the first / last 10% of steps."""

    objective: str
    steps: int
    batch_size: int
    learning_rate: float
    precision: str
    seconds: float
    first_loss: float
    last_loss: float
    num_train_samples: int

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return (f"{self.steps} steps of {self.objective} at batch {self.batch_size}, lr {self.learning_rate:g}, "
                f"{self.precision}, {self.seconds:.1f} s; loss {self.first_loss:.4g} → {self.last_loss:.4g}")


def fine_tune(
    model: nn.Module,
    workload: Workload,
    *,
    device: torch.device,
    steps: int,
    learning_rate: float,
    batch_size: int = 32,
    teacher: nn.Module | None = None,
    precision: str = "auto",
    seed: int = 0,
    hints: Sequence[tuple[nn.Module, nn.Module]] = (),
    cosine_weight: float = 1.0,
) -> FineTuneReport:
    """Fine-tune `model` in place on the workload's training samples; leaves it in eval mode.

    The global RNG state and each parameter's `requires_grad` are as they were on return.

    Args:
        model: fp32 module on `device`, `model(*workload.collate(samples))` -> [B, ...].
        workload: supplies `train_samples` (and `train_labels` for classification) and `collate`.
        device: where model, teacher and batches live.
        steps: optimizer steps (≥ 1); the training samples are read in seeded random order.
        learning_rate: peak AdamW learning rate.
        batch_size: training rows per step.
        teacher: the model to distil from (required when the workload has no train labels);
            it is not modified.
        precision: "auto", "bf16", "fp16" or "fp32" (`overdrive.train.config.training_precision`).
        seed: order of the training samples.
        hints: (student module, teacher module) pairs whose outputs are also matched with MSE
            under distillation (see `overdrive.train.objective`): e.g. each encoder layer's output.
        cosine_weight: weight of the mean cosine distance (1 − cos) between output and teacher
            rows, added to the MSE under distillation; 0 for MSE alone.

    Returns:
        A FineTuneReport.

    Raises:
        ConfigError (a ValueError): no training samples, no teacher for distillation, bad
            steps, batch size, learning rate or precision.
    """
    from overdrive.core.errors import ConfigError
    from overdrive.train.config import TrainConfig, autocast_dtype
    from overdrive.train.launch import DistEnv
    from overdrive.train.loop import run_training
    from overdrive.train.objective import Objective

    if not workload.train_samples:
        raise ConfigError(f"workload {workload.name!r} has no training samples to fine-tune on")
    objective = Objective(workload, teacher, teacher_name="the unpruned model", hints=hints, cosine_weight=cosine_weight)
    config = TrainConfig(workload=workload.name, steps=steps, learning_rate=learning_rate, batch_size=batch_size,
                         precision=precision, seed=seed, train_mode=objective.classification)
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=device)
    trainable = {p: p.requires_grad for p in model.parameters()}
    rng_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=rng_devices):
            summary = run_training(config, env, workload=dataclasses.replace(workload, model=model), objective=objective)
    finally:
        model.eval()
        for p, flag in trainable.items():
            p.requires_grad_(flag)
    return FineTuneReport(
        objective=summary.objective, steps=summary.steps, batch_size=batch_size, learning_rate=learning_rate,
        precision=f"{summary.precision} autocast" if autocast_dtype(summary.precision) else "fp32",
        seconds=summary.seconds, first_loss=summary.first_loss, last_loss=summary.last_loss,
        num_train_samples=len(workload.train_samples),
    )
