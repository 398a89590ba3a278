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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from overdrive.core.timer import Timer
from overdrive.core.workload import Workload
from overdrive.techniques.precision.quantized_layers import quantized_module, set_module

CALIBRATION_BATCH = 32
TIMING_REPEATS = 9


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


def calibration_batches(workload: Workload, rows: list[Any], device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """The calibration rows collated in batches of CALIBRATION_BATCH (text sorted by length, as served).

    Raises:
        RuntimeError: no rows, or too few for one batch of a model that takes one batch size.
    """
    if not rows:
        raise RuntimeError("the per-layer search calibrates on the workload's training rows, and it has none (pass --data "
                           "with 100+ rows, or name the layers in the config)")
    if workload.sample_length is not None:
        rows = sorted(rows, key=workload.sample_length)
    size = workload.fixed_batch_size or CALIBRATION_BATCH
    batches = []
    for i in range(0, len(rows), size):
        chunk = rows[i:i + size]
        if workload.fixed_batch_size and len(chunk) < workload.fixed_batch_size:
            break
        batches.append(tuple(t.to(device) for t in workload.collate(chunk)))
    if not batches:
        raise RuntimeError(f"too few training rows for one calibration batch of {workload.fixed_batch_size}")
    return batches


def _outputs(model: nn.Module, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(*b).float().cpu() for b in batches])


def _figure(workload: Workload, output: torch.Tensor, reference: torch.Tensor) -> float:
    if not torch.isfinite(output).all():
        return float("-inf")
    return workload.fidelity(output, reference)[workload.fidelity_key]


def _saved_ms(original: nn.Module, lowered: nn.Module, x: torch.Tensor, timer: Timer) -> float:
    """Median over TIMING_REPEATS interleaved pairs of (original's time − lowered's time) on `x`, in ms:
    interleaved, so that a busy machine slows both sides of each pair alike."""
    with torch.no_grad():
        for module in (original, lowered, original, lowered):  # warm-up
            module(x)
        return statistics.median(timer(original, x)[1] - timer(lowered, x)[1] for _ in range(TIMING_REPEATS)) * 1e3


class Candidates:
    """How the search builds a candidate: `model(names)` returns the model with exactly the layers
    `names` in low precision (the others as they were); `restore()` puts the model back.
    `saved_ms(name)` is the time the layer alone saves per calibration batch, or None when it is
    not timed per layer."""

    def model(self, names: list[str]) -> nn.Module:
        raise NotImplementedError

    def restore(self) -> None:
        pass

    def saved_ms(self, name: str) -> float | None:
        return None


class SwappedLayers(Candidates):
    """Layers swapped in place for their low-precision module (`quantized_layers.quantized_module`); each
    layer's saving timed eagerly on the input it gets from the first calibration batch (layers of one
    weight and input shape share a timing)."""

    def __init__(self, model: nn.Module, names: list[str], scheme: str, device: torch.device, first_batch: tuple):
        modules = dict(model.named_modules())
        self.net, self.originals = model, {n: modules[n] for n in names}
        self.lowered = {n: quantized_module(self.originals[n], scheme, device) for n in names}
        keys: dict[str, tuple] = {}
        captured: dict[tuple, torch.Tensor] = {}

        def capture(name):
            def hook(module, args):
                key = (type(module).__name__, tuple(module.weight.shape), tuple(args[0].shape))
                keys[name] = key
                captured.setdefault(key, args[0].detach())
            return hook

        hooks = [self.originals[n].register_forward_pre_hook(capture(n)) for n in names]
        try:
            with torch.no_grad():
                model(*first_batch)
        finally:
            for hook in hooks:
                hook.remove()
        timer, by_key = Timer(device), {}
        self.saved: dict[str, float | None] = {}
        for name in names:
            key = keys.get(name)
            if key is not None and key not in by_key:
                x = captured[key]
                by_key[key] = _saved_ms(self.originals[name], self.lowered[name], x, timer)
            self.saved[name] = by_key.get(key)

    def model(self, names):
        chosen = set(names)
        for name, original in self.originals.items():
            set_module(self.net, name, self.lowered[name] if name in chosen else original)
        return self.net

    def restore(self):
        self.model([])

    def saved_ms(self, name):
        return self.saved.get(name)


def search(workload: Workload, batches: list[tuple[torch.Tensor, ...]], reference_model: nn.Module,
           candidates: Candidates, layers: list[LayerChoice], *, scheme: str, floor: float, margin: float,
           calibration_rows: int) -> SearchResult:
    """Choose the layers (of `layers`, those without a note) that take `scheme` while the fidelity figure on
    the calibration `batches` stays ≥ 1 − (1 − floor) × margin. The model is restored before returning.

    Raises:
        RuntimeError: no layer can take `scheme`.
    """
    start = time.perf_counter()
    names = [c.name for c in layers if not c.note]
    if not names:
        raise RuntimeError(f"no layer of the model can take {scheme} here")
    reference = _outputs(reference_model, batches)
    target = 1.0 - (1.0 - floor) * margin
    by_name = {c.name: c for c in layers}
    try:
        for name in names:  # 1. sensitivity: one layer at a time
            by_name[name].saved_ms = candidates.saved_ms(name)
            by_name[name].drop = max(0.0, 1.0 - _figure(workload, _outputs(candidates.model([name]), batches), reference))

        def order(name: str) -> tuple:
            c = by_name[name]
            if c.saved_ms is None:  # not timed per layer: by drop alone
                return (False, c.drop, 0.0)
            return (c.saved_ms <= 0, c.drop / c.saved_ms if c.saved_ms > 0 else c.drop, -c.saved_ms)

        chosen, fidelity = [], None
        for name in sorted(names, key=order):  # 2. greedy, in order of drop per ms saved
            figure = _figure(workload, _outputs(candidates.model(chosen + [name]), batches), reference)
            if figure >= target:
                chosen.append(name)
                by_name[name].precision, fidelity = scheme, figure
            else:
                by_name[name].note = f"would lower {workload.fidelity_key} to {figure:.4f} (< {target:.4f})"
    finally:
        candidates.restore()
    return SearchResult(chosen=chosen, layers=layers, fidelity=fidelity, target=target, key=workload.fidelity_key,
                        calibration_rows=calibration_rows, seconds=time.perf_counter() - start)
