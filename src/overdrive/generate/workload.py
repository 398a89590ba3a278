"""What `optimize`, `bench` and `run` need of a causal LM: the model, its tokenizer, and real text apart for each
use (`GenerationWorkload`). Built-in: `pydoc-lm` (`workloads/pydoc_lm.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from overdrive.core.errors import ConfigError

GENERATION_WORKLOADS = ("pydoc-lm",)


@dataclass
class GenerationWorkload:
    """A causal LM and the held-out text its figures and guard are taken on; each list is token ids, apart from
    the others (no text is both judged and calibrated on).

    Attributes:
        name: the workload's name (a plan records it and rebuilds the model from it).
        model: a Hugging Face causal LM of the Llama family (`Decoder.from_hf` takes it), fp32.
        tokenizer: its Hugging Face tokenizer.
        prompts: prompts the guard generates from and the timings run (the first ones of each batch).
        calibration: texts the per-layer searches measure each layer's KL on.
        held_out: texts the held-out perplexity is taken on.
        real_weights: trained weights (accuracy claims hold) rather than random ones (speed only).
        facts: what the workload says about itself (`overdrive list`).
    """

    name: str
    model: nn.Module
    tokenizer: object
    prompts: list[list[int]]
    calibration: list[list[int]]
    held_out: list[list[int]]
    real_weights: bool = True
    facts: dict = field(default_factory=dict)

    def prompt_text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def is_generation_workload(spec) -> bool:
    return isinstance(spec, str) and spec in GENERATION_WORKLOADS


def create_generation_workload(spec: str, *, num_prompts: int = 32, log=None) -> GenerationWorkload:
    """The built-in generation workload `spec`. pydoc-lm's held-out sentences are split in order: the first
    `num_prompts` give prompts (their first six words), the next 32 calibrate, the next 96 measure perplexity.

    Raises:
        ConfigError: an unknown name.
    """
    if spec != "pydoc-lm":
        raise ConfigError(f"unknown generation workload {spec!r}; expected one of {', '.join(GENERATION_WORKLOADS)}")
    import transformers

    from overdrive.workloads.pydoc_lm import build_pydoc_lm

    bar = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" on stderr: not the user's business
    try:
        lm = build_pydoc_lm(log=log)
    finally:
        if bar:
            transformers.utils.logging.enable_progress_bar()
    tok = lm.tokenizer
    sentences = list(lm.held_out)
    ids = [tok(s)["input_ids"] for s in sentences]
    prompts = [tok(" ".join(s.split()[:6]))["input_ids"] for s in sentences[:num_prompts]]
    calibration = [x for x in ids[num_prompts:num_prompts + 32] if len(x) >= 2]
    held_out = [x for x in ids[num_prompts + 32:num_prompts + 128] if len(x) >= 2]
    return GenerationWorkload(name=spec, model=lm.model, tokenizer=tok, prompts=prompts, calibration=calibration,
                              held_out=held_out, facts=dict(lm.facts))
