"""Technique = a frozen config dataclass + one registered transform, keyed by the config's type.

As in torchao's `quantize_(model, Int8WeightOnlyConfig())`, a config says what to do and the
registry finds the transform from the config's class: `technique_for(config).apply(model,
config, workload=..., device=...) -> model` returns the transformed model (the caller hands
it a private copy, so transforms may work in place). A plan step is its config; the
technique's name (`bf16`, `int8-dynamic`, what the CLI and plan.json spell) is the config
class's `name`. A technique that changes how samples are grouped into batches (length
bucketing) overrides `batching`; one that leaves a report (pruning: parameters, FLOPs,
recovery) formats its own lines in `describe_report`. Registration makes the technique
visible to the CLI, the tuner and the test battery.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from overdrive.core.workload import BatchingPolicy, Workload


class Stage(enum.IntEnum):
    """Canonical composition order (DESIGN.md): batching, then prune → precision → graph → compile → runtime."""

    BATCHING = 0
    PRUNE = 1
    PRECISION = 2
    GRAPH = 3
    COMPILE = 4
    RUNTIME = 5


@dataclass(frozen=True, kw_only=True)
class TechniqueConfig:
    """Base of all technique configs; subclasses are frozen, kw-only, validated in __post_init__,
    and set `name`, the name of the technique they configure."""

    name: ClassVar[str]
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
        name: the technique's name (`bf16`, `int8-dynamic`, ...): its config class's `name`.
        config_cls: its TechniqueConfig subclass (one technique per config class).
        stage: where it sits in the canonical composition order.
        lossless: True when outputs must match fp32 within float tolerance (tested with
            assert_close); False when a fidelity floor judges it.
        group: techniques sharing a group are alternatives; composition keeps at most one.
        devices: device types it can run on.
        rewrites_modules: True when it rewrites nn.Module internals (not possible on TorchScript).
        opt_in: True when the tuner tries it only if the user names it (lossy without a
            follow-up step, or slow to apply).
        batch_dependence: for a technique whose rows can depend on their batch-mates, how (named
            when the tuner's batch-invariance check rejects it); "" otherwise.
        exportable: True when the model it leaves still exports (ONNX, OpenVINO) with its effect
            kept (pruning, folding, batching); False when its effect lives in PyTorch's execution
            (autocast, torch.compile, torch.ao int8), so no `leaves_pytorch` step may follow it.
        leaves_pytorch: True for a runtime outside PyTorch (ONNX Runtime, OpenVINO, TensorRT): it
            exports the model built so far; only exportable steps may come before it, none after.
        compute_dtype: the dtype its matrix products run in ("bfloat16", "int8", ...), whose measured
            GEMM peak is a plan's compute roof (`core.roofline`); None: it leaves the dtype as it was.
            A technique whose dtype depends on its config (a runtime's precision) overrides `dtype_of`.
    """

    config_cls: ClassVar[type[TechniqueConfig]]
    stage: ClassVar[Stage]
    lossless: ClassVar[bool]
    group: ClassVar[str | None] = None
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    rewrites_modules: ClassVar[bool] = False  # needs nn.Module internals, which TorchScript hides
    opt_in: ClassVar[bool] = False  # tried only when named in `techniques`
    batch_dependence: ClassVar[str] = ""
    exportable: ClassVar[bool] = False
    leaves_pytorch: ClassVar[bool] = False
    description: ClassVar[str] = ""
    compute_dtype: ClassVar[str | None] = None
    # what building it costs before its first timed pass, for the time budget (`tuning.budget.SETUP_PRIOR`):
    # "cheap", "export" (a model out of PyTorch), "compile", "search" (per layer) or "train"
    setup_cost: ClassVar[str] = "cheap"
    # how likely, before anything is measured, it is to break a fidelity floor (the time budget weighs its
    # predicted gain by it): whole-model int8 with one activation scale per tensor often does on transformers
    fidelity_risk: ClassVar[float] = 0.0
    dtype_layers: ClassVar[tuple[type[nn.Module], ...] | None] = None  # the layers compute_dtype applies to; None: all

    @property
    def name(self) -> str:
        return self.config_cls.name

    def unsupported_reason(self, workload: Workload, device: torch.device,
                           config: TechniqueConfig | None = None) -> str | None:
        """Why this technique cannot run on this workload and device (with `config`, when the
        reason depends on it), or None when it can."""
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only"
        if self.rewrites_modules and workload.is_torchscript:
            return "not applicable: TorchScript hides the modules this rewrites (save the model with torch.export instead)"
        return self.applicability(workload, device)

    def applicability(self, workload: Workload, device: torch.device) -> str | None:
        """Subclass hook: a reason this technique does not apply (no such layers, no support here)."""
        return None

    def redundancy(self, workload: Workload) -> str | None:
        """Subclass hook: why trying this would measure nothing, because the baseline already does
        what it does (`BatchingPolicy.deployed`). Unlike `applicability`, a plan that holds it still
        builds; the tuner only does not try it."""
        return None

    def apply(self, model: nn.Module, config: TechniqueConfig, *, workload: Workload, device: torch.device) -> nn.Module:
        return model

    def batching(self, policy: BatchingPolicy, config: TechniqueConfig) -> BatchingPolicy:
        return policy

    def variants(self, config: TechniqueConfig, workload: Workload, device: torch.device) -> list[TechniqueConfig]:
        """The configs the tuner measures, each alone, when the user gave none (`config` is the default):
        the fastest kept one is composed. One, `config`, unless the technique has modes worth searching."""
        return [config]

    def dtype_of(self, config: TechniqueConfig) -> str | None:
        """The dtype `config`'s matrix products run in (see `compute_dtype`); None: unchanged."""
        return self.compute_dtype

    def includes(self, config: TechniqueConfig) -> tuple[str, ...]:
        """Names of techniques whose effect this step already has (a searched precision step that
        compiles its model includes `compile`): they cannot also be in its plan."""
        return ()

    def for_guard(self, config: TechniqueConfig, guard: Any) -> TechniqueConfig:
        """The config the tuner uses under `guard` (tuning.guard.Guard): a searched step takes the
        budget's floor as its own."""
        return config

    def resolve(self, step: TechniqueConfig, before: list[TechniqueConfig], *, workload: Workload,
                device: torch.device, folder: Any) -> TechniqueConfig:
        """The step as plan.json keeps it, once `optimize` chose it after the steps `before`: with
        what it found written in (pruned weights in a checkpoint under `folder`, a search's layers),
        so that reloading the plan rebuilds the same model without pruning or searching again."""
        return step

    def check_files(self, step: TechniqueConfig) -> None:
        """Read the files `step` names (a checkpoint), before anything is measured.

        Raises:
            RuntimeError: one is missing, unreadable or not this technique's (the message names it).
        """

    def describe_report(self, report: dict[str, Any], fidelity_key: str) -> str:
        """One line for the report this technique's `apply` left (`model.overdrive_report`)."""
        return f"{self.name}: " + ", ".join(f"{k} {v}" for k, v in report.items() if k != "technique")


_BY_CONFIG: dict[type[TechniqueConfig], Technique] = {}
_BY_NAME: dict[str, Technique] = {}


def register(cls: type[Technique]) -> type[Technique]:
    """Class decorator: instantiate and register a technique under its config class (and name)."""
    config_cls = cls.config_cls
    if config_cls in _BY_CONFIG or config_cls.name in _BY_NAME:
        raise ValueError(f"technique {config_cls.name!r} ({config_cls.__name__}) registered twice")
    _BY_CONFIG[config_cls] = _BY_NAME[config_cls.name] = cls()
    return cls


def unregister(name: str) -> None:
    """Remove technique `name` from the registry (tests and plugins that register their own)."""
    technique = _BY_NAME.pop(name)
    del _BY_CONFIG[technique.config_cls]


def list_techniques() -> list[Technique]:
    """All registered techniques, in canonical order (stage, then name)."""
    return sorted(_BY_NAME.values(), key=lambda t: (t.stage, t.name))


def get_technique(name: str) -> Technique:
    """The technique registered as `name`.

    Raises:
        KeyError: no such technique (the message lists the known names).
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown technique {name!r}; known: {', '.join(sorted(_BY_NAME))}") from None


def technique_for(config: TechniqueConfig) -> Technique:
    """The technique that `config` configures (by its type).

    Raises:
        TypeError: `config` is not a registered technique's config.
    """
    try:
        return _BY_CONFIG[type(config)]
    except KeyError:
        raise TypeError(f"{type(config).__name__} is not the config of a registered technique") from None


def default_config(name: str) -> TechniqueConfig:
    """The default config of technique `name` (KeyError when there is none by that name)."""
    return get_technique(name).config_cls()


def config_to_dict(config: TechniqueConfig) -> dict[str, Any]:
    """A plan.json step: {"name": technique name, "config": its fields with a version}."""
    return {"name": config.name, "config": config.to_dict()}


def config_from_dict(data: dict[str, Any]) -> TechniqueConfig:
    """The config of a plan.json step (`config_to_dict`'s inverse).

    Raises:
        KeyError: an unknown technique; ValueError: unknown or invalid fields.
    """
    return get_technique(data["name"]).config_cls.from_dict(data.get("config", {}))


def conflict(steps: list[TechniqueConfig], step: TechniqueConfig) -> str | None:
    """Why `step` cannot follow `steps` in one plan, or None: a technique another step includes, two
    techniques of one group (alternatives: bf16 / int8, one runtime per plan), a runtime outside PyTorch after a step that
    does not survive export, or any step after such a runtime."""
    new = technique_for(step)
    for before in steps:
        old = technique_for(before)
        if new.name in old.includes(before):
            return f"{old.name} already includes {new.name}"
        if old.name in new.includes(step):
            return f"{new.name} includes {old.name}, already kept"
        if old.group and old.group == new.group:
            return f"alternative to {old.name}, already kept ({new.group}: a plan keeps one)"
        if old.leaves_pytorch:
            return f"{new.name} cannot follow {old.name}: the model has left PyTorch"
    blocking = [technique_for(s).name for s in steps if not technique_for(s).exportable]
    if new.leaves_pytorch and blocking:
        return (f"{new.name} runs the exported model, so it cannot follow {', '.join(blocking)} (whose effect lives in "
                "PyTorch's execution); it is tried instead of them")
    return None


def compute_dtype(steps: list[TechniqueConfig]) -> str:
    """The dtype a plan's matrix products run in: the last step's that sets one, else "float32"."""
    dtypes = [d for d in (technique_for(s).dtype_of(s) for s in steps) if d]
    return dtypes[-1] if dtypes else "float32"


def compute_layers(steps: list[TechniqueConfig]) -> tuple[type[nn.Module], ...] | None:
    """The layer types `compute_dtype(steps)` applies to (int8-dynamic: nn.Linear), None for the whole model."""
    setting = [technique_for(s) for s in steps if technique_for(s).dtype_of(s)]
    return setting[-1].dtype_layers if setting else None


def describe_report(report: dict[str, Any], fidelity_key: str) -> str:
    """One line for a technique's report, formatted by the technique that left it."""
    return get_technique(report["technique"]).describe_report(report, fidelity_key)


def fallbacks(model: nn.Module) -> str | None:
    """What a technique's module ran some other way than planned (CUDA-graph shapes run eagerly): the
    `overdrive_fallbacks()` of each module that has one, joined; None when nothing fell back."""
    said = [m.overdrive_fallbacks() for m in model.modules() if hasattr(m, "overdrive_fallbacks")]
    return "; ".join(s for s in said if s) or None


class ForwardWrapper(nn.Module):
    """Base for modules that wrap `inner` and change how its forward runs (a context, a layout)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
