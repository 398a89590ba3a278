"""Real English sentences from the Python language reference that ships with CPython.

`pydoc_data.topics` holds the reference text used by `help()`. We keep prose paragraphs
(not indented code or grammar), split them at sentence ends, and keep pieces of 40–300
characters: about 2,000 distinct sentences, the same on every machine with the same
CPython minor version.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

from overdrive.files.cache import cached

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


_SKIPPED_STDLIB_PARTS = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__")


@functools.cache
def python_docstring_sentences() -> tuple[str, ...]:
    """Training sentences from the docstrings of the standard library's sources, none of which
    is an evaluation sentence.

    Used for fine-tuning and distillation (pruning's recovery), so that no sentence of
    `python_doc_sentences` is trained on. The sources are parsed with `ast` (nothing is
    imported, so no module's import side effects run); test suites and IDLE are skipped.
    About 13,000 sentences of 40–300 characters on CPython 3.11, shuffled with seed 0. Building them
    takes seconds (9 s on a 2-core machine), so they are kept in overdrive's cache (`files.cache`),
    keyed by the interpreter, its library's files and this module's source.
    """
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = [path.stat() for path in lib.glob("*.py")]
    key = {"python": sys.version, "stdlib": str(lib), "files": len(files),
           "newest": max((f.st_mtime_ns for f in files), default=0),
           "code": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}

    def build(folder: Path) -> dict:
        (folder / "sentences.json").write_text(json.dumps(_docstring_sentences(lib, set(python_doc_sentences()))))
        return {}

    entry = cached("corpus-docstrings", key, build)
    return tuple(json.loads((entry.folder / "sentences.json").read_text()))


def _docstring_sentences(lib: Path, seen: set[str]) -> list[str]:
    import ast

    out: list[str] = []
    for path in sorted(lib.rglob("*.py")):
        parts = path.relative_to(lib).parts
        if any(part in _SKIPPED_STDLIB_PARTS or part.startswith("test") for part in parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            for paragraph in re.split(r"\n\s*\n", doc or ""):
                if any(marker in paragraph for marker in (">>>", "::", "{")):
                    continue  # examples and code
                for sentence in _SENTENCE_END.split(" ".join(line.strip() for line in paragraph.splitlines())):
                    sentence = sentence.strip()
                    if (_MIN_CHARS <= len(sentence) <= _MAX_CHARS and sentence not in seen
                            and sum(ch.isalpha() for ch in sentence) >= 0.6 * len(sentence)):
                        seen.add(sentence)
                        out.append(sentence)
    random.Random(0).shuffle(out)
    return out
