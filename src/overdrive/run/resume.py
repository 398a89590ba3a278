"""The resumable output of `overdrive run`: the folder `OUTPUT.parts/` with its manifest and
finished chunks, the claim on the output (checks, lock), and atomic writes.

A chunk is done when `OUTPUT.parts/chunk-K.npy` exists: its errors are written first, then its
outputs under a temporary name, flushed to disk and renamed, so a kill at any point leaves
whole chunks or no chunk. The manifest records what a resumed run must share with the first
(input fingerprint, model, plan hash, device type, batch and chunk size).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from overdrive.core.digest import file_sha256
from overdrive.core.errors import ConfigError, DataError, arg
from overdrive.run.outputs import OUTPUT_FORMATS, OutputChunk, output_format

MANIFEST_VERSION = 3  # 2: the fingerprints of the weights and plan checkpoints; 3: the probe record's answer


class Parts:
    """The folder `OUTPUT.parts/`: manifest.json and, per finished chunk, chunk-K.npy
    (float32 [n, *row], NaN rows for failed records) and chunk-K.errors.json ([[index, reason], ...])."""

    def __init__(self, output: Path):
        self.dir = output.with_name(output.name + ".parts")
        self._lock_fd: int | None = None

    def lock(self) -> bool:
        """Take an exclusive lock on the folder for this process (flock; released when the process
        ends, also by SIGKILL). False when another process holds it."""
        import fcntl

        fd = os.open(self.dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def locked_by_another(self) -> bool:
        if not self.dir.is_dir() or self._lock_fd is not None:
            return False
        if self.lock():
            self.unlock()
            return False
        return True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def remove(self) -> None:
        self.unlock()
        shutil.rmtree(self.dir, ignore_errors=True)

    def chunk_path(self, k: int) -> Path:
        return self.dir / f"chunk-{k:06d}.npy"

    def done(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.dir.glob("chunk-*.npy")}

    def write_chunk(self, k: int, outputs: np.ndarray, errors: list[tuple[int, str]]) -> None:
        """Errors first, then the outputs under a temporary name, flushed, renamed: the .npy's
        presence is the chunk's completion mark."""
        atomic_write(self.dir / f"chunk-{k:06d}.errors.json", json.dumps(errors).encode())
        buffer = _npy_bytes(outputs)
        atomic_write(self.chunk_path(k), buffer)

    def read_errors(self, k: int) -> list[tuple[int, str]]:
        return [tuple(e) for e in json.loads((self.dir / f"chunk-{k:06d}.errors.json").read_text())]

    def read_chunk(self, k: int, start: int) -> tuple[OutputChunk, list[tuple[int, str]]]:
        outputs = np.load(self.chunk_path(k), allow_pickle=False)
        errors = self.read_errors(k)
        failed = np.zeros(len(outputs), dtype=bool)
        failed[[i - start for i, _ in errors]] = True
        return OutputChunk(start, outputs, failed), errors

    def clean_temporaries(self) -> None:
        for p in self.dir.glob("*.tmp"):
            p.unlink(missing_ok=True)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def checkpoint_fingerprints(steps) -> dict[str, str]:
    """{file name: sha256} of each checkpoint file a plan's steps name (pruning's `checkpoint`)."""
    return {Path(c).name: file_sha256(c) for c in (getattr(s, "checkpoint", None) for s in steps) if c}


def claim_output(config) -> tuple[str, str, Parts]:
    """The checks that need no model, done before one is built, then the claim on the output
    (`config`: an `overdrive.run.job.RunConfig`):
    `OUTPUT.parts/` is created (or reused with `resume`) and locked for this process.

    Returns:
        (output format, mode, parts): mode "new" (no run recorded), "resume" (a manifest exists),
        or "complete" (`resume`, and OUTPUT exists with no interrupted run recorded: nothing to do).

    Raises:
        DataError: a missing input, an unknown format, an output in the way without `resume` or
            `overwrite`, another process writing the same output, an unwritable output.
        ConfigError: both `resume` and `overwrite`, or a `text_field` for input that has no fields.
    """
    from overdrive.files.inputs import TENSOR_FORMATS, TEXT_FORMATS

    output, parts = config.output, Parts(config.output)
    if not config.input.exists():
        raise DataError(f"{arg('input', config.input)}: no such file or folder")
    if config.input.is_file() and config.input.suffix.lower() not in {*TEXT_FORMATS, *TENSOR_FORMATS}:
        known = sorted(TEXT_FORMATS) + [*TENSOR_FORMATS, "a folder of images"]
        raise DataError(f"{arg('input', config.input)}: unknown format {config.input.suffix or '(no suffix)'!r}; expected one of "
                        f"{', '.join(known)}")
    if config.input.is_file() and config.input.stat().st_size == 0:
        raise DataError(f"{arg('input', config.input)} holds no records (the file is empty)")  # before the model is built
    if config.text_field is not None and (config.input.is_dir() or TEXT_FORMATS.get(config.input.suffix.lower()) not in
                                          ("jsonl", "csv")):
        raise ConfigError(f"{arg('text_field')} applies to .jsonl and .csv input only")
    if output.is_dir():
        raise DataError(f"{arg('output', output)} is a folder; give a file path ending in {', '.join(OUTPUT_FORMATS)}")
    fmt = output_format(output)
    if config.input.resolve() == output.resolve():
        raise DataError(f"{arg('output')} is the {arg('input')} file; choose another path")
    if config.resume and config.overwrite:
        raise ConfigError(f"{arg('resume', True)} continues a run and {arg('overwrite', True)} starts it over; pass one of them")
    if parts.locked_by_another():
        raise DataError(f"another overdrive run is writing {output} now (it holds {parts.dir}); wait for it or stop it")
    if config.overwrite:
        output.unlink(missing_ok=True)
        errors_file(output).unlink(missing_ok=True)
        shutil.rmtree(parts.dir, ignore_errors=True)
    elif parts.dir.exists() and not config.resume:
        raise DataError(f"{parts.dir} holds the chunks of an interrupted run; pass {arg('resume', True)} to continue it or "
                        f"{arg('overwrite', True)} to start over")
    elif output.exists() and not parts.dir.exists():
        if config.resume:
            return fmt, "complete", parts
        raise DataError(f"{arg('output', output)} exists; pass {arg('overwrite', True)} to replace it (or {arg('resume', True)} to continue a run)")
    try:
        parts.dir.mkdir(parents=True, exist_ok=True)
        probe = output.with_name(output.name + ".errors.jsonl.tmp")  # the longest name this run writes there
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise DataError(f"{arg('output', output)}: cannot write there ({exc.strerror or exc})") from None
    if not parts.lock():
        raise DataError(f"another overdrive run is writing {output} now (it holds {parts.dir}); wait for it or stop it")
    return fmt, ("resume" if (parts.dir / "manifest.json").exists() else "new"), parts


def check_manifest(parts: Parts, manifest: dict[str, Any], output: Path) -> dict[str, Any]:
    """The stored manifest of the interrupted run, after checking that this run is the same one.

    Raises:
        DataError: it differs (input changed, another model or plan, ...) or is unreadable.
    """
    stored = _read_manifest(parts)
    differ = [k for k in manifest if k not in ("batch_size", "chunk_size") and stored.get(k) != manifest[k]]
    if differ:
        named = [_difference(k, stored.get(k), manifest[k]) for k in differ if k in ("weights", "checkpoints")]
        other = [_difference(k, stored.get(k), manifest[k]) for k in differ if k not in ("weights", "checkpoints")]
        details = "; ".join(named + ([f"the interrupted run differs ({'; '.join(other[:3])})"] if other else []))
        raise DataError(f"cannot resume into {output}: {details}; its finished chunks would not match the rest, "
                        f"{arg('overwrite', True)} starts over")
    return stored


PROBE_RTOL = 1e-3


def check_probe(stored: dict[str, Any], probe: dict[str, Any], output: Path) -> None:
    """The model answers the manifest's probe record as it did in the interrupted run (within float
    noise: `PROBE_RTOL` of the answer's norm), so its code and settings, not only its weights, are the same.

    Raises:
        DataError: the answer changed (a changed forward or a plain attribute the weights do not hold).
    """
    was = stored.get("probe")
    if not was:
        return
    a, b = np.asarray(was["values"]), np.asarray(probe["values"])
    scale = max(float(was["norm"]), float(probe["norm"]), 1e-12)
    if a.shape != b.shape or abs(was["norm"] - probe["norm"]) > PROBE_RTOL * scale or \
            (a.size and float(np.abs(a - b).max()) > PROBE_RTOL * scale):
        raise DataError(f"cannot resume into {output}: the model answers differently than in the interrupted run (the "
                        f"output for the same record has norm {probe['norm']:.6g}, was {was['norm']:.6g}; its code or "
                        f"settings changed, not only weights); its finished chunks would not match the rest, "
                        f"{arg('overwrite', True)} starts over")


def _difference(key: str, was: Any, now: Any) -> str:
    if key == "weights":
        return f"the model's weights changed since the interrupted run (fingerprint {str(was)[:8]}… → {str(now)[:8]}…)"
    if key == "checkpoints":
        was, now = was or {}, now or {}
        changed = [f"plan checkpoint {n} changed" for n in now if n in was and was[n] != now[n]]
        changed += [f"plan checkpoint {n} is new" for n in now if n not in was]
        changed += [f"plan checkpoint {n} is gone" for n in was if n not in now]
        return "; ".join(changed)
    if isinstance(was, dict) and isinstance(now, dict):
        fields = [k for k in now if was.get(k) != now[k]]
        return f"{key} " + ", ".join(f"{k} was {was.get(k)!r}, now {now[k]!r}" for k in fields[:2])
    return f"{key} was {was!r}, now {now!r}"


def _read_manifest(parts: Parts) -> dict[str, Any]:
    try:
        stored = json.loads((parts.dir / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{parts.dir}/manifest.json is unreadable ({exc}); pass {arg('overwrite', True)} to start over") from None
    if stored.get("version") != MANIFEST_VERSION:
        raise DataError(f"{parts.dir} was written by another overdrive version; pass {arg('overwrite', True)} to start over")
    return stored


def errors_file(output: Path) -> Path:
    return output.with_name(output.name + ".errors.jsonl")
