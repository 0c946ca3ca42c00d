"""The vLLM command lines the launcher builds, GPU-only options included (no GPU needed:
these tests check the generated arguments against vLLM's own argument parser)."""

import json
import os
import subprocess
import sys

import pytest
from primerl_inference.config import DisaggregationConfig, InferenceConfig
from primerl_inference.launcher import server_command


def args_of(argv: list[str]) -> list[str]:
    return argv[argv.index("primerl_inference.serve") + 1 :]


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_cpu_server():
    spec = server_command(InferenceConfig(port=8100), "m", 512, replica=0, run_dir="/r", device="cpu")
    a = args_of(spec.argv)
    assert value(a, "--model") == "m" and value(a, "--port") == "8100" and value(a, "--max-model-len") == "512"
    assert "--enforce-eager" in a and value(a, "--middleware") == "primerl_inference.admin.AdminMiddleware"
    assert value(a, "--kv-cache-memory-bytes") == str(2**30) and "CUDA_VISIBLE_DEVICES" not in spec.env
    small = server_command(InferenceConfig(cpu_kv_cache_gib=0.0625), "m", 512, replica=0, run_dir="/r", device="cpu")
    assert value(args_of(small.argv), "--kv-cache-memory-bytes") == str(64 * 2**20)  # fractions of a GiB
    assert spec.env["PRIMERL_INSPECT_IN_PROCESS"] == "1"  # CPU only: no subprocess inspects the model class
    assert spec.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # CPU only: the model in the engine process
    assert spec.env["TORCHDYNAMO_DISABLE"] == "1"  # CPU only: the sampler's helpers eager, no compile at step 0
    assert spec.url == "http://127.0.0.1:8100"


def test_a_cpu_server_keeps_the_users_torchdynamo_setting(monkeypatch):
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    spec = server_command(InferenceConfig(port=8100), "m", 512, replica=0, run_dir="/r", device="cpu")
    assert spec.env["TORCHDYNAMO_DISABLE"] == "0"


def test_replicas_get_their_own_ports_and_gpus():
    cfg = InferenceConfig(port=9000, num_replicas=2, tensor_parallel_size=2, gpus=[4, 5, 6, 7])
    specs = [server_command(cfg, "m", 1024, i, "/r", device="cuda") for i in range(2)]
    assert [s.port for s in specs] == [9000, 9001]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["4,5", "6,7"]
    assert all("VLLM_ENABLE_V1_MULTIPROCESSING" not in s.env for s in specs)  # vLLM's default on GPUs
    assert all("PRIMERL_INSPECT_IN_PROCESS" not in s.env for s in specs)  # CUDA stays out of the server process
    assert all("TORCHDYNAMO_DISABLE" not in s.env for s in specs)  # vLLM compiles on GPUs
    assert value(args_of(specs[1].argv), "--tensor-parallel-size") == "2"


def test_an_unset_gpu_memory_utilization_is_vllms_default_on_the_command_line():
    """None (the config's default) never reaches vLLM: servers with GPUs of their own take 0.9;
    `primerl rl` writes the colocated share into the config before it starts them."""
    argv = server_command(InferenceConfig(), "m", 1024, 0, "/r", device="cuda").argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    set_ = server_command(InferenceConfig(gpu_memory_utilization=0.35), "m", 1024, 0, "/r", device="cuda").argv
    assert set_[set_.index("--gpu-memory-utilization") + 1] == "0.35"


def test_gpu_only_options():
    cfg = InferenceConfig(
        quantization="fp8",
        kv_cache_dtype="fp8",
        enable_expert_parallel=True,
        data_parallel_size=2,
        kv_offload_gib=16,
        disaggregation=DisaggregationConfig(role="prefill"),
        enable_lora=True,
        max_lora_rank=32,
        extra_args=["--seed", "3"],
    )
    a = args_of(server_command(cfg, "m", 4096, 0, "/r", device="cuda").argv)
    assert value(a, "--quantization") == "fp8" and value(a, "--kv-cache-dtype") == "fp8"
    assert "--enable-expert-parallel" in a and value(a, "--data-parallel-size") == "2"
    assert float(value(a, "--kv-offloading-size")) == 16.0 and value(a, "--kv-offloading-backend") == "native"
    assert json.loads(value(a, "--kv-transfer-config")) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert value(a, "--max-lora-rank") == "32" and a[-2:] == ["--seed", "3"]


def test_too_few_gpus_is_a_config_error():
    with pytest.raises(ValueError, match="gpus lists 2 GPUs, but 2 replicas x 2 GPUs each need 4"):
        InferenceConfig(num_replicas=2, tensor_parallel_size=2, gpus=[0, 1])


PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
ns = parser.parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: getattr(ns, k) for k in json.loads(sys.argv[2])}, default=str))
"""


def test_vllm_parses_the_gpu_command_line():
    """vLLM's own parser accepts every flag we generate and reads the values we meant."""
    cfg = InferenceConfig(
        quantization="fp8",
        kv_cache_dtype="fp8",
        enable_expert_parallel=True,
        data_parallel_size=2,
        kv_offload_gib=16,
        disaggregation=DisaggregationConfig(role="decode"),
        tensor_parallel_size=4,
        gpu_memory_utilization=0.5,
    )
    a = args_of(server_command(cfg, "m", 4096, 0, "/r", device="cuda").argv)
    keys = [
        "quantization",
        "kv_cache_dtype",
        "enable_expert_parallel",
        "data_parallel_size",
        "kv_offloading_size",
        "kv_offloading_backend",
        "kv_transfer_config",
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "middleware",
        "enable_prefix_caching",
    ]
    out = subprocess.run(
        [sys.executable, "-c", PARSE, json.dumps(a), json.dumps(keys)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ns = json.loads(out.stdout.strip().splitlines()[-1])
    assert ns["quantization"] == "fp8" and ns["kv_cache_dtype"] == "fp8" and ns["enable_expert_parallel"] is True
    assert ns["data_parallel_size"] == 2 and ns["tensor_parallel_size"] == 4 and ns["gpu_memory_utilization"] == 0.5
    assert float(ns["kv_offloading_size"]) == 16.0 and ns["kv_offloading_backend"] == "native"
    assert "kv_consumer" in ns["kv_transfer_config"] and ns["max_model_len"] == 4096
    assert ns["middleware"] == ["primerl_inference.admin.AdminMiddleware"] and ns["enable_prefix_caching"] is True


INSPECT = """
import json, sys
from primerl_inference.serve import register_in_process
from vllm import ModelRegistry
arch = "Qwen3ForCausalLM"
lazy = ModelRegistry.models[arch]
assert hasattr(lazy, "module_name"), "vLLM registers its own models lazily"
assert register_in_process(sys.argv[1]) == [arch]
assert register_in_process("Qwen/Qwen3-0.6B") == []  # a hub id: left to vLLM
now = ModelRegistry.models[arch]
assert not hasattr(now, "module_name") and now.load_model_cls() is lazy.load_model_cls()
# what vLLM's own subprocess finds out about the class, and what it reads from the class here
print(json.dumps([repr(lazy.inspect_model_cls()), repr(now.inspect_model_cls())]))
"""


@pytest.mark.slow
def test_a_cpu_server_reads_the_model_class_in_process_and_learns_what_the_subprocess_would(tmp_path):
    """serve.py's `register_in_process`: the checkpoint's architecture becomes a class vLLM
    has imported, and vLLM's facts about it equal those its own inspection subprocess gives."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    out = subprocess.run(
        [sys.executable, "-c", INSPECT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    from_subprocess, in_process = json.loads(out.stdout.strip().splitlines()[-1])
    assert from_subprocess == in_process and "is_text_generation_model=True" in in_process


def test_the_lora_ranks_the_config_takes_are_the_ones_vllm_takes():
    """inference.max_lora_rank is checked when the config loads (without vLLM): against vLLM's
    own list, so that the two cannot drift apart."""
    import typing

    from primerl_inference.config import LORA_RANKS
    from vllm.config.lora import MaxLoRARanks

    assert LORA_RANKS == typing.get_args(MaxLoRARanks)
