"""Data and model parallelism on torch.distributed, one plain `apply_*` function per technique.

The strategies are torch's own: DistributedDataParallel, FSDP2 (`fully_shard`), DTensor tensor
parallelism, and `torch.distributed.pipelining`. Processes are started by torchrun (which also
spans nodes); `overdrive.train.launch` starts it for the user when asked for N processes. The
backend is NCCL on GPUs and gloo on CPU.

The order in which `overdrive.train.loop` applies them to a model, the one torchtitan uses
(Liang et al., "TorchTitan", ICLR 2025), is:

1. tensor parallel (`apply_tensor_parallel`): it rewrites Linear weights into DTensors, so it
   must see the plain model;
2. activation checkpointing per block (`apply_activation_checkpointing`);
3. torch.compile (per model, after the rewrites, so it traces what will run);
4. data parallel last (`apply_ddp` or `apply_fsdp`): it wraps or shards the final parameters.

Pipeline parallelism replaces steps 1 and 4: each rank builds only its stage
(`overdrive.train.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from overdrive.core.errors import ConfigError, arg
from overdrive.core.transformer import Layout, encoder_layer, find_blocks
from overdrive.train.launch import DistEnv

STRATEGIES = ("none", "ddp", "fsdp", "pipeline", "tensor-parallel")
SCHEDULES = ("gpipe", "1f1b")


class ParallelConfigError(ConfigError):
    """Degrees, microbatches or split points that cannot work; raised before any process starts."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How `world_size` processes divide the work: dp × pp × tp = world_size.

    One strategy per run: `ddp` and `fsdp` make every rank a data-parallel replica (dp =
    world_size), `pipeline` makes every rank a stage (pp = world_size), `tensor-parallel`
    splits every block across all ranks (tp = world_size); `none` is one process.

    Attributes:
        strategy: one of STRATEGIES.
        world_size: processes in the job (torchrun's WORLD_SIZE).
        microbatches: pipeline microbatches per step (pipeline only; default 2 × stages).
        schedule: "gpipe" or "1f1b" (pipeline only).
        split_points: pipeline only: the block index at which each stage after the first
            starts (pp − 1 increasing indices); None to balance the measured block costs.

    Raises:
        ParallelConfigError: an unknown strategy or schedule, degrees whose product is not the
            world size, fewer microbatches than pipeline stages, or malformed split points.
    """

    strategy: str
    world_size: int
    microbatches: int | None = None
    schedule: str = "gpipe"
    split_points: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ParallelConfigError(f"unknown strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.world_size < 1:
            raise ParallelConfigError(f"world size must be ≥ 1, got {self.world_size}")
        if self.strategy == "none" and self.world_size != 1:
            raise ParallelConfigError(f"strategy 'none' runs one process, but the world size is {self.world_size}; "
                                      f"choose {arg('strategy')} ddp, fsdp, pipeline or tensor-parallel")
        if self.dp * self.pp * self.tp != self.world_size:  # guards future mixed degrees
            raise ParallelConfigError(f"dp {self.dp} × pp {self.pp} × tp {self.tp} must equal the world size {self.world_size}")
        if self.strategy != "pipeline":
            if self.microbatches is not None or self.split_points is not None:
                raise ParallelConfigError(f"{arg('microbatches')} and {arg('split_points')} apply to {arg('strategy')} pipeline only")
            return
        if self.pp < 2:
            raise ParallelConfigError(f"pipeline parallelism needs ≥ 2 stages (processes), got {self.pp}; use {arg('world_size', 2)} or more")
        if self.schedule not in SCHEDULES:
            raise ParallelConfigError(f"unknown pipeline schedule {self.schedule!r}; expected one of {', '.join(SCHEDULES)}")
        if self.num_microbatches < self.pp:
            raise ParallelConfigError(
                f"{self.num_microbatches} microbatches for {self.pp} pipeline stages would leave stages idle every step "
                f"(bubble fraction ≥ (p−1)/(m+p−1) = {(self.pp - 1) / (self.num_microbatches + self.pp - 1):.2f}); "
                f"use {arg('microbatches')} ≥ {self.pp} (e.g. {2 * self.pp})")
        if self.split_points is not None:
            points = list(self.split_points)
            if len(points) != self.pp - 1 or points != sorted(set(points)) or points[0] < 1:
                raise ParallelConfigError(f"{arg('split_points')} needs {self.pp - 1} increasing block indices ≥ 1 for "
                                          f"{self.pp} stages, got {points}")

    @property
    def dp(self) -> int:
        return self.world_size if self.strategy in ("ddp", "fsdp") else 1

    @property
    def pp(self) -> int:
        return self.world_size if self.strategy == "pipeline" else 1

    @property
    def tp(self) -> int:
        return self.world_size if self.strategy == "tensor-parallel" else 1

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp


# -- the techniques -------------------------------------------------------------------------------


_ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Hardswish, nn.LeakyReLU, nn.Mish)


def _segments(seq: nn.Sequential) -> list[list[nn.Module]]:
    """A Sequential cut after each activation: conv-bn-relu groups are one segment each."""
    segments, current = [], []
    for module in seq:
        current.append(module)
        if isinstance(module, _ACTIVATIONS):
            segments.append(current)
            current = []
    return segments + ([current] if current else [])


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Recompute each block's activations in the backward pass instead of storing them
    (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016), with PyTorch's
    non-reentrant `torch.utils.checkpoint`.

    Blocks are `find_blocks`' entries (`overdrive.core.transformer`: transformer layers), or for
    a Sequential its segments ending at each activation. Parameter names are unchanged (the
    forward methods are replaced, no wrapper modules are added), so checkpoints load with or
    without it.

    Recomputation runs BatchNorm's forward twice per step in train mode, so its running
    statistics take two momentum updates per step; batch statistics, and so the loss and
    gradients, are unchanged.

    Returns:
        The number of checkpointed blocks.
    """
    _, blocks = find_blocks(model)
    if isinstance(blocks, nn.ModuleList):
        for block in blocks:
            block.forward = _checkpointed(block.forward)
        return len(blocks)
    segments = _segments(blocks)

    def forward(x):
        for segment in segments:
            x = checkpoint(_run_segment, segment, x, use_reentrant=False)
        return x

    blocks.forward = forward
    return len(segments)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _run_segment(segment, x):
    for module in segment:
        x = module(x)
    return x


def apply_ddp(model: nn.Module, env: DistEnv, *, find_unused_parameters: bool = False) -> nn.Module:
    """DistributedDataParallel (Li et al., VLDB 2020): gradients all-reduced in buckets,
    overlapped with the backward pass. Use `no_sync()` on accumulation micro-steps.

    Args:
        find_unused_parameters: after each forward, walk the autograd graph for the parameters
            it did not reach and reduce a zero gradient for them on this rank (a branch that
            depends on the data); costs one graph traversal per step.
    """
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                                   find_unused_parameters=find_unused_parameters)


def apply_fsdp(model: nn.Module, env: DistEnv, *, param_dtype: torch.dtype | None,
               reduce_unused: bool = False) -> nn.Module:
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across the
    data-parallel ranks (ZeRO-3, Rajbhandari et al. 2020), each block its own unit so one
    block's parameters are all-gathered while the previous block computes.

    Args:
        param_dtype: the dtype parameters are all-gathered and computed in (bf16 for mixed
            precision), with gradients reduced in fp32; None for fp32 throughout.
        reduce_unused: reduce-scatter a zero gradient for each parameter this rank's backward
            did not reach (`set_reduce_scatter_unused_params`, FSDP2's counterpart of DDP's
            `find_unused_parameters`), so ranks that took different branches still reduce the
            same parameters.

    Returns:
        The same module, sharded in place (its parameters become DTensors).

    Raises:
        ValueError: `reduce_unused` with a torch whose FSDP2 cannot do it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(env.device.type, (env.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    _, blocks = find_blocks(model)
    if isinstance(blocks, nn.ModuleList):
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if reduce_unused:
        if not hasattr(model, "set_reduce_scatter_unused_params"):
            raise ValueError(f"FSDP2 in torch {torch.__version__} cannot reduce parameters that only some ranks reached "
                             "(no set_reduce_scatter_unused_params); use DDP, or a newer torch")
        model.set_reduce_scatter_unused_params(True)
    return model


def apply_tensor_parallel(model: nn.Module, env: DistEnv) -> int:
    """Megatron-style tensor parallelism (Shoeybi et al., 2019) with DTensor: in each
    transformer block, the attention query/key/value and the FFN's first Linear are split
    column-wise (each rank computes its own heads and its slice of the FFN width) and the
    attention output and FFN output Linears row-wise (their partial sums are all-reduced), so a
    block costs two all-reduces forward and two backward. Embeddings, LayerNorms and the
    pooling stay replicated.

    Supports BERT-style blocks (`attention.self.{query,key,value}`, `attention.output.dense`,
    `intermediate.dense`, `output.dense`, as in transformers' BERT, RoBERTa, MiniLM); the plan's
    module paths are the layer adapter's (`overdrive.core.transformer.BertLayer.paths`).
    nn.MultiheadAttention layers (ViT) are refused: their q/k/v are one packed Linear.

    Returns:
        The number of blocks split.

    Raises:
        ValueError: the blocks are not BERT-style, or the heads or FFN width do not divide by
            the number of ranks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = env.world_size
    _, blocks = find_blocks(model)
    styles = {"query": ColwiseParallel, "key": ColwiseParallel, "value": ColwiseParallel,
              "attention_output": RowwiseParallel, "intermediate": ColwiseParallel, "output": RowwiseParallel}
    layers = []
    for block in blocks:
        layer = encoder_layer(block)
        if layer is None or layer.layout is not Layout.BERT:
            why = ("its nn.MultiheadAttention packs q/k/v into one in_proj_weight" if layer is not None
                   else "it lacks attention.self.{query,key,value}, attention.output.dense, intermediate.dense or output.dense")
            raise ValueError(f"tensor parallel supports BERT-style transformer blocks; {type(block).__name__} is not one: {why}")
        if layer.num_heads % tp or layer.intermediate.out_features % tp:
            raise ValueError(f"tensor parallel degree {tp} must divide the {layer.num_heads} attention heads and the FFN "
                             f"width {layer.intermediate.out_features}")
        layers.append(layer)
    mesh = init_device_mesh(env.device.type, (tp,))
    for layer in layers:
        parallelize_module(layer.layer, mesh, {path: styles[role]() for role, path in layer.paths().items()})
        for attr in ("num_attention_heads", "all_head_size"):  # older transformers reshape with these
            if hasattr(layer.attention, attr):
                setattr(layer.attention, attr, getattr(layer.attention, attr) // tp)
    return len(layers)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, *, group=None) -> torch.Tensor:
    """Clip gradients to a total L2 norm of `max_norm`; returns the norm before clipping (fp32 scalar).

    Works for any mix of plain and DTensor gradients (FSDP shards, tensor-parallel splits):
    each DTensor's norm is reduced over its mesh. `group`: a process group whose ranks hold
    disjoint parameters (pipeline stages), over which squared norms are summed.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g.float() if not isinstance(g, DTensor) else g, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum() if squares else torch.zeros(())
    if group is not None:
        dist.all_reduce(total, group=group)
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device) if not isinstance(g, DTensor) else coef.item())
    return total
