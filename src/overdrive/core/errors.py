"""The errors overdrive raises for what its caller can fix, and how they name arguments.

Every such error is an `OverdriveError`; the subclasses say what went wrong:

- `ConfigError`: an argument value, or a combination of them, that cannot work (a batch size
  of 0, a device that is not here, an unknown technique). Also a `ValueError`.
- `WorkloadError`: the model or workload cannot be built, loaded or run as given (an unknown
  name, an import that fails, a file that is not a model, a model that fails on its example).
- `PlanError`: a plan, or a checkpoint it names, that cannot be used here (unreadable, made for
  another workload or device type).
- `DataError`: records or files a job reads or writes (`run`'s input and output).
- `RunAborted`: a job that started and stopped (too many failed records, the model raised);
  what it finished is kept.

A message names the arguments it is about with `arg(name, value)`: `str(error)` shows them as
Python keyword arguments (`batch_size=8`), and the command line (`overdrive.cli`) renders the
same error with its own flags (`--batch-size 8`), so the library never speaks in flags.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_MARK = "\x1e"  # wraps an argument reference: MARK name [UNIT command-line text UNIT Python text] MARK
_UNIT = "\x1f"
_REFERENCE = re.compile(f"{_MARK}([A-Za-z_][A-Za-z0-9_]*)(?:{_UNIT}(.*?){_UNIT}(.*?))?{_MARK}", re.S)
_NO_VALUE = object()


def arg(name: str, value=_NO_VALUE) -> str:
    """A reference to API argument `name` (with the value it had or should have) inside an
    error message: rendered `name=value` by `str(error)` and `--flag value` by the CLI."""
    if value is _NO_VALUE:
        return f"{_MARK}{name}{_MARK}"
    python = repr(value) if isinstance(value, (str, int, float, bool, tuple, list, type(None))) else repr(str(value))
    return f"{_MARK}{name}{_UNIT}{value}{_UNIT}{python}{_MARK}"


class OverdriveError(Exception):
    """Base of the errors overdrive raises for something the caller can fix; the message says
    what was expected and what to do instead."""

    def render(self, spell: Callable[[str, str | None], str]) -> str:
        """The message with each argument reference spelled by `spell(name, value as text or None)`
        (the command line's flags, for instance)."""
        return _REFERENCE.sub(lambda m: spell(m.group(1), m.group(2)), self._text())

    def __str__(self) -> str:
        """The message, argument references as Python keyword arguments (`batch_size=8`)."""
        return _REFERENCE.sub(lambda m: m.group(1) if m.group(3) is None else f"{m.group(1)}={m.group(3)}", self._text())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def _text(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(OverdriveError, ValueError):
    """An argument value, or a combination of arguments, that cannot work."""


class WorkloadError(OverdriveError):
    """The model or workload cannot be built, loaded or run as given."""


class PlanError(OverdriveError):
    """A plan, or a checkpoint it names, that cannot be used here."""


class DataError(OverdriveError):
    """Input records or output files of a job that cannot be read or written as asked."""


class RunAborted(OverdriveError):
    """A job that started and stopped partway (too many failed records, the model raised, a
    write failed); the work it finished is kept for a resume."""


def one_line(exc: BaseException, *, max_chars: int = 240) -> str:
    """`Type: message` on one line: the last non-empty line of the message (TorchScript and
    torch.export put the useful part last), cut at a word boundary to `max_chars`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
    if len(text) > max_chars:
        text = text[:max_chars].rsplit(" ", 1)[0] + " …"
    return text
