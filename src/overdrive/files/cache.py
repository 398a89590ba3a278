"""A cache of what is expensive to make and the same every time: exported and converted models
(ONNX files, OpenVINO IR, their int8 forms), so that a second `optimize`, `serve`, `run` or `bench`
of a plan with a runtime starts from the file instead of exporting again.

An entry is a folder `ROOT/<kind>/<key>/` holding the files and `meta.json`; the key is a sha256
over everything the files depend on: the model (`model_key`: its weights, its structure and the
code of every module class in it; `outputs_key`: what it answers on the example, which also covers
code its forward calls elsewhere), the example it was traced with, the settings, and the versions
of torch, the exporter and overdrive. An entry is written into a temporary folder and renamed into
place, so a reader never sees half of one; concurrent writers of the same key both succeed and one
folder wins. Entries not used for longest are removed when the cache grows past its size limit.

ROOT is `$OVERDRIVE_CACHE`, else `$XDG_CACHE_HOME/overdrive`, else `~/.cache/overdrive`;
`OVERDRIVE_CACHE=off` turns caching off (every call builds into a temporary folder). The limit is
`$OVERDRIVE_CACHE_MAX_GB` (default 8).

A cached ONNX file is still proved against PyTorch on real rows at every use (`files.onnx`): a key
that missed a difference cannot give wrong answers silently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import marshal
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from overdrive.core.digest import weights_fingerprint

CACHE_ENV = "OVERDRIVE_CACHE"
LIMIT_ENV = "OVERDRIVE_CACHE_MAX_GB"
DEFAULT_LIMIT_GB = 8.0
META = "meta.json"


def cache_root() -> Path | None:
    """The cache folder, or None when caching is off (`OVERDRIVE_CACHE=off`, `0` or `none`)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none", "false") else Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "overdrive"


@functools.lru_cache(maxsize=None)
def _class_code(cls: type) -> bytes:
    """The bytecode of every function `cls` and its bases (up to nn.Module) define: a changed forward
    changes the key even when the weights do not. Line numbers are in it, so a moved method does too
    (a needless rebuild, never a wrong hit)."""
    digest = hashlib.sha256()
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        digest.update(f"{klass.__module__}.{klass.__qualname__}\0".encode())
        for name, value in sorted(vars(klass).items(), key=lambda kv: kv[0]):
            func = getattr(value, "__func__", value)
            code = getattr(func, "__code__", None)
            if code is not None:
                digest.update(name.encode() + b"\0" + marshal.dumps(code))
    return digest.digest()


def model_key(model: nn.Module) -> str:
    """sha256 (hex) of what a model's export depends on: its weights and buffers
    (`core.digest.weights_fingerprint`), its module tree (repr, types) and the code of each module
    class (bytecode; a TorchScript or fx module's own `code`)."""
    digest = hashlib.sha256(weights_fingerprint(model).encode())
    digest.update(repr(model).encode())
    for name, module in model.named_modules():
        digest.update(name.encode() + b"\0" + _class_code(type(module)))
        code = getattr(module, "code", None)  # torch.jit.ScriptModule, torch.fx.GraphModule
        if isinstance(code, str):
            digest.update(code.encode())
    return digest.hexdigest()


def outputs_key(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    """sha256 (hex) of what `model` answers on `inputs`, at bfloat16 precision (float sums that differ in
    their last bits between runs seldom change it; when they do, the cost is a rebuild, never a wrong
    hit). It covers what `model_key` cannot see: code the forward calls outside its module classes (a
    helper function, a library's)."""
    from torch.utils._pytree import tree_leaves

    with torch.no_grad():
        leaves = [t for t in tree_leaves(model(*inputs)) if isinstance(t, torch.Tensor)]
    return tensors_key(t.detach().to(torch.bfloat16) if t.is_floating_point() else t for t in leaves)


def tensors_key(tensors) -> str:
    """sha256 (hex) of tensors' shapes, dtypes and bytes, in order (an example, calibration rows)."""
    digest = hashlib.sha256()
    for t in tensors:
        t = torch.as_tensor(t).detach().cpu().contiguous()
        digest.update(f"{list(t.shape)} {t.dtype}\0".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def versions(*packages: str) -> dict[str, str]:
    """{package: version} of torch, overdrive and `packages` (those not installed: "absent")."""
    from importlib import metadata

    found = {"torch": torch.__version__}
    for name in ("overdrive", *packages):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


class Entry:
    """One cache entry: `folder` holds the files, `meta` what `make` returned, `hit` whether it was
    there already. With caching off, `folder` is a temporary folder alive as long as the entry."""

    def __init__(self, folder: Path, meta: dict[str, Any], hit: bool, keep: Any = None):
        self.folder, self.meta, self.hit, self._keep = folder, meta, hit, keep


def cached(kind: str, key_parts: dict[str, Any], make: Callable[[Path], dict[str, Any]]) -> Entry:
    """The entry for `kind` and `key_parts`, made by `make(folder)` when absent.

    Args:
        kind: what the entry holds ("onnx", "openvino", ...): a folder of its own under the root.
        key_parts: everything the files depend on, JSON-serialisable (`model_key`, settings, `versions`).
        make: writes the files into the (empty, existing) folder it is given and returns the
            JSON-serialisable facts to keep beside them.

    Raises:
        whatever `make` raises (nothing is kept then).
    """
    root = cache_root()
    if root is None:
        temporary = tempfile.TemporaryDirectory(prefix=f"overdrive-{kind}-")
        folder = Path(temporary.name)
        return Entry(folder, make(folder), hit=False, keep=temporary)
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:40]
    folder = root / kind / key
    meta_file = folder / META
    if meta_file.is_file():
        try:
            meta = json.loads(meta_file.read_text())
            os.utime(meta_file)  # used now: the last to be evicted
            return Entry(folder, meta, hit=True)
        except (OSError, json.JSONDecodeError):
            shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=folder.parent))
    try:
        meta = make(building)
        (building / META).write_text(json.dumps(meta, sort_keys=True, default=str))
        try:
            os.rename(building, folder)
        except OSError:  # another process stored the same key first: theirs is as good
            shutil.rmtree(building, ignore_errors=True)
            if not meta_file.is_file():
                raise
            return Entry(folder, json.loads(meta_file.read_text()), hit=False)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    evict(root)
    return Entry(folder, meta, hit=False)


def evict(root: Path, limit_bytes: float | None = None) -> list[Path]:
    """Remove the entries used longest ago until the cache holds at most `limit_bytes`
    (default `$OVERDRIVE_CACHE_MAX_GB`, 8 GiB); returns the folders removed."""
    if limit_bytes is None:
        try:
            limit_bytes = float(os.environ.get(LIMIT_ENV, DEFAULT_LIMIT_GB)) * 2**30
        except ValueError:
            limit_bytes = DEFAULT_LIMIT_GB * 2**30
    entries = []
    for meta_file in root.glob(f"*/*/{META}"):
        folder = meta_file.parent
        try:
            size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
            entries.append((meta_file.stat().st_mtime, size, folder))
        except OSError:
            continue
    total = sum(size for _, size, _ in entries)
    removed = []
    for _, size, folder in sorted(entries, key=lambda e: e[0]):
        if total <= limit_bytes:
            break
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
    stale = time.time() - 3600  # half-built folders of processes that died
    for building in root.glob("*/.*-*"):
        try:
            if building.stat().st_mtime < stale:
                shutil.rmtree(building, ignore_errors=True)
        except OSError:
            pass
    return removed
