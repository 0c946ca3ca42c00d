"""Running a command as a torchrun rank, with a deterministic exit.

After a rank has finished (checkpoints and metrics written, process group left), it exits
with `os._exit` instead of a normal interpreter shutdown. Reason: on CPU (gloo), a rank
occasionally aborted during interpreter finalisation with "terminate called without an
active exception" after all its work was done (seen in CI on the SFT tests, not
reproducible in isolation), and torchrun then reports the whole job failed. Remove when
that teardown race is understood and fixed.
"""

from __future__ import annotations

import os
import sys


def run_and_exit(command, args: list[str] | None = None) -> None:
    try:
        command(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
