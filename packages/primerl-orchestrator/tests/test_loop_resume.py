"""The orchestrator's resume, without an inference server: the groups a resumed run starts draw
the same tasks, from the same environments, as the run that never stopped.

The producer (`Orchestrator._produce`) runs for real over two real built-in environments of
different sizes and weights; only the rollouts are left out (`_run_group` records the group it
was given instead of asking a server). The state crosses the restart the way it does in a run:
`resume_state` into a checkpoint's meta.json, read back by a fresh orchestrator's `_resume`.
"""

import asyncio
from types import SimpleNamespace

from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, EnvMix
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.loop import Orchestrator
from primerl_protocol import rundir

GROUPS_PER_STEP = 4
SEED = 7


def orchestrator(run_dir, max_steps: int) -> Orchestrator:
    """An orchestrator over reverse-text (5 tasks, weight 2) and math (3 tasks, weight 1), set
    up as `Orchestrator.run` does before it starts the servers (resumed if `run_dir` holds a
    checkpoint)."""
    cfg = SimpleNamespace(
        orchestrator=OrchestratorConfig(
            batch_size=2 * GROUPS_PER_STEP, group_size=2, max_async_level=100, max_in_flight=10**6
        ),
        run_dir=str(run_dir),
        max_steps=max_steps,
    )
    o = Orchestrator(cfg)
    o.envs = [
        Environment(EnvConfig(id="reverse-text", weight=2, args={"num_tasks": 5}), seed=SEED),
        Environment(EnvConfig(id="math", weight=1, args={"num_tasks": 3}), seed=SEED),
    ]
    o.by_name = {e.name: e for e in o.envs}
    o.mix = EnvMix(o.envs)
    o._resume()
    if o.version is None:  # resumed: the trainer has published its restored weights
        o.version = o.step
    return o


def produce(o: Orchestrator) -> dict[int, tuple[str, int, str]]:
    """Run the producer until the start rule holds it back (max_steps); {group id: (env,
    position, task id)} of every group it started. The groups stay running (never finish)."""
    drawn = {}

    async def record(group, env, task):  # stands in for the rollouts (an inference server)
        drawn[group.group_id] = (env.name, group.position, task.data.id)

    async def no_servers_to_revive():
        pass

    async def go():
        o._run_group = record
        o.pool = SimpleNamespace(maybe_revive=no_servers_to_revive)
        producer = asyncio.create_task(o._produce())
        for _ in range(50):  # let the producer and the recorders run
            await asyncio.sleep(0)
        assert not o.may_start() and not producer.done()
        producer.cancel()

    asyncio.run(go())
    assert o.failure is None
    return drawn


def test_a_resumed_run_draws_the_same_tasks_as_the_uninterrupted_run(tmp_path):
    steps = 7
    whole = produce(orchestrator(tmp_path / "whole", max_steps=steps))
    assert sorted(whole) == list(range(steps * GROUPS_PER_STEP))
    envs = [env for env, _, _ in whole.values()]
    assert envs.count("reverse-text") == 19 and envs.count("math") == 9  # 3+ epochs of each

    # The interrupted run: the groups of steps 0..3 start; steps 0..2 train on 12 of them (they
    # finish out of order) and step 2 is checkpointed; the rest is lost in the crash. 16 draws
    # leave the 2:1 mix mid-cycle, so its own position matters too, not only the tasksets'.
    run_dir = tmp_path / "interrupted"
    first = orchestrator(run_dir, max_steps=4)
    before = produce(first)
    assert len(before) == 16
    trained = [0, 1, 3, 4, 5, 7, 8, 9, 10, 12, 13, 15]
    for gid in trained:
        del first.running[gid]
    first.step = 3
    state = first.resume_state(3)
    folder = rundir.step_folder(run_dir / rundir.CHECKPOINTS, 2)
    folder.mkdir(parents=True)
    rundir.write_meta(folder, {"step": 2, "world_size": 1, "data": {"next_step": 3, "orchestrator": state}})

    resumed = orchestrator(run_dir, max_steps=steps)
    assert resumed.step == 3
    after = produce(resumed)
    # the groups not trained before the crash run again (same ids, same tasks), then new ones
    assert sorted(after) == sorted({*range(steps * GROUPS_PER_STEP)} - set(trained))
    assert {gid: before[gid] for gid in trained} | after == whole
