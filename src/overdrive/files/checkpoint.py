"""The layout of a training checkpoint folder (`overdrive train --save`): ROOT/step-N, each a
torch.distributed.checkpoint folder. Read here, below `workloads` (`--weights`) and `train`."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from overdrive.core.errors import ConfigError, arg


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when there is no process group: that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _checkpoints(root: Path) -> list[Path]:
    found = [p for p in root.glob("step-*") if (p / ".metadata").exists() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder itself, or the newest ROOT/step-N under a `save_dir` folder.

    Raises:
        ConfigError: neither is there.
    """
    if (path / ".metadata").exists():
        return path
    found = _checkpoints(path) if path.is_dir() else []
    if not found:
        raise ConfigError(f"{arg('resume_dir', path)}: no checkpoint there (expected a step-N folder written by {arg('save_dir')})")
    return found[-1]
