"""The time budget optimize keeps (`time_budget_s`, `--time-budget`): which candidate to try next,
and whether it can still finish.

Before a candidate is built, its cost and gain are estimated from cheap signals: what was measured
for this model (same weights, device and batch size) by an earlier optimize (`History`, kept in the
cache folder), else a prediction: for a precision technique, Amdahl's law over the share of FLOPs in
the layers it lowers and the measured GEMM peak of its dtype against fp32; for length bucketing and
padding removal, the padding the evaluation batches hold; a prior for the rest. Cost: the seconds
its build takes (by its `setup_cost` kind: an export, a compile, a search, training; scaled by the
model's size and its baseline pass), plus one comparison. Candidates are tried by predicted gain per
second; one whose estimate no longer fits in what is left, after the time kept back for composing
the winners and timing the plan against the baseline, is reported untried, with the estimate.

A prediction only orders the candidates and decides what is left untried: every figure in the table
is still measured.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overdrive.core.workload import BatchingPolicy

DEFAULT_TIME_BUDGET_S = 420.0

# Seconds a technique's build and warm-up take before its first timed pass, when nothing was measured
# for this model: fixed + per million parameters + per baseline pass (one pass over the timing rows).
SETUP_PRIOR = {
    "cheap": (0.5, 0.02, 2.0),
    "export": (3.0, 0.4, 3.0),  # torch.export / ONNX / OpenVINO conversion, a session
    "compile": (20.0, 0.5, 6.0),  # Inductor's graphs (fewer with its cache)
    "search": (8.0, 0.3, 40.0),  # a per-layer sensitivity search, calibration
    "train": (30.0, 1.0, 80.0),  # pruning's recovery fine-tune
}
GAIN_PRIOR = {"cheap": 1.05, "export": 1.25, "compile": 1.1, "search": 1.3, "train": 1.2}
DAMPING = 0.6  # a prediction's excess over 1×, shrunk: eager overheads take part of any arithmetic gain


@dataclass
class Estimate:
    """What a candidate is expected to buy and cost, and where the figures come from."""

    gain: float  # throughput ÷ the baseline's
    setup_s: float  # seconds to build and warm it up
    compare_s: float  # seconds to time it against the baseline
    source: str  # "measured for this model before" or "predicted: ..."

    @property
    def cost_s(self) -> float:
        return self.setup_s + self.compare_s

    @property
    def priority(self) -> float:
        """Predicted gain per second (log of the ratio, so a loss ranks below any gain)."""
        return math.log(max(self.gain, 1e-3)) / max(self.cost_s, 0.1)


@dataclass
class Budget:
    """Seconds optimize may take from `start`; None: no limit."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - (time.monotonic() - self.start)

    def affords(self, cost_s: float, reserve_s: float = 0.0) -> bool:
        return self.left() - reserve_s >= cost_s

    def describe(self) -> str:
        return "no time budget" if self.seconds is None else f"the time budget ({self.seconds:.0f} s)"


def resolve_budget(value: float | None) -> float | None:
    """`time_budget_s` as given: None → the default; 0 or math.inf → no limit.

    Raises:
        ValueError: negative or not a number.
    """
    if value is None:
        return DEFAULT_TIME_BUDGET_S
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"expected seconds ≥ 0 (0: no limit), not {value!r}")
    return None if value == 0 or math.isinf(value) else float(value)


def default_dtype_layers() -> tuple:
    """The layers a precision technique lowers unless it names its own (`Technique.dtype_layers`)."""
    from torch import nn

    return (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class History:
    """What earlier optimize runs measured for one model on one device at one batch size: per
    technique label, the gain, the build seconds and the whole trial's seconds. Kept as JSON in the
    cache folder (`files.cache`); nothing is kept when caching is off."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        if path is not None and path.is_file():
            try:
                self.entries = json.loads(path.read_text()).get("techniques", {})
            except (OSError, json.JSONDecodeError, AttributeError):
                self.entries = {}

    @classmethod
    def for_model(cls, model, device, batch_size: int) -> History:
        from overdrive.files.cache import cache_root, model_key

        root = cache_root()
        if root is None:
            return cls(None)
        return cls(root / "history" / f"{model_key(model)[:32]}-{device.type}-b{batch_size}.json")

    def get(self, label: str) -> dict[str, Any] | None:
        return self.entries.get(label)

    def record(self, label: str, *, gain: float | None, setup_s: float, trial_s: float, kept: bool) -> None:
        self.entries[label] = {"gain": gain, "setup_s": round(setup_s, 3), "trial_s": round(trial_s, 3), "kept": kept,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text(json.dumps({"techniques": self.entries}, indent=1, sort_keys=True))
            temporary.replace(self.path)
        except OSError:
            pass  # a read-only cache costs the next run its head start, nothing else


@dataclass
class Signals:
    """The cheap facts the predictions use, read once after the baseline."""

    params_m: float  # parameters, millions
    pass_s: float  # one baseline pass over the timing rows, seconds
    compare_s: float  # one comparison against the baseline, seconds (measured once one ran)
    padding: float | None = None  # the share of padding tokens in the baseline's batches (`padding_share`)
    shares: dict[tuple, float | None] = field(default_factory=dict)  # layer types -> share of FLOPs
    peaks: dict[str, float | None] = field(default_factory=dict)  # dtype -> measured GEMM FLOP/s


def padding_share(workload, indices: list[int], batch_size: int) -> float | None:
    """The share of the tokens in the baseline's batches of `batch_size` that are padding (each batch
    padded to its longest row; cut in `BatchingPolicy.deployed`'s order: text sorted by length, the rest
    in `indices`' order); None for a workload without lengths."""
    if workload.bucket_length is None:
        return None
    order = BatchingPolicy.deployed(workload).order(workload, indices)
    lengths = [workload.bucket_length(workload.samples[indices[p]]) for p in order]
    padded = real = 0
    for start in range(0, len(lengths), batch_size):
        chunk = lengths[start:start + batch_size]
        padded += max(chunk) * len(chunk)
        real += sum(chunk)
    return 1.0 - real / padded if padded else None


def estimate(technique, config, signals: Signals, history: History, label: str, device) -> Estimate:
    """The gain and cost expected of trying `technique` (with `config`) alone."""
    seen = history.get(label)
    fixed, per_m, per_pass = SETUP_PRIOR[technique.setup_cost]
    setup = fixed + per_m * signals.params_m + per_pass * signals.pass_s
    if seen is not None:
        gain = seen.get("gain") or 1.0
        if not seen.get("kept"):  # not kept then (too slow, over the budget, failed): no reason to hurry to it now
            gain = min(gain, 1.0)
        return Estimate(gain=gain, setup_s=float(seen.get("setup_s", setup)), compare_s=signals.compare_s,
                        source="measured for this model before")
    gain, why = _predicted_gain(technique, config, signals, device)
    if technique.fidelity_risk and gain > 1.0:  # a gain it may well not be allowed to keep
        gain = math.exp(math.log(gain) * (1.0 - technique.fidelity_risk))
        why += f", weighed by a {technique.fidelity_risk:.0%} risk of breaking the fidelity floor"
    return Estimate(gain=gain, setup_s=setup, compare_s=signals.compare_s, source=f"predicted: {why}")


def _predicted_gain(technique, config, signals: Signals, device) -> tuple[float, str]:
    dtype = technique.dtype_of(config) if hasattr(technique, "dtype_of") else technique.compute_dtype
    if technique.name in ("length-bucketing", "remove-padding") and signals.padding is not None:
        gain = 1.0 / max(1.0 - signals.padding, 0.05)
        return 1.0 + DAMPING * (gain - 1.0), f"{signals.padding:.0%} of the tokens are padding"
    if dtype and dtype != "float32" and signals.peaks.get("float32"):
        layers = technique.dtype_layers or default_dtype_layers()
        share = signals.shares.get(layers)
        peak = signals.peaks.get(dtype)
        if share is not None and peak:
            speed = peak / signals.peaks["float32"]
            gain = 1.0 / ((1.0 - share) + share / max(speed, 1e-3))
            return 1.0 + DAMPING * (gain - 1.0), f"{share:.0%} of the FLOPs in its layers, {dtype} GEMM {speed:.1f}× fp32"
    return GAIN_PRIOR[technique.setup_cost], f"a prior for {technique.setup_cost} techniques on {device.type}"
