"""torchrun without its traceback: `python -m overdrive.train._torchrun ARGS` runs
`torch.distributed.run` with ARGS. When a rank fails it exits with code 1 and, instead of
torchrun's Python traceback and failure table, writes the failed ranks and their exit codes as
JSON to the file named by FAILURES_ENV (or one line to stderr without it): `overdrive train`
composes one line from them. The failing rank has already written its own error (a traceback
for a crash, or its one-line error to the file `overdrive train` reads)."""

from __future__ import annotations

import json
import logging
import os
import sys

FAILURES_ENV = "OVERDRIVE_TORCHRUN_FAILURES"


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # "failed (exitcode: 2)", "sending SIGTERM"
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        failed = sorted([rank, f.exitcode] for rank, f in exc.failures.items())
        if os.environ.get(FAILURES_ENV):
            with open(os.environ[FAILURES_ENV], "w") as f:
                json.dump(failed, f)
        else:
            sys.stderr.write("torchrun: " + ", ".join(f"rank {r} exited with {c}" for r, c in failed) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
