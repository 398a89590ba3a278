"""The training loop: pruning's recovery fine-tune (and the base of `overdrive train`).

Two objectives, chosen by the workload's training data:

- classification (`workload.train_labels` set): cross-entropy of the model's logits against
  the labels, with the model in train mode (BatchNorm statistics adapt to the new widths);
- distillation (no labels): mean squared error between the model's outputs and a teacher's
  (the unmodified model) on the training samples, as in Reimers & Gurevych, "Making
  Monolingual Sentence Embeddings Multilingual using Knowledge Distillation" (EMNLP 2020),
  plus the cosine distance between them, optionally plus the MSE of intermediate layer outputs.
  The student stays in eval mode (no dropout), so it learns to match the deterministic
  teacher it is judged against.

AdamW with linear warm-up over the first 10% of steps, then cosine decay to zero; gradients
clipped to norm 1.0; mixed precision where the device runs it natively (bf16 autocast on a
bf16 GPU or a CPU with AVX512-BF16; fp16 with a gradient scaler on older GPUs).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from overdrive.core import devices
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


def _lr_lambda(steps: int):
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


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

    Args:
        model: fp32 module on `device`, `model(*workload.collate(samples))` -> [B, ...].
        workload: supplies `train_samples` (and `train_labels` for classification) and `collate`.
        device: where model, teacher and batches live.
        steps: optimizer steps (≥ 1); the training samples are cycled in seeded random order.
        learning_rate: peak AdamW learning rate.
        batch_size: training rows per step.
        teacher: the model to distil from (required when the workload has no train labels);
            it is not modified.
        precision: "auto", "bf16", "fp16" or "fp32" (see `training_precision`).
        seed: order of the training samples.
        hints: (student module, teacher module) pairs whose outputs are also matched with MSE
            under distillation (intermediate-layer distillation, as in TinyBERT, Jiao et al.
            2020, and CoFi pruning, Xia et al. 2022): e.g. each encoder layer's output.
        cosine_weight: weight of the mean cosine distance (1 − cos) between output and teacher
            rows, added to the MSE under distillation (the direction is what embeddings are
            judged by); 0 for MSE alone.

    Returns:
        A FineTuneReport.

    Raises:
        ValueError: no training samples, no teacher for distillation, bad steps or precision.
    """
    if not workload.train_samples:
        raise ValueError(f"workload {workload.name!r} has no training samples to fine-tune on")
    classification = workload.train_labels is not None
    if not classification and teacher is None:
        raise ValueError("distillation needs a teacher model (the workload has no training labels)")
    if steps < 1 or batch_size < 1 or not learning_rate > 0:
        raise ValueError(f"steps, batch_size and learning_rate must be positive, got {steps}, {batch_size}, {learning_rate}")
    dtype_name = training_precision(device, precision)
    autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype_name)
    scaler = torch.amp.GradScaler("cuda") if dtype_name == "fp16" else None

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0, **({"fused": True} if device.type == "cuda" else {}))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(steps))
    generator = torch.Generator().manual_seed(seed)
    n = len(workload.train_samples)
    order: list[int] = []
    losses: list[float] = []
    model.train(classification)
    if teacher is not None:
        teacher.eval()
    captured: dict[tuple[int, int], torch.Tensor] = {}
    handles = [module.register_forward_hook(_capture(captured, (i, side)))
               for i, pair in enumerate(hints if not classification else ()) for side, module in enumerate(pair)]
    start = time.perf_counter()
    try:
        for _ in range(steps):
            if len(order) < batch_size:
                order += torch.randperm(n, generator=generator).tolist()
            idx, order = order[:batch_size], order[batch_size:]
            inputs = tuple(t.to(device) for t in workload.collate([workload.train_samples[i] for i in idx]))
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                output = model(*inputs)
                if classification:
                    loss = nn.functional.cross_entropy(output.float(), workload.train_labels[idx].to(device))
                else:
                    with torch.no_grad():
                        target = teacher(*inputs)
                    loss = nn.functional.mse_loss(output.float(), target.float())
                    if cosine_weight:
                        cosine = nn.functional.cosine_similarity(output.float().flatten(1), target.float().flatten(1), dim=-1)
                        loss = loss + cosine_weight * (1.0 - cosine).mean()
                    for i in range(len(handles) // 2):
                        loss = loss + nn.functional.mse_loss(captured[i, 0].float(), captured[i, 1].float())
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(params, 1.0)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
            schedule.step()
            losses.append(loss.item())
    finally:
        model.eval()
        for handle in handles:
            handle.remove()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tenth = max(1, steps // 10)
    objective = ("cross-entropy on the training labels" if classification else
                 f"distillation (MSE{' + cosine' if cosine_weight else ''}) toward the unpruned model")
    if handles:
        objective += f" and its {len(handles) // 2} layer outputs"
    return FineTuneReport(
        objective=objective,
        steps=steps, batch_size=batch_size, learning_rate=learning_rate, precision=f"{dtype_name} autocast" if autocast_dtype else "fp32",
        seconds=time.perf_counter() - start, first_loss=sum(losses[:tenth]) / tenth, last_loss=sum(losses[-tenth:]) / tenth,
        num_train_samples=n,
    )


def _capture(store: dict, key):
    def hook(_module, _inputs, output):
        store[key] = output[0] if isinstance(output, tuple) else output

    return hook


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy in eval mode with gradients off: the teacher for distillation."""
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher
