"""The trainer command with one fault injected, for tests (torchrun runs this file on each rank):

    PRIMERL_TEST_FULL_DISK_AT_WRITE=N torchrun ... faulty_trainer_entry.py @ cfg.toml
    PRIMERL_TEST_KILLED_AFTER_CHECKPOINT=S torchrun ... faulty_trainer_entry.py sft @ cfg.toml

FULL_DISK_AT_WRITE: rank 0's N-th write of published weights (1 = the first) fails as on a full
disk (ENOSPC), after every rank took part in gathering them: the other ranks go on to wait for
the next batch. KILLED_AFTER_CHECKPOINT: every rank dies (exit 137, as by SIGKILL, nothing
flushed or closed) the moment the checkpoint of step S is whole. A first argument `sft` runs
`primerl sft` instead of the RL trainer.
"""

import errno
import os
import sys

import primerl_trainer.checkpoint as checkpoint
import primerl_trainer.publish as publish
from primerl.cli import main, trainer_main
from primerl.torchrun import run_and_exit


def full_disk_at(write: int):
    real, calls = publish.save_hf, [0]

    def save_hf(state, config, folder, **kwargs):  # only rank 0 writes
        calls[0] += 1
        if calls[0] == write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        return real(state, config, folder, **kwargs)

    return save_hf


def killed_after(step: int):
    real = checkpoint.Checkpointer.save

    def save(self, at: int, *args, **kwargs):
        folder = real(self, at, *args, **kwargs)
        if at == step:
            os._exit(137)
        return folder

    return save


if __name__ == "__main__":
    if "PRIMERL_TEST_FULL_DISK_AT_WRITE" in os.environ:
        publish.save_hf = full_disk_at(int(os.environ["PRIMERL_TEST_FULL_DISK_AT_WRITE"]))
    if "PRIMERL_TEST_KILLED_AFTER_CHECKPOINT" in os.environ:
        checkpoint.Checkpointer.save = killed_after(int(os.environ["PRIMERL_TEST_KILLED_AFTER_CHECKPOINT"]))
    if sys.argv[1:2] == ["sft"]:
        run_and_exit(main, sys.argv[1:])
    else:
        run_and_exit(trainer_main)
