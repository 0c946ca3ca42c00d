import pytest
from primerl_algos.config import AdvantageConfig, FilterConfig
from primerl_algos.filters import filter_rollouts, select
from primerl_protocol.rollouts import Rollout, Turn


def rollout(sid, group, reward, tokens=3, **kw):
    turn = Turn(prompt_ids=[1, 2], completion_ids=list(range(tokens)), completion_logprobs=[-0.1] * tokens)
    return Rollout(sample_id=sid, group_id=group, turns=[turn], reward=reward, **kw)


def test_each_rollout_filter_counts_its_reason():
    rollouts = [
        rollout(0, 0, 1.0),
        rollout(1, 0, 1.0, error="reward function raised KeyError"),
        rollout(2, 0, 1.0, tokens=0),
        rollout(3, 0, 1.0, truncated=True),
        rollout(4, 0, 1.0, tokens=1),
        rollout(5, 0, 1.0, tokens=50),
        rollout(6, 0, 7.0),
    ]
    cfg = FilterConfig(truncated=True, min_tokens=2, max_tokens=20, reward_range=(0.0, 1.0))
    kept, report = filter_rollouts(rollouts, cfg)
    assert [r.sample_id for r in kept] == [0]
    assert dict(report.dropped) == {
        "errored": 1,
        "empty": 1,
        "truncated": 1,
        "too_short": 1,
        "too_long": 1,
        "reward_out_of_range": 1,
    }
    assert report.kept == 1 and report.total == 7


def test_filters_can_be_turned_off():
    kept, report = filter_rollouts(
        [rollout(0, 0, 1.0, tokens=0), rollout(1, 0, 1.0, truncated=True)], FilterConfig(empty=False, truncated=False)
    )
    assert len(kept) == 2 and not report.dropped


def test_zero_advantage_groups_are_dropped_and_errored_rollouts_leave_the_baseline():
    rollouts = [
        rollout(0, 0, 1.0),
        rollout(1, 0, 1.0),
        rollout(2, 0, 1.0),  # all equal: no signal
        rollout(3, 1, 1.0),
        rollout(4, 1, 0.0),
        rollout(5, 1, 0.0, error="timeout"),
    ]
    out, report = select(rollouts, FilterConfig(), AdvantageConfig(type="drgrpo"), max_tokens=10)
    # group 1 without the errored rollout: rewards [1, 0], mean 0.5
    assert [(r.sample_id, a) for r, a in out] == [(3, 0.5), (4, -0.5)]
    assert dict(report.dropped) == {"errored": 1, "zero_advantage": 3}
    assert report.kept == 2 and report.total == 6


def test_plugin_filter(tmp_path, monkeypatch):
    (tmp_path / "my_filters.py").write_text(
        "def odd_only(rollouts):\n    return [r.sample_id % 2 == 1 for r in rollouts]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    kept, report = filter_rollouts(
        [rollout(i, 0, 1.0) for i in range(5)], FilterConfig(plugins=["my_filters:odd_only"])
    )
    assert [r.sample_id for r in kept] == [1, 3]
    assert report.dropped["my_filters:odd_only"] == 3


def test_non_finite_rewards_never_train_even_with_the_errored_filter_off():
    nan, inf = float("nan"), float("inf")
    rollouts = [
        rollout(0, 0, 1.0),
        rollout(1, 0, 0.0),
        rollout(2, 0, nan),
        rollout(3, 0, inf),
        rollout(4, 0, -inf),
        rollout(5, 0, 0.0, error="BadScore: environment 'e': reward 'r' returned '1.0' (str), not a number"),
    ]
    out, report = select(rollouts, FilterConfig(errored=False), AdvantageConfig(type="drgrpo"), max_tokens=10)
    # the baseline is the two finite members' (mean 0.5): by hand, 1 - 0.5 and 0 - 0.5
    assert [(r.sample_id, a) for r, a in out] == [(0, 0.5), (1, -0.5)]
    assert dict(report.dropped) == {"bad_score": 4}


def test_a_group_whose_advantages_are_not_finite_is_dropped(tmp_path, monkeypatch):
    (tmp_path / "nan_adv.py").write_text("import numpy as np\ndef f(r):\n    return np.log(r - 0.5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rollouts = [rollout(0, 0, 1.0), rollout(1, 0, 0.0), rollout(2, 1, 1.0), rollout(3, 1, 2.0)]
    # group 0: log(0.5), log(-0.5) = nan -> dropped; group 1: log(0.5), log(1.5), both finite
    out, report = select(rollouts, FilterConfig(), AdvantageConfig(type="nan_adv:f"), max_tokens=10)
    assert [r.sample_id for r, _ in out] == [2, 3]
    assert dict(report.dropped) == {"non_finite_advantage": 2}


# Rewards 0, 0.5, 1: mean m = 0.5 exactly, population std s = sqrt(1/6). By hand, per estimator:
#   drgrpo r - m = -0.5, 0, 0.5;  grpo (r - m) / (s + 1e-6);  rloo r_i - mean of the others =
#   0 - 0.75, 0.5 - 0.5, 1 - 0.25;  maxrl (r - m) / m = -1, 0, 1. The middle rollout's is exactly 0.
S = (1 / 6) ** 0.5
MIXED_GROUP_ADVANTAGES = {
    "drgrpo": [-0.5, 0.0, 0.5],
    "grpo": [-0.5 / (S + 1e-6), 0.0, 0.5 / (S + 1e-6)],
    "rloo": [-0.75, 0.0, 0.75],
    "maxrl": [-1.0, 0.0, 1.0],
}


@pytest.mark.parametrize("estimator", sorted(MIXED_GROUP_ADVANTAGES))
def test_a_group_with_some_zero_advantages_is_kept_whole(estimator):
    # Only groups whose advantages are ALL zero carry no gradient (docs/algorithms.md, Filters);
    # here one member's is exactly 0: the group trains, that member included (its tokens count
    # in the loss's normalisation like any other's).
    rollouts = [rollout(0, 7, 0.0), rollout(1, 7, 0.5), rollout(2, 7, 1.0)]
    out, report = select(rollouts, FilterConfig(), AdvantageConfig(type=estimator), max_tokens=10)
    assert [r.sample_id for r, _ in out] == [0, 1, 2]
    assert [a for _, a in out] == pytest.approx(MIXED_GROUP_ADVANTAGES[estimator], abs=1e-12)
    assert out[1][1] == 0.0
    assert not report.dropped and report.kept == 3
