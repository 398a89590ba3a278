"""Real English sentences from the Python language reference that ships with CPython.

`pydoc_data.topics` holds the reference text used by `help()`. We keep prose paragraphs
(not indented code or grammar), split them at sentence ends, and keep pieces of 40–300
characters: about 2,000 distinct sentences, the same on every machine with the same
CPython minor version.
"""

from __future__ import annotations

import functools
import random
import re

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_MIN_CHARS, _MAX_CHARS = 40, 300


def _prose_paragraphs(text: str):
    after_code_marker = False
    for paragraph in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in paragraph.splitlines() if line.strip()]
        if not lines:
            continue
        is_code = after_code_marker or any(
            marker in paragraph for marker in ("::=", ">>>", "{", "}")
        )
        after_code_marker = lines[-1].endswith(":")
        if is_code or set(lines[-1]) <= set("*=-~^+|"):
            continue  # code samples, grammar rules, section underlines and tables
        yield " ".join(lines)


@functools.cache
def python_doc_sentences() -> tuple[str, ...]:
    """All usable sentences, in a stable order.

    Returns:
        A tuple of distinct sentences, each 40–300 characters long, shuffled with seed 0.
    """
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out: list[str] = []
    for key in sorted(topics):
        for paragraph in _prose_paragraphs(topics[key]):
            for sentence in _SENTENCE_END.split(paragraph):
                sentence = sentence.strip()
                if not (_MIN_CHARS <= len(sentence) <= _MAX_CHARS) or sentence in seen:
                    continue
                if sum(ch.isalpha() for ch in sentence) < 0.6 * len(sentence):
                    continue  # mostly symbols: a code fragment that slipped through
                seen.add(sentence)
                out.append(sentence)
    random.Random(0).shuffle(out)  # mix topics so that any prefix is a fair sample
    return tuple(out)
