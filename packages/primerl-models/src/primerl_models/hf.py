"""Hugging Face checkpoints: read, convert to our names and layouts, build the model, write back.

Names: ours are HF's without the `model.` prefix, except mixture-of-experts layers, where HF
stores each expert's [out, in] matrices separately and we stack them [E, in, out] for grouped
GEMMs, and the router (`mlp.gate` -> `mlp.router`). `to_ours(to_hf(sd)) == sd` exactly.

Everything a user can get wrong fails here, naming it: an unsupported model_type, a missing
config.json or safetensors file, a corrupt file, a missing or unexpected tensor, a tensor of
the wrong shape.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from primerl_models.common.args import ModelArgs
from primerl_models.common.attention import Backend
from primerl_models.common.transformer import Transformer
from primerl_models.families import family_for

_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.w_(gate|up|down)$")


def to_ours(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names and layouts -> ours."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, tensor in hf.items():
        if m := _HF_EXPERT.match(name):
            experts[(int(m[1]), m[3])][int(m[2])] = tensor
            continue
        if name == "lm_head.weight" and args.tie_embeddings:
            continue  # tied: the embedding is the output projection
        ours = name.removeprefix("model.").replace(".mlp.gate.weight", ".mlp.router.weight")
        out[ours] = tensor
    for (layer, proj), by_index in experts.items():
        missing = sorted(set(range(args.num_experts)) - set(by_index))
        if missing:
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight" for e in missing[:3]]
            raise ValueError(f"missing tensors: {', '.join(names)}{' ...' if len(missing) > 3 else ''}")
        out[f"layers.{layer}.mlp.experts.w_{proj}"] = torch.stack([by_index[e].T for e in sorted(by_index)])
    return out


def to_hf(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names and layouts -> HF's (contiguous tensors, ready for safetensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in ours.items():
        if m := _OUR_EXPERTS.match(name):
            for e, w in enumerate(tensor.unbind(0)):
                out[f"model.layers.{m[1]}.mlp.experts.{e}.{m[2]}_proj.weight"] = w.T.contiguous()
            continue
        if name == "lm_head.weight":
            out[name] = tensor.contiguous()
            continue
        out["model." + name.replace(".mlp.router.weight", ".mlp.gate.weight")] = tensor.contiguous()
    return out


def resolve_model_folder(name: str, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a hub id, downloaded (or found in the local HF cache)."""
    path = Path(name)
    if path.is_dir():
        return path
    if not is_hub_id(name):
        raise FileNotFoundError(f"model folder {name!r} does not exist (nor is it a hub id of the form org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(f"model {name!r} is not a local folder, and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    except Exception as err:  # offline, unknown id, no access: say which model and why
        raise FileNotFoundError(f"model {name!r} is not a local folder and could not be fetched from the hub: {err}") from None


def is_hub_id(name: str) -> bool:
    """`org/name` that is no local path: what `primerl rl` fetches from the hub before it starts."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def read_config(path: str | Path) -> dict:
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: a model folder needs config.json (HF layout)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: invalid JSON ({err})") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
    for p in paths:
        if not p.exists():
            raise FileNotFoundError(f"{p} is listed in {index.name} but missing")
    return paths


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF checkpoint folder (single file or sharded with an index)."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    out[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file}: not a readable safetensors file ({err})") from None
    return out


def check_state_dict(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], where: str) -> None:
    """Missing, unexpected and wrongly shaped tensors, all named, in one error."""
    problems = []
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    for name in sorted(set(expected) & set(got)):
        if tuple(expected[name].shape) != tuple(got[name].shape):
            problems.append(
                f"tensor {name} has shape {tuple(got[name].shape)}, expected {tuple(expected[name].shape)}"
            )
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))


def build_model(args: ModelArgs, device: str | torch.device = "cpu", attn_backend: Backend = "auto") -> Transformer:
    """A model built on the meta device, then materialised (uninitialised) on `device`."""
    with torch.device("meta"):
        model = Transformer(args, attn_backend)
    model.to_empty(device=device)
    model.reset_moe_stats()
    return model


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    attn_backend: Backend = "auto",
) -> Transformer:
    """Our model with the weights of a HF checkpoint folder."""
    path = Path(path)
    cfg = read_config(path)
    args = family_for(cfg, str(path / "config.json")).args_from_hf(cfg)
    state = to_ours(read_tensors(path), args)
    model = build_model(args, device, attn_backend).to(dtype)
    check_state_dict(model.state_dict(), state, str(path))
    model.load_state_dict(state)
    return model


def save_hf(
    state_dict: dict[str, torch.Tensor],
    hf_config: dict,
    path: str | Path,
    max_shard_bytes: int = 5 << 30,
) -> list[Path]:
    """Write our state dict as a HF checkpoint (config.json, safetensors shards and index)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in to_hf(state_dict).items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = []
    if len(shards) == 1:
        files.append(path / "model.safetensors")
        save_file(shards[0], str(files[0]), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = path / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update({name: file.name for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    return files
