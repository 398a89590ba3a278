"""Digests that say whether two things are the same: a file's bytes, a model's weights.

Run's manifest, a plan's `model_sha256` and the cache of exports key on them."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """sha256 of a file's bytes, hex, read in 8 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


def weights_fingerprint(model) -> str:
    """sha256 (hex) over the model's state_dict, parameters and buffers: each entry's name, shape,
    dtype and bytes, in state_dict order. TorchScript modules and torch.export programs' modules
    have a state_dict too. A value that is not a tensor contributes its type name only.

    Args:
        model: an nn.Module (the workload's fp32 model, before any technique).
    """
    import torch

    digest = hashlib.sha256()
    for name, value in model.state_dict().items():
        digest.update(name.encode() + b"\0")
        if not isinstance(value, torch.Tensor):
            digest.update(type(value).__name__.encode() + b"\0")
            continue
        t = value.detach()
        digest.update(f"{list(t.shape)} {t.dtype}\0".encode())
        if t.is_quantized:
            t = t.int_repr()
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous().reshape(-1)
        digest.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return digest.hexdigest()
