"""The environments primerl knows by name, and why one does not load, said so a user can act
(environment.py and checks.py both use these; this module imports neither).

verifiers reports every failure to import as "not found"; `explain` tells apart:
- the module itself is not there (with a did-you-mean among the built-in names: `reverse_text`
  for `reverse-text`),
- the module is there but a module *it* imports is not installed (named, with the line),
- the module is written for the classic verifiers API (0.3: `load_environment()`), which
  verifiers 0.4 does not load,
- the module raised at import (its exception and line).
"""

from __future__ import annotations

import difflib
import sys
import traceback
from types import TracebackType

from primerl_envs.config import EnvConfig

BUILTIN = {
    "reverse-text": "primerl-reverse-text",
    "alphabet-sort": "primerl-alphabet-sort",
    "math": "primerl-math",
    "tool-use": "primerl-tool-use",
    "code": "primerl-code",
    "shapes": "primerl-shapes",
    "swe": "primerl-swe",
    "terminal": "primerl-terminal",
    "search": "primerl-search",
}
"""primerl's built-in environments: short name -> verifiers taskset id (a top-level module)."""


class EnvLoadError(ValueError):
    """An environment that cannot be loaded: names the environment and what was wrong."""


CLASSIC_API = (
    "this is the classic verifiers API (0.3: a module whose `load_environment()` returns an environment); "
    "verifiers 0.4 environments are Tasksets: a `vf.Taskset` subclass exported through the module's `__all__`, "
    "whose tasks carry `@vf.reward` methods (`import verifiers.v1 as vf`; docs/environments.md, "
    '"Writing an environment", shows a whole one)'
)


def module_name(taskset_id: str) -> str:
    """The module verifiers imports for `taskset_id` (its rule: hub owner and version dropped,
    dashes to underscores, lower case)."""
    return taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def did_you_mean(env_id: str) -> str:
    """` Did you mean 'reverse-text'?` for an id close to a built-in name, else ''."""
    names = list(BUILTIN)
    normal = env_id.strip().lower().replace("_", "-")
    found = [n for n in names if n == normal or BUILTIN[n] == normal]
    found = found or difflib.get_close_matches(normal, names, n=1, cutoff=0.75)
    return f" Did you mean {found[0]!r}?" if found else ""


LOADERS = ("importlib", "<frozen", "/verifiers/", "/pydantic/", "/pydantic_core/", "/primerl_envs/")
"""Paths of frames that load a module rather than belong to it."""


def user_frame(tb: TracebackType | None) -> str:
    """` (file.py, line N)` of the innermost frame that is not the loading machinery, else ''."""
    where = ""
    for frame in traceback.extract_tb(tb):
        if not any(part in frame.filename for part in LOADERS):
            where = f" ({frame.filename}, line {frame.lineno})"
    return where


def _missing_dependency(err: BaseException, module: str) -> ModuleNotFoundError | None:
    """The ModuleNotFoundError behind `err` for a module other than `module` itself (a module
    it imports), if that is what it is."""
    seen = err
    while seen is not None:
        if isinstance(seen, ModuleNotFoundError) and seen.name:
            top = seen.name.split(".")[0]
            return None if top in (module, module.split(".")[0]) else seen
        seen = seen.__cause__ or seen.__context__
    return None


def explain(cfg: EnvConfig, taskset_id: str, err: BaseException) -> EnvLoadError:
    """The EnvLoadError for an environment whose taskset `taskset_id` did not load with `err`."""
    where = f"environment {cfg.display_name!r} (id {cfg.id!r})"
    module = module_name(taskset_id)
    loaded = sys.modules.get(module) or sys.modules.get(f"verifiers.v1.tasksets.{module}")
    if loaded is not None and callable(getattr(loaded, "load_environment", None)) and not _has_taskset(loaded):
        return EnvLoadError(
            f"{where}: module {module!r} ({getattr(loaded, '__file__', '?')}) defines "
            f"`load_environment()`: {CLASSIC_API}"
        )
    if isinstance(err, ModuleNotFoundError) and not str(err).startswith(("taskset ", "No module")):
        return EnvLoadError(f"{where}: {err}")  # verifiers' own: a harness or judge not found, the built-in ones named
    if isinstance(err, ModuleNotFoundError):
        if (dep := _missing_dependency(err, module)) is not None:
            return EnvLoadError(
                f"{where}: its module {module!r} was found, but importing it failed: it imports {dep.name!r}, which "
                f"is not installed{user_frame(dep.__traceback__)}; install it in this environment (the orchestrator "
                "imports it too)"
            )
        return EnvLoadError(
            f"{where}: not found (no module {module!r}).{did_you_mean(cfg.id)} Built-in environments: "
            f"{', '.join(BUILTIN)}; otherwise give an installed taskset package or the path of a local module "
            "(./my_env.py)"
        )
    if isinstance(err, SyntaxError):
        return EnvLoadError(f"{where}: its module has a syntax error: {err.msg} ({err.filename}, line {err.lineno})")
    if isinstance(err, EnvLoadError):
        return err
    return EnvLoadError(f"{where}: {type(err).__name__}: {err}{user_frame(err.__traceback__)}")


def _has_taskset(module) -> bool:
    import verifiers.v1 as vf

    return any(
        isinstance(obj, type) and issubclass(obj, vf.Taskset) and obj is not vf.Taskset
        for obj in (getattr(module, name, None) for name in getattr(module, "__all__", ()) or ())
    )
