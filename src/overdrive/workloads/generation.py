"""The built-in generation workloads (`generate.workload.GenerationWorkload`): `pydoc-lm`, with its held-out
sentences split into prompts, calibration and perplexity texts."""

from __future__ import annotations

from overdrive.core.errors import ConfigError
from overdrive.generate.workload import GenerationWorkload

GENERATION_WORKLOADS = ("pydoc-lm",)


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
