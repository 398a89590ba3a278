"""User workloads: `package.module:factory`, a TorchScript file, or a torch.export .pt2 file.

A factory returns either a `Workload`, or a pair `(model, example_input)` where
`example_input` is a tensor (or tuple of tensors) whose first dimension is the batch. For a
pair, and for saved files, candidates are judged by agreement with the fp32 outputs on real
rows: the rows of `data` when given, else the rows of the example itself (a .pt2 file carries
the example it was exported with); of 100 or more (and no `metric`), the last fifth is kept apart
for calibration and recovery, never judged (`overdrive.workloads.data.hold_out`). Only when the
example is a placeholder (every value the same, as the zeros made from a TorchScript file's
`input_shape`) are `NUM_SAMPLES` seeded random rows of its shape used, and the table says that
fidelity is then on random inputs, shape only.
"""

from __future__ import annotations

import contextlib
from functools import partial
import copy
import importlib
import os
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from overdrive.core.errors import ConfigError, WorkloadError, arg, one_line
from overdrive.core.graph_ops import is_graph_program, to_eval_ops, training_mode_modules, training_mode_ops
from overdrive.core.input_limits import InputLimits, derive_input_limits
from overdrive.core.workload import Workload, eval_mode, judged_figure, logits_fidelity, pad_stack
from overdrive.workloads.data import hold_out
from overdrive.workloads.signature import (
    SignatureModel,
    choose_outputs,
    cut_padding,
    model_call_kwargs,
    row_size,
    describe_dims,
    detect_dynamic_dims,
    normalize_dims,
    padding_check,
    is_tokenizer,
    outputs_fidelity,
    pick_output,
    split_example,
    text_workload,
)
from overdrive.workloads.structured import OutputLayout

NUM_SAMPLES = 64


def _random_like_rows(example: tuple[torch.Tensor, ...], num_rows: int,
                      ranges: dict[int, tuple[int, int]] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """Seeded rows of the example's per-row shapes and dtypes: N(0, 1) floats, 0/1 booleans, and
    integers in `ranges[i]` = [low, high) for input i when known (the ids an embedding takes), else
    uint8 over 0..255 and other integers over the example's own values."""
    generator = torch.Generator().manual_seed(0)
    columns = []
    for i, tensor in enumerate(example):
        shape = (num_rows, *tensor.shape[1:])
        if tensor.dtype.is_floating_point:
            columns.append(torch.randn(shape, generator=generator).to(tensor.dtype))
        elif tensor.dtype == torch.bool:
            columns.append(torch.randint(0, 2, shape, generator=generator).bool())
        else:
            if ranges and i in ranges:
                low, high = ranges[i]
            elif tensor.dtype == torch.uint8:
                low, high = 0, 256
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


@contextlib.contextmanager
def _eval_for_probes(model: nn.Module):
    """Eval mode while the probes run, then every submodule's own mode back: the caller's model is
    not changed (a training script that goes on with it keeps its dropout)."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        eval_mode(model)
        yield model
    finally:
        for m, training in modes:
            m.training = training


def _is_placeholder(example: tuple[torch.Tensor, ...]) -> bool:
    """True when every tensor of the example holds one value throughout (zeros from a shape): no real rows."""
    return all(t.numel() == 0 or bool((t.reshape(-1) == t.reshape(-1)[0]).all()) for t in example)


def _eval_graph(name: str, model: nn.Module, *, owned: bool) -> tuple[nn.Module, list[str]]:
    """A torch.export program exported in train mode, with its dropout and batch-norm ops switched to
    eval mode (a copy unless `owned`), and the note that says so; other models as they are.

    Raises:
        WorkloadError: training-mode ops that cannot be switched (the message names them).
    """
    if not is_graph_program(model) or not training_mode_ops(model):
        return model, []
    model = model if owned else copy.deepcopy(model)
    try:
        found = to_eval_ops(model)
    except RuntimeError as exc:
        raise WorkloadError(f"{name}: the program was exported in training mode ({', '.join(training_mode_ops(model))}) "
                            f"and {exc}") from None
    return model, [f"the program was exported in training mode ({', '.join(found)}): its outputs change from call to "
                   "call; overdrive switched those ops to eval mode (dropout off, batch norm on its running statistics), "
                   "as model.eval() would before torch.export"]


def workload_from_model(name: str, model: nn.Module, example: torch.Tensor | tuple[torch.Tensor, ...], *,
                        data: Iterable | None = None, metric: Callable[[torch.Tensor], float] | None = None,
                        owned: bool = False, output: str | list[str] | None = None,
                        dynamic_dims: dict | None = None) -> Workload:
    """Wrap a model and one example batch into a Workload judged on real rows: those of `data` when
    given, else the example's own rows; seeded random rows of the example's shape and dtype only
    when the example is a placeholder (one value throughout), which the workload then says. Of 100
    or more real rows, the last fifth are the training rows (calibration for int8, pruning's
    recovery), never judged, as with `optimize --data` (`overdrive.workloads.data.hold_out`);
    not with a `metric`, which scores every row of `data`.

    The model is measured in eval mode; the caller's module is not changed (copies are put in eval
    mode when built). A torch.export program exported in train mode has its dropout and batch-norm
    ops switched to eval mode (on a copy unless `owned`), and `notes` says so.

    Args:
        name: the workload name (used for the output folder).
        model: any module whose forward takes the example's tensors (by keyword for a dict) and
            returns a tensor, tuple, dict, dataclass or ModelOutput holding floating [B, ...]
            tensors with the example's batch size B.
        example: a tensor, a tuple of tensors or a dict of keyword tensors, each [B, ...].
        data: evaluation batches, each shaped like `example` (a tensor, a tuple of tensors with the
            same first dimension, or for a dict example a dict with its keys, as a tokenizer returns
            it); their rows, in order, are the samples.
        metric: a task score of the model's outputs on all rows of `data`, float32 [N, ...] in
            data order -> float, higher is better (e.g. accuracy in percent, closing over your
            labels); `max_accuracy_drop` budgets it in its own units.
        owned: the model was loaded by overdrive (a file), so it may be changed in place.
        output: the output(s) judged, by path ("logits", "0"); None: every floating [B, ...] one
            (`overdrive.workloads.signature.choose_outputs`).
        dynamic_dims: dimensions whose size varies from row to row, {"input_ids": {1: "seq"}} or
            {input index: [dims]}; rows are zero-padded there per batch, after checking that padding
            leaves the answers unchanged. None: found by calling the model at two sizes (inputs
            with integer ids only); {}: none.

    Raises:
        WorkloadError: the example or data are not tensors of one layout, the model does not
            run on the example or does not return a [B, ...] tensor, or it was exported in train
            mode with ops that cannot be switched to eval mode.
        ConfigError: a `metric` without `data`.
    """
    example, input_names = split_example(name, example)
    model, notes = _eval_graph(name, model, owned=owned)
    if not is_graph_program(model) and training_mode_modules(model):
        notes.append(f"the model is in training mode ({len(training_mode_modules(model))} dropout / batch-norm layers, "
                     "e.g. " + ", ".join(training_mode_modules(model)[:3]) + "): overdrive measures copies in eval mode; "
                     "your module is not changed")
    batch = int(example[0].shape[0])
    user_model, output_names, widths = model, None, None
    with _eval_for_probes(user_model):
        try:
            with torch.no_grad():
                out = model(**dict(zip(input_names, example))) if input_names else model(*example)
        except Exception as exc:  # noqa: BLE001 - any failure here is the user's model
            shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in zip(input_names or [""] * len(example), example))
            raise WorkloadError(f"{name}: the model failed on its example input ({shapes.strip()}): {one_line(exc)}") from None
        dims = normalize_dims(name, dynamic_dims, example, input_names)
        varying: set[str] = set()
        if dims:
            varying, problem = padding_check(model, input_names, example, dims)
            if problem:
                raise WorkloadError(f"{name}: {arg('dynamic_dims')} ({describe_dims(dims, input_names)}): {problem}")
        elif dynamic_dims is None and not _is_placeholder(example):
            dims, varying, size_notes = detect_dynamic_dims(model, input_names, example, out)
            notes += size_notes
            if dims:
                notes.append(f"{describe_dims(dims, input_names)} vary from row to row (found by calling the model at two "
                             "sizes; zero padding leaves its answers unchanged): rows of any size there are taken and "
                             "padded per batch; pass dynamic_dims={} to hold them fixed")
        if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[0] == batch and out.dtype.is_floating_point \
                and input_names is None and output is None and not varying:
            pass  # the model already has overdrive's form: positional inputs, one tensor [B, ...]
        elif isinstance(out, torch.Tensor) and (out.dim() == 0 or out.shape[0] != batch):
            raise WorkloadError(f"{name}: the model must return a tensor [B, ...] with B = {batch} rows; it returned "
                                f"shape {tuple(out.shape)}")
        else:
            output_names, output_notes = choose_outputs(name, out, batch, output, varying)
            notes += output_notes
            widths = [pick_output(out, p)[0].numel() for p in output_names]
            fidelity = outputs_fidelity(widths) if len(output_names) > 1 else logits_fidelity
            call_kwargs = model_call_kwargs(model, output_names)
            if call_kwargs:
                notes.append("the model is called with use_cache=False: no judged output is its KV cache (past_key_values), "
                             "so it is not built, here or in the plan's model")
            model = SignatureModel(model, input_names, output_names, layout=OutputLayout.of(out, output_names),
                                   call_kwargs=call_kwargs)
        fixed = None if _accepts_other_batch_sizes(model, example) else batch
        placeholder = data is None and _is_placeholder(example)
        limits = derive_input_limits(model, example) if data is not None or placeholder else None
    # A Hugging Face model's position table bounds its sequence length: longer rows are refused, not run.
    positions = getattr(getattr(user_model, "config", None), "max_position_embeddings", None)
    max_size = positions if dims and isinstance(positions, int) and positions > 0 else None
    if metric is not None and data is None:
        raise ConfigError(f"{arg('metric')} scores the outputs on {arg('data')}; give the evaluation batches too")
    train = None
    if data is not None:
        samples, source = _rows_of(name, data, example, limits, dims, input_names), "data"
    elif not placeholder:
        samples, source = [tuple(t[r].detach().cpu() for t in example) for r in range(batch)], "example"
    else:
        ranges = {r.input: (r.low, r.high) for r in limits.ranges} if limits else {}
        samples, source = _random_like_rows(example, NUM_SAMPLES, ranges), "random"
        unknown = [i for i, t in enumerate(example) if not t.dtype.is_floating_point and t.dtype not in (torch.bool, torch.uint8)
                   and i not in ranges]
        if unknown:
            notes.append(f"integer input(s) {unknown} of the placeholder example hold one value and index no embedding "
                         "overdrive could see, so their random rows hold that value only; pass data for real rows")
    row_length = None
    if dims:
        samples, cut = cut_padding(samples, dims, input_names)
        if cut:
            notes.append(f"{cut} of {len(samples)} rows were cut to the length their attention_mask gives (right padding) "
                         "and are padded per batch, as rows of other lengths are")
        first = min(dims)
        row_length = partial(row_size, first, dims[first][0])
    if source != "random" and metric is None:  # real rows, 100+: a fifth for calibration, never judged, as `with_data`
        samples, train, held_notes = hold_out(samples, "your" if source == "data" else "your example's")
        notes += held_notes
    return Workload(
        name=name,
        model=model,
        samples=samples,
        train_samples=train,
        collate=partial(pad_stack, dims, max_size=max_size) if dims else stack_rows,
        dynamic_dims=dims,
        row_length=row_length,
        fidelity=fidelity if output_names else logits_fidelity,
        input_names=input_names,
        output_names=output_names,
        fidelity_key=judged_figure(widths or [out[0].numel()]),
        default_batch_size=batch,
        fixed_batch_size=fixed,
        metric=metric,
        real_weights=True,
        rows_source=source,
        notes=notes,
        extra={"classifier": output_names == ["logits"], "output_widths": widths if output_names else None,
               "max_dynamic_size": max_size},  # a Hugging Face classifier's ModelOutput: `run` adds predictions
        description={"data": "user model on its own evaluation data", "example": "user model on its example's rows",
                     "random": "user model with seeded inputs of its example's shape (speed only)"}[source],
    )


def stack_rows(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Samples that are tuples of row tensors -> the model's inputs, each [B, ...]."""
    return tuple(torch.stack(col) for col in zip(*rows))


def _rows_of(name: str, data: Iterable, example: tuple[torch.Tensor, ...],
             limits: InputLimits | None = None, dims: dict[int, tuple[int, ...]] | None = None,
             names: list[str] | None = None) -> list[tuple[torch.Tensor, ...]]:
    """The rows of evaluation batches `data` as samples (tuples of row tensors, detached, on the CPU).

    Raises:
        WorkloadError: a batch that is not laid out like the example, a row outside the model's
            `limits` (an id past an embedding's rows, a NaN), or no rows at all.
    """
    rows: list[tuple[torch.Tensor, ...]] = []
    for i, batch in enumerate(data):
        if isinstance(batch, Mapping):  # a dict batch (a tokenizer's BatchEncoding): the example's keys, in its order
            if not names or any(n not in batch for n in names):
                raise WorkloadError(f"{name}: batch {i} of {arg('data')} has keys {sorted(map(str, batch))}; expected "
                                    + (f"{names}, the example's" if names else "tensors by position, as the example"))
            batch = tuple(batch[n] for n in names)
        batch = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        if len(batch) != len(example) or not all(isinstance(t, torch.Tensor) for t in batch):
            raise WorkloadError(f"{name}: batch {i} of {arg('data')} is not {len(example)} tensor(s) like the example")
        for j, (t, e) in enumerate(zip(batch, example)):
            fixed = [d for d in range(1, e.dim()) if d not in (dims or {}).get(j, ())]
            if t.dim() != e.dim() or t.shape[0] != batch[0].shape[0] or t.dtype != e.dtype or \
                    any(t.shape[d] != e.shape[d] for d in fixed):
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


_CALLED: dict[str, tuple[object, str]] = {}  # a factory's result kept for the next call (see `call_factory`)


def call_factory(spec: str, *, keep: bool = False) -> tuple[object, str]:
    """Import `package.module:factory`, call it with no arguments: (what it returned, the workload's name: the
    factory's, or its module's for one named `build`). `keep`: the result is also kept for the next call with
    this spec, which takes it instead of calling again (a command that looks at what a factory makes before
    choosing its path builds the model once).

    Raises:
        WorkloadError: the module does not import, the attribute is missing or not callable, the factory fails.
    """
    if spec in _CALLED:
        return _CALLED.pop(spec)
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise WorkloadError(f"{spec!r} is not an import path; expected 'package.module:factory'")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` and uvicorn: the current folder imports
        sys.path.insert(0, os.getcwd())
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
    result = (made, factory_name(spec))
    if keep:
        _CALLED[spec] = result
    return result


def factory_name(spec: str) -> str:
    """The workload's name for `package.module:factory`: the factory's, or its module's for one named `build`."""
    module_name, _, attr = spec.partition(":")
    return attr if attr != "build" else module_name.rsplit(".", 1)[-1]


def build_from_import_path(spec: str, *, dynamic_dims: dict | None = None) -> Workload:
    """Import `package.module:factory` and call it with no arguments.

    Raises:
        WorkloadError: the module does not import, the attribute is missing, or the factory
            returns something other than a Workload or a (model, example_input) pair.
    """
    made, name = call_factory(spec)
    if dynamic_dims and not (isinstance(made, tuple) and len(made) == 2 and not is_tokenizer(made[1])):
        raise ConfigError(f"{arg('dynamic_dims')} applies to a (model, example) factory; {spec}() brings its own rows "
                          "(a Workload, or a tokenizer that pads)")
    if isinstance(made, Workload):
        return made
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        if len(made) == 2 and is_tokenizer(made[1]) and not isinstance(made[1], (dict, tuple, list)):
            return text_workload(name, made[0], made[1])
        if len(made) == 3 and is_tokenizer(made[2]):  # (model, example, tokenizer): the tokenizer makes the rows
            return text_workload(name, made[0], made[2])
        if len(made) == 2:
            return workload_from_model(name, *made, dynamic_dims=dynamic_dims)
    raise WorkloadError(f"{spec}() returned {type(made).__name__}; expected an overdrive Workload, a (model, "
                        "example_input) pair, or (model, tokenizer) / (model, example_input, tokenizer)")


def check_archive(path: Path) -> None:
    """Read every member of a zip archive (torch.export, TorchScript and torch.save files are zips)
    and verify its CRC-32, so a damaged file is refused instead of loading with wrong weights.

    Raises:
        WorkloadError: a member fails its CRC check or cannot be decompressed (the message names it).
    """
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as exc:
        raise WorkloadError(f"{path} is damaged: {one_line(exc)}; export or copy it again") from None
    if bad is not None:
        raise WorkloadError(f"{path} is damaged: its member {bad!r} fails the zip CRC-32 check (a truncated or corrupted "
                            "copy?); export or copy it again")


def archive_kind(path: Path) -> str:
    """'export' (torch.export.save), 'torchscript' (torch.jit.save), 'pickle' (torch.save) or 'unknown'."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        return "unknown"
    # By the layout under the archive's top folder, not by substrings: a TorchScript torchvision
    # model holds `code/__torch__/torchvision/models/...`, which is not torch.export's `models/`.
    top = [n.split("/")[1:] for n in names if n.count("/") >= 1]
    if any(p[0] == "constants.pkl" for p in top if len(p) == 1) and any(p[0] == "code" for p in top if len(p) > 1):
        return "torchscript"
    if any(p == ["archive_format"] or (len(p) == 2 and p[0] == "models" and p[1].endswith(".json")) for p in top):
        return "export"
    if any(p == ["data.pkl"] for p in top):
        return "pickle"
    return "unknown"


def build_from_file(path: Path, *, input_shape: tuple[int, ...] | None, input_dtype: torch.dtype,
                    dynamic_dims: dict | None = None) -> Workload:
    """Load a torch.export program (torch.export.save, .pt2) or a TorchScript archive (torch.jit.save).

    Args:
        path: the file.
        input_shape: the input shape [B, ...]; needed for TorchScript, which stores none;
            .pt2 files carry their example inputs.
        input_dtype: dtype of the generated inputs when `input_shape` is given.

    Raises:
        WorkloadError: the file is missing, a folder, not one of the two formats, damaged (a member
            fails its CRC check), or a TorchScript file was given without `input_shape`.
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
        raise WorkloadError(f"{path} is not a model file (not a zip archive, or its zip directory is damaged); expected a "
                            "torch.export (.pt2) or TorchScript (.pt) archive")
    check_archive(path)
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
        return workload_from_model(name, program.module(), example, owned=True, dynamic_dims=dynamic_dims)
    if input_shape is None:
        raise WorkloadError(f"{path} is TorchScript, which stores no input shape; pass {arg('input_shape', 'B,C,H,W')} "
                            "(for example)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated in favour of torch.export
        try:
            model = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:  # noqa: BLE001
            raise WorkloadError(f"{path}: torch.jit.load failed: {one_line(exc)}") from None
    return workload_from_model(name, model, torch.zeros(input_shape, dtype=input_dtype), owned=True,
                               dynamic_dims=dynamic_dims)
