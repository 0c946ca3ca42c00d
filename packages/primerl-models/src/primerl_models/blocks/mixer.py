"""What a token mixer is to the decoder layer (model.py): the one place where tokens see each
other. Softmax attention (attention.py), Gated DeltaNet (gated_deltanet.py) and Mamba2
(mamba2.py) are mixers; model.MIXERS says which spec builds which, under which name.

    out_BTD = mixer(x_BTD, cos_BTR, sin_BTR, seqs, backend)

`rope` is the rotary embedding whose cos and sin it takes (None: it takes no positions and
gets None for both); `prepare` runs once per forward before the layers, outside any compiled
region, for host-side layouts (host syncs) the mixer's kernels read.
"""

from __future__ import annotations

import torch
from torch import nn

from primerl_models.args import Rope
from primerl_models.packing import PackedSeqs


class Mixer(nn.Module):
    rope: Rope | None = None

    def prepare(self, seqs: PackedSeqs, device: torch.device) -> None:
        """Host-side work before the layers run (default: none)."""

    def forward(
        self, x_BTD: torch.Tensor, cos_BTR: torch.Tensor | None, sin_BTR: torch.Tensor | None, seqs: PackedSeqs, backend
    ) -> torch.Tensor:
        raise NotImplementedError
