"""primerl-envs without a model server: reward helpers (by hand), loading errors, task streams."""

from fractions import Fraction

import pytest
from primerl_envs.config import EnvConfig
from primerl_envs.environment import BUILTIN, Environment, EnvLoadError, TaskStream, verifiers_config
from primerl_envs.scoring import boxed_answer_matches, last_boxed, lcs_length, lcs_ratio, parse_number


def test_lcs_by_hand():
    assert lcs_length("abcde", "ace") == 3
    assert lcs_length("abc", "acb") == 2
    assert lcs_length("", "abc") == 0
    assert lcs_ratio("abc", "abc") == 1.0
    assert lcs_ratio("abc", "xyz") == 0.0
    assert lcs_ratio("abc", "acb") == pytest.approx(2 * 2 / 6)
    assert lcs_ratio(["b", "a"], ["a", "b"]) == pytest.approx(2 * 1 / 4)


def test_boxed_answers():
    assert last_boxed(r"so \boxed{3} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{unclosed") is None
    assert parse_number("7/2") == Fraction(7, 2) == parse_number("3.5")
    assert parse_number("1,000") == 1000
    assert parse_number("x") is None
    assert boxed_answer_matches(r"answer: \boxed{3.5}", "7/2")
    assert boxed_answer_matches(r"\boxed{ 42 }", "42")
    assert not boxed_answer_matches(r"\boxed{41}", "42")
    assert not boxed_answer_matches("42", "42")  # an answer must be boxed


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_environments_load_and_make_tasks(name):
    env = Environment(EnvConfig(id=name, args={"num_tasks": 7}))
    assert len(env.tasks) == 7
    task = env.tasks.next()
    assert task.data.prompt_text
    # verifiers' cloud defaults are replaced by local ones.
    role = env.vf_config.agent
    assert role.runtime.type == "subprocess"
    assert role.harness.id == "primerl-chat"


def test_unknown_environment_names_builtins():
    with pytest.raises(EnvLoadError, match="no-such-env.*reverse-text"):
        verifiers_config(EnvConfig(id="no-such-env"))


def test_missing_local_module_names_the_path(tmp_path):
    with pytest.raises(EnvLoadError, match="no such file"):
        verifiers_config(EnvConfig(id=str(tmp_path / "missing_env.py")))


def test_bad_argument_names_the_field():
    with pytest.raises(EnvLoadError, match="num_taskz"):
        Environment(EnvConfig(id="reverse-text", args={"num_taskz": 3}))


def test_local_module_environment(tmp_path):
    (tmp_path / "my_local_env.py").write_text(
        "import verifiers.v1 as vf\n"
        "class D(vf.TaskData):\n    answer: str\n"
        "class T(vf.Task[D, vf.State, vf.TaskConfig]):\n"
        "    @vf.reward\n    async def r(self, trace: vf.Trace) -> float:\n        return 1.0\n"
        "class S(vf.Taskset[T, vf.TasksetConfig]):\n"
        "    def load(self):\n        return [T(D(prompt=str(i), answer='x')) for i in range(3)]\n"
        "__all__ = ['S']\n"
    )
    env = Environment(EnvConfig(id=str(tmp_path / "my_local_env.py")))
    assert env.name == "my_local_env"
    assert sorted(env.tasks.next().data.prompt for _ in range(3)) == ["0", "1", "2"]


def test_task_stream_epochs_and_resume():
    env = Environment(EnvConfig(id="reverse-text", args={"num_tasks": 5}))
    taskset = env.tasks
    first = [taskset.next().data.id for _ in range(12)]
    # every epoch of 5 holds each task exactly once, in a new order per epoch
    assert sorted(first[:5]) == sorted(first[5:10]) == sorted(f"reverse-{i}" for i in range(5))
    assert first[:5] != first[5:10]
    # a stream built at position 7 continues exactly where this one was at 7
    resumed = TaskStream(
        __import__("verifiers.v1", fromlist=["x"]).load_taskset(env.vf_config.taskset), seed=0, position=7
    )
    assert [resumed.next().data.id for _ in range(5)] == first[7:12]


def test_mix_follows_the_weights_exactly_and_resumes():
    from primerl_envs.environment import EnvMix

    def mix():
        return EnvMix(
            [
                Environment(EnvConfig(id="reverse-text", weight=3, args={"num_tasks": 4})),
                Environment(EnvConfig(id="math", weight=1, args={"num_tasks": 4})),
            ]
        )

    m = mix()
    draws = []
    for _ in range(60):
        env = m.next()
        draws.append((env.name, env.tasks.next().data.id))
    names = [d[0] for d in draws]
    assert names.count("reverse-text") == 45 and names.count("math") == 15
    for n in range(1, 61):  # never more than one away from the exact share
        assert abs(names[:n].count("math") - n / 4) <= 1
    # resume after 25 draws: the next 35 are the same environments and the same tasks
    m2 = mix()
    for _ in range(25):
        m2.next().tasks.next()
    saved = m2.state()
    m3 = mix()
    m3.load_state(saved)
    again = []
    for _ in range(35):
        env = m3.next()
        again.append((env.name, env.tasks.next().data.id))
    assert again == draws[25:]


def test_mix_needs_distinct_names():
    from primerl_envs.environment import EnvMix

    with pytest.raises(EnvLoadError, match="distinct names"):
        EnvMix([Environment(EnvConfig(id="math")), Environment(EnvConfig(id="math"))])


def _closure(lock: dict, name: str) -> set[str]:
    """Every package `name` installs, by the workspace's lock file."""
    packages = {p["name"]: p for p in lock["package"]}
    seen, todo = set(), [name]
    while todo:
        for dep in packages[todo.pop()].get("dependencies", []):
            if dep["name"] not in seen:
                seen.add(dep["name"])
                todo.append(dep["name"])
    return seen


def test_primerl_envs_installs_and_runs_without_torch():
    """Environments are written and run on machines without the trainer's stack: neither the
    locked install of primerl-envs nor loading its built-in environments and making their
    tasks needs torch or primerl-algos."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    lock = tomllib.loads((Path(__file__).parents[3] / "uv.lock").read_text())
    installs = _closure(lock, "primerl-envs")
    assert "verifiers" in installs  # the walk does follow the graph
    assert not installs & {"torch", "primerl-algos", "primerl-trainer", "primerl-models"}
    code = (
        "import sys\n"
        "for name in ('torch', 'primerl_algos'): sys.modules[name] = None  # importing them fails\n"
        "from primerl_envs.config import EnvConfig\n"
        "from primerl_envs.environment import BUILTIN, Environment\n"
        "from primerl_envs.rollouts import trace_to_rollout\n"
        "for name in sorted(BUILTIN): Environment(EnvConfig(id=name, args={'num_tasks': 2})).tasks.next()\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_default_factory_check_is_remembered_and_still_right():
    """compat.install() memoises pydantic's 'does this default_factory take the validated data?'
    (an inspect.signature per defaulted field per model_construct, before): the answers stay
    pydantic's own, for plain factories, data-taking ones and unhashable ones."""
    import pydantic
    from primerl_envs import compat
    from pydantic._internal import _fields

    class Unhashable:
        __hash__ = None

        def __call__(self, data):
            return data["a"] * 2

    compat.install()
    assert _fields.takes_validated_data_argument(list) is False
    assert _fields.takes_validated_data_argument(lambda data: data) is True
    assert _fields.takes_validated_data_argument(Unhashable()) is True

    class M(pydantic.BaseModel):
        a: int = 1
        items: list = pydantic.Field(default_factory=list)
        b: int = pydantic.Field(default_factory=lambda data: data["a"] + 1)
        c: int = pydantic.Field(default_factory=Unhashable())

    for _ in range(2):  # the second time from the memo
        m = M.model_construct(a=5)
        assert (m.items, m.b, m.c) == ([], 6, 10)
        assert M(a=2).model_dump() == {"a": 2, "items": [], "b": 3, "c": 4}
