"""`--weights CKPT`: trained weights into a workload's model, so train → optimize → serve closes.

A checkpoint is either a torch.distributed.checkpoint (DCP) folder that `overdrive train --save`
wrote (a `step-N` folder, or the `--save` folder itself: its newest step), or a `torch.save` file of
a state dict (bare, or under "model" / "state_dict", as training scripts commonly nest it). Every
parameter and buffer of the model must be in it with its shape: a partial or mismatched
checkpoint is refused with the names, never loaded halfway.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from overdrive.core.errors import ConfigError, arg, one_line
from overdrive.core.workload import Workload


def load_weights(workload: Workload, path: str | Path) -> Workload:
    """Load `path` into `workload.model` in place and note it in `workload.notes`.

    A user model behind `SignatureModel` takes a state dict of either the wrapper (what `train`
    saves) or the user's own module (what the user's script saves).

    Returns:
        The same workload.

    Raises:
        ConfigError: no checkpoint at `path`, not a state dict, or one that does not fit the model
            (missing or unexpected names, other shapes).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{arg('weights', path)}: no such file or folder")
    targets = [workload.model]
    inner = getattr(workload.model, "model", None)
    if isinstance(inner, nn.Module) and type(workload.model).__name__ == "SignatureModel":
        targets.append(inner)
    errors = []
    for target in targets:
        try:
            kind = _load_dcp(target, path) if path.is_dir() else _load_file(target, path)
        except _Mismatch as exc:
            errors.append(str(exc))
            continue
        workload.notes.append(f"weights from {path} ({kind})")
        workload.extra["weights"] = str(path)
        return workload
    raise ConfigError(f"{arg('weights', path)} does not fit {workload.name!r}: {errors[-1]}")


class _Mismatch(Exception):
    pass


def _check_keys(model: nn.Module, state: dict) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {list(state[k].shape)} (the model's: {list(v.shape)})" for k, v in own.items()
              if k in state and isinstance(state[k], torch.Tensor) and state[k].shape != v.shape]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            raise _Mismatch(f"{len(names)} name(s) {what}: {', '.join(names[:3])}{more}")


def _load_file(model: nn.Module, path: Path) -> str:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a pickle that is not plain tensors, or not a torch file at all
        raise ConfigError(f"{arg('weights', path)} is not a torch.save state dict ({one_line(exc)})") from None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{arg('weights', path)} holds {type(state).__name__}, not a state dict of tensors")
    _check_keys(model, state)
    model.load_state_dict(state)
    return "torch.save state dict"


def _load_dcp(model: nn.Module, path: Path) -> str:
    import torch.distributed.checkpoint as dcp

    from overdrive.files.checkpoint import _single_process_quiet, resolve_checkpoint

    try:
        folder = resolve_checkpoint(path)
    except ConfigError:
        raise ConfigError(f"{arg('weights', path)}: no checkpoint in this folder (expected a step-N folder that "
                          "`overdrive train --save` wrote, or its --save folder)") from None
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    saved = {k.removeprefix("model."): v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k} {list(saved[k].size)} (the model's: {list(v.shape)})" for k, v in own.items()
              if k in saved and hasattr(saved[k], "size") and list(saved[k].size) != list(v.shape)]
    for what, names in (("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)):
        if names:
            raise _Mismatch(f"{len(names)} name(s) {what}: {', '.join(names[:3])}{' and more' if len(names) > 3 else ''}")
    state = {"model": {k: v.clone() for k, v in own.items()}}
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(folder))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"{arg('weights', path)}: reading the checkpoint failed: {one_line(exc)}") from None
    model.load_state_dict(state["model"])
    return f"torch.distributed.checkpoint {folder.name}"
