"""Inference from the training strategies: a model split across devices (pipeline parallel).

Data-parallel inference is one replica per device: `overdrive serve --device cuda` runs one
model instance per GPU (`overdrive.cli.serve`). For a model too large for one device, or to use
several devices on one stream of batches, `PipelinedModel` cuts it into stages with the same
split as pipeline-parallel training (`overdrive.train.pipeline.build_stage_module`), one stage per
device, and runs each batch as microbatches in a wavefront: at clock tick t, stage s runs
microbatch t − s (the forward half of GPipe's schedule, as in torchgpipe, Kim et al. 2020).
Each stage runs on its own device's current stream; kernel launches are asynchronous, so on
GPUs the stages of different microbatches overlap. On one CPU it is the same code path,
without the overlap.
"""

from __future__ import annotations

import torch
from torch import nn

from overdrive.core.transformer import find_blocks
from overdrive.train.pipeline import balanced_split, build_stage_module, measure_block_costs


def _to(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    return tuple(_to(v, device) for v in value)


class PipelinedModel(nn.Module):
    """`model` split into len(devices) stages, one per device; forward(*inputs) -> output on
    the first device, equal to `model(*inputs)` up to floating-point order.

    Args:
        model: an nn.Sequential, or a SentenceEmbedder over a transformers encoder (see
            `overdrive.train.pipeline.build_stage_module`), in eval mode.
        devices: one device per stage (the same device may repeat).
        microbatches: pieces each batch is cut into along dim 0 (at most its rows).
        example: inputs to time the blocks on, to balance the split (ignored when
            `split_points` is given); None splits the blocks evenly by count.
        split_points: the first block of each stage after the first.

    Raises:
        ValueError: fewer than 2 devices, fewer blocks than devices, or a model that cannot be
            split (see `build_stage_module`).
    """

    def __init__(self, model: nn.Module, devices: list[torch.device], *, microbatches: int = 4,
                 example: tuple[torch.Tensor, ...] | None = None, split_points: list[int] | None = None):
        super().__init__()
        if len(devices) < 2:
            raise ValueError(f"a pipelined model needs ≥ 2 stages (devices), got {len(devices)}")
        if microbatches < 1:
            raise ValueError(f"microbatches must be ≥ 1, got {microbatches}")
        _, blocks = find_blocks(model)
        if split_points is None:
            costs = measure_block_costs(model, example) if example is not None else [1.0] * len(blocks)
            split_points = balanced_split(costs, len(devices))
        self.split_points, self.devices, self.microbatches = list(split_points), list(devices), microbatches
        self.stages = nn.ModuleList(
            build_stage_module(model, s, self.split_points)[0].to(d).eval() for s, d in enumerate(devices))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs[0].shape[0]
        chunks = list(zip(*(t.tensor_split(min(self.microbatches, rows)) for t in inputs)))
        n, p = len(chunks), len(self.stages)
        carried: list = [None] * n
        for tick in range(n + p - 1):  # wavefront: stage s runs microbatch tick − s
            for s in range(p - 1, -1, -1):  # later stages first, so this tick's inputs are last tick's outputs
                m = tick - s
                if 0 <= m < n:
                    x = chunks[m] if s == 0 else carried[m]
                    args = _to(x if isinstance(x, tuple) else (x,), self.devices[s])
                    carried[m] = self.stages[s](*args)
        return torch.cat([_to(out, self.devices[0]) for out in carried])
