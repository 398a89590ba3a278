"""Static int8 of chosen layers through PT2E (torchao's `prepare_pt2e` / `convert_pt2e` with
`X86InductorQuantizer`), for `mixed-int8-static` on the CPU.

The model is exported with torch.export (batch dimension dynamic), the chosen nn.Conv2d / nn.Linear
layers are annotated with the quantizer's default static recipe (int8 activations per tensor with
scales calibrated on the training rows, int8 weights per channel), and the converted graph holds
quantize / dequantize pairs around them. Run eagerly it computes int8 numerics in fp32 (what the
search measures); compiled by Inductor with `freezing` on, the pairs become oneDNN int8 convolution
and linear kernels. Static scales are constants, so a row's output does not depend on its batch-mates.
Calibration is deterministic: the same rows give the same scales, so a plan rebuilds the same model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from overdrive.techniques.precision.sensitivity import Candidates

LAYER_TYPES = (nn.Linear, nn.Conv2d)


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
    try:
        return torch.export.export(model, example, dynamic_shapes=shapes).module()
    except Exception as exc:  # noqa: BLE001 - many export errors; all mean "this model does not export"
        raise RuntimeError(f"torch.export cannot capture the model for PT2E: {' '.join(str(exc).split())[:200]}") from None


def quantize(exported: nn.Module, names: list[str], batches: list[tuple[torch.Tensor, ...]]) -> nn.Module:
    """A copy of `exported` with the layers `names` in static int8, calibrated on `batches`."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    quantizer = x86.X86InductorQuantizer()
    config = x86.get_default_x86_inductor_quantization_config()
    for name in names:
        quantizer.set_module_name_qconfig(name, config)
    prepared = prepare_pt2e(copy.deepcopy(exported), quantizer)
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return convert_pt2e(prepared)


def save_program(model: nn.Module, example: tuple[torch.Tensor, ...], fixed_batch: bool, path) -> None:
    """Write the quantised graph module as a torch.export program (`torch.export.save`): reloading it gives the same
    graph and the same static scales, without calibrating again."""
    shapes = None if fixed_batch else tuple({0: torch.export.Dim.AUTO} for _ in example)
    tmp = path.with_suffix(".tmp")
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
