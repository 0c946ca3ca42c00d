"""Ulysses context parallelism on 2 ranks (torchrun, gloo, CPU, fp32) against the whole rows: 2
packed rows of 12 tokens (3 and 2 documents, one crossing the split between the ranks in each),
GQA (4 query heads, 2 kv heads). Each rank's attention output is the whole row's for its tokens, and the gradients of
its q, k, v chunks are the whole row's (the loss over every rank's tokens reaches them)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from primerl_trainer.testing import free_port_block

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

ENTRY = Path(__file__).with_name("context_parallel_entry.py")


def test_ulysses_attention_equals_the_whole_row(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={free_port_block(1)}", str(ENTRY), str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        row = torch.load(tmp_path / f"rank_{rank}.pt")["sdpa"]
        torch.testing.assert_close(row["out"], row["ref"], atol=1e-5, rtol=0)
        mine = slice(6 * rank, 6 * rank + 6)
        for got, full in zip(row["grads"], row["ref_grads"]):
            torch.testing.assert_close(got, full[:, mine], atol=1e-5, rtol=0)
        assert row["grads"][1].abs().sum() > 0
