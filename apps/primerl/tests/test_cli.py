"""The commands: help lists config sections, --dry-run, config errors, bad set-ups named before anything starts."""

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from primerl.cli import inference_main, main, orch_main, trainer_main
from primerl.configs import RLConfig
from primerl_protocol.config import load_config
from primerl_trainer.testing import free_port_block

COMMANDS = {
    "rl": (main, ["rl"], ["trainer", "orchestrator", "inference", "envs", "model", "seq_len"]),
    "sft": (main, ["sft", "data.path=d.jsonl"], ["trainer", "data", "model"]),
    "eval": (main, ["eval"], ["inference", "envs", "eval", "run"]),
    "primerl-orch": (orch_main, [], ["orchestrator", "inference", "envs"]),
    "primerl-trainer": (trainer_main, [], ["trainer", "transport"]),
    "primerl-inference": (inference_main, [], ["inference"]),
}


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "rl.toml"
    path.write_text('[model]\nname = "tiny"\n')
    return path


@pytest.mark.parametrize("name", COMMANDS)
def test_help_lists_config_sections(name):
    cmd, prefix, expected = COMMANDS[name]
    result = CliRunner().invoke(cmd, [*prefix[:1], "--help"])
    assert result.exit_code == 0, result.output
    section_lines = result.output.split("Config sections and top-level keys:")[1]
    for section in expected:
        assert re.search(rf"\n\s+{section}\s", section_lines), section


def test_rl_dry_run_prints_toml_of_the_resolved_config(config):
    args = ["rl", "@", str(config), "orchestrator.group_size=4", "--dry-run"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = tomllib.loads(result.output)
    assert printed["orchestrator"]["group_size"] == 4
    assert printed["model"]["name"] == "tiny"
    # What it printed is the whole config: loading it alone gives the same config.
    again = config.parent / "printed.toml"
    again.write_text(result.output)
    assert load_config(RLConfig, ["@", str(again)]) == load_config(
        RLConfig, ["@", str(config), "orchestrator.group_size=4"]
    )


@pytest.mark.parametrize(
    "setup, message",
    [
        ("model", "model.name: tiny/config.json not found"),
        # an org/name id is fetched from the hub before anything starts; offline here (HF_HUB_OFFLINE)
        ("hub", "model.name: model 'no-such-org/no-such-model' is not a local folder and could not be fetched"),
        ("gpt2", "model_type 'gpt2' is not implemented by primerl-models; supported:"),
        ("no-envs", "envs.train: no training environments"),
        ("missing-env", "envs.train[0].id:"),
        ("long-rows", "seq_len = 8192 is above the model's max_position_embeddings = 4096"),
    ],
)
def test_rl_bad_setups_fail_before_any_process_starts(tmp_path, monkeypatch, setup, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "gpt2" if setup == "gpt2" else "qwen3", "max_position_embeddings": 4096})
    )
    name = {"model": "tiny", "hub": "no-such-org/no-such-model"}.get(setup, str(model))
    envs = {"no-envs": "", "missing-env": '[[envs.train]]\nid = "./no_such_env.py"\n'}.get(
        setup, '[[envs.train]]\nid = "reverse-text"\n'
    )
    path = tmp_path / "rl.toml"
    seq_len = "seq_len = 8192\n" if setup == "long-rows" else ""
    path.write_text(f'{seq_len}run_dir = "{tmp_path / "run"}"\n[model]\nname = "{name}"\n{envs}')
    result = CliRunner().invoke(main, ["rl", "@", str(path)])
    # 2: the user's input is wrong, as for a config error (1 is for what started and failed)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started


def test_orchestrator_and_eval_without_environments_fail_naming_the_section(config):
    cmd, prefix, _ = COMMANDS["primerl-orch"]
    result = CliRunner().invoke(cmd, [*prefix, "@", str(config)])
    assert result.exit_code == 1
    assert "no training environments: add at least one [[envs.train]] entry" in result.output
    cmd, prefix, _ = COMMANDS["eval"]  # refused as the config loads, before any server starts
    result = CliRunner().invoke(cmd, [*prefix, "@", str(config)])
    assert result.exit_code == 2
    assert "envs.eval: no eval environments: add at least one [[envs.eval]] entry" in result.output


def test_config_error_exits_2_naming_the_key(config):
    result = CliRunner().invoke(main, ["rl", "@", str(config), "trainer.optimizer.weight_decy=0.1"])
    assert result.exit_code == 2
    assert "primerl rl: config error: unknown key `trainer.optimizer.weight_decy`" in result.output
    assert "did you mean `trainer.optimizer.weight_decay`?" in result.output


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["seq_len=1024", "trainer.micro_batch_tokens=512"],
            "trainer.micro_batch_tokens = 512 is below seq_len = 1024: the orchestrator packs rows",
        ),
        (
            ["orchestrator.max_async_level=3"],
            "trainer.weights.keep = 3 with orchestrator.max_async_level = 3: .* set trainer.weights.keep >= 4",
        ),
        (["orchestrator.sampling.temperature=0"], "temperature 0 \\(greedy\\) cannot train"),
        (
            ["orchestrator.share_prompts=true", "transport.trainer_ranks=2", "trainer.parallel.cp=2"],
            "orchestrator.share_prompts = true with trainer.parallel.cp = 2: rows whose samples share a prompt",
        ),
        (
            ["orchestrator.share_prompts=true", 'trainer.attention="varlen"'],
            'orchestrator.share_prompts = true with trainer.attention = "varlen": varlen kernels cannot attend',
        ),
    ],
)
def test_values_trainer_and_orchestrator_must_agree_on_are_checked_at_load(config, overrides, message):
    result = CliRunner().invoke(main, ["rl", "@", str(config), *overrides, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert re.search(message, result.output), result.output


def test_console_scripts_are_installed():
    bindir = Path(sys.executable).parent
    for script in ["primerl", "primerl-orch", "primerl-trainer", "primerl-inference"]:
        out = subprocess.run([bindir / script, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "Usage:" in out.stdout, (script, out.stderr)


@pytest.mark.parametrize("name", ["sft", "primerl-trainer"])
def test_trainers_name_a_model_that_cannot_be_loaded(name, config, tmp_path):
    cmd, prefix, _ = COMMANDS[name]
    args = [*prefix, "@", str(config), f"model.name={tmp_path / 'no-such-model'}", f"run_dir={tmp_path / 'run'}"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "primerl.sft_entry" if name == "sft" else "primerl.trainer_entry",
            *args[len(prefix[:1]) :],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert result.returncode == 1, result.stderr
    assert f"cannot load model '{tmp_path / 'no-such-model'}'" in result.stderr


def test_inference_command_names_a_server_that_does_not_come_up(tmp_path):
    cfg = tmp_path / "inf.toml"
    port = free_port_block(1)
    cfg.write_text(
        f'run_dir = "{tmp_path}"\n[model]\nname = "{tmp_path / "no-such-model"}"\n[inference]\nport = {port}\n'
    )
    result = CliRunner().invoke(inference_main, ["@", str(cfg)])
    assert result.exit_code == 1
    assert f"inference replica 0 (http://127.0.0.1:{port}) exited with code" in result.output
    assert (tmp_path / "logs" / "inference-0.log").exists()


def test_the_servers_lora_rank_fits_the_published_adapters_before_anything_starts():
    """`primerl rl` with published adapters sets vLLM's --max-lora-rank from the model: the
    smallest vLLM takes that holds the adapter's largest module (GLM-4's gate_up_proj holds two
    adapted layers: twice the rank); one set too low, or targets that match nothing, stop the
    run before it starts, naming the keys."""
    from primerl.errors import RunError
    from primerl.launch import fit_lora_rank
    from primerl_models.families import FAMILIES, TinyShape

    shape = TinyShape(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    qwen3, glm4 = (FAMILIES[f].tiny_config(shape) for f in ("qwen3", "glm4"))

    def fitted(hf_config, *overrides):
        cfg = load_config(RLConfig, ["model.name=m", *overrides])
        return fit_lora_rank(cfg, hf_config).inference.max_lora_rank

    assert fitted(qwen3, "trainer.lora.rank=8") == 8
    assert fitted(qwen3, "trainer.lora.rank=12") == 16  # vLLM takes 8 or 16, nothing between
    assert fitted(glm4, "trainer.lora.rank=8") == 16
    assert fitted(glm4, "trainer.lora.rank=8", 'trainer.lora.targets=["q_proj", "up_proj"]') == 8
    assert fitted(glm4, "trainer.lora.rank=8", 'trainer.lora.publish="merged"') is None
    with pytest.raises(
        RunError,
        match=r"inference.max_lora_rank = 8, but the adapters trainer.lora publishes have rank "
        r"16 \(trainer.lora.rank = 8 x 2 layers the checkpoint fuses\): set it to 16",
    ):
        fitted(glm4, "trainer.lora.rank=8", "inference.max_lora_rank=8")
    with pytest.raises(RunError, match=r"trainer.lora.publish = \"adapter\": trainer.lora.targets = \['qkv'\] matches"):
        fitted(qwen3, 'trainer.lora.targets=["qkv"]')


def test_shared_prompts_are_on_where_exact_and_refused_elsewhere_before_anything_starts():
    """`primerl rl` (and --slurm) resolve an unset orchestrator.share_prompts from the model and
    the trainer's settings: on for models whose every mixer is attention (GPT-OSS's windows and
    sinks included), off for recurrent ones (Qwen3.5, Nemotron-H), MLA (GLM-5), context
    parallelism; asked for where it is not exact, the run is refused naming the key and why."""
    from primerl.errors import CheckError
    from primerl.launch import share_prompts
    from primerl_models.families import FAMILIES, TinyShape

    shape = TinyShape(vocab_size=48, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)

    def resolved(family, *overrides):
        cfg = load_config(RLConfig, ["model.name=m", *overrides])
        return share_prompts(cfg, FAMILIES[family].tiny_config(shape)).orchestrator.share_prompts

    for family in ("llama", "qwen3", "qwen3_moe", "glm4_moe", "gpt_oss", "minimax_m2"):
        assert resolved(family) is True, family
    for family in ("qwen3_5", "nemotron_h", "glm_moe_dsa"):
        assert resolved(family) is False, family
        assert resolved(family, "orchestrator.share_prompts=false") is False
    assert resolved("qwen3", "transport.trainer_ranks=2", "trainer.parallel.cp=2") is False
    assert resolved("qwen3", 'trainer.attention="varlen"') is False
    assert resolved("qwen3", "orchestrator.share_prompts=false") is False
    with pytest.raises(
        CheckError,
        match=r"orchestrator.share_prompts = true, but qwen3_5's layer 0 mixes tokens with GatedDeltaNet, which is "
        r"recurrent .*set orchestrator.share_prompts = false",
    ):
        resolved("qwen3_5", "orchestrator.share_prompts=true")


def test_merge_lora_refuses_a_missing_adapter_naming_it(tmp_path):
    """The command's errors are one line naming the folder, exit code non-zero, nothing written
    (the merge itself: packages/primerl-trainer/tests/test_adapters.py)."""
    from primerl_models.tiny import build_tiny_model

    base = build_tiny_model(tmp_path / "base")
    result = CliRunner().invoke(main, ["merge-lora", str(base), str(tmp_path / "nowhere"), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "primerl merge-lora:" in result.output and "nowhere" in result.output, result.output
    assert not (tmp_path / "out").exists()


def lora_adapter(folder: Path, base: Path, recorded: str | None, *, rank: int = 2) -> Path:
    """A PEFT LoRA adapter on q_proj of every layer of `base` (shapes read off its weights),
    whose adapter_config.json names `recorded` as its base model."""
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(base / "model.safetensors")
    tensors = {}
    for name, w in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, w.shape[1])
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(w.shape[0], rank)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": ["q_proj"],
                "bias": "none",
                "base_model_name_or_path": recorded,
            }
        )
    )
    return folder


def test_merge_lora_refuses_an_adapter_of_another_base_naming_both(tmp_path):
    """An adapter whose base_model_name_or_path names another model than BASE is refused
    (exit 2, nothing written) unless --allow-base-mismatch; the same model under another path
    (a copy of the folder, the hub id of a download) is accepted."""
    from primerl_models.tiny import build_tiny_model

    trained_on = build_tiny_model(tmp_path / "Qwen3-Tiny", hidden_size=32, num_layers=1)
    other = build_tiny_model(tmp_path / "Qwen3-Tiny-Base", hidden_size=32, num_layers=1, seed=1)
    adapter = lora_adapter(tmp_path / "adapter", trained_on, str(trained_on))

    result = CliRunner().invoke(main, ["merge-lora", str(other), str(adapter), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert (
        f"the adapter {adapter} was trained on '{trained_on}' (base_model_name_or_path in its "
        f"adapter_config.json), not on '{other}'"
    ) in result.output, result.output
    assert "--allow-base-mismatch" in result.output
    assert not (tmp_path / "out").exists()

    args = ["merge-lora", str(other), str(adapter), str(tmp_path / "out"), "--allow-base-mismatch"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and (tmp_path / "out" / "config.json").exists(), result.output
    result = CliRunner().invoke(main, ["merge-lora", str(trained_on), str(adapter), str(tmp_path / "same")])
    assert result.exit_code == 0, result.output
    hub = lora_adapter(tmp_path / "hub-adapter", trained_on, "some-org/qwen3-tiny")  # names compare, any case
    result = CliRunner().invoke(main, ["merge-lora", str(trained_on), str(hub), str(tmp_path / "from-hub")])
    assert result.exit_code == 0, result.output


def test_merge_lora_refuses_an_adapter_whose_layers_do_not_fit_the_base_naming_the_layer(tmp_path):
    """Shapes are checked whatever the names say (--allow-base-mismatch included): an adapter of
    a wider model of the same name is refused, naming the first layer that does not fit."""
    from primerl_models.tiny import build_tiny_model

    wide = build_tiny_model(tmp_path / "wide" / "Qwen3-Tiny", hidden_size=64, num_layers=1)
    base = build_tiny_model(tmp_path / "Qwen3-Tiny", hidden_size=32, num_layers=1)
    adapter = lora_adapter(tmp_path / "adapter", wide, str(wide))
    for flags in ([], ["--allow-base-mismatch"]):
        result = CliRunner().invoke(main, ["merge-lora", str(base), str(adapter), str(tmp_path / "out"), *flags])
        assert result.exit_code == 2, result.output
        assert (
            "adapter module model.layers.0.self_attn.q_proj: A (2, 64) and B (64, 2) of rank 2 do not fit the "
            "base weight (32, 32)"
        ) in result.output, result.output
        assert not (tmp_path / "out").exists()


def test_eval_of_a_run_that_published_adapters_serves_them(tmp_path):
    """`primerl eval run=...` on a LoRA run starts its servers with LoRA on and a rank that holds
    the largest published one (r, or a fused module's rank_pattern); an explicit
    inference.enable_lora = false, or a run of full weights, leaves the settings alone."""
    from primerl.cli import _eval_inference
    from primerl.configs import EvalConfig
    from primerl_protocol import rundir
    from primerl_protocol.weights import ADAPTER, FULL, write_marker

    run = tmp_path / "run"
    for step, (r, pattern) in enumerate([(8, {}), (8, {"gate_up_proj": 16})]):
        folder = rundir.step_folder(run / rundir.WEIGHTS, step)
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"r": r, "rank_pattern": pattern}))
        write_marker(folder, step, ["adapter_config.json"], 0.0, format=ADAPTER)

    envs = 'envs.eval=[{id = "reverse-text"}]'

    def inference(*overrides):
        return _eval_inference(load_config(EvalConfig, ['model.name="tiny"', f'run="{run}"', envs, *overrides]))

    got = inference()
    assert got.enable_lora and got.max_lora_rank == 16
    assert got.admin_token and inference().admin_token != got.admin_token  # its own, to load the steps with
    assert inference('inference.admin_token="mine"').admin_token == "mine"
    assert inference("inference.max_lora_rank=32").max_lora_rank == 32
    assert inference("inference.enable_lora=false").enable_lora is False
    full = tmp_path / "full"
    folder = rundir.step_folder(full / rundir.WEIGHTS, 0)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    write_marker(folder, 0, ["model.safetensors"], 0.0, format=FULL)
    assert _eval_inference(load_config(EvalConfig, ['model.name="tiny"', f'run="{full}"', envs])).enable_lora is None
    (rundir.step_folder(run / rundir.WEIGHTS, 1) / "adapter_config.json").write_text('{"rank": 8}')  # no "r"
    with pytest.raises(ValueError, match="step_1/adapter_config.json: not a readable PEFT adapter config"):
        inference()
