"""The one training objective, used by `overdrive train` and by pruning's recovery fine-tune.

Chosen by the workload's training data:

- classification (`workload.train_labels` set): cross-entropy of the model's logits against
  the labels;
- distillation (no labels): mean squared error between the model's outputs and a frozen
  teacher's on the same rows, as in Reimers & Gurevych, "Making Monolingual Sentence
  Embeddings Multilingual using Knowledge Distillation" (EMNLP 2020), plus the mean cosine
  distance (1 − cos) between them, plus, for each (student module, teacher module) hint pair,
  the MSE of their outputs (intermediate-layer distillation, as in TinyBERT, Jiao et al. 2020,
  and CoFi pruning, Xia et al. 2022).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from overdrive.core.workload import Workload


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy in eval mode with gradients off: the teacher for distillation."""
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class Objective:
    """The loss of a batch of training rows: cross-entropy on labels, or distillation.

    Use: `target = objective.target(indices, inputs, device)` (labels, or the teacher's
    outputs computed without gradients), then `loss = objective(model(*inputs), target)`,
    a scalar fp32 tensor. Hint pairs are captured by forward hooks registered while the
    objective is entered as a context manager (`with objective: ...`); outside it, or with no
    hints, only the output terms count.

    Args:
        workload: supplies `train_labels` (classification when set).
        teacher: the frozen model to distil from; required when the workload has no labels.
        teacher_name: how reports name the teacher ("the unpruned model").
        hints: (student module, teacher module) pairs whose outputs ([B, ...] tensors, or
            tuples whose first element is one) are matched with MSE under distillation.
        cosine_weight: weight of the cosine-distance term under distillation (0: MSE alone).

    Raises:
        ConfigError: distillation asked for without a teacher.
    """

    def __init__(self, workload: Workload, teacher: nn.Module | None, *,
                 teacher_name: str = "the frozen starting model",
                 hints: Sequence[tuple[nn.Module, nn.Module]] = (), cosine_weight: float = 1.0):
        from overdrive.core.errors import ConfigError, arg

        self.workload, self.teacher = workload, teacher
        self.classification = workload.train_labels is not None
        if not self.classification and teacher is None:
            raise ConfigError(f"distillation needs a {arg('teacher')} model (workload {workload.name!r} has no training labels)")
        self.hints = list(hints) if not self.classification else []
        self.cosine_weight = cosine_weight
        self._captured: dict[tuple[int, int], torch.Tensor] = {}
        self._handles: list = []
        if self.classification:
            self.name = "cross-entropy on the training labels"
        else:
            terms = "MSE + cosine" if cosine_weight else "MSE"
            self.name = f"distillation ({terms}) toward {teacher_name}"
            if self.hints:
                self.name += f" and its {len(self.hints)} layer outputs"

    def __enter__(self) -> Objective:
        for i, pair in enumerate(self.hints):
            for side, module in enumerate(pair):
                self._handles.append(module.register_forward_hook(self._capture((i, side))))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._captured.clear()

    def _capture(self, key: tuple[int, int]):
        def hook(_module, _inputs, output):
            self._captured[key] = output[0] if isinstance(output, tuple) else output

        return hook

    def target(self, indices: list[int], inputs: tuple[torch.Tensor, ...], device: torch.device) -> torch.Tensor:
        """Labels [B] (int64) for classification, else the teacher's outputs [B, ...] (fp32)."""
        if self.classification:
            return self.workload.train_labels[indices].to(device)
        with torch.no_grad():
            return self.teacher(*inputs).float()

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        output = output.float()
        if self.classification:
            return nn.functional.cross_entropy(output, target)
        loss = nn.functional.mse_loss(output, target)
        if self.cosine_weight:
            cosine = nn.functional.cosine_similarity(output.flatten(1), target.flatten(1), dim=-1)
            loss = loss + self.cosine_weight * (1.0 - cosine).mean()
        for i in range(len(self.hints)):
            student, teacher = self._captured.pop((i, 0), None), self._captured.pop((i, 1), None)
            if student is not None and teacher is not None:
                loss = loss + nn.functional.mse_loss(student.float(), teacher.float())
        return loss
