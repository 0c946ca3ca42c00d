"""`python -m primerl_inference.serve VLLM_ARGS...`: vLLM's OpenAI-compatible server, as
`python -m vllm.entrypoints.openai.api_server VLLM_ARGS...` starts it (same arguments, same
server), from a main module that imports nothing at its top.

Why a module of our own: vLLM starts its engine core in a *spawned* process, and a spawned
process first imports the parent's main module again. With vLLM's api_server module as the main
module that re-import took about 10 s of a 22 s start on a 2-core CPU machine (its FastAPI app,
OpenAI protocol models, tokenizer code) before the engine could start; this module costs
nothing to re-import. (That module path is also deprecated in vLLM 0.32.)
"""

if __name__ == "__main__":
    try:
        from vllm.entrypoints.launchers.api_server.entry import main
    except ImportError:  # a vLLM without the launchers package (older): its classic entry point
        import runpy

        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
    else:
        main()
