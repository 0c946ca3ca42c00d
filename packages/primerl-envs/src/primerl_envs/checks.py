"""An environment checked before a run starts, and why one does not load, said so a user can act.

    check_environment(EnvConfig(id="reverse-text", args={"num_tasks": 100}))   # EnvLoadError, or its name

`primerl rl` and `primerl eval` call `check_environment` for every configured environment
before any server or trainer starts (a mistake costs seconds, not the minutes vLLM takes to load):
the module is imported, its arguments validated against the taskset's config, the environment
built (its harness resolved) and one task drawn. Nothing is started: no runtime, tool server or
child process.

Why a module does not load is said by primerl_envs.registry's `explain`.
"""

from __future__ import annotations

from primerl_envs.config import EnvConfig
from primerl_envs.environment import verifiers_config
from primerl_envs.registry import EnvLoadError, explain, user_frame


def check_environment(cfg: EnvConfig) -> str:
    """Load `cfg` as the orchestrator will (module, arguments, environment, harness) and draw one
    task; EnvLoadError naming what is wrong. Returns the first task's prompt, cut to 80
    characters (for a message)."""
    import verifiers.v1 as vf

    where = f"environment {cfg.display_name!r} (id {cfg.id!r})"
    vf_config = verifiers_config(cfg)  # the module, the arguments (EnvLoadError, explained)
    try:
        env = vf.load_environment(vf_config)  # the taskset, built with its arguments, and the harness
    except EnvLoadError:
        raise
    except Exception as err:  # noqa: BLE001 - user code: anything, named
        raise explain(cfg, vf_config.taskset.id, err) from err
    taskset = getattr(env, "taskset", None) or vf.load_taskset(vf_config.taskset)
    try:
        task = next(iter(taskset), None)
    except Exception as err:  # noqa: BLE001
        raise EnvLoadError(
            f"{where}: drawing its first task failed: {type(err).__name__}: {err}{user_frame(err.__traceback__)}"
        ) from err
    if task is None:
        raise EnvLoadError(f"{where}: its taskset has no tasks (args {cfg.args})")
    prompt = getattr(getattr(task, "data", None), "prompt", "")
    return str(prompt)[:80]
