"""Hugging Face checkpoints: read, convert to our names and layouts, build the model, write back.

Names and layouts are each family's (families/checkpoint.py); `to_ours(to_hf(sd)) == sd`
exactly. Tensors a family carries (GLM-4.5's MTP layer) are not loaded into the model: the
publisher copies them from the source folder into every published folder (`carried_tensors`).
Checkpoints stored block-quantised in FP8 (`quantization_config` with quant_method "fp8" and
`weight_block_size`, MiniMax-M2's) are dequantised at load with their stored scales
(`weight_scale_inv`), and so are MXFP4 ones (quant_method "mxfp4", GPT-OSS's experts:
`X_blocks` and `X_scales`); what is published is plain weights (`published_config`).

Everything a user can get wrong fails here, naming it: an unsupported model_type, a missing
config.json or safetensors file, a corrupt file, a missing or unexpected tensor, a tensor of
the wrong shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from primerl_models.args import ModelArgs
from primerl_models.blocks.attention import Backend
from primerl_models.families import FAMILIES, family_for
from primerl_models.families.checkpoint import no_carried
from primerl_models.model import Transformer


def to_ours(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names and layouts -> ours, by the family's checkpoint rules (families/checkpoint.py)."""
    return FAMILIES[args.model_type].checkpoint.to_ours(hf, args)


def to_hf(ours: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our names and layouts -> HF's (contiguous tensors, ready for safetensors)."""
    return FAMILIES[args.model_type].checkpoint.to_hf(ours)


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
        return Path(
            snapshot_download(
                name, revision=revision, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
            )
        )
    except Exception as err:  # offline, unknown id, no access: say which model and why
        raise FileNotFoundError(
            f"model {name!r} is not a local folder and could not be fetched from the hub: {err}"
        ) from None


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


def read_tensors(path: str | Path, keep=None) -> dict[str, torch.Tensor]:
    """Every tensor of a HF checkpoint folder (single file or sharded with an index), or those
    whose names `keep(name)` accepts."""
    out: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        out[name] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as err:
            raise ValueError(f"{file}: not a readable safetensors file ({err})") from None
    return out


# The 16 values of an FP4 (e2m1) nibble: sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling): `blocks` uint8 [..., R, G, 16] hold 32 FP4 values per group
    (two per byte, the low nibble first), `scales` uint8 [..., R, G] each group's power of two
    (biased by 127). Returns [..., G * 32, R]: the rows' values, transposed as the BF16
    checkpoints store these matrices (GPT-OSS's experts: [E, in, out])."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.shape[:-1] != scales.shape
        or blocks.shape[-1] != 16
    ):
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
            f"{scales.dtype} do not pair (uint8 [..., R, G, 16] and uint8 [..., R, G])"
        )
    if blocks.dim() > 3:  # one expert at a time: the int and float temporaries stay small
        return torch.stack([dequantize_mxfp4(b, sc, dtype) for b, sc in zip(blocks, scales)])
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low, high = (blocks & 0x0F).int(), (blocks >> 4).int()
    values = torch.stack([lut[low], lut[high]], dim=-1).flatten(-2)  # [R, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def dequantize(tensors: dict[str, torch.Tensor], cfg: dict, dtype: torch.dtype, where: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with what its `quantization_config` quantised made plain
    `dtype` (block-quantised FP8, MXFP4); a checkpoint without one is returned as is."""
    quant = cfg.get("quantization_config")
    if quant and quant.get("quant_method") == "mxfp4":
        out = dict(tensors)
        for blocks_name in [n for n in tensors if n.endswith("_blocks")]:
            name = blocks_name.removesuffix("_blocks")
            if name + "_scales" not in out:
                raise ValueError(f"{where}: {blocks_name} has no scales {name}_scales")
            try:
                out[name] = dequantize_mxfp4(out.pop(blocks_name), out.pop(name + "_scales"), dtype)
            except ValueError as err:
                raise ValueError(f"{where}: {name}: {err}") from None
        if stray := sorted(n for n in out if n.endswith("_scales")):
            raise ValueError(f"{where}: MXFP4 scales without their blocks: {', '.join(stray[:5])}")
        return out
    return dequantize_fp8(tensors, cfg, dtype, where)


def dequantize_fp8(
    tensors: dict[str, torch.Tensor], cfg: dict, dtype: torch.dtype, where: str
) -> dict[str, torch.Tensor]:
    """Block-quantised FP8 weights (`X.weight` float8 with `X.weight_scale_inv` [ceil(out/bo),
    ceil(in/bi)] fp32, bo x bi = weight_block_size) -> `X.weight` = fp8 x scale in `dtype`.
    A checkpoint without `quantization_config` is returned as is."""
    quant = cfg.get("quantization_config")
    if not quant:
        return tensors
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise ValueError(
            f"{where}: quantization_config {{quant_method: {method!r}, weight_block_size: {block!r}}} is not "
            "supported; block-quantised fp8 and mxfp4 checkpoints are dequantised at load, other quantised ones are not"
        )
    out = dict(tensors)
    for scale_name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        name = scale_name.removesuffix("_scale_inv")
        if name not in out:
            raise ValueError(f"{where}: {scale_name} has no weight {name}")
        weight, scale = out[name], out.pop(scale_name)
        rows, cols = weight.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{where}: {scale_name} has shape {tuple(scale.shape)}, expected {grid} for "
                f"{name} {tuple(weight.shape)} in blocks of {tuple(block)}"
            )
        full = scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
        out[name] = (weight.float() * full).to(dtype)
    unscaled = [n for n, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if unscaled:
        raise ValueError(f"{where}: fp8 tensors without a weight_scale_inv: {', '.join(sorted(unscaled)[:5])}")
    return out


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of dequantize_fp8 for a weight [out, in] (or a stack of them, [..., out, in]):
    (e4m3 weight, fp32 weight_scale_inv [..., ceil(out/bo), ceil(in/bi)]), each block's scale its
    amax / 448 (e4m3's largest value; the amax taken as at least 1e-12, so an all-zero block has
    a scale), as DeepSeek-V3, MiniMax-M2 and GLM-5-FP8 store it and vLLM's block-FP8 layers read
    it. On the weight's device, in one pass (no loop over blocks)."""
    *lead, rows, cols = weight.shape
    bo, bi = block
    grid = (-(-rows // bo), -(-cols // bi))
    w = torch.nn.functional.pad(weight.float(), (0, grid[1] * bi - cols, 0, grid[0] * bo - rows))
    blocks = w.view(*lead, grid[0], bo, grid[1], bi)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[..., :, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(*lead, grid[0] * bo, grid[1] * bi)[..., :rows, :cols].contiguous(), scale


def fp8_weights(path: str | Path, cfg: dict) -> tuple[tuple[int, int], set[str]] | None:
    """A block-FP8 checkpoint's block and the HF names of the weights it stores in FP8 (those
    with a `weight_scale_inv`, read from the files' headers); None for any other checkpoint."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8" or len(quant.get("weight_block_size") or ()) != 2:
        return None
    names = set()
    for file in _weight_files(Path(path)):
        with safe_open(file, "pt") as f:
            names |= {n.removesuffix("_scale_inv") for n in f.keys() if n.endswith(".weight_scale_inv")}
    return tuple(quant["weight_block_size"]), names


FP8Layout = tuple[tuple[int, int], set[str]]
"""A block-FP8 checkpoint's (block, HF names of the weights it stores in FP8): fp8_weights."""


def to_fp8(tensors: dict[str, torch.Tensor], fp8: FP8Layout) -> dict[str, torch.Tensor]:
    """HF tensors with each weight `fp8` names block-quantised (quantize_fp8: the weight in
    e4m3 and its `weight_scale_inv` beside it), the others as they are, in the same order.
    Weights of one shape and device (a layer's experts) are quantised together, in one call."""
    block, names = fp8
    batches: dict[tuple, list[str]] = {}
    for name, t in tensors.items():
        if name in names:
            batches.setdefault((tuple(t.shape), t.device, t.dtype), []).append(name)
    quantised = {}
    for batch in batches.values():
        q, scale = quantize_fp8(torch.stack([tensors[n] for n in batch]), block)
        quantised.update({n: (q[i], scale[i]) for i, n in enumerate(batch)})
    out = {}
    for name, t in tensors.items():
        if name in quantised:
            out[name], out[name + "_scale_inv"] = quantised[name]
        else:
            out[name] = t
    return out


def published_config(cfg: dict, fp8: FP8Layout | None = None) -> dict:
    """The config.json of weights the trainer publishes: what it dequantised is written plain,
    unless it is published in the checkpoint's block FP8 again (`fp8`, for servers whose layers
    read FP8): then the quantization_config stays."""
    return dict(cfg) if fp8 else {k: v for k, v in cfg.items() if k != "quantization_config"}


def _carried(cfg: dict):
    """Whether a HF tensor name (or the fp8 scale of one) is carried through by cfg's family;
    None when the family carries nothing."""
    checkpoint = family_for(cfg).checkpoint
    if checkpoint.carried is no_carried:
        return None
    carried = checkpoint.carried(cfg)
    return lambda name: carried(name.removesuffix("_scale_inv"))


def carried_tensors(path: str | Path, cfg: dict, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint folder that its family carries through untrained (HF names),
    dequantised when the checkpoint is fp8 (the published config says it is not). No file is
    opened for families that carry nothing."""
    carried = _carried(cfg)
    if carried is None:
        return {}
    tensors = read_tensors(path, keep=carried)
    return dequantize(tensors, cfg, dtype, str(path)) if tensors else {}


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
            problems.append(f"tensor {name} has shape {tuple(got[name].shape)}, expected {tuple(expected[name].shape)}")
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
    freeze_vision: bool = True,
) -> Transformer:
    """Our model with the weights of a HF checkpoint folder. A vision tower, when the model has
    one, is frozen (requires_grad False) unless `freeze_vision` is False."""
    path = Path(path)
    cfg = read_config(path)
    family = family_for(cfg, str(path / "config.json"))
    args = family.args_from_hf(cfg)
    args.freeze_vision = freeze_vision
    carried = _carried(cfg)
    tensors = read_tensors(path, keep=None if carried is None else lambda name: not carried(name))
    state = to_ours(dequantize(tensors, cfg, dtype, str(path)), args)
    model = build_model(args, device, attn_backend).cast_parameters(dtype)
    check_state_dict(model.state_dict(), state, str(path))
    model.load_state_dict(state)
    return model


def save_hf(
    state_dict: dict[str, torch.Tensor],
    hf_config: dict,
    path: str | Path,
    max_shard_bytes: int = 5 << 30,
    carried: dict[str, torch.Tensor] | None = None,
    fp8: FP8Layout | None = None,
) -> list[Path]:
    """Write our state dict as a HF checkpoint (config.json, safetensors shards and index),
    with the `carried` tensors (HF names, see `carried_tensors`) beside it unchanged; `fp8`:
    the weights it names block-quantised (to_fp8), as the source checkpoint stored them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu() for k, v in family_for(hf_config).checkpoint.to_hf(state_dict).items()}
    tensors.update(carried or {})
    if fp8:
        tensors = to_fp8(tensors, fp8)
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
