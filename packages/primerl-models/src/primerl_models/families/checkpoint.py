"""A family's checkpoint names and layouts, both ways: `to_ours(to_hf(sd)) == sd` exactly.

Ours are HF's without the `model.` prefix, except where a layout differs:
- mixture-of-experts layers: HF stores each expert's [out, in] matrices separately
  (`<experts>.<e>.<proj>.weight`); we stack them [E, in, out] for grouped GEMMs
  (`mlp.experts.w_gate|w_up|w_down`);
- the router: HF's `mlp.gate` (or the family's name for it) is our `mlp.router`;
- `renames`: the family's own names for blocks we name otherwise (MiniMax-M2's
  `block_sparse_moe`), each (HF piece, our piece), the first that matches applies;
- `fused_gate_up`: dense MLPs stored as one `mlp.gate_up_proj` [2F, D] (gate rows first, GLM-4)
  are split into our gate_proj and up_proj, and fused again on the way out.
`carried` names the tensors the trainer does not train but inference needs (GLM-4.5's MTP
layer): they are not loaded into the model and travel from the source folder to every
published folder unchanged (hf.py).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROJS = ("gate", "up", "down")
_OUR_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.w_(gate|up|down)$")
_OUR_DENSE = re.compile(r"^layers\.(\d+)\.mlp\.(gate|up)_proj\.weight$")


def no_carried(cfg: dict) -> Callable[[str], bool]:
    return lambda name: False


@dataclass(frozen=True)
class Checkpoint:
    renames: tuple[tuple[str, str], ...] = ((".mlp.gate.", ".mlp.router."),)
    experts: str = "mlp.experts"
    """HF prefix (inside a layer) of the per-expert weights."""
    expert_projs: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of each expert's gate, up and down projections (MiniMax-M2: w1, w3, w2)."""
    fused_gate_up: bool = False
    carried: Callable[[dict], Callable[[str], bool]] = no_carried
    """cfg -> whether a HF tensor name is carried through instead of trained."""

    def _hf_expert(self) -> re.Pattern:
        projs = "|".join(re.escape(p) for p in self.expert_projs)
        return re.compile(rf"^model\.layers\.(\d+)\.{re.escape(self.experts)}\.(\d+)\.({projs})\.weight$")

    def to_ours(self, hf: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
        """HF names and layouts -> ours (carried tensors must have been taken out)."""
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
        proj_of = dict(zip(self.expert_projs, PROJS))
        pattern = self._hf_expert()
        for name, tensor in hf.items():
            if m := pattern.match(name):
                experts[(int(m[1]), proj_of[m[3]])][int(m[2])] = tensor
                continue
            if name == "lm_head.weight":
                if not args.tie_embeddings:
                    out[name] = tensor
                continue  # tied: the embedding is the output projection
            ours = name.removeprefix("model.")
            for theirs, mine in self.renames:
                if theirs in ours:
                    ours = ours.replace(theirs, mine)
                    break
            if self.fused_gate_up and ours.endswith(".mlp.gate_up_proj.weight"):
                gate, up = tensor.chunk(2, dim=0)
                out[ours.replace("gate_up_proj", "gate_proj")] = gate
                out[ours.replace("gate_up_proj", "up_proj")] = up
                continue
            out[ours] = tensor
        for (layer, proj), by_index in sorted(experts.items()):
            spec = args.layers[layer].mlp if layer < args.num_layers else None
            count = getattr(spec, "num_experts", 0)
            missing = sorted(set(range(count)) - set(by_index))
            if missing:
                hf_proj = self.expert_projs[PROJS.index(proj)]
                names = [f"model.layers.{layer}.{self.experts}.{e}.{hf_proj}.weight" for e in missing[:3]]
                raise ValueError(f"missing tensors: {', '.join(names)}{' ...' if len(missing) > 3 else ''}")
            out[f"layers.{layer}.mlp.experts.w_{proj}"] = torch.stack([by_index[e].T for e in sorted(by_index)])
        return out

    def to_hf(self, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our names and layouts -> HF's (contiguous tensors, ready for safetensors)."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in ours.items():
            if m := _OUR_EXPERTS.match(name):
                hf_proj = self.expert_projs[PROJS.index(m[2])]
                for e, w in enumerate(tensor.unbind(0)):
                    out[f"model.layers.{m[1]}.{self.experts}.{e}.{hf_proj}.weight"] = w.T.contiguous()
                continue
            if name == "lm_head.weight":
                out[name] = tensor.contiguous()
                continue
            if self.fused_gate_up and (m := _OUR_DENSE.match(name)):
                if m[2] == "gate":  # up_proj joins it (gate rows first)
                    up = ours[f"layers.{m[1]}.mlp.up_proj.weight"]
                    out[f"model.layers.{m[1]}.mlp.gate_up_proj.weight"] = torch.cat([tensor, up]).contiguous()
                continue
            theirs = name
            for hf_piece, mine in self.renames:
                if mine in theirs:
                    theirs = theirs.replace(mine, hf_piece)
                    break
            out["model." + theirs] = tensor.contiguous()
        return out
