"""Static int8 of chosen layers through PT2E (torchao's `prepare_pt2e` / `convert_pt2e` with
`X86InductorQuantizer`), for `mixed-int8-static` on the CPU.

The model is exported with torch.export (batch dimension dynamic), the chosen nn.Conv2d / nn.Linear
layers are annotated with the quantizer's default static recipe (int8 activations per tensor with
scales calibrated on the training rows, int8 weights per channel), and the converted graph holds
quantize / dequantize pairs around them. Run eagerly it computes int8 numerics in fp32 (what the
search measures); compiled by Inductor with `freezing` on, the pairs become oneDNN int8 convolution
and linear kernels. Static scales are constants, so a row's output does not depend on its batch-mates.
Calibration is deterministic: the same rows give the same scales, so a plan rebuilds the same model.

PT2E, torchao and Inductor warn about their own internals while they export, quantise and compile. The
user sees the report instead: the warnings in `NOISE` are dropped (`quiet`), any other one torch or
torchao raises while quantising becomes a note in the step's report (`said`), and the user's own
model's warnings pass through as they were raised.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from overdrive.techniques.precision.sensitivity import Candidates

LAYER_TYPES = (nn.Linear, nn.Conv2d)
# (message start, module) of warnings about torch's and torchao's own code that say nothing about the user's model.
NOISE = (
    # Inductor's oneDNN int8 linear lowering copies its own weight zero point with torch.tensor(tensor) (torch 2.14).
    ("To copy construct from a tensor", r"torch\._inductor"),
    # X86InductorQuantizer: a pool after a layer the search left in fp32 stays fp32 too, as it should.
    ("The input of maxpool2d is not quantized", r"torchao"),
)
NOTES_ATTR = "overdrive_pt2e_notes"  # what torch / torchao said while making a graph module, kept on it


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The warnings in `NOISE` dropped while the block runs (export, quantisation, an Inductor compile); others pass."""
    with warnings.catch_warnings():
        for message, module in NOISE:
            warnings.filterwarnings("ignore", message=message, module=module)
        yield


_REEMITTED: dict = {}  # the warnings registry of those `said` raises again: the search quantises many times


@contextlib.contextmanager
def said(notes: list[str]) -> Iterator[None]:
    """Warnings raised while the block runs: torch's and torchao's user / runtime warnings not in `NOISE` appended
    to `notes` (once each), their other ones (deprecations of their own internals) dropped, and the rest (the
    user's model's own) raised again as they were, once per place."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        module = _module_of(w.filename)
        text = " ".join(str(w.message).split())
        if module is None:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_REEMITTED, source=w.source)
        elif issubclass(w.category, (UserWarning, RuntimeWarning)) and \
                not any(text.startswith(m) and re.match(n, module) for m, n in NOISE) and f"{module}: {text}" not in notes:
            notes.append(f"{module}: {text}")


def _module_of(filename: str) -> str | None:
    """"torch._inductor.mkldnn_lowerings" for a file of the installed torch or torchao, else None."""
    import importlib.util

    path = Path(filename).resolve()
    for package in ("torch", "torchao"):
        spec = importlib.util.find_spec(package)
        root = Path(spec.origin).resolve().parent if spec and spec.origin else None
        if root is not None and path.is_relative_to(root):
            return ".".join((package, *path.relative_to(root).with_suffix("").parts))
    return None


def notes_of(module: nn.Module) -> list[str]:
    """What torch / torchao said while `export` or `quantize` made `module` (see `said`)."""
    return list(getattr(module, NOTES_ATTR, None) or [])


def layer_reason(layer: nn.Module) -> str | None:
    if type(layer) not in LAYER_TYPES:
        return f"a subclass ({type(layer).__name__}), whose forward may differ: left in fp32"
    return None


def export(model: nn.Module, example: tuple[torch.Tensor, ...], fixed_batch: bool) -> nn.Module:
    """The model as a torch.export graph module, its batch dimension dynamic unless `fixed_batch`.

    Raises:
        RuntimeError: torch.export cannot capture the model (the message says why).
    """
    shapes = None if fixed_batch else tuple({0: torch.export.Dim.AUTO} for _ in example)
    notes: list[str] = []
    try:
        with said(notes):
            exported = torch.export.export(model, example, dynamic_shapes=shapes).module()
    except Exception as exc:  # noqa: BLE001 - many export errors; all mean "this model does not export"
        raise RuntimeError(f"torch.export cannot capture the model for PT2E: {' '.join(str(exc).split())[:200]}") from None
    setattr(exported, NOTES_ATTR, notes)
    return exported


def quantize(exported: nn.Module, names: list[str], batches: list[tuple[torch.Tensor, ...]]) -> nn.Module:
    """A copy of `exported` with the layers `names` in static int8, calibrated on `batches`."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    notes = notes_of(exported)
    with said(notes):
        quantizer = x86.X86InductorQuantizer()
        config = x86.get_default_x86_inductor_quantization_config()
        for name in names:
            quantizer.set_module_name_qconfig(name, config)
        prepared = prepare_pt2e(copy.deepcopy(exported), quantizer)
        with torch.no_grad():
            for batch in batches:
                prepared(*batch)
        converted = convert_pt2e(prepared)
    setattr(converted, NOTES_ATTR, notes)
    return converted


def save_program(model: nn.Module, example: tuple[torch.Tensor, ...], fixed_batch: bool, path) -> None:
    """Write the quantised graph module as a torch.export program (`torch.export.save`): reloading it gives the same
    graph and the same static scales, without calibrating again."""
    shapes = None if fixed_batch else tuple({0: torch.export.Dim.AUTO} for _ in example)
    tmp = path.with_name(path.stem + ".tmp.pt2")  # torch.export.save logs a warning for a name not ending in .pt2
    with quiet():
        torch.export.save(torch.export.export(model, example, dynamic_shapes=shapes), tmp)
    tmp.replace(path)


def load_program(path) -> nn.Module:
    """The graph module `save_program` wrote.

    Raises:
        RuntimeError: the file is missing or not a torch.export program (the message names it).
    """
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401 - registers the quantized_decomposed ops the graph calls

    try:
        return torch.export.load(path).module()
    except FileNotFoundError:
        raise RuntimeError(f"checkpoint {path} does not exist") from None
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file fails in many ways
        raise RuntimeError(f"checkpoint {path} cannot be read as a torch.export program ({type(exc).__name__})") from None


def quantized_layer_count(model: nn.Module) -> int:
    """How many int8 convolutions / linears a converted graph runs (dequantised int8 weights feeding one)."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return 0
    ops = {"conv2d", "linear"}
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in ops:
            weight = node.args[1] if len(node.args) > 1 else None
            if isinstance(weight, torch.fx.Node) and "dequantize" in str(weight.target):
                count += 1
    return count


class StaticCandidates(Candidates):
    """Each candidate is the exported model with those layers quantised and calibrated anew (not timed per layer)."""

    def __init__(self, exported: nn.Module, batches: list[tuple[torch.Tensor, ...]]):
        self.exported, self.batches = exported, batches

    def model(self, names):
        return quantize(self.exported, names, self.batches)
