"""The built-in workloads load real weights and data with no hub access."""

from __future__ import annotations

import pytest
import torch

from overdrive.workloads import create_workload
from overdrive.files.sentences import python_doc_sentences, python_docstring_sentences


def test_python_doc_sentences_are_real_and_plentiful():
    sentences = python_doc_sentences()
    assert len(sentences) >= 2048
    assert len(set(sentences)) == len(sentences)
    assert all(40 <= len(s) <= 300 for s in sentences)
    assert sum(s[0].isupper() or s[0] in "\"'(" for s in sentences) > 0.9 * len(sentences)


def test_training_sentences_never_include_an_evaluation_sentence():
    training = python_docstring_sentences()
    assert len(training) >= 5000 and len(set(training)) == len(training)
    assert not set(training) & set(python_doc_sentences())
    assert all(40 <= len(s) <= 300 for s in training)


def test_digits_cnn_training_split_is_apart_from_the_test_images():
    w = create_workload("digits-cnn")
    assert len(w.train_samples) == 1437 and w.train_labels.shape == (1437,)
    test = {tuple(x.flatten().tolist()) for x in w.samples}
    overlap = sum(tuple(x.flatten().tolist()) in test for x in w.train_samples)
    assert overlap <= 5  # scikit-learn's digits holds a few exact duplicate images across the split


def test_digits_cnn_has_real_test_accuracy(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERDRIVE_CACHE", str(tmp_path))
    w = create_workload("digits-cnn")  # trains (seeded) into the empty cache
    assert len(w.samples) == 360 and w.labels.shape == (360,)
    with torch.no_grad():
        acc = w.task_metric(w.model(torch.stack(list(w.samples))))["accuracy_pct"]
    assert acc >= 97.0
    assert list(tmp_path.glob("digits-cnn/*/digits_cnn.pt"))
    again = create_workload("digits-cnn")  # loads the cache: identical weights
    for a, b in zip(w.model.state_dict().values(), again.model.state_dict().values()):
        torch.testing.assert_close(a, b)


@pytest.mark.slow
def test_minilm_matches_sentence_transformers():
    """Our loading + pooling reproduces sentence-transformers' own encode on the same files."""
    from sentence_transformers import SentenceTransformer

    w = create_workload("minilm")
    sentences = list(w.samples[:16])
    ids, mask = w.collate(sentences)
    with torch.no_grad():
        ours = w.model(ids, mask)
    theirs = SentenceTransformer(w.extra["model_path"], device="cpu").encode(sentences, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(ours, theirs.float(), dim=-1)
    assert cos.min().item() > 0.9999
    assert w.extra["max_seq_length"] == 256 and ours.shape == (16, 384)


def test_torchvision_by_name_has_random_weights_flagged():
    w = create_workload("resnet18")
    assert not w.real_weights and w.fidelity_key == "min_cosine"
    assert w.collate(list(w.samples[:2]))[0].shape == (2, 3, 224, 224)


def test_bert_base_random_tokens_follow_the_real_sentences():
    w = create_workload("bert-base-random")
    assert not w.real_weights and len(w.samples) == 2048
    ids, mask = w.collate(list(w.samples[:4]))
    assert ids.shape == mask.shape and ids.dtype == torch.int64
    assert mask.sum(-1).tolist() == [w.sample_length(s) for s in w.samples[:4]]
    assert (ids[:, 0] == 101).all()  # [CLS]
    with torch.no_grad():
        assert w.model(ids, mask).shape == (4, 768)
