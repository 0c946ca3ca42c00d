"""The samples the algorithms make of rollouts: token sequences ready to train on (a msgspec
Struct, so the orchestrator can checkpoint them).

Rollouts (one episode of an environment: one or more turns, a reward, maybe an error) are
plain data defined in primerl_protocol.rollouts, so environments need neither torch nor this
package. Trajectory merging (merging.py) turns its turns into one or more samples; advantages
(advantages.py) and filters (filters.py) work on groups of rollouts of the same task; packing
(packing.py) lays samples into the trainer's rows.
"""

from __future__ import annotations

import msgspec
from primerl_protocol.images import Image


class Sample(msgspec.Struct, kw_only=True):
    """One token sequence to train on: prompt and completion tokens, with per-token data."""

    sample_id: int
    """The rollout it came from."""
    part: int = 0
    """Which sample of that rollout (multi-turn rollouts whose turns do not extend each other
    give several)."""
    token_ids: list[int]
    loss_mask: list[bool]
    """True for tokens the policy sampled (trained on); False for prompt and environment tokens."""
    inference_logprobs: list[float]
    """Inference logprob per token (0.0 where not sampled)."""
    advantage: float = 0.0
    temperature: float = 1.0
    policy_step: int = 0
    images: list[Image] = []
    """Its images, in the order of their runs of image tokens in `token_ids`."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.inference_logprobs) != n:
            raise ValueError(
                f"sample {self.sample_id}: token_ids ({n}), loss_mask ({len(self.loss_mask)}) and "
                f"inference_logprobs ({len(self.inference_logprobs)}) differ in length"
            )

    def __len__(self) -> int:
        return len(self.token_ids)
