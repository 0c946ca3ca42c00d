"""The off-policy bound at its exact edge, through the real batch builder (`Orchestrator._build`)
without an inference server: a group whose oldest rollout is exactly `max_async_level` steps
older than the step being built trains; one step older is dropped, counted and never sent.

Real parts: the run config, build_step (filters, advantages, packing), the server pool and
generator (never started: the builder only reads their counters), and a real ZeroMQ PUSH/PULL
pair (inproc) carrying the TrainBatch as the trainer would receive it. The environment mix is
a stand-in: the builder only asks it for its resume state, and a real environment costs ~10 s
to load (verifiers' import).
"""

import asyncio
from types import SimpleNamespace

import pytest
from primerl_orchestrator.batching import Group
from primerl_orchestrator.config import OrchestratorConfig, OrchRunConfig
from primerl_orchestrator.generate import Generator
from primerl_orchestrator.loop import Orchestrator
from primerl_orchestrator.servers import ServerPool
from primerl_protocol import AsyncReceiver, AsyncSender, BatchMessage, TrainBatch
from primerl_protocol.config import ModelConfig
from primerl_protocol.rollouts import Rollout, Turn

G = 2
"""Rollouts per group, and per batch: each step takes exactly one group."""


def group(group_id: int, policy_step: int) -> Group:
    """A finished group of G rollouts started on `policy_step`, rewards 1 and 0 (so its
    advantages are not zero and the zero-advantage filter keeps it)."""
    turn = Turn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.5])
    rollouts = [
        Rollout(
            sample_id=group_id * G + i,
            group_id=group_id,
            turns=[turn],
            reward=float(i == 0),
            policy_step=policy_step,
            env="toy",
        )
        for i in range(G)
    ]
    return Group(group_id, "toy", group_id, rollouts)


def build_one_step(tmp_path, k: int, step: int, groups: list[Group]) -> tuple[Orchestrator, TrainBatch]:
    """Run the builder for `step` alone (max_steps = step + 1) over `groups`, finished in that
    order; the orchestrator after it and the TrainBatch the trainer received."""
    cfg = OrchRunConfig(
        model=ModelConfig(name="m"),
        seq_len=64,
        max_steps=step + 1,
        run_dir=str(tmp_path),
        orchestrator=OrchestratorConfig(batch_size=G, group_size=G, max_async_level=k),
    )
    orch = Orchestrator(cfg)
    orch.step = orch.version = step
    orch.out_dir.mkdir(parents=True)
    orch.mix = SimpleNamespace(state=lambda: {"current": [0.0], "positions": {"toy": 0}})
    endpoint = f"inproc://batches-{id(orch)}"

    async def go() -> TrainBatch:
        orch.pool = ServerPool(["http://127.0.0.1:9"], "m", None)
        orch.gen = Generator(orch.pool, "m", "m")
        orch.senders = [AsyncSender(endpoint, BatchMessage, channel="batches/rank0", bind=True)]
        trainer = AsyncReceiver(endpoint, BatchMessage, channel="batches/rank0")
        try:
            orch.done.extend(groups)
            await asyncio.wait_for(orch._build(), 5)
            return await trainer.recv(timeout_s=10)
        finally:
            trainer.close(0)
            orch.senders[0].close(0)
            await orch.pool.close()

    return orch, asyncio.run(go())


@pytest.mark.parametrize("k", [OrchestratorConfig().max_async_level, 0, 3])
def test_a_group_max_async_level_steps_old_trains_and_one_step_older_is_dropped_and_counted(tmp_path, k):
    step = k + 2  # the step being built; it allows policies step - k and newer
    too_old, at_the_bound, fresh = group(0, step - k - 1), group(1, step - k), group(2, step)
    orch, batch = build_one_step(tmp_path, k, step, [too_old, at_the_bound, fresh])

    # the group exactly k steps old is the step's batch (the fresh one, behind it, is not needed)
    assert batch.step == step
    trained = [(int(i), int(p)) for mb in batch.micro_batches for i, p in zip(mb.sample_ids, mb.policy_steps) if i >= 0]
    assert sorted(trained) == [(1 * G + i, step - k) for i in range(G)]
    assert batch.metrics["off_policy/level"] == k
    assert [g.group_id for g in orch.done] == [fresh.group_id]
    # the group k + 1 steps old is dropped and counted: its G rollouts, in the step's metrics
    assert orch.dropped_groups == [too_old.group_id]
    assert orch.stale_dropped == G and batch.metrics["off_policy/dropped"] == G
