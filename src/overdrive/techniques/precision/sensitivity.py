"""Per-layer sensitivity analysis and the greedy search under a fidelity floor (`mixed.py` uses it).

The method is the standard post-training mixed-precision recipe (layer-wise sensitivity, as in
HAWQ's ordering and Intel Neural Compressor's / ModelOpt's accuracy-driven fallback), measured
rather than estimated:

1. sensitivity: each candidate layer alone in low precision; the workload's fidelity figure on the
   calibration rows (its training split, never the evaluation rows) against the unchanged model
   gives the drop, 1 − fidelity;
2. time saved: each layer's fp32 and low-precision forms timed eagerly on the input it gets from
   the first calibration batch (layers of one weight and input shape share a timing);
3. order: by drop per millisecond saved (the cheapest fidelity per unit of time first; a layer
   that saves no time in eager mode comes last, since the compiled model fuses its quantisation);
4. greedy: layers are switched in that order, the whole model measured on the calibration rows
   after each; a layer that would take the figure below the target stays in high precision.

The tuner then judges the chosen model on the evaluation rows like every candidate (fidelity,
accuracy budget, batch invariance, speed).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from overdrive.core.timer import Timer
from overdrive.core.workload import Workload
from overdrive.techniques.precision.quantized_layers import LAYER_TYPES, describe_layer, layer_reason, quantized_module, set_module

CALIBRATION_BATCH = 32
TIMING_REPEATS = 7


@dataclass(kw_only=True)
class LayerChoice:
    """One layer's row of the search table.

    Attributes:
        name: module path; shape: "in→out".
        drop: 1 − fidelity on the calibration rows with this layer alone in low precision (None: not measured).
        saved_ms: fp32 time − low-precision time of the layer, eager, per calibration batch (ms).
        precision: what the search chose ("int8", "fp8", "fp32").
        note: why it stayed in fp32, when it did.
    """

    name: str
    shape: str
    drop: float | None = None
    saved_ms: float | None = None
    precision: str = "fp32"
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(kw_only=True)
class SearchResult:
    chosen: list[str]
    layers: list[LayerChoice]
    fidelity: float | None  # the figure with every chosen layer switched, on the calibration rows
    target: float
    key: str
    calibration_rows: int
    seconds: float
    notes: list[str] = field(default_factory=list)


def quantizable_layers(model: nn.Module) -> list[str]:
    """Paths of the plain nn.Linear and nn.Conv2d layers of `model` (subclasses may change forward: left alone)."""
    return [name for name, module in model.named_modules() if type(module) in LAYER_TYPES and name]


def calibration_batches(workload: Workload, rows: list[Any], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The calibration rows collated in batches of CALIBRATION_BATCH (text sorted by length, as served)."""
    if workload.sample_length is not None:
        rows = sorted(rows, key=workload.sample_length)
    size = min(CALIBRATION_BATCH, workload.fixed_batch_size or CALIBRATION_BATCH)
    batches = []
    for i in range(0, len(rows), size):
        chunk = rows[i:i + size]
        if workload.fixed_batch_size and len(chunk) < workload.fixed_batch_size:
            break
        batches.append(tuple(t.to(device) for t in workload.collate(chunk)))
    return batches


def _outputs(model: nn.Module, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(*b).float().cpu() for b in batches])


def _figure(workload: Workload, output: torch.Tensor, reference: torch.Tensor) -> float:
    value = workload.fidelity(output, reference)[workload.fidelity_key]
    return value if torch.isfinite(torch.as_tensor(output)).all() else float("-inf")


def _time_ms(module: nn.Module, x: torch.Tensor, timer: Timer) -> float:
    with torch.no_grad():
        module(x)
        module(x)
        return statistics.median(timer(module, x)[1] for _ in range(TIMING_REPEATS)) * 1e3


def search(model: nn.Module, workload: Workload, device: torch.device, *, scheme: str, floor: float, margin: float,
           calibration_rows: int) -> SearchResult:
    """Choose the layers of `model` that take `scheme` while the fidelity figure on the calibration
    rows stays ≥ 1 − (1 − floor) × margin. `model` is left as it was.

    Raises:
        RuntimeError: the workload has no training rows, or the model has no layer that can take `scheme`.
    """
    start = time.perf_counter()
    if not workload.train_samples:
        raise RuntimeError("the per-layer search calibrates on the workload's training rows, and it has none (pass --data "
                           "with 100+ rows, or name the layers in the config)")
    candidates, layers = [], []
    modules = dict(model.named_modules())
    for name in quantizable_layers(model):
        choice = LayerChoice(name=name, shape=describe_layer(modules[name]))
        choice.note = layer_reason(modules[name], scheme, device) or ""
        layers.append(choice)
        if not choice.note:
            candidates.append(name)
    if not candidates:
        raise RuntimeError(f"no nn.Linear or nn.Conv2d layer of the model can take {scheme} here")
    rows = list(workload.train_samples)[:calibration_rows]
    batches = calibration_batches(workload, rows, device)
    if not batches:
        raise RuntimeError(f"too few training rows for one calibration batch of {workload.fixed_batch_size}")
    reference = _outputs(model, batches)
    target = 1.0 - (1.0 - floor) * margin
    originals = {name: modules[name] for name in candidates}
    lowered = {name: quantized_module(originals[name], scheme, device) for name in candidates}
    by_name = {c.name: c for c in layers}

    inputs: dict[str, tuple] = {}  # each layer's input shape on the first batch, and one input per distinct (layer, input) shape
    captured: dict[tuple, torch.Tensor] = {}

    def capture(name):
        def hook(module, args):
            key = (type(module).__name__, tuple(module.weight.shape), tuple(args[0].shape))
            inputs[name] = key
            captured.setdefault(key, args[0].detach())
        return hook

    hooks = [originals[n].register_forward_pre_hook(capture(n)) for n in candidates]
    try:
        with torch.no_grad():
            model(*batches[0])
    finally:
        for hook in hooks:
            hook.remove()
    timer, saved_by_key = Timer(device), {}
    for name in candidates:
        key = inputs.get(name)
        if key is not None and key not in saved_by_key:
            x = captured[key]
            saved_by_key[key] = _time_ms(originals[name], x, timer) - _time_ms(lowered[name], x, timer)
        by_name[name].saved_ms = saved_by_key.get(key)
    del captured

    try:
        for name in candidates:  # 1. sensitivity: one layer at a time
            set_module(model, name, lowered[name])
            by_name[name].drop = max(0.0, 1.0 - _figure(workload, _outputs(model, batches), reference))
            set_module(model, name, originals[name])

        def order(name: str) -> tuple:
            c = by_name[name]
            saved = c.saved_ms if c.saved_ms is not None else 0.0
            return (saved <= 0, c.drop / saved if saved > 0 else c.drop, -saved)

        chosen, fidelity = [], None
        for name in sorted(candidates, key=order):  # 2. greedy, in order of drop per ms saved
            set_module(model, name, lowered[name])
            figure = _figure(workload, _outputs(model, batches), reference)
            if figure >= target:
                chosen.append(name)
                by_name[name].precision, fidelity = scheme, figure
            else:
                set_module(model, name, originals[name])
                by_name[name].note = f"would lower {workload.fidelity_key} to {figure:.4f} (< {target:.4f})"
    finally:
        for name, module in originals.items():
            set_module(model, name, module)
    return SearchResult(chosen=chosen, layers=layers, fidelity=fidelity, target=target, key=workload.fidelity_key,
                        calibration_rows=len(rows), seconds=time.perf_counter() - start)
