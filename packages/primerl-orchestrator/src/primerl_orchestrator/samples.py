"""Rollouts as text, for people to read: the run's rollouts file and the W&B samples table.

    samples = Samples(cfg.orchestrator.samples, run_dir / "orchestrator", tokenizer="Qwen/Qwen3-0.6B")
    if samples.due(step):
        rows = await samples.take(step, groups)   # appended to rollouts.jsonl; rank 0's batch carries them

Every `interval` steps, the first `num_groups` groups of the step's batch (all their rollouts,
trained or not) become RolloutSamples: the first model call's prompt and everything after it,
decoded with the model's tokenizer (chat template and special tokens shown as the model saw
them), the reward and the named rewards, the advantage (None: it did not train), the policy
that generated it, its error. Each text keeps at most TEXT_CHARS characters (both ends).

The files stay within `max_mb`: when rollouts.jsonl would pass half of it, it becomes
rollouts.old.jsonl (replacing the older one) and a new one starts, so the newest samples are
always kept. Without a tokenizer (none installed, or a model folder without one) the tokens
are shown as their ids, and a warning says so once.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
from primerl_protocol.rollouts import Rollout, RolloutSample
from primerl_protocol.rundir import ROLLOUTS, ROLLOUTS_OLD

log = logging.getLogger("primerl.orchestrator")

TEXT_CHARS = 20_000
"""Most characters kept of a prompt or a completion (the first and last halves)."""


def clip(text: str, limit: int = TEXT_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def prompt_and_completion(rollout: Rollout) -> tuple[list[int], list[int]]:
    """Token ids of the first call's prompt and of everything after it: the last call's whole
    sequence past that prompt when it extends it (tool results and user turns in between
    included), else every call's completion in turn."""
    if not rollout.turns:
        return [], []
    first, last = rollout.turns[0], rollout.turns[-1]
    prompt = first.prompt_ids
    whole = last.prompt_ids + last.completion_ids
    if whole[: len(prompt)] == prompt:
        return prompt, whole[len(prompt) :]
    return prompt, [t for turn in rollout.turns for t in turn.completion_ids]


def to_sample(
    step: int, rollout: Rollout, advantage: float | None, decode: Callable[[list[int]], str]
) -> RolloutSample:
    prompt, completion = prompt_and_completion(rollout)
    return RolloutSample(
        step=step,
        policy_step=rollout.policy_step,
        env=rollout.env,
        group_id=rollout.group_id,
        sample_id=rollout.sample_id,
        prompt=clip(decode(prompt)),
        completion=clip(decode(completion)),
        reward=rollout.reward,
        rewards=dict(rollout.metrics),
        advantage=advantage,
        error=None if rollout.error is None else clip(rollout.error, 2000),
        truncated=rollout.truncated,
        completion_tokens=rollout.num_completion_tokens,
    )


def load_decoder(tokenizer: str | None) -> Callable[[list[int]], str]:
    """`tokenizer`'s decode (special tokens kept), or token ids as text when it cannot be loaded."""
    if tokenizer is None:
        return str
    try:  # optional (renderers' extra, which verifiers' training client needs): not a declared dependency
        tok = importlib.import_module("transformers").AutoTokenizer.from_pretrained(tokenizer)
    except Exception as err:  # noqa: BLE001 - samples are for reading; the run goes on without text
        log.warning(
            "rollout samples show token ids: the tokenizer %s cannot be loaded (%s: %s)",
            tokenizer,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return str
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


class Samples:
    def __init__(self, cfg, folder: Path, tokenizer: str | None = None) -> None:
        self.cfg, self.folder, self.tokenizer = cfg, Path(folder), tokenizer
        self.path = self.folder / ROLLOUTS
        self.decode: Callable[[list[int]], str] | None = None
        """Loaded on first use (tests may set their own)."""

    def due(self, step: int) -> bool:
        return bool(self.cfg.interval) and step % self.cfg.interval == 0

    async def take(self, step: int, groups: list) -> list[RolloutSample]:
        """Samples of the first num_groups of `groups` (batching.Group, their advantages filled
        by build_step), appended to the rollouts file."""
        if self.decode is None:  # a tokenizer takes a while to load: not on the event loop
            self.decode = await asyncio.to_thread(load_decoder, self.tokenizer)
        rows = [
            to_sample(step, r, g.advantages.get(r.sample_id), self.decode)
            for g in groups[: self.cfg.num_groups]
            for r in g.rollouts
        ]
        self.write(rows)
        return rows

    def write(self, rows: list[RolloutSample]) -> None:
        """Append `rows`, moving the file aside first when it would pass half of max_mb (rows
        that alone pass it are left out, and counted in a warning)."""
        half = int(self.cfg.max_mb * 1e6 / 2)
        lines = [msgspec.json.encode(r) + b"\n" for r in rows]
        fit, size = [], 0
        for line in lines:
            if size + len(line) <= half:
                fit.append(line)
                size += len(line)
        if len(fit) < len(lines):
            log.warning(
                "rollout samples: %d of %d rows left out, the rest pass half of orchestrator.samples.max_mb (%g MB)",
                len(lines) - len(fit),
                len(lines),
                self.cfg.max_mb,
            )
        if not fit:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size + size > half:
            self.path.replace(self.folder / ROLLOUTS_OLD)
        with self.path.open("ab") as f:
            f.write(b"".join(fit))


def read_samples(folder: Path) -> list[dict]:
    """Every sample kept in `folder` (an orchestrator folder), oldest first."""
    out = []
    for name in (ROLLOUTS_OLD, ROLLOUTS):
        path = Path(folder) / name
        if path.exists():
            out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out
