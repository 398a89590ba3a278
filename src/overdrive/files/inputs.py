"""Record sources for `overdrive run` (offline batch inference); the writers are in `overdrive.run.outputs`.

A *record source* is a random-access view of the user's input, one record per output row:

| input                          | record                        | `source` key          |
|--------------------------------|-------------------------------|-----------------------|
| `.txt` (one sentence per line) | the line's text (no newline)  | "line 12" (from 1)    |
| `.jsonl` / `.ndjson`           | the string field `text_field` | "line 12" (from 1)    |
| `.csv` (with a header row)     | the column `text_field`       | "row 12" (from 1)     |
| a folder of images             | the decoded image tensor      | path under the folder |
| `.npy` array [N, *row]         | row i as a tensor             | "name.npy[11]"        |
| `.npz`, an array per input     | row i of each (a tuple)       | "name.npz[11]"        |
| `.jsonl`, a field per input    | (tensor models) each field's  | "line 12" (from 1)    |
|                                | nested list, as a tensor      |                       |

The three tensor sources are in `overdrive.files.tensor_sources`; `open_source` picks among all.
Records are located once at open time (byte offsets of lines / CSV rows, a sorted file list,
a memory map), so any worker process can read any record by index without reading the others.
`read(i)` decodes one record and raises `RecordError` with a reason when that record alone is
bad (invalid UTF-8, not JSON, missing field, corrupt image); the run files it and goes on.
Problems with the input as a whole (missing path, unknown format, no such column, wrong array
shape) raise `DataError` before anything runs.
"""

from __future__ import annotations

import csv
import io
import json
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from overdrive.core.errors import ConfigError, DataError, arg

TEXT_FORMATS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv"}
TENSOR_FORMATS = (".npy", ".npz")  # and .jsonl with a field per input, for tensor models
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class RecordError(Exception):
    """One record cannot be read or decoded; the message is the reason filed for it."""


# -- locating records ----------------------------------------------------------------------------


def line_offsets(path: Path) -> np.ndarray:
    """Byte offsets of the lines of `path`: int64 [L + 1], line i is bytes [o[i], o[i+1]).

    A final line without a newline counts; a newline at the very end does not start a new one.
    """
    size = path.stat().st_size
    if size == 0:
        return np.zeros(1, dtype=np.int64)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        ends = np.flatnonzero(np.frombuffer(mm, dtype=np.uint8) == 0x0A).astype(np.int64) + 1
    if ends.size == 0 or ends[-1] != size:
        ends = np.append(ends, size)
    return np.concatenate([[0], ends]).astype(np.int64)


def csv_record_offsets(path: Path) -> np.ndarray:
    """Byte offsets of the records of a CSV file, int64 [R + 1] (the header is record 0).

    A record ends at a newline outside quotes: RFC 4180 doubles a quote inside a quoted field,
    so a record is complete when it holds an even number of quote characters.
    """
    offsets = [0]
    quotes = 0
    pos = 0
    with open(path, "rb") as f:
        for line in f:
            pos += len(line)
            quotes += line.count(b'"')
            if quotes % 2 == 0:
                offsets.append(pos)
                quotes = 0
    if offsets[-1] != pos:  # an unterminated quote runs to the end of the file: one last (bad) record
        offsets.append(pos)
    return np.asarray(offsets, dtype=np.int64)


class ByteRecords:
    """Records that are byte ranges of one file; opens its own handle per process (workers)."""

    def __init__(self, path: Path, offsets: np.ndarray):
        self.path = path
        self.offsets = offsets
        self._file = None
        self._pid = None

    def raw(self, i: int) -> bytes:
        if self._file is None or self._pid != os.getpid():
            self._file, self._pid = open(self.path, "rb"), os.getpid()  # noqa: SIM115 (kept open for the run)
        self._file.seek(int(self.offsets[i]))
        return self._file.read(int(self.offsets[i + 1] - self.offsets[i]))

    def __getstate__(self):
        return {"path": self.path, "offsets": self.offsets, "_file": None, "_pid": None}


def _decode_utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecordError(f"invalid UTF-8 ({exc.reason} at byte {exc.start})") from None


# -- sources -------------------------------------------------------------------------------------


def json_object(raw: bytes) -> dict:
    """One JSONL line as a JSON object; RecordError with the reason (bad UTF-8, not JSON, not an object)."""
    _decode_utf8(raw)  # a precise reason for bad bytes
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise RecordError(f"not a JSON object ({str(exc).split(':')[0]})") from None
    if not isinstance(obj, dict):
        raise RecordError(f"not a JSON object (a {type(obj).__name__})")
    return obj


class RecordSource:
    """Base of the record sources; see the module docstring for what each one reads.

    Attributes:
        path: the input file or folder.
        format: "text", "jsonl", "csv", "images" or "npy".
        kind: "text" (records are str) or "tensor" (records are tensors).
    """

    path: Path
    format: str
    kind: str

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, i: int) -> Any:
        """Record i, decoded. Raises RecordError when it cannot be."""
        raise NotImplementedError

    def source_key(self, i: int) -> str:
        """Where record i came from, for the errors file: "line 12", "row 3", a file path."""
        return f"line {i + 1}"

    def length_hints(self, indices: Sequence[int]) -> list[int]:
        """A cheap length per record for length bucketing (characters of text); 0 where unknown."""
        return [0] * len(indices)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this input, for the resume check (path, size, modification time, records)."""
        stat = self.path.stat()
        return {"path": str(self.path.resolve()), "format": self.format, "records": len(self),
                "size_bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class TextLinesSource(RecordSource):
    """One UTF-8 sentence per line; a trailing "\\r" is dropped; empty lines are (empty) records."""

    format = "text"
    kind = "text"

    def __init__(self, path: Path):
        self.path = path
        self.records = ByteRecords(path, line_offsets(path))

    def __len__(self) -> int:
        return len(self.records.offsets) - 1

    def read(self, i: int) -> str:
        return _decode_utf8(self.records.raw(i).rstrip(b"\n").rstrip(b"\r"))

    def length_hints(self, indices: Sequence[int]) -> list[int]:
        o = self.records.offsets
        return [int(o[i + 1] - o[i]) for i in indices]


class JsonlSource(RecordSource):
    """One JSON object per line; the record is its string field `text_field`.

    Raises:
        DataError: the first object does not have `text_field` (the field name is likely wrong).
    """

    format = "jsonl"
    kind = "text"

    def __init__(self, path: Path, text_field: str):
        self.path = path
        self.text_field = text_field
        offsets = line_offsets(path)
        self.records = ByteRecords(path, offsets)
        for i in range(min(len(self), 100)):  # the first record that parses decides whether the field exists
            try:
                obj = json.loads(self.records.raw(i))
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict) and text_field not in obj:
                raise DataError(f"{path}: the first JSON record has no field {text_field!r}; its fields are "
                                f"{sorted(obj)[:20]} (choose one with {arg('text_field')})")
            break

    def __len__(self) -> int:
        return len(self.records.offsets) - 1

    def read(self, i: int) -> str:
        obj = json_object(self.records.raw(i))
        if self.text_field not in obj:
            raise RecordError(f"no field {self.text_field!r}")
        value = obj[self.text_field]
        if not isinstance(value, str):
            raise RecordError(f"field {self.text_field!r} is a {type(value).__name__}, not a string")
        return value

    def length_hints(self, indices: Sequence[int]) -> list[int]:
        hints = []
        for i in indices:
            try:
                hints.append(len(self.read(i)))
            except RecordError:
                hints.append(0)
        return hints


class CsvSource(RecordSource):
    """A CSV file with a header row; the record is the column `text_field` (RFC 4180 quoting).

    Raises:
        DataError: the header is unreadable or has no column `text_field`.
    """

    format = "csv"
    kind = "text"

    def __init__(self, path: Path, text_field: str):
        self.path = path
        self.text_field = text_field
        offsets = csv_record_offsets(path)
        if len(offsets) < 2:
            raise DataError(f"{path}: empty CSV file; expected a header row naming a column {text_field!r}")
        self.records = ByteRecords(path, offsets)
        try:
            header = next(csv.reader(io.StringIO(self.records.raw(0).decode("utf-8-sig"))))
        except (UnicodeDecodeError, StopIteration, csv.Error) as exc:
            raise DataError(f"{path}: cannot read the CSV header ({exc})") from None
        if text_field not in header:
            raise DataError(f"{path}: no column {text_field!r}; the header has {header[:20]} (choose one with {arg('text_field')})")
        self.column = header.index(text_field)

    def __len__(self) -> int:
        return len(self.records.offsets) - 2

    def source_key(self, i: int) -> str:
        return f"row {i + 1}"

    def read(self, i: int) -> str:
        text = _decode_utf8(self.records.raw(i + 1))
        try:
            rows = list(csv.reader(io.StringIO(text)))
        except csv.Error as exc:
            raise RecordError(f"malformed CSV row ({exc})") from None
        if len(rows) != 1 or len(rows[0]) <= self.column:
            raise RecordError(f"CSV row has no column {self.text_field!r} (it has {len(rows[0]) if rows else 0} fields)")
        return rows[0][self.column]

    def length_hints(self, indices: Sequence[int]) -> list[int]:
        o = self.records.offsets
        return [int(o[i + 2] - o[i + 1]) for i in indices]


class ImageFolderSource(RecordSource):
    """The image files under a folder (recursively, sorted by relative path), decoded with
    Pillow and turned into the model's input by `transform` (PIL image -> float tensor [C, H, W])."""

    format = "images"
    kind = "tensor"

    def __init__(self, path: Path, transform: Callable[[Any], torch.Tensor], mode: str):
        self.path = path
        self.transform = transform
        self.mode = mode
        self.files = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                            if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not self.files:
            raise DataError(f"{path}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in this folder")

    def __len__(self) -> int:
        return len(self.files)

    def source_key(self, i: int) -> str:
        return self.files[i]

    def read(self, i: int) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(self.path / self.files[i]) as image:
                image = image.convert(self.mode)  # also forces the decode: a truncated file fails here
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise RecordError(f"cannot decode image: {exc}") from None
        return self.transform(image)

    def fingerprint(self) -> dict[str, Any]:
        stats = [(self.path / f).stat() for f in self.files]
        return {"path": str(self.path.resolve()), "format": self.format, "records": len(self),
                "size_bytes": sum(s.st_size for s in stats), "mtime_ns": max(s.st_mtime_ns for s in stats),
                "files_hash": hash_strings(self.files)}


def hash_strings(items: Iterable[str]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for item in items:
        digest.update(item.encode("utf-8", "surrogatepass") + b"\0")
    return digest.hexdigest()[:16]


# -- images --------------------------------------------------------------------------------------


class ResizeToTensor:
    """PIL image -> [C, H, W] resized to (H, W) (bilinear, antialiased): float32 in [0, 1] (`scale`
    1/255, the default), float32 in [0, 255] (`scale` 1), or uint8 (`dtype` uint8); then optionally
    normalised per channel: (x - mean) / std. Picklable, for DataLoader workers."""

    def __init__(self, size: tuple[int, int], mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                 *, scale: float = 1 / 255, dtype: torch.dtype = torch.float32):
        self.size = tuple(size)
        self.mean, self.std = mean, std
        self.scale, self.dtype = scale, dtype

    def __call__(self, image) -> torch.Tensor:
        from PIL import Image

        if image.size != (self.size[1], self.size[0]):
            image = image.resize((self.size[1], self.size[0]), Image.Resampling.BILINEAR)
        if self.dtype == torch.uint8:
            array = np.asarray(image, dtype=np.uint8)
        else:
            array = np.asarray(image, dtype=np.float32) * np.float32(self.scale)
        tensor = torch.from_numpy(array.reshape(array.shape[0], array.shape[1], -1)).permute(2, 0, 1).contiguous()
        if self.mean is not None:
            tensor = (tensor - torch.tensor(self.mean).view(-1, 1, 1)) / torch.tensor(self.std).view(-1, 1, 1)
        return tensor


def single_input_sample(workload) -> Any:
    """The workload's first sample as one tensor when the model takes one input (a 1-tuple, as
    `package.module:factory` and model files give, is unwrapped); otherwise as it is."""
    sample = workload.samples[0]
    if isinstance(sample, tuple) and len(sample) == 1:
        return sample[0]
    return sample


def image_transform(workload) -> tuple[Callable[[Any], torch.Tensor], str]:
    """How a workload turns a PIL image into one input sample: (transform, Pillow mode).

    The workload's own `extra["image_transform"]` when it has one (torchvision workloads carry
    their architecture's ImageNet preset: resize, centre crop, normalise); otherwise the image is
    resized to the sample shape [C, H, W] (C = 1: greyscale "L", C = 3: "RGB") and given the range
    and dtype of the workload's real rows: uint8 0..255, float 0..255, or float 0..1 (also for
    random rows, whose range says nothing).

    Raises:
        ConfigError: the workload's samples are not single images [1 or 3, H, W], or its real rows
            hold negative values (normalised images, whose mean and std cannot be known).
    """
    sample = single_input_sample(workload)
    if not isinstance(sample, torch.Tensor) or sample.dim() != 3 or sample.shape[0] not in (1, 3):
        shape = list(sample.shape) if isinstance(sample, torch.Tensor) else type(sample).__name__
        raise ConfigError(f"workload {workload.name!r} takes inputs {shape}, not images [1 or 3, H, W]; "
                        "give it a .npy array instead")
    mode = "L" if sample.shape[0] == 1 else "RGB"
    transform = workload.extra.get("image_transform")
    if transform is not None:
        return transform, mode
    size = tuple(sample.shape[1:])
    if sample.dtype == torch.uint8:
        return ResizeToTensor(size, dtype=torch.uint8), mode
    if not sample.dtype.is_floating_point:
        raise ConfigError(f"workload {workload.name!r} takes {sample.dtype} images; give it a .npy array of its rows")
    if getattr(workload, "rows_source", "random") == "random":
        return ResizeToTensor(size), mode
    rows = [s[0] if isinstance(s, tuple) else s for s in workload.samples[:64]]
    low, high = min(float(r.min()) for r in rows), max(float(r.max()) for r in rows)
    if low < 0:
        raise ConfigError(f"workload {workload.name!r}'s rows hold values in [{low:.3g}, {high:.3g}]: normalised images, "
                          "whose mean and std overdrive cannot know; give it a .npy array of prepared rows, or a factory "
                          "Workload with extra['image_transform']")
    return ResizeToTensor(size, scale=1.0 if high > 1.0 + 1e-6 else 1 / 255), mode


# -- opening -------------------------------------------------------------------------------------


def open_source(path: Path, workload, *, text_field: str | None = None, argument: str = "input") -> RecordSource:
    """Open the user's input for `workload`, by its suffix (or as an image folder); `argument` names
    the argument the path came from in error messages (`input` for `run`, `data` for `optimize`).

    Raises:
        DataError: the path is missing, its format is unknown or does not suit the workload, or
            the input as a whole is unreadable (see each source).
    """
    if not path.exists():
        raise DataError(f"{arg(argument, path)}: no such file or folder")
    if path.is_dir():
        if workload.is_text:
            raise DataError(f"{arg(argument, path)} is a folder; {workload.name!r} is a text model and reads a .txt, .jsonl "
                            "or .csv file")
        transform, mode = image_transform(workload)
        return ImageFolderSource(path, transform, mode)
    suffix = path.suffix.lower()
    from overdrive.files.tensor_sources import JsonlTensorSource, NpySource, NpzSource, input_names, row_specs

    if suffix == ".npz" or (suffix in (".jsonl", ".ndjson") and not workload.is_text):
        if workload.is_text:
            raise DataError(f"{arg(argument, path)}: {workload.name!r} is a text model; give a .txt, .jsonl or .csv file")
        if text_field is not None:
            raise ConfigError(f"{arg('text_field')} names the text field of a text model's input; this model takes tensors")
        return (NpzSource if suffix == ".npz" else JsonlTensorSource)(path, input_names(workload), row_specs(workload))
    if suffix in TEXT_FORMATS:
        if not workload.is_text:
            raise DataError(f"{arg(argument, path)}: {workload.name!r} takes tensors, not text; give a folder of images or a .npy array")
        fmt = TEXT_FORMATS[suffix]
        if fmt == "text":
            if text_field is not None:
                raise ConfigError(f"{arg('text_field')} applies to .jsonl and .csv input; a .txt file holds one sentence per line")
            return TextLinesSource(path)
        return (JsonlSource if fmt == "jsonl" else CsvSource)(path, text_field or "text")
    if suffix == ".npy":
        if workload.is_text:
            raise DataError(f"{arg(argument, path)}: {workload.name!r} is a text model; give a .txt, .jsonl or .csv file")
        sample = single_input_sample(workload)
        if not isinstance(sample, torch.Tensor):
            raise ConfigError(f"workload {workload.name!r} takes several inputs per row ({', '.join(input_names(workload))}); "
                              ".npy input holds one: give a .npz with an array per input, or .jsonl with a field per input")
        return NpySource(path, *row_specs(workload)[0])
    known = sorted(TEXT_FORMATS) + [*TENSOR_FORMATS, "a folder of images"]
    raise DataError(f"{arg(argument, path)}: unknown format {suffix or '(no suffix)'!r}; expected one of {', '.join(known)}")
