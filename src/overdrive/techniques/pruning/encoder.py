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

import enum
from dataclasses import dataclass

import torch
from torch import nn

from overdrive.techniques.pruning.recovery import PruningConfig, PruningTechnique, importance_gradients


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


def keep_heads(block: EncoderBlock, heads: torch.Tensor, gram: torch.Tensor | None = None) -> None:
    """Keep attention heads `heads` (sorted int64 indices) of `block`: q/k/v rows and output
    columns; with the output projection's input `gram`, its kept columns are refit (`refit`)."""
    size = block.head_size
    index = (heads.unsqueeze(1) * size + torch.arange(size, device=heads.device)).flatten()
    for linear in (block.attention.query, block.attention.key, block.attention.value):
        keep_out_features(linear, index.to(linear.weight.device))
    if gram is not None:
        refit(block.attention_output, index, gram)
    else:
        keep_in_features(block.attention_output, index.to(block.attention_output.weight.device))
    block.attention.num_attention_heads = len(heads)
    block.attention.all_head_size = len(heads) * size


def keep_ffn(block: EncoderBlock, neurons: torch.Tensor, gram: torch.Tensor | None = None) -> None:
    """Keep intermediate (FFN) neurons `neurons` of `block`: intermediate rows and output columns;
    with the output Linear's input `gram`, its kept columns are refit (`refit`)."""
    keep_out_features(block.intermediate, neurons.to(block.intermediate.weight.device))
    if gram is not None:
        refit(block.output, neurons, gram)
    else:
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


class _StopForward(Exception):
    """Raised by a calibration hook once it has what it needs: the rest of the forward is skipped."""


@torch.no_grad()
def input_gram(model: nn.Module, linear: nn.Linear, inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The Gram matrix of `linear`'s inputs over all tokens of the batches `inputs`, augmented
    with a constant 1 feature (for the bias): float64 [in + 1, in + 1]. Each forward stops at
    `linear`, so the layers after it cost nothing.

    Its diagonal gives each input feature's squared activation norm (activation importance);
    the whole matrix gives the least-squares refit of the Linear after pruning (`refit`).
    """
    gram = torch.zeros(linear.in_features + 1, linear.in_features + 1, dtype=torch.float64, device=linear.weight.device)

    def accumulate(_module, args):
        x = args[0].float().reshape(-1, args[0].shape[-1])
        x = torch.cat([x, torch.ones(x.shape[0], 1, device=x.device)], dim=1)
        gram.add_((x.T @ x).double())
        raise _StopForward

    handle = linear.register_forward_pre_hook(accumulate)
    try:
        for batch in inputs:
            try:
                model(*batch)
            except _StopForward:
                pass
    finally:
        handle.remove()
    return gram


def activation_norm(gram: torch.Tensor) -> torch.Tensor:
    """‖x_j‖ over the calibration tokens for each input feature j, float32 [in], from `input_gram`."""
    return gram.diagonal()[:-1].clamp_min(0).sqrt().float()


@torch.no_grad()
def refit(linear: nn.Linear, kept: torch.Tensor, gram: torch.Tensor, *, ridge: float = 1e-3) -> None:
    """Keep input features `kept` of `linear` and re-solve its weight and bias by least squares so
    that, on the calibration inputs, it reproduces the output it had with all its inputs
    (the layer-wise reconstruction of Kwon et al., "A Fast Post-Training Pruning Framework for
    Transformers", NeurIPS 2022), with ridge `ridge` × the mean diagonal. In place."""
    n = linear.in_features
    has_bias = linear.bias is not None
    full = linear.weight.double()
    if has_bias:
        full = torch.cat([full, linear.bias.double().unsqueeze(1)], dim=1)  # [out, n + 1]
        rows = torch.cat([kept.to(gram.device), torch.tensor([n], device=gram.device)])
        columns = gram
    else:
        rows, columns = kept.to(gram.device), gram[:n, :n]
    lhs = gram[rows][:, rows]
    lhs = lhs + ridge * lhs.diagonal().mean() * torch.eye(len(rows), dtype=lhs.dtype, device=lhs.device)
    solution = torch.linalg.solve(lhs, columns[rows] @ full.T)  # [k (+1), out]
    weight = solution[: len(kept)].T
    linear.weight = nn.Parameter(weight.to(linear.weight.dtype).contiguous())
    if has_bias:
        linear.bias = nn.Parameter(solution[-1].to(linear.bias.dtype).contiguous())
    linear.in_features = len(kept)


def calibration_batches(workload, device: torch.device, *, num_samples: int = 1024) -> list[tuple]:
    """The first `num_samples` training samples, collated one per batch for text (so no padding
    token enters the statistics) and 32 per batch otherwise. Evaluation samples are never used.

    Raises:
        ValueError: the workload has no training samples.
    """
    if not workload.train_samples:
        raise ValueError("activation importance and reconstruction need training samples to calibrate on; use l2")
    samples = list(workload.train_samples[:num_samples])
    size = 1 if workload.is_text else 32
    return [tuple(t.to(device) for t in workload.collate(samples[i:i + size])) for i in range(0, len(samples), size)]


class UnitImportance(str, enum.Enum):
    """How heads or FFN neurons are ranked (see prune_heads / prune_ffn)."""

    AUTO = "auto"  # activation when the workload has training samples to calibrate on, else l2
    L2 = "l2"
    TAYLOR = "taylor"
    ACTIVATION = "activation"


@dataclass(frozen=True, kw_only=True)
class EncoderPruningConfig(PruningConfig):
    """Fields prune-heads and prune-ffn share (and PruningConfig's fine-tune fields):
    ratio: fraction of each layer's heads / FFN width to remove, in (0, 1).
    importance: how the units are ranked.
    reconstruct: refit the output Linear's kept columns by least squares on training samples so
        the layer reproduces its unpruned output (when the workload has training samples).
    """

    ratio: float = 1 / 3
    importance: UnitImportance = UnitImportance.AUTO
    reconstruct: bool = True

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "importance", UnitImportance(self.importance))
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"{type(self).__name__}.ratio must be in (0, 1), got {self.ratio}")


def weight_score(t: torch.Tensor, taylor: bool) -> torch.Tensor:
    """Per-entry importance of a weight: w² (magnitude) or |w · ∂L/∂w| (first-order Taylor)."""
    if taylor:
        return (t.detach() * t.grad).abs() if t.grad is not None else torch.zeros_like(t)
    return t.detach() ** 2


class EncoderPruningTechnique(PruningTechnique):
    """The prune loop prune-heads and prune-ffn share: per encoder layer, in order, count the units
    to keep, score them (weights, Taylor, or calibration activations), keep the best, and refit
    the layer's output Linear; then update the config. Subclasses say which Linear receives the
    units, how many to keep, how to score and how to keep them."""

    def output_linear(self, block: EncoderBlock) -> nn.Linear:
        raise NotImplementedError

    def counts(self, block: EncoderBlock, config) -> tuple[int, int]:
        """(units now, units to keep)."""
        raise NotImplementedError

    def scores(self, block: EncoderBlock, taylor: bool, activation: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, block: EncoderBlock, kept: torch.Tensor, gram: torch.Tensor | None) -> None:
        raise NotImplementedError

    def applicability(self, workload, device):
        if not find_blocks(workload.model):
            return "not applicable: no BERT-style encoder layers (attention.self.query/key/value, intermediate.dense) in the model"
        return None

    def prune(self, model, config, *, workload, device):
        blocks = find_blocks(model)
        importance = config.importance
        if importance is UnitImportance.AUTO:
            importance = UnitImportance.ACTIVATION if workload.train_samples else UnitImportance.L2
        reconstruct = config.reconstruct and bool(workload.train_samples)
        taylor = importance is UnitImportance.TAYLOR
        if taylor:
            importance_gradients(model, workload, device)
        activation = importance is UnitImportance.ACTIVATION
        batches = calibration_batches(workload, device) if activation or reconstruct else None
        for block in blocks:  # in order: each layer's statistics see the layers before it already pruned
            current, keep = self.counts(block, config)
            if keep >= current:
                continue
            gram = input_gram(model, self.output_linear(block), batches) if batches else None
            scores = self.scores(block, taylor, activation_norm(gram) if activation else None)
            self.keep(block, scores.topk(keep).indices.sort().values, gram if reconstruct else None)
        model.zero_grad(set_to_none=True)
        update_config(model, blocks)
        return {"importance": importance.value, "reconstructed": reconstruct}

    def distillation_hints(self, model, teacher):
        return layer_hints(model, teacher)
