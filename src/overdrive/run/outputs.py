"""Output writers for `overdrive run`: the finished run (rows in input order, keyed by input
index) as `.npy`, Parquet (pyarrow), CSV or JSONL. Every writer is deterministic: the same rows
give the same bytes.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from overdrive.core.errors import ConfigError, arg

OUTPUT_FORMATS = {".npy": "npy", ".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl"}


def output_format(path: Path) -> str:
    """The writer for `path`, by suffix. Raises ConfigError for an unknown one."""
    fmt = OUTPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{arg('output', path)}: unknown format {path.suffix or '(no suffix)'!r}; expected one of "
                        f"{', '.join(OUTPUT_FORMATS)}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise ConfigError(f"{arg('output', '.parquet')} needs pyarrow; pip install pyarrow") from None
    return fmt


# -- writers -------------------------------------------------------------------------------------


@dataclass
class OutputChunk:
    """Finished rows of one chunk: `outputs` float32 [n, *row] for input indices start..start+n-1,
    NaN rows where `failed` is True."""

    start: int
    outputs: np.ndarray
    failed: np.ndarray  # bool [n]


def write_output(path: Path, fmt: str, chunks: Iterable[OutputChunk], *, total: int, row_shape: tuple[int, ...],
                 keys: Callable[[int], str] | None, classifier: bool) -> int:
    """Write every chunk, in order, to `path` in format `fmt`; returns the rows written.

    Layouts:
        npy: float32 [total, *row_shape], row i for input i; failed inputs are rows of NaN.
        parquet, csv, jsonl: one row per input that succeeded, in input order, with `index`
            (input index, from 0), `source` (image folders: the file), `prediction` (classifiers:
            the argmax; empty / null for a row holding NaN) and the output: Parquet `output`
            list<float32>; CSV `output_0..output_{D-1}` (flattened); JSONL `output` (nested as the
            row shape; NaN and infinities as null, which JSON lacks). Floats are written so that
            they read back to the same float32 (9 significant digits).
    """
    if fmt == "npy":
        array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(total, *row_shape))
        for chunk in chunks:
            array[chunk.start: chunk.start + len(chunk.outputs)] = chunk.outputs
        array.flush()
        del array
        return total
    written = 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        width = int(np.prod(row_shape))
        fields = [pa.field("index", pa.int64())] + ([pa.field("source", pa.string())] if keys else []) \
            + ([pa.field("prediction", pa.int64())] if classifier else []) + [pa.field("output", pa.list_(pa.float32(), width))]
        schema = pa.schema(fields, metadata={"overdrive.row_shape": json.dumps(list(row_shape))})
        with pq.ParquetWriter(path, schema, compression="zstd") as writer:
            for chunk in chunks:
                index, rows = _kept(chunk)
                if not len(index):
                    continue
                columns = [pa.array(index, pa.int64())]
                if keys:
                    columns.append(pa.array([keys(int(i)) for i in index], pa.string()))
                if classifier:
                    flat_rows = rows.reshape(len(rows), -1)
                    columns.append(pa.array(flat_rows.argmax(-1), pa.int64(), mask=~np.isfinite(flat_rows).all(-1)))
                flat = pa.array(rows.reshape(-1).astype(np.float32), pa.float32())
                columns.append(pa.FixedSizeListArray.from_arrays(flat, width))
                writer.write_table(pa.Table.from_arrays(columns, schema=schema))
                written += len(index)
        return written
    with open(path, "w", encoding="utf-8", newline="") as f:
        if fmt == "csv":
            out = csv.writer(f, lineterminator="\n")
            width = int(np.prod(row_shape))
            out.writerow(["index"] + (["source"] if keys else []) + (["prediction"] if classifier else [])
                         + [f"output_{j}" for j in range(width)])
        for chunk in chunks:
            index, rows = _kept(chunk)
            for i, row in zip(index.tolist(), rows):
                flat = row.reshape(-1)
                finite = bool(np.isfinite(flat).all())
                prediction = int(flat.argmax()) if finite else None  # no argmax of a row holding NaN
                head = [i] + ([keys(i)] if keys else []) + ([prediction if finite else ""] if classifier else [])
                if fmt == "csv":
                    out.writerow(head + [f"{v:.9g}" for v in flat.tolist()])
                else:
                    record = {"index": i} | ({"source": keys(i)} if keys else {}) \
                        | ({"prediction": prediction} if classifier else {})
                    numbers = [float(f"{v:.9g}") if math.isfinite(v) else None for v in flat.tolist()]  # JSON has no NaN
                    values = json.dumps(np.array(numbers, dtype=object).reshape(row.shape).tolist())
                    f.write(json.dumps(record)[:-1] + ', "output": ' + values + "}\n")
            written += len(index)
    return written


def _kept(chunk: OutputChunk) -> tuple[np.ndarray, np.ndarray]:
    keep = ~chunk.failed
    return np.flatnonzero(keep) + chunk.start, chunk.outputs[keep]
