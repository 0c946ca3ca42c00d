"""The ranks' agreement on each step's batches (BatchSource.agree), on two real gloo ranks in
two processes (no model, no sockets: the batches are handed in). Every micro-batch is a forward
and a backward whose FSDP collectives every rank joins, so ranks given different numbers of
micro-batches must both refuse the step; left alone, the rank with more waits for ever."""

import os
import subprocess
import sys

from primerl_trainer.testing import free_port_block

RANK = """
import sys
from primerl_protocol.testing import train_batch
from primerl_trainer.distributed import init_distributed
from primerl_trainer.rl import BatchSource, TrainerError

d = init_distributed(timeout_s=60)
source = BatchSource.__new__(BatchSource)  # only its agreement: no sockets
source.d = d
# per case: this rank's micro-batch count, or -1 for "told to stop" (no batch)
for step, case in enumerate(sys.argv[1:]):
    rows = int(case.split(",")[d.rank])
    msg = None if rows < 0 else train_batch(num_micro_batches=rows, step=step)
    try:
        print(f"step {step}: verdict {source.agree(step, msg, None)}", flush=True)
    except TrainerError as err:
        print(f"step {step}: {err}", flush=True)
# Leave together: a rank whose peer has already closed the connection can abort in gloo's
# teardown at exit (SIGABRT, seen once in CI after every step had printed).
import torch.distributed as dist
dist.barrier()
dist.destroy_process_group()
"""


def test_ranks_with_different_micro_batch_counts_both_refuse_the_step():
    port = free_port_block(1)
    cases = ["2,2", "2,1", "-1,3", "1,3"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, *cases],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for out in outs:  # both ranks decide the same
        lines = [line for line in out.splitlines() if line.startswith("step ")]
        assert lines[0] == "step 0: verdict 0.0"  # equal counts: train
        assert lines[1].startswith(
            "step 1: refused the batch for step 1: the ranks got different numbers of "
            "micro-batches (rank 0: 2, rank 1: 1)"
        )
        assert lines[2] == "step 2: verdict 1.0"  # a rank told to stop: everyone stops, nothing to refuse
        assert "(rank 0: 1, rank 1: 3)" in lines[3]
