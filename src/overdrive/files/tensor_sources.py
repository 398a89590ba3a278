"""Record sources of tensor models for `overdrive run` (and `--data`): `.npy` [N, *row], `.npz` with
an array per model input, `.jsonl` with a field per input (see `overdrive.files.inputs` for the text
and image sources and `open_source`). Inputs are named as `serve` names them (`input_names`);
sizes that vary from row to row (`Workload.dynamic_dims`) are -1 in a row spec, checked ≥ 1."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from overdrive.core.errors import DataError
from overdrive.files.inputs import RecordError, RecordSource, ByteRecords, json_object, line_offsets


class NpySource(RecordSource):
    """Rows of a .npy array [N, *row], memory-mapped; row i is record i, as the model's dtype.

    Raises:
        DataError: not a readable .npy file, or rows of another shape than `row_shape`.
    """

    format = "npy"
    kind = "tensor"

    def __init__(self, path: Path, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.path = path
        try:
            self.array = np.load(path, mmap_mode="r", allow_pickle=False)
        except EOFError:
            raise DataError(f"{path}: holds no records (the file is empty)") from None
        except (ValueError, OSError) as exc:
            raise DataError(f"{path}: not a readable .npy array ({exc})") from None
        if self.array.ndim < 1 or not _fits(self.array.shape[1:], row_shape):
            raise DataError(f"{path}: array of shape {list(self.array.shape)}; this model takes rows of shape "
                            f"{_describe_shape(row_shape)}, i.e. an array [N, {_describe_shape(row_shape)[1:]}")
        if self.array.dtype.kind not in "biuf":
            raise DataError(f"{path}: array of dtype {self.array.dtype}; expected a numeric array")
        self.dtype = dtype

    def __len__(self) -> int:
        return int(self.array.shape[0])

    def source_key(self, i: int) -> str:
        return f"{self.path.name}[{i}]"

    def read(self, i: int) -> torch.Tensor:
        return _cast_row(torch.from_numpy(np.array(self.array[i])), self.dtype)

    def __getstate__(self):  # workers re-open the memory map rather than pickling the data
        return {k: v for k, v in self.__dict__.items() if k != "array"} | {"array": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.array = np.load(self.path, mmap_mode="r", allow_pickle=False)


def _cast_row(row: torch.Tensor, dtype: torch.dtype, name: str = "row") -> torch.Tensor:
    """`row` as the model input's dtype; RecordError for NaN/inf or a value the dtype cannot hold exactly."""
    if not torch.isfinite(row.float()).all():
        raise RecordError(f"{name} holds NaN or infinite values")
    cast = row.to(dtype)
    if not dtype.is_floating_point and not torch.equal(cast.to(row.dtype), row):  # 3.5 -> 3, 2**40 -> int32
        bad = row.reshape(-1)[(cast.to(row.dtype) != row).reshape(-1)][0].item()
        raise RecordError(f"{name} holds {bad}, which the model's {str(dtype).removeprefix('torch.')} input cannot hold exactly")
    return cast


def input_names(workload) -> list[str]:
    """The names of a tensor workload's inputs, as `serve` and `run` spell them: the model's keywords
    (`input_ids`, `attention_mask`) when it has them, else `input`, or `input__0`, `input__1`, ..."""
    sample = workload.samples[0]
    count = len(sample) if isinstance(sample, tuple) else 1
    return list(workload.input_names or (["input"] if count == 1 else [f"input__{i}" for i in range(count)]))


def row_specs(workload) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Per input: its row shape, with -1 where the size varies from row to row (`Workload.dynamic_dims`),
    and its dtype."""
    sample = workload.samples[0]
    dims = getattr(workload, "dynamic_dims", {}) or {}
    return [(tuple(-1 if d in dims.get(i, ()) else n for d, n in enumerate(c.shape, start=1)), c.dtype)
            for i, c in enumerate(sample if isinstance(sample, tuple) else (sample,))]


def _fits(shape: Sequence[int], want: Sequence[int]) -> bool:
    """A row shape against a spec with -1 for sizes that vary (≥ 1)."""
    return len(shape) == len(want) and all(w in (-1, n) and n >= 1 for n, w in zip(shape, want))


def _describe_shape(want: Sequence[int]) -> str:
    return "[" + ", ".join("any" if n == -1 else str(n) for n in want) + "]"


class NpzSource(RecordSource):
    """A .npz archive with one array [N, *row] per model input, named as the inputs are (see
    `input_names`); record i is the tuple of row i of each (a lone tensor for one input).

    Raises:
        DataError: not a readable .npz, an input's array missing, rows of another shape, or arrays
            of different lengths.
    """

    format = "npz"
    kind = "tensor"

    def __init__(self, path: Path, names: list[str], specs: list[tuple[tuple[int, ...], torch.dtype]]):
        self.path, self.names, self.specs = path, names, specs
        try:
            archive = np.load(path, allow_pickle=False)
        except EOFError:
            raise DataError(f"{path}: holds no records (the file is empty)") from None
        except (ValueError, OSError) as exc:
            raise DataError(f"{path}: not a readable .npz archive ({exc})") from None
        if len(names) == 1 and names[0] not in archive.files and len(archive.files) == 1:
            names = self.names = [archive.files[0]]  # one input, one array: its name does not matter
        missing = [n for n in names if n not in archive.files]
        if missing:
            raise DataError(f"{path}: no array {missing[0]!r}; this model takes arrays {names} (one per input, named as "
                            f"its inputs), the archive holds {archive.files}")
        self.arrays = [archive[n] for n in names]
        for n, a, (shape, _) in zip(names, self.arrays, specs):
            if a.ndim < 1 or not _fits(a.shape[1:], shape):
                raise DataError(f"{path}: array {n!r} of shape {list(a.shape)}; this model takes rows of shape "
                                f"{_describe_shape(shape)}, i.e. an array [N, {_describe_shape(shape)[1:]}")
            if a.dtype.kind not in "biuf":
                raise DataError(f"{path}: array {n!r} of dtype {a.dtype}; expected a numeric array")
        if len({len(a) for a in self.arrays}) != 1:
            raise DataError(f"{path}: the arrays hold different numbers of rows "
                            f"({', '.join(f'{n}: {len(a)}' for n, a in zip(names, self.arrays))}); one row per record each")

    def __len__(self) -> int:
        return int(len(self.arrays[0]))

    def source_key(self, i: int) -> str:
        return f"{self.path.name}[{i}]"

    def read(self, i: int):
        row = tuple(_cast_row(torch.from_numpy(np.array(a[i])), dtype, f"{n!r}")
                    for a, n, (_, dtype) in zip(self.arrays, self.names, self.specs))
        return row[0] if len(row) == 1 else row


class JsonlTensorSource(RecordSource):
    """One JSON object per line with a field per model input (see `input_names`) holding its row as
    nested lists of numbers; record i is the tuple of those rows (a lone tensor for one input).

    Raises:
        DataError: the first object lacks an input's field.
    """

    format = "jsonl"
    kind = "tensor"

    def __init__(self, path: Path, names: list[str], specs: list[tuple[tuple[int, ...], torch.dtype]]):
        self.path, self.names, self.specs = path, names, specs
        self.records = ByteRecords(path, line_offsets(path))
        for i in range(min(len(self), 100)):
            try:
                obj = json.loads(self.records.raw(i))
            except (ValueError, UnicodeDecodeError):
                continue
            missing = [n for n in names if isinstance(obj, dict) and n not in obj]
            if missing:
                raise DataError(f"{path}: the first JSON record has no field {missing[0]!r}; this model takes fields "
                                f"{names} (one per input), the record has {sorted(obj)[:20]}")
            break

    def __len__(self) -> int:
        return len(self.records.offsets) - 1

    def read(self, i: int):
        obj = json_object(self.records.raw(i))
        row = []
        for n, (shape, dtype) in zip(self.names, self.specs):
            if n not in obj:
                raise RecordError(f"no field {n!r}")
            try:  # as written: 1.5 stays 1.5, so an integer input refuses it instead of reading 1
                array = np.asarray(obj[n])
                if array.dtype.kind not in "biuf":
                    raise ValueError(f"it holds {array.dtype.name} values")
                value = torch.from_numpy(array.astype(np.int64 if array.dtype.kind in "biu" else np.float64))
            except (TypeError, ValueError, OverflowError) as exc:
                raise RecordError(f"field {n!r} is not an array of numbers ({exc})") from None
            if not _fits(value.shape, shape):
                raise RecordError(f"field {n!r} has shape {list(value.shape)}; the model takes {_describe_shape(shape)}")
            row.append(_cast_row(value, dtype, f"field {n!r}"))
        return row[0] if len(row) == 1 else tuple(row)
