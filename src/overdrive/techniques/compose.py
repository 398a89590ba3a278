"""Composing techniques: a workload's model with a list of technique configs applied in order.

Below the tuner, so that a technique that rebuilds a model from steps (pruning's recovery, mixed
precision's search) need not reach up into `tuning`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core.errors import PlanError, one_line
from overdrive.core.workload import Workload, eval_mode
from overdrive.techniques.registry import BatchingPolicy, TechniqueConfig, conflict, technique_for


def build(workload: Workload, steps: list[TechniqueConfig], device: torch.device,
          reports: list[dict[str, Any]] | None = None) -> tuple[nn.Module, BatchingPolicy]:
    """Apply the technique of each config in `steps`, in order, to a private copy of the
    workload's fp32 model on `device`.

    Args:
        reports: when given, receives the report of each step that leaves one (pruning:
            parameters, FLOPs and metrics before and after, the fine-tune).

    Returns:
        (model ready to call, batching policy: `BatchingPolicy.deployed` as the steps change it).

    Raises:
        RuntimeError: a technique is unsupported here or its transform failed (message says which).
    """
    model = eval_mode(copy.deepcopy(workload.model).to(device))
    policy = BatchingPolicy.deployed(workload)
    for i, step in enumerate(steps):
        technique = technique_for(step)
        reason = technique.unsupported_reason(workload, device, step) or conflict(steps[:i], step)
        if reason:
            raise RuntimeError(f"{step.name}: {reason}")
        model = technique.apply(model, step, workload=workload, device=device)
        report = model.__dict__.pop("overdrive_report", None)  # set by the technique on its own output
        if report is not None and reports is not None:
            reports.append(report)
        policy = technique.batching(policy, step)
    return model, policy


def build_on_devices(workload: Workload, steps: list[TechniqueConfig], devices: list[torch.device]) -> list[nn.Module]:
    """`build` once per device (one replica or serving instance each).

    Raises:
        PlanError: a step cannot be applied on a device (the message names the device and why).
    """
    models = []
    for d in devices:
        try:
            models.append(build(workload, steps, d)[0])
        except RuntimeError as exc:
            raise PlanError(f"cannot build the plan's model on {d}: {one_line(exc)}") from None
    return models


def resolve_steps(steps: list[TechniqueConfig], workload: Workload, device: torch.device,
                  folder: Path) -> list[TechniqueConfig]:
    """The steps as plan.json keeps them (`Technique.resolve`): a pruning step with its weights in
    `folder/<technique>.pt`, a searched precision step with its layers, so that reloading the plan
    rebuilds the same model without pruning, fine-tuning or searching again."""
    out: list[TechniqueConfig] = []
    for step in steps:
        out.append(technique_for(step).resolve(step, list(out), workload=workload, device=device, folder=Path(folder)))
    return out
