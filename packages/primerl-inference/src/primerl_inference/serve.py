"""`python -m primerl_inference.serve VLLM_ARGS...`: vLLM's OpenAI-compatible server, as
`python -m vllm.entrypoints.openai.api_server VLLM_ARGS...` starts it (same arguments, same
server), from a main module that imports nothing at its top.

Why a module of our own: vLLM starts its engine core in a *spawned* process, and a spawned
process first imports the parent's main module again. With vLLM's api_server module as the main
module that re-import took about 10 s of a 22 s start on a 2-core CPU machine (its FastAPI app,
OpenAI protocol models, tokenizer code) before the engine could start; this module costs
nothing to re-import. (That module path is also deprecated in vLLM 0.32.)

With `PRIMERL_INSPECT_IN_PROCESS=1` (the launcher sets it for CPU servers) the model's class is
imported in this process and registered by object through vLLM's public
`ModelRegistry.register_model`, so vLLM reads what the class supports from it directly. By
default vLLM inspects a class it has not imported in a fresh Python subprocess, which imports
vLLM and torch once more (about 7 s of CPU on the 2-core machine, on the server's critical
path); it does so only to keep CUDA uninitialised in the server process, and a CPU server has
no CUDA. The result is the same class and the same facts about it.

Without torchvision (the CPU machines), vision_compat.install() first makes vLLM's Qwen3-VL /
Qwen3.5 modules importable and their image processor torchvision-free (images served, videos
refused), in the server and in the engine process vLLM spawns (which imports this module again,
as `__mp_main__`); not where the launcher imports this module for a name.
"""

import json
import os
import sys
from pathlib import Path

INSPECT_ENV = "PRIMERL_INSPECT_IN_PROCESS"


def model_argument(argv: list[str]) -> str | None:
    """The value of `--model` (`--model X` or `--model=X`) in vLLM's arguments."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
    return None


def register_in_process(model: str | None) -> list[str]:
    """Register the architectures of the local checkpoint `model` by class (see above); the
    names registered. A hub id, a folder without config.json, or an architecture vLLM does not
    know is left to vLLM as it is."""
    config = Path(model) / "config.json" if model else None
    if config is None or not config.is_file():
        return []
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except ValueError:
        return []  # vLLM names the broken file itself
    from vllm import ModelRegistry

    done = []
    for arch in architectures:
        registered = ModelRegistry.models.get(arch) if isinstance(arch, str) else None
        if registered is not None and hasattr(registered, "module_name"):  # a lazy entry
            ModelRegistry.register_model(arch, registered.load_model_cls())
            done.append(arch)
    return done


if __name__ in ("__main__", "__mp_main__"):  # the server, or its spawned engine process
    from primerl_inference.vision_compat import install as install_vision_compat

    install_vision_compat()

if __name__ == "__main__":
    if os.environ.get(INSPECT_ENV) == "1":
        register_in_process(model_argument(sys.argv[1:]))
    try:
        from vllm.entrypoints.launchers.api_server.entry import main
    except ImportError:  # a vLLM without the launchers package (older): its classic entry point
        import runpy

        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
    else:
        main()
