"""Checks that ranks which must see the same batch do: the ranks of tensor parallelism (one
replica, split across ranks) and the stages of a pipeline (the first feeds the inputs, the last
computes the targets from the same rows). And every rank starts from the same weights: rank 0's
(`adopt_rank0_weights`), as DDP does, so a factory that initialises without a seed cannot mix
different starting points (FSDP shards, tensor-parallel replicated layers, pipeline stages, a
distillation teacher per rank).

Each step, every rank reduces a fingerprint of its batch, two int64 numbers, with one MAX
all-reduce of [fingerprint, −fingerprint]: the maximum and minimum agree only when every rank
holds the same fingerprint. The fingerprint is taken before the model runs, so unequal shapes
are found before a collective inside the model would abort on them.

- shape: a CRC-32 of each tensor's dtype and shape (deterministic across processes, unlike
  Python's `hash`);
- contents: Σᵢ wordᵢ · (i + 1) + Σᵢ wordᵢ over each tensor's bytes read as 32-bit words (8-bit
  for odd sizes), in int64 arithmetic, whose wrap-around is exact and independent of the
  reduction order (a float sum is not: its rounding depends on the thread count). The position
  weight catches rows in another order.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.errors import WorkloadError, arg

_MASK = (1 << 62) - 1  # keeps −fingerprint representable in int64


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int64 numbers (one per 32-bit word, or per byte when the size is odd)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    raw = t.reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0 and raw.numel():
        return raw.view(torch.int32).to(torch.int64)
    return raw.to(torch.int64)


def batch_fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """[shape hash, contents hash] of `tensors`, an int64 [2] tensor on their device.

    Equal for bitwise-equal tensors of the same dtypes and shapes in the same order; a change of
    shape or dtype changes the first number, a change of any bit or of the rows' order (almost
    surely) the second.
    """
    device = tensors[0].device if tensors else torch.device("cpu")
    described = ";".join(f"{t.dtype}{tuple(t.shape)}" for t in tensors)
    shape = zlib.crc32(described.encode())
    contents = torch.zeros((), dtype=torch.int64, device=device)
    for k, t in enumerate(tensors):
        words = _words(t)
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=device)
        contents = contents * 1_000_003 + (words * weights).sum() + words.sum() + k
    return torch.stack([torch.tensor(shape, dtype=torch.int64, device=device), contents & _MASK])


def check_same_batch(tensors: Sequence[torch.Tensor], *, step: int, strategy: str, group=None) -> None:
    """Raise on every rank of `group` (default: all) unless all of them hold the same batch.

    Costs one all-reduce of four int64 numbers; when they disagree, one all-gather more of each
    rank's fingerprint and shapes, so that every rank raises the same message naming the ranks.

    Raises:
        WorkloadError: the ranks' batches differ in shape or contents (every rank raises it).
    """
    mine = batch_fingerprint(tensors)
    box = torch.cat([mine, -mine])
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    if torch.equal(box[:2], -box[2:]):
        return
    described = ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (mine.tolist(), described), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(gathered)))
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, (fingerprint, _) in zip(ranks, gathered, strict=True):
        groups.setdefault(tuple(fingerprint), []).append(rank)
    first, second = (g[0] for g in list(groups.values())[:2])
    shapes = {rank: text for rank, (_, text) in zip(ranks, gathered, strict=True)}
    if shapes[first] != shapes[second]:
        seen, detail = "different input shapes", f"rank {first}: {shapes[first]}; rank {second}: {shapes[second]}"
    else:
        seen, detail = "different inputs", f"the same shapes, {shapes[first]}"
    agreeing = "; ".join(", ".join(map(str, g)) for g in groups.values())
    layout = f", ranks that agree: {agreeing}" if len(ranks) > 2 else ""
    raise WorkloadError(
        f"the ranks of {arg('strategy', strategy)} must all see the same batch, but ranks {first} and {second} got "
        f"{seen} at step {step} ({detail}{layout}). The workload's training samples differ between processes: a "
        "factory that reads RANK, or unseeded randomness in the data (seed every generator, or build the samples "
        "the same way on every rank)")


def adopt_rank0_weights(model: nn.Module) -> bool:
    """Make every rank's parameters and buffers rank 0's, before any strategy wraps the model.

    Compares fingerprints first (one all-reduce) and broadcasts only when they differ.

    Returns:
        True when some rank's weights differed from another's (and were replaced by rank 0's).
    """
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors:
        return False
    mine = batch_fingerprint(tensors)
    box = torch.cat([mine, -mine])
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    if torch.equal(box[:2], -box[2:]):
        return False
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=0)
    return True
