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


# Standard-library modules whose docstrings give the training sentences (a fixed list, so the
# corpus is the same on every machine with the same CPython minor version).
_DOCSTRING_MODULES = (
    "abc argparse array asyncio bisect codecs collections contextlib copy csv dataclasses datetime decimal doctest "
    "email.message enum fractions functools heapq http.client inspect io itertools json logging math numbers operator "
    "os pathlib pdb pickle random re shutil socket sqlite3 statistics string struct subprocess tarfile tempfile "
    "textwrap threading unittest urllib.request zipfile"
).split()


@functools.cache
def python_docstring_sentences() -> tuple[str, ...]:
    """Training sentences from standard-library docstrings, none of which is an evaluation sentence.

    Used for fine-tuning and distillation (pruning's recovery), so that no sentence of
    `python_doc_sentences` is trained on. About 4,000 sentences, 40–300 characters each, in
    a stable order (module, then member name), shuffled with seed 0.
    """
    import importlib
    import inspect
    import warnings

    seen = set(python_doc_sentences())
    out: list[str] = []
    for name in _DOCSTRING_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
        docs = [module.__doc__]
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
                continue
            docs.append(member.__doc__)
            if inspect.isclass(member):
                docs += [m.__doc__ for n, m in sorted(vars(member).items()) if not n.startswith("_") and inspect.isroutine(m)]
        for doc in docs:
            if not isinstance(doc, str):
                continue
            for paragraph in re.split(r"\n\s*\n", doc):
                if any(marker in paragraph for marker in (">>>", "::", "{")):
                    continue  # examples and code
                for sentence in _SENTENCE_END.split(" ".join(line.strip() for line in paragraph.splitlines())):
                    sentence = sentence.strip()
                    if (_MIN_CHARS <= len(sentence) <= _MAX_CHARS and sentence not in seen
                            and sum(ch.isalpha() for ch in sentence) >= 0.6 * len(sentence)):
                        seen.add(sentence)
                        out.append(sentence)
    random.Random(0).shuffle(out)
    return tuple(out)
