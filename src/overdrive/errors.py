"""Errors that reach the user as one clear line (exit code 2), not a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for: an unknown workload, a bad path, a bad value.

    The message says what was expected and what to do instead. The CLI prints it on one
    line and exits with code 2.
    """


def one_line(exc: BaseException, *, max_chars: int = 240) -> str:
    """`Type: message` on one line: the last non-empty line of the message (TorchScript and
    torch.export put the useful part last), cut at a word boundary to `max_chars`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0] + " …"
    return text
