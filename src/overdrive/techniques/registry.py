"""Technique = a frozen config dataclass + one registered transform.

`apply(model, config, workload=..., device=...) -> model` returns the transformed model
(the caller hands it a private copy, so transforms may work in place). A technique that
changes how samples are grouped into batches (length bucketing) overrides `batching`.
Registration makes the technique visible to the CLI, the tuner and the test battery.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from overdrive.core.workload import Workload


class Stage(enum.IntEnum):
    """Canonical composition order (DESIGN.md): batching, then prune → precision → graph → compile → runtime."""

    BATCHING = 0
    PRUNE = 1
    PRECISION = 2
    GRAPH = 3
    COMPILE = 4
    RUNTIME = 5


@dataclass(frozen=True, kw_only=True)
class BatchingPolicy:
    """How evaluation samples are grouped into batches.

    Attributes:
        sort_by_length: order samples by `workload.sample_length` before cutting batches,
            so each batch pads to a similar length (length bucketing). Outputs are restored to
            the input order by the caller.
    """

    sort_by_length: bool = False

    def order(self, workload: Workload, indices: list[int]) -> list[int]:
        """Positions 0..len(indices)-1 in the order they are cut into batches (indices may repeat)."""
        positions = list(range(len(indices)))
        if self.sort_by_length and workload.sample_length is not None:
            positions.sort(key=lambda p: workload.sample_length(workload.samples[indices[p]]))
        return positions


@dataclass(frozen=True, kw_only=True)
class TechniqueConfig:
    """Base of all technique configs; subclasses are frozen, kw-only, validated in __post_init__."""

    VERSION: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        fields = {
            f.name: (v.value if isinstance(v, enum.Enum) else v)
            for f in dataclasses.fields(self)
            for v in [getattr(self, f.name)]
        }
        return {"version": self.VERSION, **fields}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TechniqueConfig:
        data = {k: v for k, v in data.items() if k != "version"}
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(data) - set(known)
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)


class Technique:
    """One acceleration technique. Subclasses set the class attributes and `apply`.

    Attributes:
        name: the CLI name (`bf16`, `int8-dynamic`, ...).
        config_cls: its TechniqueConfig subclass.
        stage: where it sits in the canonical composition order.
        lossless: True when outputs must match fp32 within float tolerance (tested with
            assert_close); False when a fidelity floor judges it.
        group: techniques sharing a group are alternatives; composition keeps at most one.
        devices: device types it can run on.
        rewrites_modules: True when it rewrites nn.Module internals (not possible on TorchScript).
        opt_in: True when the tuner tries it only if the user names it (lossy without a
            follow-up step, or slow to apply).
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[TechniqueConfig]]
    stage: ClassVar[Stage]
    lossless: ClassVar[bool]
    group: ClassVar[str | None] = None
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    rewrites_modules: ClassVar[bool] = False  # needs nn.Module internals, which TorchScript hides
    opt_in: ClassVar[bool] = False  # tried only when named in --techniques
    description: ClassVar[str] = ""

    def unsupported_reason(self, workload: Workload, device: torch.device) -> str | None:
        """Why this technique cannot run on this workload and device, or None when it can."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only"
        if self.rewrites_modules and workload.is_torchscript:
            return "not applicable: TorchScript hides the modules this rewrites (save the model with torch.export instead)"
        return self.applicability(workload, device)

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        """Subclass hook: a reason this technique does not apply (no such layers, no support here)."""
        return None

    def apply(self, model: nn.Module, config: TechniqueConfig, *, workload: Workload, device: torch.device) -> nn.Module:
        return model

    def batching(self, policy: BatchingPolicy, config: TechniqueConfig) -> BatchingPolicy:
        return policy


_REGISTRY: dict[str, Technique] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Class decorator: instantiate and register a technique under `cls.name`."""
    if cls.name in _REGISTRY:
        raise ValueError(f"technique {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def list_techniques() -> list[Technique]:
    """All registered techniques, in canonical order (stage, then name)."""
    return sorted(_REGISTRY.values(), key=lambda t: (t.stage, t.name))


def get_technique(name: str) -> Technique:
    """The technique registered as `name`.

    Raises:
        KeyError: no such technique (the message lists the known names).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown technique {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


class ForwardWrapper(nn.Module):
    """Base for modules that wrap `inner` and change how its forward runs (a context, a layout)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
