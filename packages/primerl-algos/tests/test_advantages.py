import numpy as np
import pytest
from primerl_algos.advantages import ADVANTAGES, compute_advantages
from primerl_algos.config import BUILTIN_ADVANTAGES, AdvantageConfig


def adv(rewards, kind, tokens=None, **cfg):
    tokens = tokens if tokens is not None else [10] * len(rewards)
    return compute_advantages(rewards, tokens, AdvantageConfig(type=kind, **cfg), max_tokens=100).tolist()


def test_grpo_centres_and_divides_by_the_std():
    # mean 0.5, population std 0.5
    assert adv([1, 0, 0, 1], "grpo") == pytest.approx([1, -1, -1, 1], rel=1e-5)


def test_drgrpo_only_centres():
    assert adv([1, 0, 0, 1], "drgrpo") == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_rloo_leaves_one_out():
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    assert adv([1, 0, 0], "rloo") == pytest.approx([1.0, -0.5, -0.5])


def test_maxrl_is_relative_to_the_mean():
    # mean 0.25: (1 - 0.25) / 0.25 = 3, (0 - 0.25) / 0.25 = -1
    assert adv([1, 0, 0, 0], "maxrl") == pytest.approx([3, -1, -1, -1])


@pytest.mark.parametrize("kind", BUILTIN_ADVANTAGES)
def test_equal_rewards_give_zero(kind):
    assert adv([0.7, 0.7, 0.7], kind) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", BUILTIN_ADVANTAGES)
def test_single_and_empty_groups(kind):
    assert adv([1.0], kind) == [0.0]
    assert adv([], kind) == []


def test_length_penalty_applies_before_the_estimator():
    # rewards 1 - 0.5 * tokens / 100 = [0.5, 0.75] -> centred [-0.125, 0.125]
    assert adv([1.0, 1.0], "drgrpo", tokens=[100, 50], length_penalty=0.5) == pytest.approx([-0.125, 0.125])


def test_config_names_match_the_registry():
    assert sorted(BUILTIN_ADVANTAGES) == ADVANTAGES.names


def test_plugin_must_return_one_advantage_per_rollout(tmp_path, monkeypatch):
    (tmp_path / "bad_adv.py").write_text("import numpy as np\ndef f(r):\n    return np.zeros(len(r) + 1)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"returned shape \(4,\) for 3 rewards"):
        adv([0, 1, 2], "bad_adv:f")
    assert np.all(np.isfinite(adv([0, 1, 2], "grpo")))
