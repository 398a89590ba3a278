"""User workloads: `package.module:factory`, a TorchScript file, or a torch.export .pt2 file.

A factory returns either a `Workload`, or a pair `(model, example_input)` where
`example_input` is a tensor (or tuple of tensors) whose first dimension is the batch. For a
pair, and for saved files, overdrive makes `NUM_SAMPLES` seeded samples of the example's
per-row shape and dtype, and judges candidates by agreement with the fp32 outputs.
"""

from __future__ import annotations

import importlib
import warnings
import zipfile
from pathlib import Path

import torch
from torch import nn

from overdrive.core.errors import UserError, one_line
from overdrive.core.workload import Workload, eval_mode, logits_fidelity

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


def _accepts_other_batch_sizes(model: nn.Module, example: tuple[torch.Tensor, ...]) -> bool:
    rows = _random_like_rows(example, example[0].shape[0] + 1)
    try:
        with torch.no_grad():
            model(*(torch.stack(col) for col in zip(*rows)))
    except Exception:  # noqa: BLE001 - a static-shape model (e.g. torch.export without Dim) refuses
        return False
    return True


def workload_from_model(name: str, model: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...]) -> Workload:
    """Wrap a model and one example batch into a Workload with seeded samples of the same shape.

    Args:
        name: the workload name (used for the output folder).
        model: any module whose forward takes the example's tensors positionally and returns
            one tensor [B, ...] with the example's batch size B.
        example: a tensor or tuple of tensors, each [B, ...].

    Raises:
        UserError: the example is not tensors, or the model does not run on it or does not
            return a [B, ...] tensor.
    """
    example = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    if not example or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in example):
        raise UserError(f"{name}: the example input must be a tensor or tuple of tensors with a batch dimension")
    model = eval_mode(model)
    batch = int(example[0].shape[0])
    try:
        with torch.no_grad():
            out = model(*example)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's model
        raise UserError(f"{name}: the model failed on its example input of shape {tuple(example[0].shape)}: {one_line(exc)}") from None
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{name}: the model must return one tensor [B, ...]; it returned {type(out).__name__}")
    if out.dim() == 0 or out.shape[0] != batch:
        raise UserError(f"{name}: the model must return a tensor [B, ...] with B = {batch} rows; it returned shape {tuple(out.shape)}")
    fixed = None if _accepts_other_batch_sizes(model, example) else batch
    return Workload(
        name=name,
        model=model,
        samples=_random_like_rows(example, NUM_SAMPLES),
        collate=lambda rows: tuple(torch.stack(col) for col in zip(*rows)),
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=batch,
        fixed_batch_size=fixed,
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
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - report whatever the import raised, sys.exit too
        raise UserError(f"cannot import {module_name!r} (from {spec!r}): {one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{module_name!r} has no callable {attr!r}; expected 'package.module:factory'")
    try:
        made = factory()
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise UserError(f"{spec}() failed: {one_line(exc)}") from None
    name = attr if attr != "build" else module_name.rsplit(".", 1)[-1]
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return workload_from_model(name, *made)
    raise UserError(f"{spec}() returned {type(made).__name__}; expected an overdrive Workload or a (model, example_input) pair")


def archive_kind(path: Path) -> str:
    """'export' (torch.export.save), 'torchscript' (torch.jit.save), 'pickle' (torch.save) or 'unknown'."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return "unknown"
    if any(n.endswith("/archive_format") or "/models/" in n for n in names):
        return "export"
    if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    if any(n.endswith("/data.pkl") for n in names):
        return "pickle"
    return "unknown"


def build_from_file(path: Path, *, input_shape: tuple[int, ...] | None, input_dtype: torch.dtype) -> Workload:
    """Load a torch.export program (torch.export.save, .pt2) or a TorchScript archive (torch.jit.save).

    Args:
        path: the file.
        input_shape: the input shape [B, ...]; needed for TorchScript, which stores none;
            .pt2 files carry their example inputs.
        input_dtype: dtype of the generated inputs when `input_shape` is given.

    Raises:
        UserError: the file is missing, a folder, not one of the two formats, or a TorchScript
            file was given without --input-shape.
    """
    if path.is_dir():
        raise UserError(f"{path} is a folder; expected a model file (.pt2 from torch.export.save, .pt from torch.jit.save)")
    if not path.is_file():
        raise UserError(f"{path}: no such file; expected a workload name, an import path or a model file")
    kind = archive_kind(path)
    name = path.stem
    if kind == "pickle":
        raise UserError(f"{path} is a torch.save checkpoint (weights or a pickled module), which carries no graph; "
                        "save the model with torch.export.save (.pt2) or torch.jit.save, or give a factory")
    if kind == "unknown":
        raise UserError(f"{path} is not a model file; expected a torch.export (.pt2) or TorchScript (.pt) archive")
    if kind == "export":
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"{path}: torch.export.load failed: {one_line(exc)}") from None
        example_args = getattr(program, "example_inputs", None)
        example = tuple(example_args[0]) if example_args and example_args[0] else None
        if input_shape is not None:
            example = (torch.zeros(input_shape, dtype=input_dtype),)
        if not example:
            raise UserError(f"{path} carries no example inputs; pass --input-shape B,C,H,W (for example)")
        return workload_from_model(name, program.module(), example)
    if input_shape is None:
        raise UserError(f"{path} is TorchScript, which stores no input shape; pass --input-shape B,C,H,W (for example)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        try:
            model = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise UserError(f"{path}: torch.jit.load failed: {one_line(exc)}") from None
    return workload_from_model(name, model, torch.zeros(input_shape, dtype=input_dtype))
