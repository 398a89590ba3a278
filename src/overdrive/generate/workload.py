"""What `optimize`, `bench` and `run` need of a causal LM: the model, its tokenizer, and real text apart for each
use (`GenerationWorkload`). The built-ins are made in `workloads/generation.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn



@dataclass
class GenerationWorkload:
    """A causal LM and the held-out text its figures and guard are taken on; each list is token ids, apart from
    the others (no text is both judged and calibrated on).

    Attributes:
        name: the workload's name (a plan records it and rebuilds the model from it).
        model: a Hugging Face causal LM that `Decoder.from_hf` takes (`decoder.FAMILIES`), fp32.
        tokenizer: its Hugging Face tokenizer.
        prompts: prompts the guard generates from and the timings run (the first ones of each batch).
        calibration: texts the per-layer searches measure each layer's KL on.
        held_out: texts the held-out perplexity is taken on.
        real_weights: trained weights (accuracy claims hold) rather than random ones (speed only).
        facts: what the workload says about itself (`overdrive list`).
        notes: what the user should know of how their model is judged (printed, and in the result's warnings).
    """

    name: str
    model: nn.Module
    tokenizer: object
    prompts: list[list[int]]
    calibration: list[list[int]]
    held_out: list[list[int]]
    real_weights: bool = True
    facts: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def prompt_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
