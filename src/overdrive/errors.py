"""Errors that reach the user as one clear line (exit code 2), not a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in what the user asked for: an unknown workload, a bad path, a bad value.

    The message says what was expected and what to do instead. The CLI prints it on one
    line and exits with code 2.
    """
