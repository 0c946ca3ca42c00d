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
    rollouts = [Rollout(sample_id=i, group_id=0, turns=[turn], reward=r, env="toy")
                for i, r in enumerate([0.0, 0.5, 1.0])]
    (batch,), m = build_step(0, [Group(0, "toy", 0, rollouts)], cfg, seq_len=32, num_ranks=1)
    trained = {int(i): float(mb.advantages[start]) for mb in batch.micro_batches
               for i, start in zip(mb.sample_ids, mb.cu_seqlens()[:-1]) if i >= 0}
    assert trained == {0: -0.5, 1: 0.0, 2: 0.5}
    assert batch.num_loss_tokens == 3 * 2 and m["batch/samples"] == 3
    assert not any(k.startswith("filter/") and v for k, v in m.items())
