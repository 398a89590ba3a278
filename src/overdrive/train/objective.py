"""The training objective: cross-entropy on the workload's labels, or distillation toward a teacher."""

from __future__ import annotations

import torch
from torch import nn

from overdrive.core.workload import Workload


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
