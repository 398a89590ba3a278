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
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from overdrive.core.errors import ConfigError, WorkloadError, arg, one_line
from overdrive.core.input_limits import InputLimits, derive_input_limits
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


def workload_from_model(name: str, model: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...], *,
                        data: Iterable | None = None, metric: Callable[[torch.Tensor], float] | None = None) -> Workload:
    """Wrap a model and one example batch into a Workload: judged on the rows of `data` when
    given, else on seeded samples of the example's shape and dtype (speed only).

    Args:
        name: the workload name (used for the output folder).
        model: any module whose forward takes the example's tensors positionally and returns
            one tensor [B, ...] with the example's batch size B. It is put in eval mode.
        example: a tensor or tuple of tensors, each [B, ...].
        data: evaluation batches, each shaped like `example` (a tensor, or a tuple of tensors
            with the same first dimension); their rows, in order, are the samples.
        metric: a task score of the model's outputs on all rows of `data`, float32 [N, ...] in
            data order -> float, higher is better (e.g. accuracy in percent, closing over your
            labels); `max_accuracy_drop` budgets it in its own units.

    Raises:
        WorkloadError: the example or data are not tensors of one layout, or the model does not
            run on the example or does not return a [B, ...] tensor.
        ConfigError: a `metric` without `data`.
    """
    example = (example,) if isinstance(example, torch.Tensor) else tuple(example)
    if not example or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in example):
        raise WorkloadError(f"{name}: the example input must be a tensor or tuple of tensors with a batch dimension")
    model = eval_mode(model)
    batch = int(example[0].shape[0])
    try:
        with torch.no_grad():
            out = model(*example)
    except Exception as exc:  # noqa: BLE001 - any failure here is the user's model
        raise WorkloadError(f"{name}: the model failed on its example input of shape {tuple(example[0].shape)}: {one_line(exc)}") from None
    if not isinstance(out, torch.Tensor):
        raise WorkloadError(f"{name}: the model must return one tensor [B, ...]; it returned {type(out).__name__}")
    if out.dim() == 0 or out.shape[0] != batch:
        raise WorkloadError(f"{name}: the model must return a tensor [B, ...] with B = {batch} rows; it returned shape {tuple(out.shape)}")
    fixed = None if _accepts_other_batch_sizes(model, example) else batch
    if metric is not None and data is None:
        raise ConfigError(f"{arg('metric')} scores the outputs on {arg('data')}; give the evaluation batches too")
    limits = derive_input_limits(model, example) if data is not None else None
    samples = _rows_of(name, data, example, limits) if data is not None else _random_like_rows(example, NUM_SAMPLES)
    return Workload(
        name=name,
        model=model,
        samples=samples,
        collate=stack_rows,
        fidelity=logits_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=batch,
        fixed_batch_size=fixed,
        metric=metric,
        real_weights=data is not None,
        description=("user model on its own evaluation data" if data is not None
                     else "user model with seeded inputs of its example's shape (speed only)"),
    )


def stack_rows(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Samples that are tuples of row tensors -> the model's inputs, each [B, ...]."""
    return tuple(torch.stack(col) for col in zip(*rows))


def _rows_of(name: str, data: Iterable, example: tuple[torch.Tensor, ...],
             limits: InputLimits | None = None) -> list[tuple[torch.Tensor, ...]]:
    """The rows of evaluation batches `data` as samples (tuples of row tensors, detached, on the CPU).

    Raises:
        WorkloadError: a batch that is not laid out like the example, a row outside the model's
            `limits` (an id past an embedding's rows, a NaN), or no rows at all.
    """
    rows: list[tuple[torch.Tensor, ...]] = []
    for i, batch in enumerate(data):
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        if len(batch) != len(example) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise WorkloadError(f"{name}: batch {i} of {arg('data')} is not {len(example)} tensor(s) like the example")
        for t, e in zip(batch, example):
            if t.dim() != e.dim() or t.shape[0] != batch[0].shape[0] or t.dtype != e.dtype:
                raise WorkloadError(f"{name}: batch {i} of {arg('data')} holds {t.dtype} {list(t.shape)}; expected rows "
                                    f"like the example's {e.dtype} {list(e.shape)} and one first dimension")
        columns = [t.detach().cpu() for t in batch]
        problems = limits.row_problems(columns) if limits else {}
        if problems:
            row, reason = min(problems.items())
            raise WorkloadError(f"{name}: batch {i} of {arg('data')}, row {row}: {reason}; a compiled model given it could "
                                "abort the process, so remove or fix that row")
        rows += [tuple(col[r] for col in columns) for r in range(batch[0].shape[0])]
    if not rows:
        raise WorkloadError(f"{name}: {arg('data')} holds no rows")
    return rows


def build_from_import_path(spec: str) -> Workload:
    """Import `package.module:factory` and call it with no arguments.

    Raises:
        WorkloadError: the module does not import, the attribute is missing, or the factory
            returns something other than a Workload or a (model, example_input) pair.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise WorkloadError(f"{spec!r} is not an import path; expected 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - report whatever the import raised, sys.exit too
        raise WorkloadError(f"cannot import {module_name!r} (from {spec!r}): {one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(f"{module_name!r} has no callable {attr!r}; expected 'package.module:factory'")
    try:
        made = factory()
    except (Exception, SystemExit) as exc:  # noqa: BLE001
        raise WorkloadError(f"{spec}() failed: {one_line(exc)}") from None
    name = attr if attr != "build" else module_name.rsplit(".", 1)[-1]
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        return workload_from_model(name, *made)
    raise WorkloadError(f"{spec}() returned {type(made).__name__}; expected an overdrive Workload or a (model, example_input) pair")


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
        WorkloadError: the file is missing, a folder, not one of the two formats, or a TorchScript
            file was given without `input_shape`.
    """
    if path.is_dir():
        raise WorkloadError(f"{path} is a folder; expected a model file (.pt2 from torch.export.save, .pt from torch.jit.save)")
    if not path.is_file():
        raise WorkloadError(f"{path}: no such file; expected a workload name, an import path or a model file")
    kind = archive_kind(path)
    name = path.stem
    if kind == "pickle":
        raise WorkloadError(f"{path} is a torch.save checkpoint (weights or a pickled module), which carries no graph; "
                        "save the model with torch.export.save (.pt2) or torch.jit.save, or give a factory")
    if kind == "unknown":
        raise WorkloadError(f"{path} is not a model file; expected a torch.export (.pt2) or TorchScript (.pt) archive")
    if kind == "export":
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # noqa: BLE001
            raise WorkloadError(f"{path}: torch.export.load failed: {one_line(exc)}") from None
        example_args = getattr(program, "example_inputs", None)
        example = tuple(example_args[0]) if example_args and example_args[0] else None
        if input_shape is not None:
            example = (torch.zeros(input_shape, dtype=input_dtype),)
        if not example:
            raise WorkloadError(f"{path} carries no example inputs; pass {arg('input_shape', 'B,C,H,W')} (for example)")
        return workload_from_model(name, program.module(), example)
    if input_shape is None:
        raise WorkloadError(f"{path} is TorchScript, which stores no input shape; pass {arg('input_shape', 'B,C,H,W')} "
                            "(for example)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        try:
            model = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise WorkloadError(f"{path}: torch.jit.load failed: {one_line(exc)}") from None
    return workload_from_model(name, model, torch.zeros(input_shape, dtype=input_dtype))
