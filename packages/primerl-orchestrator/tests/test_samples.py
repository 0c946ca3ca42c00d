"""Rollouts kept as text (primerl_orchestrator.samples): what the rollouts file holds (prompt,
completion, rewards, advantage, policy step), on which steps, that the trainer receives the
same rows for its W&B table, and that the files stay within `orchestrator.samples.max_mb`.
Through the real batch builder (`Orchestrator._build`) and a real tokenizer (a tiny model's)."""

import json
import logging

import pytest
from primerl_orchestrator.batching import Group
from primerl_orchestrator.config import OrchestratorConfig, OrchRunConfig, SamplesConfig
from primerl_orchestrator.loop import Orchestrator
from primerl_orchestrator.samples import TEXT_CHARS, Samples, clip, prompt_and_completion, read_samples
from primerl_orchestrator.testing import run_builder
from primerl_protocol.config import ModelConfig
from primerl_protocol.rollouts import Rollout, RolloutSample, Turn
from primerl_protocol.rundir import ORCHESTRATOR, ROLLOUTS, ROLLOUTS_OLD

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from primerl_models.tiny import build_tiny_model
    from transformers import AutoTokenizer

    folder = build_tiny_model(
        tmp_path_factory.mktemp("m"),
        "qwen3",
        alphabet="abcdefgh ",
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
    )
    return str(folder), AutoTokenizer.from_pretrained(str(folder))


def group(
    tok,
    group_id: int,
    policy_step: int,
    prompt: str,
    replies: list[str],
    rewards: list[float],
    error: int | None = None,
) -> Group:
    ids = tok.encode(prompt)
    rollouts = []
    for i, (reply, reward) in enumerate(zip(replies, rewards)):
        completion = tok.encode(reply) + [EOS]
        turn = Turn(prompt_ids=ids, completion_ids=completion, completion_logprobs=[-0.5] * len(completion))
        rollouts.append(
            Rollout(
                sample_id=group_id * 10 + i,
                group_id=group_id,
                turns=[turn],
                reward=reward,
                policy_step=policy_step,
                env="toy",
                metrics={"reward/exact": reward, "reply_length": float(len(reply))},
                error="TaskError: boom" if i == error else None,
            )
        )
    return Group(group_id, "toy", group_id, rollouts)


def test_the_rollouts_file_holds_prompt_completion_rewards_advantage_and_policy_every_interval_steps(
    tokenizer, tmp_path
):
    folder, tok = tokenizer
    cfg = OrchRunConfig(
        model=ModelConfig(name=folder),
        seq_len=64,
        max_steps=3,
        run_dir=str(tmp_path),
        orchestrator=OrchestratorConfig(
            batch_size=6, group_size=3, max_async_level=3, samples=SamplesConfig(interval=2, num_groups=1)
        ),
    )
    orch = Orchestrator(cfg)
    orch.samples.tokenizer = folder  # as Orchestrator.run sets it
    groups = [  # two groups a step; the first of each step is kept (num_groups = 1)
        group(tok, 0, 0, "bad cab", ["bac", "dab", "h"], [1.0, 0.0, 0.0], error=2),
        group(tok, 1, 0, "ace", ["eca", "eca", "eca"], [1.0, 1.0, 1.0]),
        group(tok, 2, 0, "fade", ["edaf", "fade", "ed"], [1.0, 0.0, 0.5]),
        group(tok, 3, 0, "cab", ["bac"] * 3, [1.0] * 3),
        group(tok, 4, 1, "head", ["daeh", "daeh", "head"], [1.0, 1.0, 0.0]),
        group(tok, 5, 1, "bead", ["daeb"] * 3, [0.0] * 3),
    ]
    batches = run_builder(orch, groups)
    rows = read_samples(tmp_path / ORCHESTRATOR)

    # steps 0 and 2 (interval 2), the first group of each: 3 rollouts a step
    assert [(r["step"], r["group_id"]) for r in rows] == [(0, 0)] * 3 + [(2, 4)] * 3
    first, second, failed = rows[:3]
    assert first["prompt"] == "bad cab" and first["completion"] == "bac<|im_end|>"
    assert second["completion"] == "dab<|im_end|>" and failed["completion"] == "h<|im_end|>"
    assert first["policy_step"] == 0 and rows[3]["policy_step"] == 1 and first["env"] == "toy"
    assert [r["reward"] for r in rows[:3]] == [1.0, 0.0, 0.0]
    assert first["rewards"] == {"reward/exact": 1.0, "reply_length": 3.0}
    # grpo over the rollouts that train (the errored one is filtered): rewards 1, 0 -> +1, -1
    assert first["advantage"] == pytest.approx(1.0, abs=1e-5) and second["advantage"] == pytest.approx(-1.0, abs=1e-5)
    assert failed["advantage"] is None and failed["error"] == "TaskError: boom"
    # step 2: rewards 1, 1, 0 -> mean 2/3, std sqrt(2)/3: advantages 1/sqrt(2), 1/sqrt(2), -sqrt(2)
    assert [r["advantage"] for r in rows[3:]] == pytest.approx([2**-0.5, 2**-0.5, -(2**0.5)], abs=1e-5)
    assert rows[3]["completion_tokens"] == 5 and rows[3]["truncated"] is False
    # the trainer gets the same rows with the steps' batches (for the W&B table), none with step 1's
    assert [len(b.samples) for b in batches] == [3, 0, 3]
    assert [
        json.loads(json.dumps(s, default=lambda o: {f: getattr(o, f) for f in o.__struct_fields__}))
        for b in batches
        for s in b.samples
    ] == rows


def test_the_rollouts_files_stay_within_max_mb_and_keep_the_newest(tmp_path, caplog):
    def sample(i: int, text: str = "x" * 900) -> RolloutSample:
        return RolloutSample(
            step=i, policy_step=i, env="toy", group_id=i, sample_id=i, prompt=text, completion="y", reward=1.0
        )

    row_bytes = (
        len(json.dumps({f: getattr(sample(10), f) for f in RolloutSample.__struct_fields__}, separators=(",", ":"))) + 1
    )
    max_mb = 0.01  # 10,000 bytes: each file at most 5,000, about 5 rows of ~1 KB
    samples = Samples(SamplesConfig(max_mb=max_mb), tmp_path)
    for step in range(10, 60):
        samples.write([sample(step)])
        sizes = [(tmp_path / name).stat().st_size for name in (ROLLOUTS, ROLLOUTS_OLD) if (tmp_path / name).exists()]
        assert sum(sizes) <= max_mb * 1e6 and all(size <= max_mb * 1e6 / 2 for size in sizes)
    kept = [r["step"] for r in read_samples(tmp_path)]
    per_file = int(max_mb * 1e6 / 2) // row_bytes
    assert kept == list(range(60 - len(kept), 60)) and len(kept) > per_file  # the newest, in order
    # a row that alone passes half of max_mb is left out, and said so
    with caplog.at_level(logging.WARNING, logger="primerl.orchestrator"):
        samples.write([sample(60, "z" * 6000), sample(61)])
    steps = [r["step"] for r in read_samples(tmp_path)]
    assert steps[-1] == 61 and 60 not in steps
    assert "1 of 2 rows left out" in caplog.text


def test_a_multi_turn_rollout_shows_its_first_prompt_and_everything_after_it():
    t1 = Turn(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-1.0])
    t2 = Turn(prompt_ids=[1, 2, 3, 9, 9], completion_ids=[4], completion_logprobs=[-1.0])  # a tool result between
    r = Rollout(sample_id=0, group_id=0, turns=[t1, t2])
    assert prompt_and_completion(r) == ([1, 2], [3, 9, 9, 4])
    rewritten = Turn(prompt_ids=[7, 3, 9], completion_ids=[5], completion_logprobs=[-1.0])  # the template rewrote it
    assert prompt_and_completion(Rollout(sample_id=0, group_id=0, turns=[t1, rewritten])) == ([1, 2], [3, 5])
    long = "a" * (TEXT_CHARS + 10)
    assert len(clip(long)) < TEXT_CHARS + 60 and clip(long).startswith("a" * 100) and "10 characters cut" in clip(long)
