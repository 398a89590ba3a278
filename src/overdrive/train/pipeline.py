"""Pipeline parallelism with `torch.distributed.pipelining`: the model's blocks are cut into
one contiguous stage per rank, and each step's batch into microbatches that flow through the
stages under a GPipe (Huang et al., NeurIPS 2019) or 1F1B (Narayanan et al., "PipeDream",
SOSP 2019) schedule.

Stages are built by hand from the model rather than traced, so they work on any
`nn.Sequential` and on transformers' encoders inside `SentenceEmbedder` (minilm): each rank
keeps a copy of the model in which the blocks of other stages are replaced by parameter-free
pass-throughs. Parameter names are therefore those of the whole model, and a pipeline
checkpoint loads at any other strategy or world size (and back).

Split points balance the measured forward time of each block (one timed forward over a
microbatch, taken on every rank and averaged so all ranks agree), unless the user gives them.
Embeddings and pooling are not counted; they stay with the first and last stage.

Idle time: with p stages, m microbatches and equal stages, GPipe leaves each stage idle for a
fraction (p − 1)/(m + p − 1) of a step (the "bubble"); `PipelineRunner` measures the real
fraction per rank as 1 − (time in the stage's forward/backward compute) / (time in the
schedule's step, which all stages enter together). Sends and receives count as idle.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from overdrive.core.timer import Timer
from overdrive.core.transformer import find_blocks
from overdrive.train.launch import DistEnv
from overdrive.train.parallel import ParallelDims


def balanced_split(costs: list[float], stages: int) -> list[int]:
    """Cut `costs` (one per block, in order) into `stages` contiguous, non-empty parts that
    minimise the largest part's sum (exact dynamic programme, O(n² · stages)).

    Returns:
        stages − 1 split points: the index of the first block of each stage after the first.

    Raises:
        ValueError: fewer blocks than stages.
    """
    n = len(costs)
    if n < stages:
        raise ValueError(f"{n} blocks cannot fill {stages} pipeline stages; use fewer processes")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][i]: first i blocks in s stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    points, i = [], n
    for s in range(stages, 1, -1):
        i = cut[s][i]
        points.append(i)
    return sorted(points)


def measure_block_costs(model: nn.Module, inputs: tuple[torch.Tensor, ...], *, repeats: int = 3) -> list[float]:
    """Median forward seconds of each of `find_blocks(model)`'s blocks on `inputs`, from
    forward hooks over `repeats` runs (after one warm-up run), timed on the inputs' device by
    `Timer` (on a GPU: the blocks' compute, not their kernel launches)."""
    _, blocks = find_blocks(model)
    timer = Timer(inputs[0].device)
    times: list[list[float]] = [[] for _ in blocks]
    starts: dict[int, object] = {}
    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: starts.__setitem__(i, timer.start())))
        handles.append(block.register_forward_hook(lambda _m, _a, _o, i=i: times[i].append(timer.stop(starts[i]))))
    try:
        with torch.no_grad():
            for _ in range(repeats + 1):
                model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return [sorted(t[1:])[len(t[1:]) // 2] for t in times]


class _SkipBlock(nn.Module):
    """A pass-through standing in for another stage's block (returns what the block would
    return in place of its output: the hidden states, or a 1-tuple for older transformers)."""

    def __init__(self, as_tuple: bool):
        super().__init__()
        self.as_tuple = as_tuple

    def forward(self, hidden_states, *args, **kwargs):
        return (hidden_states,) if self.as_tuple else hidden_states


class _PassEmbeddings(nn.Module):
    """Stands in for a transformer's embeddings after the first stage: the hidden states
    arrive as `inputs_embeds` and go on unchanged."""

    def forward(self, *args, inputs_embeds=None, **kwargs):
        return inputs_embeds


class _TransformerStage(nn.Module):
    """One stage of a SentenceEmbedder: (input_ids, mask) or (hidden, mask) in; (hidden, mask)
    out, or the pooled embedding on the last stage. `encoder` keeps the whole model's name."""

    def __init__(self, embedder: nn.Module, first: bool, last: bool):
        super().__init__()
        self.encoder, self.first, self.last = embedder.encoder, first, last

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor):
        from overdrive.workloads.minilm import mean_pool

        key = "input_ids" if self.first else "inputs_embeds"
        hidden = self.encoder(**{key: x}, attention_mask=attention_mask).last_hidden_state
        return mean_pool(hidden, attention_mask) if self.last else (hidden, attention_mask)


def build_stage_module(model: nn.Module, stage: int, split_points: list[int]) -> tuple[nn.Module, range]:
    """This rank's stage: a copy of `model` keeping only blocks [start, stop).

    Returns:
        (stage module, the range of block indices it owns).

    Raises:
        ValueError: a model that is neither an nn.Sequential nor a SentenceEmbedder over a
            transformers encoder, or split points outside its blocks.
    """
    name, blocks = find_blocks(model)
    bounds = [0, *split_points, len(blocks)]
    if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
        raise ValueError(f"split points {split_points} must lie strictly inside the {len(blocks)} blocks")
    owned = range(bounds[stage], bounds[stage + 1])
    first, last = stage == 0, stage == len(split_points)
    copied = copy.deepcopy(model)
    container = copied.get_submodule(name)
    if isinstance(copied, nn.Sequential) and container is copied:
        for i in range(len(container)):
            if i not in owned:
                container[i] = nn.Identity()
        return copied, owned
    from overdrive.workloads.minilm import SentenceEmbedder

    if not isinstance(copied, SentenceEmbedder):
        raise ValueError(f"pipeline parallel needs an nn.Sequential or a transformers sentence encoder; got "
                         f"{type(model).__name__} (return an nn.Sequential of blocks from your factory)")
    import transformers

    as_tuple = int(transformers.__version__.split(".")[0]) < 5  # transformers 4 layers return tuples
    for i in range(len(container)):
        if i not in owned:
            container[i] = _SkipBlock(as_tuple)
    if not first:
        copied.encoder.embeddings = _PassEmbeddings()
    return _TransformerStage(copied, first, last), owned


PAD_MULTIPLE = 16


def pad_token_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Pad integer [B, S] inputs (token ids, attention masks) with 0 to a multiple of
    PAD_MULTIPLE along S: pipeline stages exchange fixed-shape buffers per shape, so this
    bounds the number of shapes (and schedules) a run creates. Masked positions do not change
    a masked encoder's outputs."""
    out = []
    for t in inputs:
        if t.dim() == 2 and not t.dtype.is_floating_point and t.shape[1] % PAD_MULTIPLE:
            t = nn.functional.pad(t, (0, PAD_MULTIPLE - t.shape[1] % PAD_MULTIPLE))
        out.append(t)
    return tuple(out)


class PipelineRunner:
    """Runs one optimizer step's forward and backward through this rank's stage.

    Args:
        stage_module: from `build_stage_module`, on `env.device`, in train mode.
        dims: the pipeline layout (stages = world size, microbatches, schedule).
        env: this rank.
        loss_fn: loss_fn(output, target) -> scalar, for one microbatch (last stage only).

    A `PipelineStage` and schedule are made per input shape (every rank sees the same batch,
    so all make the same ones). `steady_busy_s` and `steady_schedule_s` accumulate the time
    inside the stage's forward and backward computations and inside the schedule's steps, over
    steps of an already seen shape: 1 − their ratio is the bubble fraction.
    """

    def __init__(self, stage_module: nn.Module, dims: ParallelDims, env: DistEnv, loss_fn: Callable):
        self.module, self.dims, self.env, self.loss_fn = stage_module, dims, env, loss_fn
        self.first, self.last = env.rank == 0, env.rank == dims.pp - 1
        self.schedules: dict[tuple, object] = {}
        self.timer = Timer(env.device)  # on a GPU: compute time, not launch time
        self.busy_s = 0.0  # inside the stage's forward and backward computations
        # over steps whose shape was seen before: compute time, and time inside the schedule's step
        # (compute, sends, receives and waits)
        self.steady_busy_s = self.steady_schedule_s = 0.0

    def _schedule(self, inputs: tuple[torch.Tensor, ...]):
        key = tuple(tuple(t.shape) for t in inputs)
        if key not in self.schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(self.module, self.env.rank, self.dims.pp, self.env.device)
            for method in ("forward_one_chunk", "backward_one_chunk"):
                setattr(stage, method, self._timed(getattr(stage, method)))
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.dims.schedule]
            self.schedules[key] = kind(stage, self.dims.num_microbatches, loss_fn=self.loss_fn, scale_grads=True)
        return self.schedules[key]

    def close(self) -> None:
        """Drop the stages and schedules (and the communication state they hold) while the process
        group is alive: left to interpreter exit, gloo aborts the process now and then."""
        dist.barrier()
        self.schedules.clear()
        gc.collect()

    def _timed(self, fn):
        def run(*args, **kwargs):
            start = self.timer.start()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += self.timer.stop(start)

        return run

    def step(self, inputs: tuple[torch.Tensor, ...], target: torch.Tensor | None) -> torch.Tensor:
        """Forward and backward of one batch (split into microbatches along dim 0); returns the
        mean microbatch loss on every rank (broadcast from the last stage).

        Args:
            inputs: the whole batch, on every rank (only the first stage feeds it in).
            target: the batch's target on the last stage, None elsewhere.
        """
        inputs = pad_token_inputs(inputs)
        new_shape = tuple(tuple(t.shape) for t in inputs) not in self.schedules
        schedule = self._schedule(inputs)
        losses: list[torch.Tensor] = []
        dist.barrier()  # all stages start the schedule together, so its time is the pipeline's own
        busy, start = self.busy_s, self.timer.start()
        if self.first:
            schedule.step(*inputs)
        elif self.last:
            schedule.step(target=target, losses=losses)
        else:
            schedule.step()
        if not new_shape:  # a new shape's first step also infers the shapes between stages
            self.steady_busy_s += self.busy_s - busy
            self.steady_schedule_s += self.timer.stop(start)
        loss = torch.stack([x.detach().float() for x in losses]).mean() if losses else torch.zeros((), device=self.env.device)
        dist.broadcast(loss, src=self.dims.pp - 1)
        return loss
