"""The two errors of `primerl rl`, below every module that raises them (launch, preflight, resume)
so that none of those imports another to name a failure; primerl.cli maps them to exit codes."""


class RunError(RuntimeError):
    """The run cannot start, or one of its processes failed (says which, and why)."""


class CheckError(RunError):
    """What the user gave is wrong, found before anything started (a pre-start check): the
    command exits 2, as for a config error (primerl.cli)."""
