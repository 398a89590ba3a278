"""Plan: device, batch size and the ordered technique configs; JSON round trip; load_plan.

The steps are applied by `overdrive.techniques.compose.build`."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core.errors import PlanError, arg
from overdrive.core.workload import Workload
from overdrive.techniques import BatchingPolicy, TechniqueConfig, config_from_dict, config_to_dict, technique_for
from overdrive.techniques.compose import build

PLAN_VERSION = 1


@dataclass(kw_only=True)
class Plan:
    """What `optimize` chose; `bench`, `serve`, `run` and `train` reload it.

    Attributes:
        workload: the workload spec it was made for (name, import path or file).
        device: "cpu" or "cuda" (a device type: the plan moves between GPUs of one kind).
        batch_size: rows per call it was tuned at.
        steps: technique configs in application order.
        measured: headline figures of the chosen configuration (samples_per_s, speedup, ...).
        environment: torch version and device name it was measured with.
        inputs: per model input, its keyword (for a dict example), the row shape and dtype it was
            measured with ({"name": "input_ids", "shape": [...], "dtype": "int64"}; the largest row
            along a varying dimension), for tensor workloads; None for text.
        outputs: the paths of the user's model outputs the plan judges and returns ("logits",
            "pooler_output"; `overdrive.workloads.signature`), None for a model returning one tensor.
        weights: the checkpoint loaded into the model (`--weights`), or None.
        dynamic_dims: {input name (or index): dims} whose size varies from row to row, or None.
        model_sha256: the fingerprint of the fp32 weights it was measured with
            (`overdrive.core.digest.weights_fingerprint`), to tell when a rebuild differs.
        batch_dependence: how the fp32 model's answer for a row depends on the rows batched with it
            (`core.workload.BatchDependence.to_dict`), as optimize found it; `run` and `serve` batch by it.
    """

    workload: str
    device: str
    batch_size: int
    steps: list[TechniqueConfig]
    measured: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] | None = None
    outputs: list[str] | None = None
    weights: str | None = None
    dynamic_dims: dict[str, list[int]] | None = None
    model_sha256: str | None = None
    batch_dependence: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PLAN_VERSION,
            "workload": self.workload,
            "device": self.device,
            "batch_size": self.batch_size,
            "techniques": [config_to_dict(s) for s in self.steps],
            "measured": self.measured,
            "environment": self.environment,
            **({"inputs": self.inputs} if self.inputs else {}),
            **({"outputs": self.outputs} if self.outputs else {}),
            **({"weights": self.weights} if self.weights else {}),
            **({"dynamic_dims": self.dynamic_dims} if self.dynamic_dims else {}),
            **({"model_sha256": self.model_sha256} if self.model_sha256 else {}),
            **({"batch_dependence": self.batch_dependence} if self.batch_dependence else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Raises ValueError (or KeyError/TypeError) for anything that is not a valid plan."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if "kind" in data:  # `generate.plan.GenerationPlan` writes one; a one-pass plan has none
            raise ValueError(f"a {data['kind']} plan for {data.get('workload')!r}, not one for a model that answers in "
                             "one forward pass")
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
            steps=[config_from_dict(s) for s in data["techniques"]],
            measured=data.get("measured", {}),
            environment=data.get("environment", {}),
            inputs=data.get("inputs"),
            outputs=data.get("outputs"),
            weights=data.get("weights"),
            dynamic_dims=data.get("dynamic_dims"),
            model_sha256=data.get("model_sha256"),
            batch_dependence=data.get("batch_dependence"),
        )

    def save(self, path: Path) -> None:
        """Write the plan as JSON; checkpoint files beside it are referenced by relative paths."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = path.parent.resolve()

        def relative(p: Path) -> str:
            return str(p.resolve().relative_to(folder)) if p.resolve().is_relative_to(folder) else str(p)

        data = dataclasses.replace(self, steps=_map_checkpoints(self.steps, relative)).to_dict()
        for key, value in (("workload", self.workload), ("weights", self.weights)):
            if value and Path(value).exists():  # found from wherever the plan is used, not only where it was made
                data[f"{key}_file"] = {"relative": os.path.relpath(Path(value).resolve(), folder),
                                       "absolute": str(Path(value).resolve())}
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path, argument: str = "plan") -> Plan:
        """Read a plan file; `argument` names the argument the path came from in error messages.

        Raises:
            PlanError: the file is missing, not JSON, or not a plan.
        """
        try:
            data = json.loads(Path(path).read_text())
            if isinstance(data, dict) and data.get("kind") == "generation":
                raise PlanError(f"{arg(argument, path)} is a plan for generating text with {data.get('workload')!r}: "
                                f"`overdrive bench {data.get('workload')} --plan {path}`, `overdrive run {path}` and "
                                f"`overdrive serve {path}` take it")
            plan = cls.from_dict(data)
            plan.steps = _map_checkpoints(plan.steps, lambda p: str(Path(path).parent / p))  # relative to the plan
            plan.workload = _model_file(plan.workload, data.get("workload_file"), Path(path).parent, argument, path)
            if plan.weights:
                plan.weights = _model_file(plan.weights, data.get("weights_file"), Path(path).parent, argument, path)
            return plan
        except FileNotFoundError:
            raise PlanError(f"{arg(argument, path)}: no such file; expected a plan.json written by `overdrive optimize`") from None
        except (IsADirectoryError, UnicodeDecodeError, OSError) as exc:
            raise PlanError(f"{arg(argument, path)} cannot be read as a plan.json ({type(exc).__name__})") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{arg(argument, path)} is not an overdrive plan ({type(exc).__name__}: {exc})") from None

    def build(self, workload: Workload, device: torch.device) -> tuple[nn.Module, BatchingPolicy]:
        return build(workload, self.steps, device)

    def check_checkpoints(self) -> None:
        """Read every checkpoint the plan names, before anything is measured.

        Raises:
            PlanError: one is missing, unreadable, or written by another technique.
        """
        for step in self.steps:
            try:
                technique_for(step).check_files(step)
            except RuntimeError as exc:
                raise PlanError(f"plan step {exc}; optimize again to rewrite it") from None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.steps]

    def create_workload(self) -> Workload:
        """The workload the plan was made for, rebuilt from its spec, with the weights it was made
        with (`--weights`) and the batch dependence optimize found; a TorchScript file, which stores no
        input shape, gets the row shape and dtype the plan was measured with.

        Raises:
            WorkloadError: as `overdrive.workloads.create_workload`.
            ConfigError: the plan's weights are gone or no longer fit.
        """
        from overdrive.core.row_dependence import checked_dependence
        from overdrive.core.digest import weights_fingerprint
        from overdrive.workloads import create_workload
        from overdrive.workloads.user import archive_kind
        from overdrive.workloads.weights import load_weights

        path = Path(self.workload)
        if path.is_file() and archive_kind(path) == "torchscript" and self.inputs and len(self.inputs) == 1:
            workload = create_workload(self.workload, input_shape=(self.batch_size, *self.inputs[0]["shape"]),
                                       input_dtype=getattr(torch, self.inputs[0]["dtype"]))
        else:
            workload = create_workload(self.workload, dynamic_dims=self.dynamic_dims)
        workload = load_weights(workload, self.weights) if self.weights else workload
        if self.batch_dependence:  # what optimize found: run and serve batch by it without measuring again
            checked_dependence(workload, self.batch_dependence)
        if self.model_sha256 and weights_fingerprint(workload.model) != self.model_sha256:
            message = ("the model's weights differ from those optimize measured for this plan (a factory that initialises "
                       "without a seed, or a changed model file or --weights?): its speedup and fidelity were measured on "
                       "other weights")
            workload.notes.append(message)
            workload.extra["weights_differ_from_plan"] = message
        return workload


def load_plan(path: str | Path, *, device: str | None = "auto", workload: str | None = None,
              argument: str = "plan") -> tuple[Plan, torch.device, str]:
    """Read a plan and check that it can run here: the one way `bench`, `serve` and `run` load one.

    A plan holds on the device type it was tuned on; `device` "auto" (or None) means that type.
    Every checkpoint the plan names is read now, so a missing one is an error before anything runs.

    Args:
        path: the plan.json `optimize` wrote.
        device: "auto", "cpu", "cuda" or "cuda:N".
        workload: the workload the caller named, if any; it must be the plan's.
        argument: the argument `path` came from, for error messages.

    Returns:
        (plan, the resolved device, the device as asked for with "auto" replaced by the plan's
        type: "cuda" without an index means every GPU to `replica_devices`).

    Raises:
        PlanError: the file is not a readable plan, it names missing or foreign checkpoints, it was
            made for another workload, or tuned on another device type than the one asked for.
        ConfigError: the device is not a device or not present.
    """
    from overdrive.core.devices import resolve_device

    plan = Plan.load(Path(path), argument)
    if workload and workload not in (plan.workload, Path(plan.workload).name) and not _same_file(workload, plan.workload):
        raise PlanError(f"{arg(argument, path)} was made for workload {plan.workload!r}, not {workload!r}; "
                        f"use it with {plan.workload!r}")
    plan.check_checkpoints()
    if device in (None, "", "auto"):
        device = plan.device
        if plan.device == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"{arg(argument, path)} was tuned on cuda and no CUDA GPU is present on this machine; "
                            f"optimize {plan.workload} with {arg('device', 'cpu')} for a CPU plan")
    resolved = resolve_device(device)
    if plan.device != resolved.type:
        raise PlanError(f"{arg(argument, path)} was tuned on {plan.device!r} and holds only there; use it with "
                        f"{arg('device', plan.device)}, or optimize {plan.workload} with {arg('device', resolved.type)} "
                        "for a plan for this device")
    return plan, resolved, device


def _map_checkpoints(steps: list[TechniqueConfig], fn) -> list[TechniqueConfig]:
    """The steps, with `fn(Path)` applied to the `checkpoint` file of those that name one."""
    return [dataclasses.replace(s, checkpoint=fn(Path(s.checkpoint))) if getattr(s, "checkpoint", None) else s
            for s in steps]


def _model_file(spec: str, recorded: dict[str, str] | None, folder: Path, argument: str, path: Path) -> str:
    """The plan's model (or weights) file as a path that exists from here: relative to the plan's
    folder first, then the absolute path it was made with.

    Raises:
        PlanError: it is at neither (the message names both).
    """
    if not isinstance(recorded, dict):
        return spec
    relative, absolute = recorded.get("relative"), recorded.get("absolute")
    tried = ([folder / relative] if relative else []) + ([Path(absolute)] if absolute else [])
    for candidate in tried:
        if candidate.exists():
            return str(candidate)
    raise PlanError(f"{arg(argument, path)} was made with {spec}, which is at neither "
                    f"{' nor '.join(str(t) for t in tried)}; put it back, or optimize again")


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).is_file() and Path(b).is_file() and Path(a).samefile(b)
    except OSError:
        return False
