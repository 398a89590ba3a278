"""The generation workloads (`generate.workload.GenerationWorkload`): the built-in `pydoc-lm`, with its held-out
sentences split into prompts, calibration and perplexity texts, and a user's own Hugging Face causal LM
(`lm_workload`: passed in Python, or a `package.module:factory` returning (model, tokenizer))."""

from __future__ import annotations

import copy

import torch
from torch import nn

from overdrive.core.errors import ConfigError, WorkloadError, arg
from overdrive.generate.workload import GenerationWorkload

# Random-weight causal LMs of real shapes, for speed only (`real_weights` False): (family, Hugging Face config).
RANDOM_LMS = {
    "llama-125m-random": ("llama", dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                                        tie_word_embeddings=False)),
    "llama-1b-random": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                                      tie_word_embeddings=True)),  # Llama 3.2 1B's shape: for a GPU
    "gpt2-small-random": ("gpt2", dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
}
GENERATION_WORKLOADS = ("pydoc-lm", *RANDOM_LMS)
PYTHON_LM_PREFIX = "<python causal LM "  # the workload of a plan made from a model passed in Python


def is_generation_workload(spec) -> bool:
    """A built-in generation workload's name, or a `package.module:factory` whose factory returns (causal LM,
    tokenizer): the factory is called once, and its result kept for the one build that follows
    (`workloads.user.call_factory`)."""
    if not isinstance(spec, str):
        return False
    if spec in GENERATION_WORKLOADS:
        return True
    if ":" not in spec or spec.startswith("<"):
        return False
    from pathlib import Path

    from overdrive.workloads.user import call_factory

    if Path(spec).exists():
        return False
    made, _ = call_factory(spec, keep=True)
    return isinstance(made, tuple) and len(made) == 2 and is_causal_lm(made[0])


def is_causal_lm(model) -> bool:
    """A Hugging Face model that generates text token by token (`PreTrainedModel.can_generate()`: a LM head and
    the generation mixin), and not an encoder-decoder."""
    config = getattr(model, "config", None)
    can_generate = getattr(model, "can_generate", None)
    return (isinstance(model, nn.Module) and config is not None and callable(can_generate) and bool(can_generate())
            and not getattr(config, "is_encoder_decoder", False))


def lm_workload(name: str, model: nn.Module, tokenizer, prompts: list[str] | None = None, *,
                num_prompts: int = 32) -> GenerationWorkload:
    """A user's causal LM as a generation workload: `prompts` (your text; None: the first six words of CPython
    reference sentences) are what the guard generates from and the timings run; the per-layer searches calibrate on
    32 CPython reference sentences and the held-out perplexity is taken on 96 others (real English text shipped
    with Python; no model trained on it is assumed). The model is judged in fp32: one in another dtype is copied
    to fp32 for the reference (your model is not changed).

    Raises:
        WorkloadError: a model overdrive's decoder does not take (the family, RoPE scaling, sliding windows), or a
            tokenizer that does not return input_ids.
        ConfigError: prompts that are not a non-empty list of non-empty strings.
    """
    from overdrive.generate.decoder import DecoderConfig
    from overdrive.files.sentences import python_doc_sentences

    try:
        DecoderConfig.from_hf(model.config)
    except ValueError as exc:
        raise WorkloadError(f"{name}: {exc}") from None
    if prompts is not None and (isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts
                                or not all(isinstance(p, str) and p.strip() for p in prompts)):
        raise ConfigError(f"{arg('prompts')}: expected a non-empty list of non-empty strings")
    notes = []
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        model = copy.deepcopy(model).float()
        notes.append("the model's weights are not fp32: a copy in fp32 is the reference every technique is judged against")
    elif model.training:
        model = copy.deepcopy(model)  # eval mode (no dropout) on a copy: the caller's model stays in training mode
        notes.append("the model is in training mode: it is judged and timed in eval mode (no dropout), on a copy")
    model = model.eval()
    sentences = [s for s in python_doc_sentences() if len(s.split()) >= 8][::7]
    source = list(prompts) if prompts is not None else [" ".join(s.split()[:6]) for s in sentences[:num_prompts]]
    rest = sentences[num_prompts:] if prompts is None else sentences

    def encode(text: str) -> list[int]:
        try:
            ids = tokenizer(text)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - any tokenizer failure is the user's to see
            raise WorkloadError(f"{name}: the tokenizer failed on {text[:40]!r}: {exc}") from None
        return [int(i) for i in ids]

    encoded = [encode(p) for p in source]
    if not all(encoded):
        raise ConfigError(f"{arg('prompts')}: a prompt the tokenizer turns into no tokens")
    context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    calibration = [x[:context] for x in map(encode, rest[:32]) if len(x) >= 2]  # the model reads no more
    held_out = [x[:context] for x in map(encode, rest[32:128]) if len(x) >= 2]
    highest = max(max(x) for x in encoded + calibration + held_out)
    if highest >= model.config.vocab_size:
        raise WorkloadError(f"{name}: the tokenizer gives token id {highest}, beyond the model's vocabulary of "
                            f"{model.config.vocab_size}: the tokenizer is not the model's")
    facts = {"prompts": f"{len(encoded)} {'of yours' if prompts is not None else 'from CPython reference sentences'}"}
    return GenerationWorkload(name=name, model=model, tokenizer=tokenizer, prompts=encoded, calibration=calibration,
                              held_out=held_out, facts=facts, notes=notes)


def create_generation_workload(spec: str, *, num_prompts: int = 32, log=None) -> GenerationWorkload:
    """The built-in generation workload `spec`. pydoc-lm's held-out sentences are split in order: the first
    `num_prompts` give prompts (their first six words), the next 32 calibrate, the next 96 measure perplexity.

    Raises:
        ConfigError: an unknown name.
    """
    if spec.startswith(PYTHON_LM_PREFIX):
        raise WorkloadError(f"{spec} is a model that was passed in Python, which no name can rebuild; use "
                            "overdrive.generate.plan.build_generator(model, tokenizer, plan.steps)")
    if spec in RANDOM_LMS:
        return random_lm_workload(spec, num_prompts=num_prompts)
    if ":" in spec and spec != "pydoc-lm":
        from overdrive.workloads.user import call_factory

        made, name = call_factory(spec)
        if not (isinstance(made, tuple) and len(made) == 2 and is_causal_lm(made[0])):
            raise WorkloadError(f"{spec}() returned {type(made).__name__}; expected (causal LM, tokenizer)")
        return lm_workload(spec, *made, num_prompts=num_prompts)
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


def random_lm_workload(spec: str, *, num_prompts: int = 32) -> GenerationWorkload:
    """A `RANDOM_LMS` model (seeded random weights at Hugging Face's initializer: speed only, `real_weights` False)
    with pydoc-lm's tokenizer (`pydoc_lm.build_tokenizer`; its ids fit the larger vocabulary), on the same
    CPython reference text as a user's model (`lm_workload`)."""
    import transformers

    from overdrive.workloads.pydoc_lm import build_tokenizer

    family, shape = RANDOM_LMS[spec]
    tok = build_tokenizer()
    special = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape, **special))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, **special))
    workload = lm_workload(spec, model.eval(), tok, num_prompts=num_prompts)
    workload.real_weights = False
    workload.facts.update(weights="random (speed only: no accuracy claim)",
                          parameters=sum(p.numel() for p in model.parameters()))
    return workload
