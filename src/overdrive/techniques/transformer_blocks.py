"""Finding BERT-style encoder blocks and shrinking their Linear layers, for prune-heads / prune-ffn.

A block is recognised by the module layout the Hugging Face BERT family shares (BERT, RoBERTa,
MiniLM, ELECTRA, XLM-R):

    layer.attention.self.{query,key,value}   Linear(hidden → heads × head_size), with the
                                             attributes num_attention_heads, attention_head_size
    layer.attention.output.dense             Linear(heads × head_size → hidden)
    layer.intermediate.dense                 Linear(hidden → intermediate)
    layer.output.dense                       Linear(intermediate → hidden)

transformers ≥ 5 reshapes q/k/v with `view(..., -1, head_size)`, so the number of heads
follows from the Linear widths; the attributes are updated too, for code that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class EncoderBlock:
    """One encoder layer's prunable parts; `name` is its path in `model.named_modules()`."""

    name: str
    layer: nn.Module  # the whole encoder layer (its output is a distillation hint)
    attention: nn.Module  # has query, key, value, num_attention_heads, attention_head_size
    attention_output: nn.Linear
    intermediate: nn.Linear
    output: nn.Linear

    @property
    def num_heads(self) -> int:
        return self.attention.query.out_features // self.attention.attention_head_size

    @property
    def head_size(self) -> int:
        return self.attention.attention_head_size


def find_blocks(model: nn.Module) -> list[EncoderBlock]:
    """Every BERT-style encoder layer in `model`, in module order (empty when there is none)."""
    blocks = []
    for name, module in model.named_modules():
        try:
            attention = module.attention.self
            block = EncoderBlock(name=name, layer=module, attention=attention, attention_output=module.attention.output.dense,
                                 intermediate=module.intermediate.dense, output=module.output.dense)
        except AttributeError:
            continue
        linears = (attention.query, attention.key, attention.value, block.attention_output, block.intermediate, block.output)
        if all(isinstance(m, nn.Linear) for m in linears) and hasattr(attention, "attention_head_size"):
            blocks.append(block)
    return blocks


@torch.no_grad()
def keep_out_features(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep only output features `index` (rows of the weight, entries of the bias), in place."""
    linear.weight = nn.Parameter(linear.weight[index].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias[index].clone())
    linear.out_features = len(index)


@torch.no_grad()
def keep_in_features(linear: nn.Linear, index: torch.Tensor) -> None:
    """Keep only input features `index` (columns of the weight), in place."""
    linear.weight = nn.Parameter(linear.weight[:, index].clone())
    linear.in_features = len(index)


def keep_heads(block: EncoderBlock, heads: torch.Tensor) -> None:
    """Keep attention heads `heads` (sorted int64 indices) of `block`: q/k/v rows and output columns."""
    size = block.head_size
    index = (heads.unsqueeze(1) * size + torch.arange(size, device=heads.device)).flatten()
    for linear in (block.attention.query, block.attention.key, block.attention.value):
        keep_out_features(linear, index.to(linear.weight.device))
    keep_in_features(block.attention_output, index.to(block.attention_output.weight.device))
    block.attention.num_attention_heads = len(heads)
    block.attention.all_head_size = len(heads) * size


def keep_ffn(block: EncoderBlock, neurons: torch.Tensor) -> None:
    """Keep intermediate (FFN) neurons `neurons` of `block`: intermediate rows and output columns."""
    keep_out_features(block.intermediate, neurons.to(block.intermediate.weight.device))
    keep_in_features(block.output, neurons.to(block.output.weight.device))


def update_config(model: nn.Module, blocks: list[EncoderBlock]) -> None:
    """Write the new widths into the model's config(s): num_attention_heads and intermediate_size
    where every layer agrees, head_dim (unchanged by head pruning, but no longer hidden ÷ heads),
    and the per-layer lists in `overdrive_pruning`."""
    heads = [b.num_heads for b in blocks]
    widths = [b.intermediate.out_features for b in blocks]
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")}
    for config in configs.values():
        if len(set(heads)) == 1:
            config.num_attention_heads = heads[0]
        if len(set(widths)) == 1:
            config.intermediate_size = widths[0]
        config.head_dim = blocks[0].head_size
        config.overdrive_pruning = {"heads_per_layer": heads, "intermediate_size_per_layer": widths}


def kept_count(current: int, ratio: float, round_to: int) -> int:
    """How many of `current` units to keep when removing `ratio` of them, rounded to a multiple
    of `round_to` (at least one multiple, at most `current`)."""
    keep = current * (1.0 - ratio)
    keep = max(round_to, int(round(keep / round_to)) * round_to)
    return min(current, keep)


def layer_hints(student: nn.Module, teacher: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(student layer, teacher layer) pairs for intermediate-layer distillation."""
    return [(s.layer, t.layer) for s, t in zip(find_blocks(student), find_blocks(teacher), strict=True)]


@torch.no_grad()
def activation_norms(model: nn.Module, blocks: list[EncoderBlock], inputs: list[tuple[torch.Tensor, ...]],
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, the L2 norm over all tokens of each input feature of the attention output
    projection (heads × head_size context features) and of the FFN output Linear (intermediate
    neurons), accumulated over the batches `inputs`.

    Returns:
        (context norms: float [heads × head_size] per block, FFN norms: float [intermediate] per block).
    """
    context = [torch.zeros(b.attention_output.in_features, device=b.attention_output.weight.device) for b in blocks]
    ffn = [torch.zeros(b.output.in_features, device=b.output.weight.device) for b in blocks]

    def accumulate(store: torch.Tensor):
        def hook(_module, args):
            store.add_(args[0].float().reshape(-1, args[0].shape[-1]).pow(2).sum(0))
        return hook

    handles = [b.attention_output.register_forward_pre_hook(accumulate(c)) for b, c in zip(blocks, context)]
    handles += [b.output.register_forward_pre_hook(accumulate(f)) for b, f in zip(blocks, ffn)]
    try:
        for batch in inputs:
            model(*batch)
    finally:
        for h in handles:
            h.remove()
    return [c.sqrt() for c in context], [f.sqrt() for f in ffn]


def calibration_batches(workload, device: torch.device, *, batches: int = 8, batch_size: int = 32) -> list[tuple]:
    """Collated batches of the workload's training samples (evaluation samples when it has none
    would leak them, so it raises instead).

    Raises:
        ValueError: the workload has no training samples.
    """
    if not workload.train_samples:
        raise ValueError("activation importance needs training samples to calibrate on; use l2 here")
    samples = list(workload.train_samples[: batches * batch_size])
    return [tuple(t.to(device) for t in workload.collate(samples[i:i + batch_size]))
            for i in range(0, len(samples), batch_size)]
