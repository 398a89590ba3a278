"""The prune loop prune-heads and prune-ffn share, and its calibration statistics.

The layers, their layouts (Hugging Face BERT family, torchvision ViT / nn.MultiheadAttention)
and the surgery on them are `overdrive.core.transformer`'s; this module ranks units (weights,
first-order Taylor, or calibration activations), keeps the best in each layer, and collects
the input Gram matrices that the activation criterion and the least-squares refit of the
layer's output Linear (Kwon et al., NeurIPS 2022; `overdrive.core.transformer.refit`) use.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from overdrive.core.transformer import SUPPORTED_LAYOUTS, EncoderLayer, encoder_layers, update_config
from overdrive.techniques.graph_programs import ATTENTION_OPS, holds_graph, missing_layers_reason
from overdrive.techniques.pruning.recovery import PruningConfig, PruningTechnique, importance_gradients


def kept_count(current: int, ratio: float, round_to: int) -> int:
    """How many of `current` units to keep when removing `ratio` of them, rounded to a multiple
    of `round_to` (at least one multiple, at most `current`)."""
    keep = current * (1.0 - ratio)
    keep = max(round_to, int(round(keep / round_to)) * round_to)
    return min(current, keep)


def layer_hints(student: nn.Module, teacher: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(student layer, teacher layer) pairs for intermediate-layer distillation."""
    return [(s.layer, t.layer) for s, t in zip(encoder_layers(student), encoder_layers(teacher), strict=True)]


class _StopForward(Exception):
    """Raised by a calibration hook once it has what it needs: the rest of the forward is skipped."""


@torch.no_grad()
def input_gram(model: nn.Module, linear: nn.Linear, inputs: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """The Gram matrix of `linear`'s inputs over all tokens of the batches `inputs`, augmented
    with a constant 1 feature (for the bias): float64 [in + 1, in + 1]. Each forward stops at
    `linear`, so the layers after it cost nothing.

    Its diagonal gives each input feature's squared activation norm (activation importance);
    the whole matrix gives the least-squares refit of the Linear after pruning
    (`overdrive.core.transformer.refit`).
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
    """The prune loop prune-heads and prune-ffn share: per encoder layer (`encoder_layers`), in
    order, count the units to keep, score them (weights, Taylor, or calibration activations),
    keep the best, and refit the layer's output Linear; then update the config. Subclasses say
    which Linear receives the units, how many to keep, how to score and how to keep them, and
    what a layer needs before it is scored (`prepare`)."""

    def output_linear(self, block: EncoderLayer) -> nn.Linear:
        raise NotImplementedError

    def counts(self, block: EncoderLayer, config) -> tuple[int, int]:
        """(units now, units to keep)."""
        raise NotImplementedError

    def scores(self, block: EncoderLayer, taylor: bool, activation: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def keep(self, block: EncoderLayer, kept: torch.Tensor, gram: torch.Tensor | None) -> None:
        raise NotImplementedError

    def prepare(self, block: EncoderLayer, model: nn.Module) -> None:
        """Make `block` ready to be scored and pruned, losslessly (nothing by default)."""

    def applicability(self, workload, device):
        if not encoder_layers(workload.model):
            if holds_graph(workload.model):
                rewrites = f"{self.name} rewrites encoder-layer modules (BERT layout, nn.MultiheadAttention)"
                return missing_layers_reason(workload.model, layers="encoder", ops=ATTENTION_OPS, rewrites=rewrites)
            return f"not applicable: no {SUPPORTED_LAYOUTS} in the model"
        return None

    def prune(self, model, config, *, workload, device):
        blocks = encoder_layers(model)
        # only layers that lose units are touched (a ratio that rounds back to the full width changes nothing)
        todo = [(block, keep) for block in blocks for current, keep in [self.counts(block, config)] if keep < current]
        for block, _ in todo:  # before gradients and statistics, which must see the modules that are pruned
            self.prepare(block, model)
        importance = config.importance
        if importance is UnitImportance.AUTO:
            importance = UnitImportance.ACTIVATION if workload.train_samples else UnitImportance.L2
        reconstruct = config.reconstruct and bool(workload.train_samples)
        taylor = importance is UnitImportance.TAYLOR
        if taylor:
            importance_gradients(model, workload, device)
        activation = importance is UnitImportance.ACTIVATION
        batches = calibration_batches(workload, device) if activation or reconstruct else None
        for block, keep in todo:  # in order: each layer's statistics see the layers before it already pruned
            gram = input_gram(model, self.output_linear(block), batches) if batches else None
            scores = self.scores(block, taylor, activation_norm(gram) if activation else None)
            self.keep(block, scores.topk(keep).indices.sort().values, gram if reconstruct else None)
        model.zero_grad(set_to_none=True)
        update_config(model, blocks)
        return {"importance": importance.value, "reconstructed": reconstruct}

    def distillation_hints(self, model, teacher):
        return layer_hints(model, teacher)
