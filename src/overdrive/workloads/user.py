"""User workloads: `package.module:factory`, a TorchScript file, or a torch.export .pt2 file.

A factory returns either a `Workload`, or a pair `(model, example_input)` where
`example_input` is a tensor (or tuple of tensors) whose first dimension is the batch. For a
pair, and for saved files, overdrive makes `NUM_SAMPLES` seeded samples of the example's
per-row shape and dtype, and judges candidates by agreement with the fp32 outputs.
"""

from __future__ import annotations

import importlib
import zipfile
from pathlib import Path

import torch
from torch import nn

from overdrive.errors import UserError
from overdrive.workloads.base import Workload, eval_mode, logits_fidelity

NUM_SAMPLES = 64


def _random_like_rows(example: tuple[torch.Tensor, ...], num_rows: int) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(0)
    columns = []
    for tensor in example:
        shape = (num_rows, *tensor.shape[1:])
        if tensor.dtype.is_floating_point:
            columns.append(torch.randn(shape, generator=generator).to(tensor.dtype))
        elif tensor.dtype == torch.bool:
            columns.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            low, high = int(tensor.min()), int(tensor.max()) + 1
            columns.append(torch.randint(low, max(high, low + 1), shape, generator=generator, dtype=tensor.dtype))
    return [tuple(col[i] for col in columns) for i in range(num_rows)]


def workload_from_model(name: str, model: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...]) -> Workload:
    """Wrap a model and one example batch into a Workload with seeded samples of the same shape.

    Args:
        name: the workload name (used for the output folder).
        model: any module whose forward takes the example's tensors positionally and returns a tensor.
        example: a tensor or tuple of tensors, each [B, ...].

    Raises:
        UserError: the example is not tensors, or the model does not run on it or return a tensor.
    """
    example = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    if not example or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in example):
        raise UserError(f"{name}: the example input must be a tensor or tuple of tensors with a batch dimension")
    model = eval_mode(model)
    try:
        with torch.no_grad():
            out = model(*example)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's model
        raise UserError(f"{name}: the model failed on its example input: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{name}: the model must return one tensor [B, ...]; it returned {type(out).__name__}")
    return Workload(
        name=name,
        model=model,
        samples=_random_like_rows(example, NUM_SAMPLES),
        collate=lambda rows: tuple(torch.stack(col) for col in zip(*rows)),
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=max(1, int(example[0].shape[0])),
        real_weights=False,
        description="user model with seeded inputs of its example's shape (speed only)",
    )


def build_from_import_path(spec: str) -> Workload:
    """Import `package.module:factory` and call it with no arguments.

    Raises:
        UserError: the module does not import, the attribute is missing, or the factory
            returns something other than a Workload or a (model, example_input) pair.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UserError(f"{spec!r} is not an import path; expected 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - report whatever the import raised
        raise UserError(f"cannot import {module_name!r} (from {spec!r}): {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{module_name!r} has no callable {attr!r}; expected 'package.module:factory'")
    try:
        made = factory()
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"{spec}() failed: {type(exc).__name__}: {exc}") from exc
    name = attr if attr != "build" else module_name.rsplit(".", 1)[-1]
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return workload_from_model(name, *made)
    raise UserError(f"{spec}() returned {type(made).__name__}; expected an overdrive Workload or a (model, example_input) pair")


def build_from_file(path: Path, *, input_shape: tuple[int, ...] | None, input_dtype: torch.dtype) -> Workload:
    """Load a TorchScript archive (torch.jit.save) or a torch.export program (torch.export.save).

    Args:
        path: the file.
        input_shape: the per-batch input shape [B, ...] for TorchScript, which stores none;
            .pt2 files carry their example inputs.
        input_dtype: dtype of the generated inputs for TorchScript files.

    Raises:
        UserError: the file is missing or is not one of the two formats, or a TorchScript
            file was given without --input-shape.
    """
    if not path.is_file():
        raise UserError(f"{path}: no such file; expected a workload name, an import path or a model file")
    if not zipfile.is_zipfile(path):
        raise UserError(f"{path} is not a model file; expected a TorchScript (.pt) or torch.export (.pt2) archive")
    name = path.stem
    try:
        program = torch.export.load(str(path))
    except Exception:  # noqa: BLE001 - not a torch.export archive; try TorchScript next
        program = None
    if program is not None:
        example_args = getattr(program, "example_inputs", None)
        example = tuple(example_args[0]) if example_args and example_args[0] else None
        if input_shape is not None:
            example = (torch.zeros(input_shape, dtype=input_dtype),)
        if not example:
            raise UserError(f"{path} carries no example inputs; pass --input-shape B,C,H,W (for example)")
        return workload_from_model(name, program.module(), example)
    try:
        model = torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        raise UserError(
            f"{path} is not a model file overdrive can load ({type(exc).__name__}); "
            "expected a TorchScript (.pt) or torch.export (.pt2) archive"
        ) from exc
    if input_shape is None:
        raise UserError(f"{path} is TorchScript, which stores no input shape; pass --input-shape B,C,H,W (for example)")
    return workload_from_model(name, model, torch.zeros(input_shape, dtype=input_dtype))
