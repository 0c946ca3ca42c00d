"""A user's reward function that raises, through the whole orchestrator (`Orchestrator.run`):
its traceback is logged once, the step's console line shows the error rate, and when the rate
stays above `orchestrator.max_error_rate` for `error_patience` steps the run stops, naming the
traceback, and the trainer is told why.

Real parts: the user's environment (a local module whose reward divides by zero), verifiers'
scoring of it, primerl's single-turn path and rollout conversion, the Generator, the whole
loop (producer, builder, policy listener), its log, and real ZeroMQ sockets to a test double
of the trainer (TrainerDouble). Stood in: the inference server (an HTTP server that answers
every /inference/v1/generate with the same valid replies; no vLLM needed to make a reward
function raise) and the server pool in front of it (no health probes or weight loads).
"""

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp import web
from primerl_envs.config import EnvConfig, EnvsConfig
from primerl_inference.config import InferenceConfig
from primerl_orchestrator import loop
from primerl_orchestrator.config import OrchestratorConfig, OrchRunConfig, SamplingConfig
from primerl_orchestrator.generate import Generator
from primerl_orchestrator.loop import Orchestrator, OrchestratorError
from primerl_orchestrator.testing import TrainerDouble
from primerl_protocol import SocketSettings
from primerl_protocol.config import ModelConfig, TransportConfig, WandbConfig

USER_ENV = """
import verifiers.v1 as vf
from primerl_envs.tasks import AnswerData
from primerl_reverse_text import ReverseTextConfig, ReverseTextTaskset


def score(reply):
    return len(reply) / (len(reply) - len(reply))


class BrokenTask(vf.Task[AnswerData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def similarity(self, trace: vf.Trace) -> float:
        return score(trace.last_reply or "")


class BrokenTaskset(vf.Taskset[BrokenTask, ReverseTextConfig]):
    def load(self):
        for task in ReverseTextTaskset.load(self):
            yield BrokenTask(task.data, task.config)


__all__ = ["BrokenTaskset"]
"""
RAISING_LINE = 8
"""The line of USER_ENV that raises (`return len(reply) / ...`)."""
EOS = 2
"""The tiny tokenizer's <|im_end|>: a reply that ends normally."""
GROUP = 2


@contextlib.asynccontextmanager
async def stand_in_server():
    """An HTTP server whose /inference/v1/generate answers n valid replies ("ab" then end)."""

    async def generate(request):
        n = (await request.json())["sampling_params"]["n"]
        reply = {
            "token_ids": [5, 6, EOS],
            "finish_reason": "stop",
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (5, 6, EOS)]},
        }
        return web.json_response({"choices": [dict(reply, index=i) for i in range(n)]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class StandInPool:
    """The one stand-in server, always healthy, serving the policy the loop last loaded."""

    def __init__(self, url: str) -> None:
        self.server = SimpleNamespace(url=url, version=0, model=None, healthy=True)
        self.servers = [self.server]

    def healthy(self):
        return self.servers

    @contextlib.asynccontextmanager
    async def lease(self):
        yield self.server

    async def report_failure(self, server, error) -> bool:
        return False

    async def maybe_revive(self) -> None:
        pass

    async def load_weights(self, path, version, checksum=None, format=None, served=None) -> float:
        self.server.version = version
        return 0.0

    def stats(self) -> dict[str, float]:
        return {"servers/healthy": 1.0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from primerl_models.tiny import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("m"),
        "qwen3",
        alphabet="abcdefgh",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )


def test_a_reward_function_that_raises_is_logged_once_shown_and_stops_the_run_naming_its_traceback(
    model, tmp_path, monkeypatch, caplog
):
    from primerl_trainer.testing import free_port_block

    user_env = tmp_path / "broken_reward.py"
    user_env.write_text(USER_ENV)
    port = free_port_block(2)
    patience = 3
    cfg = OrchRunConfig(
        model=ModelConfig(name=str(model)),
        seq_len=256,
        max_steps=20,
        run_dir=str(tmp_path / "run"),
        wandb=WandbConfig(mode="disabled"),
        transport=TransportConfig(
            batch_port=port + 1,
            policy_port=port,
            sockets=SocketSettings(linger_ms=0, send_timeout_s=30, recv_timeout_s=30),
        ),
        orchestrator=OrchestratorConfig(
            batch_size=2 * GROUP, group_size=GROUP, sampling=SamplingConfig(max_tokens=4), error_patience=patience
        ),
        inference=InferenceConfig(urls=["http://unused"], admin_token="t"),
        envs=EnvsConfig(train=[EnvConfig(id=str(user_env), name="mine", args={"num_tasks": 8})]),
    )
    trainer = TrainerDouble(cfg.transport, Path(cfg.run_dir), model, max_steps=cfg.max_steps).start()

    async def go():
        async with stand_in_server() as url:
            pool = StandInPool(url)

            async def generator(stack, model_cfg, urls, token, **kw):
                return Generator(pool, model_cfg.name, model_cfg.name)

            monkeypatch.setattr(loop, "start_generator", generator)
            await asyncio.wait_for(Orchestrator(cfg).run(), 120)

    with caplog.at_level(logging.INFO, logger="primerl.orchestrator"), pytest.raises(OrchestratorError) as stop:
        asyncio.run(go())
    trainer.join(30)

    # the stop: every rollout errored (100% > 50%) at steps 0, 1, 2: it names the steps, the
    # settings, and the traceback down to the user's line
    message = str(stop.value)
    assert message.startswith(
        "stopping the run: more than 50% of the rollouts errored at each of steps 0-2 "
        "(100%, 100%, 100%; orchestrator.max_error_rate = 0.5 for "
        "orchestrator.error_patience = 3 steps)"
    ), message
    assert f"environment 'mine': ZeroDivisionError at {user_env}:{RAISING_LINE} in score:" in message
    assert "return len(reply) / (len(reply) - len(reply))" in message
    assert message.rstrip().endswith(
        "ZeroDivisionError: division by zero\nwhich was raised as: "
        "verifiers.v1.errors.TaskError: task BrokenTask scoring: ZeroDivisionError: "
        "division by zero"
    )
    # the trainer trained the three steps, then was told to stop, and why
    assert [s.step for s in trainer.steps] == [0, 1, 2]
    assert trainer.stopped == f"the orchestrator stopped: {message.splitlines()[0]}"

    # 12 rollouts raised; the traceback was logged once, with the user's frame
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage()[:200] for r in errors]
    logged = errors[0].getMessage()
    assert logged.startswith(
        "step 0: a rollout of environment 'mine' errored: TaskError: task BrokenTask scoring: "
        f"ZeroDivisionError: division by zero (raised at {user_env}:{RAISING_LINE} in score; "
        "the first of its kind"
    )
    assert f'File "{user_env}", line {RAISING_LINE}, in score' in logged and "Traceback" in logged
    # each step's console line shows the error rate and what trained
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ") and " | " in r.getMessage()]
    assert len(lines) == patience and all("| errors 100.0% | trained 0/4 |" in line for line in lines), lines
    own = Path(cfg.run_dir) / "orchestrator" / "metrics.jsonl"
    rows = [json.loads(line) for line in own.read_text().splitlines()]
    assert [r["rollouts/new_error_kinds"] for r in rows] == [1, 0, 0]
