"""Plan: device, batch size and the ordered technique configs; JSON round trip; `build`."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core.errors import UserError, one_line
from overdrive.core.workload import Workload, eval_mode
from overdrive.techniques import BatchingPolicy, TechniqueConfig, get_technique

PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Step:
    """One technique with its config, as applied in a plan or candidate."""

    name: str
    config: TechniqueConfig

    @classmethod
    def default(cls, name: str) -> Step:
        return cls(name=name, config=get_technique(name).config_cls())

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "config": self.config.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Step:
        technique = get_technique(data["name"])
        return cls(name=data["name"], config=technique.config_cls.from_dict(data.get("config", {})))


def build(workload: Workload, steps: list[Step], device: torch.device,
          reports: list[dict[str, Any]] | None = None) -> tuple[nn.Module, BatchingPolicy]:
    """Apply `steps` in order to a private copy of the workload's fp32 model on `device`.

    Args:
        reports: when given, receives the report of each step that leaves one (pruning:
            parameters, FLOPs and metrics before and after, the fine-tune).

    Returns:
        (model ready to call, batching policy).

    Raises:
        RuntimeError: a technique is unsupported here or its transform failed (message says which).
    """
    model = eval_mode(copy.deepcopy(workload.model).to(device))
    policy = BatchingPolicy()
    for step in steps:
        technique = get_technique(step.name)
        reason = technique.unsupported_reason(workload, device)
        if reason:
            raise RuntimeError(f"{step.name}: {reason}")
        model = technique.apply(model, step.config, workload=workload, device=device)
        report = model.__dict__.pop("overdrive_report", None)  # set by the technique on its own output
        if report is not None and reports is not None:
            reports.append(report)
        policy = technique.batching(policy, step.config)
    return model, policy


def build_on_devices(workload: Workload, steps: list[Step], devices: list[torch.device]) -> list[nn.Module]:
    """`build` once per device (one replica or serving instance each).

    Raises:
        UserError: a step cannot be applied on a device (the message names the device and why).
    """
    models = []
    for d in devices:
        try:
            models.append(build(workload, steps, d)[0])
        except RuntimeError as exc:
            raise UserError(f"cannot build the plan's model on {d}: {one_line(exc)}") from None
    return models


def save_checkpoints(steps: list[Step], workload: Workload, device: torch.device, folder: Path) -> list[Step]:
    """Write the weights of each pruning step to `folder/<technique>.pt` and return the steps
    with `checkpoint` set, so that reloading the plan reuses the pruned, recovered model
    instead of pruning and fine-tuning again."""
    from overdrive.techniques.pruning.recovery import PruningTechnique, save_checkpoint

    out: list[Step] = []
    for step in steps:
        if isinstance(get_technique(step.name), PruningTechnique) and not step.config.checkpoint:
            model, _ = build(workload, out + [step], device)  # cached: reshapes and loads, no new fine-tune
            path = Path(folder) / f"{step.name}.pt"
            save_checkpoint(model, path, step.name)
            step = Step(name=step.name, config=dataclasses.replace(step.config, checkpoint=str(path)))
        out.append(step)
    return out


@dataclass(kw_only=True)
class Plan:
    """What `optimize` chose; `bench`, `serve`, `run` and `train` reload it.

    Attributes:
        workload: the workload spec it was made for (name, import path or file).
        device: "cpu" or "cuda" (a device type: the plan moves between GPUs of one kind).
        batch_size: rows per call it was tuned at.
        steps: techniques in application order.
        measured: headline figures of the chosen configuration (samples_per_s, speedup, ...).
        environment: torch version and device name it was measured with.
    """

    workload: str
    device: str
    batch_size: int
    steps: list[Step]
    measured: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "workload": self.workload,
            "device": self.device,
            "batch_size": self.batch_size,
            "techniques": [s.to_dict() for s in self.steps],
            "measured": self.measured,
            "environment": self.environment,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Raises ValueError (or KeyError/TypeError) for anything that is not a valid plan."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"plan version {data.get('version')!r} is not {PLAN_VERSION}")
        if not isinstance(data.get("batch_size"), int) or data["batch_size"] < 1:
            raise ValueError(f"batch_size must be a positive integer, got {data.get('batch_size')!r}")
        if data.get("device") not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {data.get('device')!r}")
        return cls(
            workload=data["workload"],
            device=data["device"],
            batch_size=int(data["batch_size"]),
            steps=[Step.from_dict(s) for s in data["techniques"]],
            measured=data.get("measured", {}),
            environment=data.get("environment", {}),
        )

    def save(self, path: Path) -> None:
        """Write the plan as JSON; checkpoint files beside it are referenced by relative paths."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent.resolve()

        def relative(p: Path) -> str:
            return str(p.resolve().relative_to(folder)) if p.resolve().is_relative_to(folder) else str(p)

        data = dataclasses.replace(self, steps=_map_checkpoints(self.steps, relative)).to_dict()
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, label: str = "--plan") -> Plan:
        """Read a plan file; `label` names where the path came from in error messages.

        Raises:
            UserError: the file is missing, not JSON, or not a plan.
        """
        try:
            plan = cls.from_dict(json.loads(Path(path).read_text()))
            plan.steps = _map_checkpoints(plan.steps, lambda p: str(Path(path).parent / p))  # relative to the plan
            return plan
        except FileNotFoundError:
            raise UserError(f"{label} {path}: no such file; expected a plan.json written by `overdrive optimize`") from None
        except (IsADirectoryError, UnicodeDecodeError, OSError) as exc:
            raise UserError(f"{label} {path} cannot be read as a plan.json ({type(exc).__name__})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{label} {path} is not an overdrive plan ({type(exc).__name__}: {exc})") from None

    def build(self, workload: Workload, device: torch.device) -> tuple[nn.Module, BatchingPolicy]:
        return build(workload, self.steps, device)

    def check_checkpoints(self) -> None:
        """Read every checkpoint the plan names, before anything is measured.

        Raises:
            UserError: one is missing, unreadable, or written by another technique.
        """
        from overdrive.techniques.pruning.recovery import load_checkpoint

        for step in self.steps:
            checkpoint = getattr(step.config, "checkpoint", None)
            if checkpoint:
                try:
                    load_checkpoint(checkpoint, step.name)
                except RuntimeError as exc:
                    raise UserError(f"plan step {exc}; run `overdrive optimize` again to rewrite it") from None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]


def _map_checkpoints(steps: list[Step], fn) -> list[Step]:
    """Steps whose config names a `checkpoint` file, with `fn(Path)` applied to that path."""
    out = []
    for step in steps:
        checkpoint = getattr(step.config, "checkpoint", None)
        if checkpoint:
            step = Step(name=step.name, config=dataclasses.replace(step.config, checkpoint=fn(Path(checkpoint))))
        out.append(step)
    return out
