"""The trainer command with one fault injected, for tests (torchrun runs this file on each rank):

    PRIMERL_TEST_FULL_DISK_AT_WRITE=N torchrun ... faulty_trainer_entry.py @ cfg.toml

Rank 0's N-th write of published weights (1 = the first) fails as on a full disk (ENOSPC),
after every rank took part in gathering them: the other ranks go on to wait for the next batch.
"""

import errno
import os

import primerl_trainer.publish as publish
from primerl.cli import trainer_main
from primerl.torchrun import run_and_exit


def full_disk_at(write: int):
    real, calls = publish.save_hf, [0]

    def save_hf(state, config, folder, **kwargs):  # only rank 0 writes
        calls[0] += 1
        if calls[0] == write:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))
        return real(state, config, folder, **kwargs)

    return save_hf


if __name__ == "__main__":
    publish.save_hf = full_disk_at(int(os.environ["PRIMERL_TEST_FULL_DISK_AT_WRITE"]))
    run_and_exit(trainer_main)
