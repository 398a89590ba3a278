"""Workload registry: `list_workloads()` and `create_workload(spec)`.

A spec is a built-in name (`minilm`, `digits-cnn`), a torchvision architecture name
(`resnet50`), an import path (`package.module:factory`), or a saved model file.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from overdrive.core.errors import WorkloadError
from overdrive.core.workload import Workload, embedding_fidelity, logits_fidelity

__all__ = ["Workload", "create_workload", "list_workloads", "embedding_fidelity", "logits_fidelity"]


def _minilm() -> Workload:
    from overdrive.workloads.minilm import build_minilm

    return build_minilm()


def _digits() -> Workload:
    from overdrive.workloads.digits import build_digits_cnn

    return build_digits_cnn()


def _bert_base_random() -> Workload:
    from overdrive.workloads.bert_random import build_bert_base_random

    return build_bert_base_random()


BUILTIN: dict[str, tuple[Callable[[], Workload], str]] = {
    "minilm": (_minilm, "all-MiniLM-L6-v2 sentence embeddings, real weights, real sentences"),
    "digits-cnn": (_digits, "small CNN trained on scikit-learn digits, real test accuracy"),
    "bert-base-random": (_bert_base_random, "BERT-base shape, random weights, real sentence lengths (speed only)"),
}


def list_workloads() -> dict[str, str]:
    """Built-in workload names with a one-line description (torchvision names are extra)."""
    return {name: desc for name, (_, desc) in BUILTIN.items()} | {
        "pydoc-lm": "a causal LM (LlamaForCausalLM, 11 M parameters, byte-level BPE) trained here on CPython's docs "
                    "(once, ~11 min on 2 cores; real weights); optimize / bench / run generate with it "
                    "(docs/generate.md); `python -m overdrive.workloads.pydoc_lm` prints its held-out perplexity",
        "llama-125m-random": "a causal LM of a real shape (LlamaForCausalLM, 768 wide, 12 layers, GQA 12/4, 32k "
                             "vocabulary), random weights: generation speed only",
        "gpt2-small-random": "GPT-2 small's shape (GPT2LMHeadModel, 124 M parameters), random weights: generation "
                             "speed only",
        "<torchvision name>": "any torchvision classifier, e.g. resnet50 (random weights: speed only)",
        "package.module:factory": "your factory returning a Workload, (model, example_input), or (causal LM, "
                                  "tokenizer) for generation",
        "<file>.pt / .pt2": "a TorchScript or torch.export archive",
    }


def create_workload(
    spec: str, *, input_shape: tuple[int, ...] | None = None, input_dtype: torch.dtype = torch.float32,
    dynamic_dims: dict | None = None,
) -> Workload:
    """Build the workload a user named.

    Args:
        dynamic_dims: for a `(model, example)` factory or a model file: the dimensions whose size
            varies from row to row (see `overdrive.workloads.user.workload_from_model`).

    Raises:
        WorkloadError: nothing by that name, an import path that fails, or a file that is not a model.
        ConfigError: `dynamic_dims` for a workload that brings its own rows (a built-in, a Workload).
    """
    if not spec.strip():
        raise WorkloadError("the workload is empty; expected a name (see `overdrive list`), 'package.module:factory' or a model file")
    if spec.startswith("<python "):  # a plan `overdrive.optimize` made from a module or Workload object
        raise WorkloadError(f"{spec} is a model that was passed in Python, which no name can rebuild; load the plan "
                            "with overdrive.load(plan, model)")
    if ":" in spec and not Path(spec).exists():
        from overdrive.workloads.user import build_from_import_path

        return build_from_import_path(spec, dynamic_dims=dynamic_dims)
    path = Path(spec)
    if spec not in BUILTIN and (path.suffix or path.exists()):
        from overdrive.workloads.user import build_from_file

        return build_from_file(path, input_shape=input_shape, input_dtype=input_dtype, dynamic_dims=dynamic_dims)
    if dynamic_dims:
        from overdrive.core.errors import ConfigError, arg

        raise ConfigError(f"{arg('dynamic_dims')} applies to a (model, example) factory or a model file; {spec!r} "
                          "brings its own rows")
    if spec in BUILTIN:
        return BUILTIN[spec][0]()
    from overdrive.workloads.vision import build_torchvision, torchvision_names

    if spec in torchvision_names():
        return build_torchvision(spec)
    raise WorkloadError(
        f"unknown workload {spec!r}; expected one of {', '.join(BUILTIN)}, a torchvision model name "
        "(e.g. resnet50), 'package.module:factory', or a .pt/.pt2 file (see `overdrive list`)"
    )
