"""LoRA adapters published as adapters: PEFT's layout with the served model's Hugging Face names.

    layout = AdapterLayout.of(model)                  # at setup: ValueError if it cannot be done
    tensors = layout.tensors(adapter_state, dtype)    # base_model.model.<hf module>.lora_A/B.weight
    config = layout.config(lora_cfg, base_model)      # adapter_config.json
    export_merged(base, adapter_folder, out)          # a full HF checkpoint (`primerl merge-lora`)

Our layers are named and shaped by the family's checkpoint rules (families/checkpoint.py):
mostly HF's names without `model.`, but a family may fuse several of our layers into one HF
tensor (GLM-4's `gate_up_proj`, Qwen3.5's `q_proj` holding the attention output gate
interleaved per head) or split one of ours into several. The layout is read off the family's
own `to_hf`, run on probes: every linear layer's weight becomes an [out, 1] tensor of codes
(which adapted layer, which of its rows; 0 where no adapter sits), every other tensor an empty
one on the meta device, and what comes out says which of our rows each row of each HF tensor
is. Then, exactly:

- an HF tensor made of rows of one adapted layer (renamed, split, reordered): A as ours and B
  the rows it holds (a split shares A);
- one made of rows of k adapted layers (a fusion): A = [A_1; ...; A_k] and B block-diagonal
  (its rows from layer i in columns i r .. (i + 1) r), so that its B A row is that layer's own
  B_i A_i row: rank k r, written in PEFT's `rank_pattern` (and alpha k alpha in
  `alpha_pattern`, so the scale alpha / r stays);
- rows of a layer without an adapter get zero rows of B.

Any other layout (a weight stored transposed or mixed by columns) is refused at setup, naming
the tensor; such a model is published merged (trainer.lora.publish = "merged").
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from primerl_models import Transformer, carried_tensors, family_for, published_config, save_hf, to_hf
from primerl_models.blocks.moe import GroupedExperts
from primerl_models.hf import dequantize, read_config, read_tensors, to_ours
from primerl_protocol.weights import ADAPTER, ADAPTER_CONFIG, ADAPTER_WEIGHTS, MARKER, verify
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from primerl_trainer.config import LoRAConfig
from primerl_trainer.distributed import Dist
from primerl_trainer.lora import LoRALinear, apply_lora
from primerl_trainer.publish import SIDE_FILES, StepFolders

log = logging.getLogger("primerl.trainer")

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in adapter_model.safetensors."""
_ROW_BITS = 32  # a probe code is (adapted layer index + 1) << _ROW_BITS | row


@dataclass
class Source:
    """Rows of one of our adapted layers inside an HF tensor."""

    layer: str
    """Our LoRALinear's module name."""
    hf_rows: torch.Tensor
    """Which rows of the HF tensor (long)."""
    rows: torch.Tensor
    """Our rows they are, in the same order (long)."""


@dataclass
class Piece:
    """One HF module of the adapter."""

    module: str
    """Its HF name (the weight's name without `.weight`)."""
    out: int
    """Its rows (output features)."""
    sources: list[Source]


class AdapterLayout:
    def __init__(self, pieces: list[Piece], rank: int) -> None:
        self.pieces, self.r = pieces, rank

    @classmethod
    def of(
        cls, model: nn.Module, convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    ) -> AdapterLayout:
        """The layout of `model`'s adapters under HF names; `convert(our state dict)` -> HF's
        (default: the family's checkpoint rules, for a Transformer). ValueError naming what
        cannot be an adapter."""
        if convert is None:
            if not isinstance(model, Transformer):
                raise TypeError(f"{type(model).__name__} is not a Transformer: pass `convert` (our names -> HF's)")
            convert = functools.partial(to_hf, args=model.args)
        if any(isinstance(m, GroupedExperts) and m.lora_scale for m in model.modules()):
            raise ValueError(
                "adapters on MoE experts (trainer.lora.experts) cannot be published as a PEFT adapter "
                'vLLM loads: set trainer.lora.publish = "merged"'
            )
        adapted = [name for name, m in model.named_modules() if isinstance(m, LoRALinear)]
        if not adapted:
            raise ValueError("the model has no LoRA layers to publish")
        index = {name: i + 1 for i, name in enumerate(adapted)}
        linear = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        probe, out_features = {}, {}
        for key, tensor in model.state_dict().items():
            if ".lora_" in key:
                continue
            module, _, leaf = key.rpartition(".")
            if leaf == "weight" and module in linear:
                rows = torch.arange(tensor.shape[0], dtype=torch.long)
                probe[key] = (rows + (index[module] << _ROW_BITS) if module in index else rows * 0)[:, None]
                out_features[module] = tensor.shape[0]
            else:
                probe[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        covered = {name: torch.zeros(out_features[name], dtype=torch.bool) for name in adapted}
        pieces = []
        for hf_name, codes in convert(probe).items():
            if codes.device.type == "meta" or codes.dtype != torch.long or not bool((codes > 0).any()):
                continue
            layers = sorted({adapted[i - 1] for i in (codes >> _ROW_BITS).unique().tolist() if i > 0})
            if codes.dim() != 2 or codes.shape[1] != 1 or not hf_name.endswith(".weight"):
                raise ValueError(
                    f"the checkpoint stores {hf_name} (from our {', '.join(layers)}) in another layout than rows "
                    "of them: its adapter cannot be written in PEFT's layout; leave those layers out of "
                    'trainer.lora.targets, or set trainer.lora.publish = "merged"'
                )
            codes = codes[:, 0]
            which, rows = codes >> _ROW_BITS, codes & ((1 << _ROW_BITS) - 1)
            sources = []
            for i in which.unique().tolist():
                if i > 0:
                    at = (which == i).nonzero().squeeze(1)
                    sources.append(Source(adapted[i - 1], at, rows[at]))
                    covered[adapted[i - 1]][rows[at]] = True
            pieces.append(Piece(hf_name.removesuffix(".weight"), len(codes), sources))
        if lost := [name for name, seen in covered.items() if not bool(seen.all())]:
            raise ValueError(
                f"the checkpoint's names leave out rows of {', '.join(lost[:3])}: their adapters cannot "
                'be published as one; set trainer.lora.publish = "merged"'
            )
        rank = next(m for m in model.modules() if isinstance(m, LoRALinear)).lora_A.weight.shape[0]
        return cls(pieces, rank)

    @property
    def rank(self) -> int:
        """The largest rank of a published module (r, or k r where k adapted layers are fused)."""
        return self.r * max(len(p.sources) for p in self.pieces)

    def tensors(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """PEFT's tensors from our adapters' (`<layer>.lora_A.weight` [r, in], `.lora_B.weight` [out, r])."""
        out = {}
        for p in self.pieces:
            a = [state[f"{s.layer}.lora_A.weight"] for s in p.sources]
            r = a[0].shape[0]
            b = a[0].new_zeros(p.out, r * len(a))
            for i, s in enumerate(p.sources):
                b[s.hf_rows, i * r : (i + 1) * r] = state[f"{s.layer}.lora_B.weight"][s.rows]
            out[f"{PEFT_PREFIX}{p.module}.lora_A.weight"] = torch.cat(a).to(dtype).contiguous()
            out[f"{PEFT_PREFIX}{p.module}.lora_B.weight"] = b.to(dtype).contiguous()
        return out

    def config(self, cfg: LoRAConfig, base_model: str) -> dict:
        """PEFT's adapter_config.json (what vLLM's PEFTHelper and PEFT read)."""
        fused = [p for p in self.pieces if len(p.sources) > 1]
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": cfg.rank,
            "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout,
            "target_modules": sorted({p.module.rsplit(".", 1)[-1] for p in self.pieces}),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            # keys are matched as suffixes at a "." boundary, as regular expressions: escaped
            "rank_pattern": {re.escape(p.module): cfg.rank * len(p.sources) for p in fused},
            "alpha_pattern": {re.escape(p.module): cfg.alpha * len(p.sources) for p in fused},
        }


def published_rank(hf_config: dict, cfg: LoRAConfig) -> int:
    """The rank the adapters of `cfg` on the model of `hf_config` are published with (what
    vLLM's --max-lora-rank must hold), from a model on the meta device (no weights read).
    ValueError when they cannot be published as an adapter."""
    with torch.device("meta"):
        model = Transformer(family_for(hf_config).args_from_hf(hf_config))
        apply_lora(model, cfg)
    return AdapterLayout.of(model).rank


class AdapterPublisher(StepFolders):
    """Each step's adapter as a published folder: adapter_config.json and
    adapter_model.safetensors, checksummed and renamed into place as full weights are
    (StepFolders); PolicyReady.format says it is an adapter."""

    format = ADAPTER

    def __init__(
        self,
        run_dir: str | Path,
        model: nn.Module,
        cfg: LoRAConfig,
        base_model: str,
        keep: int,
        dtype: torch.dtype,
        d: Dist,
    ):
        super().__init__(run_dir, keep, d)
        self.layout = AdapterLayout.of(model)
        self.adapter_config = self.layout.config(cfg, base_model)
        self.dtype = dtype

    def gather(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Our adapters' full tensors on rank 0's CPU (every rank takes part; fp32 until written)."""
        out = {}
        for name, tensor in model.state_dict().items():
            if ".lora_" in name:
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                if self.d.is_main:
                    out[name] = full.detach().float().cpu()
        return out

    def write(self, state: dict[str, torch.Tensor], tmp: Path) -> list[str]:
        save_file(self.layout.tensors(state, self.dtype), tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config, indent=2))
        return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def merge_adapter(hf: dict[str, torch.Tensor], folder: str | Path) -> dict[str, torch.Tensor]:
    """HF weights `hf` with the PEFT LoRA adapter in `folder` merged in as PEFT merges it: each
    module's weight += scale B A, scale = lora_alpha / r, or a module's alpha_pattern /
    rank_pattern values where a pattern (a regular expression, matched as a suffix at a "."
    boundary) names it; summed in fp32, cast back to the weight's dtype. Written from PEFT's
    rules, not from the publisher's layout, so tests check one against the other. ValueError
    naming what does not fit (an adapter for another model, a kind of adapter PEFT's LoRA
    merge does not describe)."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(folder / ADAPTER_WEIGHTS)
    except (OSError, json.JSONDecodeError, SafetensorError) as err:
        raise ValueError(f"{folder}: not a readable PEFT adapter folder ({err})") from None
    if (
        cfg.get("peft_type") != "LORA"
        or cfg.get("bias", "none") != "none"
        or cfg.get("use_rslora")
        or cfg.get("use_dora")
        or cfg.get("fan_in_fan_out")
    ):
        raise ValueError(
            f"{folder / ADAPTER_CONFIG}: only plain LoRA adapters merge here (peft_type LORA, bias "
            "none, no rsLoRA, DoRA or fan_in_fan_out)"
        )

    def pattern(values: dict, module: str, default):
        return next((v for k, v in values.items() if re.match(rf"(.*\.)?({k})$", module)), default)

    out = dict(hf)
    for name in sorted(tensors):
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b_name = name.replace(".lora_A.", ".lora_B.")
        if b_name not in tensors:
            raise ValueError(f"{folder / ADAPTER_WEIGHTS}: {name} has no {b_name}")
        weight = out.get(f"{module}.weight")
        if weight is None:
            raise ValueError(f"adapter module {module} has no weight in the base model (an adapter of another model?)")
        a, b = tensors[name].float(), tensors[b_name].float()
        r = pattern(cfg.get("rank_pattern") or {}, module, cfg["r"])
        alpha = pattern(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        if not a.shape[0] == b.shape[1] == r or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"adapter module {module}: A {tuple(a.shape)} and B {tuple(b.shape)} of rank {r} do not "
                f"fit the base weight {tuple(weight.shape)}"
            )
        out[f"{module}.weight"] = (weight.float() + (alpha / r) * (b @ a)).to(weight.dtype)
    return out


def model_names(name_or_path: str | Path, hf_config: dict | None = None) -> set[str]:
    """The names a model goes by, lower-cased: the last part of its hub id or folder (a hub
    cache folder `models--org--name/snapshots/<hash>`: `name`), and of the `_name_or_path`
    transformers writes into config.json. Copies and downloads of one model share a name."""
    names = set()
    for text in (str(name_or_path), (hf_config or {}).get("_name_or_path") or ""):
        parts = [p for p in Path(text).parts if p not in ("/", ".", "..")]
        cached = next((p for p in reversed(parts) if p.startswith("models--")), None)
        if cached is not None:
            parts = cached.split("--")[1:]
        if parts:
            names.add(parts[-1].lower())
    return names


def check_base(base: str | Path, adapter: str | Path, hf_config: dict) -> None:
    """Refuse an adapter whose adapter_config.json names another base model
    (`base_model_name_or_path`) than the folder `base`: not the same folder, and no name in
    common (`model_names`); ValueError naming both. An adapter that names none passes (with a
    warning)."""
    base, adapter = Path(base), Path(adapter)
    try:
        recorded = json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{adapter}: not a readable PEFT adapter folder ({err})") from None
    if not recorded:
        log.warning(
            "%s names no base model (base_model_name_or_path): merged onto %s unchecked", adapter / ADAPTER_CONFIG, base
        )
        return
    same_folder = Path(recorded).expanduser().is_dir() and Path(recorded).expanduser().resolve() == base.resolve()
    if same_folder or model_names(recorded) & model_names(base, hf_config):
        return
    raise ValueError(
        f"the adapter {adapter} was trained on {recorded!r} (base_model_name_or_path in its {ADAPTER_CONFIG}), "
        f"not on {str(base)!r}: merged onto another model it gives a model nobody trained. Merge it onto "
        f"{recorded!r}, or pass --allow-base-mismatch if {str(base)!r} is that model under another name"
    )


def export_merged(
    base: str | Path,
    adapter: str | Path,
    out: str | Path,
    dtype: torch.dtype | str | None = None,
    *,
    check_base_model: bool = True,
) -> Path:
    """A full HF checkpoint at `out`: the base model folder with the adapter folder (a published
    `weights/step_N` of a LoRA run, whose checksum is verified, or any PEFT LoRA adapter) merged
    in, with the base's config, tokenizer files and the tensors its family carries untrained.
    dtype (a torch dtype or its name, "bfloat16"): the base config's torch_dtype by default. Written to a staging folder and renamed,
    so `out` is whole or absent; an existing `out` is refused. Refused too, before the base's
    weights are read: an adapter of another base model (`check_base`, unless `check_base_model`
    is False); and, when merging, any adapted layer whose A and B do not fit the base weight
    (`merge_adapter`, naming the layer)."""
    base, adapter, out = Path(base), Path(adapter), Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: choose a new folder for the merged model")
    if (adapter / MARKER).exists():
        verify(adapter)  # a published folder: its checksum, before anything is read from it
    cfg = read_config(base)
    if check_base_model:
        check_base(base, adapter, cfg)
    if dtype is None:
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if isinstance(dtype, str):
        named = getattr(torch, dtype, None)
        if not isinstance(named, torch.dtype):
            raise ValueError(f"{dtype!r} is not a torch dtype (bfloat16, float16, float32)")
        dtype = named
    carried = carried_tensors(base, cfg, dtype)
    hf = dequantize(read_tensors(base, keep=lambda name: name not in carried), cfg, dtype, str(base))
    merged = merge_adapter({k: v.to(dtype) for k, v in hf.items()}, adapter)
    del hf
    state = to_ours(merged, family_for(cfg, str(base / "config.json")).args_from_hf(cfg))
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(state, dict(published_config(cfg), torch_dtype=str(dtype).removeprefix("torch.")), tmp, carried=carried)
    for name in SIDE_FILES:
        if (base / name).exists():
            shutil.copy2(base / name, tmp / name)
    tmp.rename(out)
    return out
