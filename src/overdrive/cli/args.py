"""Argument types, the flags every measuring verb shares, and how library errors name flags."""

from __future__ import annotations

import argparse
import math
import sys

# API argument names whose flag is not `--` + the name with dashes; None: a positional argument.
FLAGS: dict[str, str | None] = {
    "learning_rate": "--lr",
    "resume_dir": "--resume",
    "save_dir": "--save",
    "world_size": "--nproc",
    "dynamic_dims": "--dynamic-dim",
    "model": None,
    "workload": None,
}


def flag(name: str, value: str | None, overrides: dict[str, str | None] | None = None) -> str:
    """How the command line spells a reference to API argument `name` with `value` (see
    `overdrive.core.errors.arg`): `--batch-size 8`, `--resume` for a switch (value True), the
    value alone for a positional argument; a verb's `overrides` come first."""
    spelled = {**FLAGS, **(overrides or {})}.get(name, "--" + name.replace("_", "-"))
    if spelled is None:
        return name.upper() if value is None else value
    return spelled if value in (None, "True") else f"{spelled} {value}"


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations: `--technique` is a typo to refuse, not `--techniques`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line, exit 2 (argparse prints usage too by default)
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        sys.exit(2)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def int_list(text: str) -> list[int]:
    return [positive_int(part) for part in text.split(",") if part.strip()] or positive_int("")


def name_list(text: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))  # dedupe, keep order
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated technique names (see `overdrive list`), got none")
    return names


def shape(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _number(text: str, accept, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not accept(value):  # NaN fails every comparison, so it is refused too
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def fraction(text: str) -> float:
    return _number(text, lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")


def nonnegative(text: str) -> float:
    return _number(text, lambda v: 0.0 <= v < math.inf, "a finite number ≥ 0")


def open_fraction(text: str) -> float:
    return _number(text, lambda v: 0.0 < v < 1.0, "a fraction strictly between 0 and 1 (e.g. 0.5)")


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer ≥ 0, got {value}")
    return value


def port(text: str) -> int:
    value = nonnegative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {value}")
    return value


def batch_size_arg(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None


def positive_float(text: str) -> float:
    return _number(text, lambda v: 0.0 < v < math.inf, "a finite number > 0 (e.g. 1e-4)")


def ratio(text: str) -> float:
    return _number(text, lambda v: 0.0 <= v < math.inf, "a finite ratio ≥ 0 (e.g. 1.02)")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The arguments `optimize` and `bench` share: what to measure, where, on how much."""
    p.add_argument("workload", help="minilm, digits-cnn, a torchvision name (resnet50), package.module:factory, or a .pt/.pt2 file")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when present)")
    p.add_argument("--batch-size", type=positive_int, help="rows per call (default: the workload's)")
    p.add_argument("--num-samples", type=positive_int, help="evaluation samples (default: 512 for text, all otherwise)")
    p.add_argument("--out", default="out", help="output folder; results go to OUT/<workload>/ (default: out)")
    p.add_argument("--input-shape", type=shape, help="input shape B,C,H,W... for TorchScript files, which store none")
    p.add_argument("--input-dtype", default="float32", help="dtype of generated inputs for model files (default float32)")
    p.add_argument("--data", help="your evaluation rows, judged instead of the workload's own: .npy [N, *row], a folder of "
                                  "images, or .txt / .jsonl / .csv text for text models")
    p.add_argument("--text-field", help="the JSONL field / CSV column of --data holding the text (default: text)")
    p.add_argument("--dynamic-dim", action="append", type=input_dim, metavar="INPUT:DIM",
                   help="a dimension whose size varies from row to row, e.g. input_ids:1 (repeat for each input; default: "
                        "found by calling the model at two sizes, integer inputs only)")
    add_weights_arg(p)


def input_dim(text: str) -> tuple[str | int, int]:
    name, _, dim = text.rpartition(":")
    try:
        value = int(dim)
    except ValueError:
        value = None
    if not name or value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected INPUT:DIM with DIM ≥ 1 (e.g. input_ids:1), got {text!r}")
    return (int(name) if name.isdigit() else name), value


def dynamic_dims(pairs: list[tuple[str | int, int]] | None) -> dict | None:
    """--dynamic-dim INPUT:DIM flags as `dynamic_dims` ({input: [dims]}); None when none were given."""
    if not pairs:
        return None
    out: dict = {}
    for name, dim in pairs:
        out.setdefault(name, []).append(dim)
    return out


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", help="trained weights for the model: a checkpoint folder `overdrive train --save` wrote "
                                     "(step-N, or the --save folder: its newest), or a torch.save state dict")
