"""Training checkpoints with torch.distributed.checkpoint: model, optimizer and data position,
loadable at any world size and strategy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.errors import ConfigError, arg, one_line
from overdrive.files.checkpoint import _checkpoints, _single_process_quiet, resolve_checkpoint
from overdrive.train.launch import DistEnv

KEEP_CHECKPOINTS = 2


def save_checkpoint(root: Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int, position: int,
                    env: DistEnv) -> Path:
    """Save model, optimizer (with its step counts) and the data position to ROOT/step-N with
    torch.distributed.checkpoint: each rank writes its own shards, and the checkpoint loads at
    any world size and strategy (DCP reshards on load). Written to a .tmp folder and renamed,
    so an interrupted save leaves the earlier checkpoints intact; the newest KEEP_CHECKPOINTS stay.

    Returns:
        The checkpoint folder.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    _barrier(env)
    model_state, optim_state = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": model_state, "optim": optim_state,
                  "train": {"step": torch.tensor(step), "position": torch.tensor(position)}}, checkpoint_id=str(tmp))
    _barrier(env)
    if env.is_main:
        (tmp / "train_state.json").write_text(json.dumps({"step": step, "position": position, "world_size": env.world_size}))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
        for old in _checkpoints(root)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
    _barrier(env)
    return path


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Restore a `save_checkpoint` into this (possibly differently parallelized) model.

    Args:
        path: a checkpoint folder, or a `save_dir` folder (its newest checkpoint is used).

    Returns:
        (step, data position).

    Raises:
        ConfigError: no checkpoint at `path`, or one whose parameters do not match the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = resolve_checkpoint(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "train": {"step": torch.tensor(0), "position": torch.tensor(0)}}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (RuntimeError, ValueError, KeyError) as exc:
        raise ConfigError(f"{arg('resume_dir', path)}: the checkpoint does not fit this model: {one_line(exc)}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["train"]["step"]), int(state["train"]["position"])


def _barrier(env: DistEnv) -> None:
    if dist.is_initialized():
        dist.barrier()
