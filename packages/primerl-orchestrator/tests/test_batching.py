"""What of a step's finished groups reaches the trainer (batching.build_step), checked by hand."""

from primerl_algos.config import AdvantageConfig
from primerl_orchestrator.batching import Group, build_step
from primerl_orchestrator.config import OrchestratorConfig
from primerl_protocol.rollouts import Rollout, Turn


def test_a_group_with_an_exact_zero_advantage_trains_whole_that_member_included():
    # Rewards 0, 0.5, 1 with the mean baseline (drgrpo): advantages -0.5, 0, 0.5. Only groups
    # whose advantages are all zero are dropped (docs/algorithms.md, Filters): all three
    # samples train, the middle one with advantage 0, and all their completion tokens count as
    # the batch's loss tokens (the normalisation of the step's loss).
    cfg = OrchestratorConfig(batch_size=3, group_size=3, advantage=AdvantageConfig(type="drgrpo"))
    turn = Turn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.5])
    rollouts = [
        Rollout(sample_id=i, group_id=0, turns=[turn], reward=r, env="toy") for i, r in enumerate([0.0, 0.5, 1.0])
    ]
    (batch,), m = build_step(0, [Group(0, "toy", 0, rollouts)], cfg, seq_len=32, num_ranks=1)
    trained = {
        int(i): float(mb.advantages[start])
        for mb in batch.micro_batches
        for i, start in zip(mb.sample_ids, mb.cu_seqlens()[:-1])
        if i >= 0
    }
    assert trained == {0: -0.5, 1: 0.0, 2: 0.5}
    assert batch.num_loss_tokens == 3 * 2 and m["batch/samples"] == 3
    assert not any(k.startswith("filter/") and v for k, v in m.items())


def test_each_named_reward_and_metric_is_logged_as_its_mean_over_the_rollouts_that_did_not_error():
    # Two environments; "exact" and "format" are rewards (verifiers' weighted sum is the reward),
    # "reply_length" a metric. The errored rollout's scores count nowhere (as in reward/mean).
    turn = Turn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.5])

    def rollout(i, env, exact, fmt, length, error=None):
        scores = {"reward/exact": exact, "reward/format": fmt, "reply_length": length}
        return Rollout(
            sample_id=i, group_id=i // 2, turns=[turn], reward=exact + 0.5 * fmt, env=env, metrics=scores, error=error
        )

    groups = [
        Group(0, "a", 0, [rollout(0, "a", 1.0, 1.0, 4.0), rollout(1, "a", 0.0, 1.0, 6.0)]),
        Group(1, "b", 1, [rollout(2, "b", 1.0, 0.0, 2.0), rollout(3, "b", 9.0, 9.0, 99.0, error="TaskError: x")]),
    ]
    # a reward named "max" does not overwrite the step's reward/max
    groups[0].rollouts[0].metrics["reward/max"] = 0.25
    cfg = OrchestratorConfig(batch_size=4, group_size=2)
    _, m = build_step(0, groups, cfg, seq_len=32, num_ranks=1)
    assert m["reward/exact"] == (1.0 + 0.0 + 1.0) / 3
    assert m["reward/format"] == (1.0 + 1.0 + 0.0) / 3
    assert m["metric/reply_length"] == (4.0 + 6.0 + 2.0) / 3
    assert m["reward/max"] == 1.5 and m["reward/max_reward"] == 0.25  # rewards 1.5, 0.5, 1.0
    assert m["reward/mean"] == (1.5 + 0.5 + 1.0) / 3 and m["reward/a/mean"] == 1.0 and m["reward/b/mean"] == 1.0
    # trained vs filtered: group 0 trains both; group 1 loses its errored rollout and, left with
    # one, has advantage 0 (filtered as zero_advantage)
    assert m["rollouts/trained"] == 2 and m["rollouts/filtered"] == 2 and m["rollouts/count"] == 4
    # a rollout that passes every filter but is longer than a row (seq_len 32) does not train either
    long = Turn(prompt_ids=[1] * 30, completion_ids=[4] * 10, completion_logprobs=[-0.5] * 10)
    group = Group(
        0, "a", 0, [rollout(0, "a", 1.0, 0.0, 1.0), Rollout(sample_id=1, group_id=0, turns=[long], reward=0.0, env="a")]
    )
    _, m = build_step(1, [group], OrchestratorConfig(batch_size=2, group_size=2), seq_len=32, num_ranks=1)
    assert m["filter/longer_than_row"] == 1 and m["rollouts/trained"] == 1 and m["rollouts/filtered"] == 1


def test_with_share_prompts_a_groups_prompt_is_packed_once_and_the_metrics_say_so():
    # Three rollouts of one 6-token prompt, 2 completion tokens each: 24 tokens unshared, the
    # prompt once shared (6 + 3 x 2 = 12); the same trained tokens either way.
    turn = lambda c: Turn(prompt_ids=[1, 2, 3, 4, 5, 6], completion_ids=[c, c], completion_logprobs=[-0.5, -0.5])  # noqa: E731
    rollouts = [Rollout(sample_id=i, group_id=0, turns=[turn(7 + i)], reward=float(i), env="toy") for i in range(3)]
    steps = {
        share: build_step(
            0,
            [Group(0, "toy", 0, list(rollouts))],
            OrchestratorConfig(batch_size=3, group_size=3, share_prompts=share),
            seq_len=32,
            num_ranks=1,
        )
        for share in (None, True)
    }
    for share, ((batch,), m) in steps.items():
        (mb,) = batch.micro_batches
        assert m["batch/sample_tokens"] == 24 and batch.num_loss_tokens == 6 and int(mb.loss_mask.sum()) == 6
        assert m["batch/row_tokens"] == mb.num_tokens == (12 if share else 24)
        assert mb.shares_prompts is bool(share)
