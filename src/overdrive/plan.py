"""Plan: device, batch size and the ordered technique configs; JSON round trip; `build`."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.errors import UserError
from overdrive.techniques import BatchingPolicy, TechniqueConfig, get_technique
from overdrive.workloads.base import Workload, eval_mode

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


def build(workload: Workload, steps: list[Step], device: torch.device) -> tuple[nn.Module, BatchingPolicy]:
    """Apply `steps` in order to a private copy of the workload's fp32 model on `device`.

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
        policy = technique.batching(policy, step.config)
    return model, policy


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
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Plan:
        """Read a plan file.

        Raises:
            UserError: the file is missing, not JSON, or not a plan.
        """
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise UserError(f"--plan {path}: no such file; expected a plan.json written by `overdrive optimize`") from None
        except (IsADirectoryError, UnicodeDecodeError, OSError) as exc:
            raise UserError(f"--plan {path} cannot be read as a plan.json ({type(exc).__name__})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"--plan {path} is not an overdrive plan ({type(exc).__name__}: {exc})") from None

    def build(self, workload: Workload, device: torch.device) -> tuple[nn.Module, BatchingPolicy]:
        return build(workload, self.steps, device)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]
