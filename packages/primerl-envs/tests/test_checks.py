"""An environment checked as `primerl rl` checks it before anything starts, and each way a module
fails to load named as what it is (the launcher's messages: apps/primerl/tests/test_preflight.py)."""

import pytest
from primerl_envs.checks import check_environment
from primerl_envs.config import EnvConfig
from primerl_envs.environment import EnvLoadError


def test_a_builtin_environment_passes_and_draws_a_task():
    assert check_environment(EnvConfig(id="reverse-text", args={"num_tasks": 3}))


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "raise RuntimeError('no API key in the environment')\n",
            "RuntimeError: no API key in the environment ({path}, line 1)",
        ),
        ("def f(:\n", "its module has a syntax error: invalid syntax ({path}, line 1)"),
        (
            "import verifiers.v1 as vf\nimport not_installed_here.sub\n",
            "it imports 'not_installed_here', which is not installed ({path}, line 2)",
        ),
        (
            "def load_environment(**kwargs):\n    pass\n",
            "defines `load_environment()`: this is the classic verifiers API",
        ),
        ("X = 1\n", "defines no `__all__`"),  # verifiers' own message: neither API
    ],
)
def test_each_way_a_module_fails_is_named(tmp_path, source, message):
    path = tmp_path / f"env_{abs(hash(source))}.py"
    path.write_text(source)
    with pytest.raises(
        EnvLoadError, match="^" + f"environment '{path.stem}' (id '{path}'): ".replace("(", r"\(").replace(")", r"\)")
    ) as err:
        check_environment(EnvConfig(id=str(path)))
    assert message.format(path=path) in str(err.value)


def test_a_harness_that_is_not_there_is_named_as_the_harness():
    with pytest.raises(EnvLoadError, match="harness 'no-such-harness' not found.*The built-in harnesses are"):
        check_environment(EnvConfig(id="reverse-text", harness="no-such-harness"))
