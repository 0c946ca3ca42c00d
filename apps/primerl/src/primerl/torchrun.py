"""Running a command as a torchrun rank, with a deterministic exit.

After a rank has finished (checkpoints and metrics written, process group left), it exits
with `os._exit` instead of a normal interpreter shutdown. Reason: on CPU (gloo), a rank
occasionally aborted during interpreter finalisation with "terminate called without an
active exception" after all its work was done (seen in CI on the SFT tests, not
reproducible in isolation), and torchrun then reports the whole job failed. Remove when
that teardown race is understood and fixed.

Each rank also dies with its torchrun (`die_with_parent`).
"""

from __future__ import annotations

import os
import sys


def die_with_parent() -> None:
    """Be killed when torchrun dies (Linux). torchrun starts each rank in a session of its own,
    so a torchrun that is killed outright (SIGKILL, the OOM killer) would leave its ranks
    running, still connected to the orchestrator's sockets and taking batches meant for a
    restarted trainer."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return  # not a torchrun rank (e.g. `python -m primerl.sft_entry` under nohup): keep running
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:  # torchrun died before the line above
        os._exit(1)


def run_and_exit(command, args: list[str] | None = None) -> None:
    die_with_parent()
    try:
        command(args)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
