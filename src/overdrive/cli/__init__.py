"""`overdrive` command line: optimize, bench, serve, run, train, export, list.

Each verb is a module here with `add_parser(subparsers)` and `main(args, argv) -> exit code`
(and `FLAGS`, where its flags spell an API argument unlike the others): it parses flags, calls
the library, and prints. Library errors (`overdrive.core.errors`)
print as one line `overdrive: error: ...` on stderr with exit code 2, their argument
references spelled as this command line's flags; no traceback. A run that stopped partway
(`RunAborted`) exits with 1, Ctrl-C with 130.
"""

from __future__ import annotations

import logging
import sys

from overdrive.cli import bench, export, listing, optimize, run, serve, train
from overdrive.cli.args import Parser, flag
from overdrive.core.errors import OverdriveError, RunAborted

VERBS = {"optimize": optimize, "bench": bench, "serve": serve, "train": train, "run": run, "export": export, "list": listing}


def build_parser() -> Parser:
    parser = Parser(prog="overdrive", description="Make a PyTorch model run as fast as the hardware allows, and prove it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for verb in VERBS.values():
        verb.add_parser(sub)
    return parser


def error_line(exc: OverdriveError, command: str) -> str:
    """The one line the command line prints for a library error, in the flags of `command`."""
    overrides = getattr(VERBS[command], "FLAGS", None)
    return " ".join(exc.render(lambda name, value: flag(name, value, overrides)).split())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    # torch.compile on a CUDA build without a GPU logs "No CUDA runtime is found" once; it is not ours to act on.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    # torchao 0.18 registers enums that torch 2.14 handles natively, and torch logs a deprecation for each at import.
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    try:
        return VERBS[args.command].main(args, argv)
    except RunAborted as exc:
        sys.stderr.write(f"overdrive: {args.command} stopped: {error_line(exc, args.command)}\n")
        return 1
    except OverdriveError as exc:
        sys.stderr.write(f"overdrive: error: {error_line(exc, args.command)}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("overdrive: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
