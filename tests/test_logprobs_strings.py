"""OpenAI logprobs' token strings (`serve/logprobs.py`) with a SentencePiece-style tokenizer, as Llama's and
Mistral's: a token that starts a word keeps its space, a character split over byte tokens is carried whole by the
token that completes it, the strings join to the text, and a top_logprobs key two alternatives share keeps the
likelier one."""

from __future__ import annotations

import pytest

from overdrive.generate.engine import TokenLogprob
from overdrive.serve.logprobs import chat_logprobs, completion_logprobs

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def spm():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "▁A": 2, "▁list": 3, "▁is": 4, "▁a": 5, "▁sequence": 6, ".": 7, "<0xE4>": 8,
             "<0xB8>": 9, "<0xAD>": 10}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>")


def test_token_strings_read_as_in_the_text_after_the_prompt(spm):
    prompt, new = [2, 3, 4], [5, 6, 7, 8, 9, 10]  # "A list is" + " a sequence.中" (中: bytes E4 B8 AD)
    entries = [TokenLogprob(t, -1.0, [(t, -1.0), (6, -2.0), (3, -3.0)]) for t in new]
    lp = completion_logprobs(entries, spm, prompt)
    assert lp["tokens"] == [" a", " sequence", ".", "", "", "中"]
    assert "".join(lp["tokens"]) == spm.decode(prompt + new)[len(spm.decode(prompt)):]
    assert lp["text_offset"] == [0, 2, 11, 12, 12, 12]
    assert lp["top_logprobs"][0] == {" a": -1.0, " sequence": -2.0, " list": -3.0}
    chat = chat_logprobs(entries, spm, prompt)["content"]
    assert [e["token"] for e in chat] == lp["tokens"] and chat[5]["bytes"] == list("中".encode())
    # a stream's later chunk: its context holds the earlier tokens, its offset the earlier characters
    later = completion_logprobs(entries[2:], spm, prompt + new[:2], offset=11)
    assert later["tokens"] == lp["tokens"][2:] and later["text_offset"] == lp["text_offset"][2:]


def test_alternatives_that_read_the_same_keep_the_likelier_logprob(spm):
    entries = [TokenLogprob(8, -0.5, [(8, -0.5), (9, -1.5), (5, -2.5)])]  # two partial bytes both read as ""
    assert completion_logprobs(entries, spm, [2])["top_logprobs"] == [{"": -0.5, " a": -2.5}]
