"""Trajectory merging on constructed multi-turn rollouts with known answers."""

import pytest
from primerl_algos.merging import merge_turns
from primerl_protocol.rollouts import Rollout, Turn

SYS, USER1, USER2, TOOL = [1, 2], [3, 4], [5], [60, 61, 62]
THINK, ANSWER = [70, 71], [80, 81]


def test_single_turn():
    r = Rollout(
        sample_id=9,
        group_id=0,
        turns=[Turn(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.5, -0.25])],
    )
    (s,) = merge_turns(r, advantage=1.5)
    assert s.token_ids == [1, 2, 3, 4, 5]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.inference_logprobs == [0.0, 0.0, 0.0, -0.5, -0.25]
    assert (s.sample_id, s.part, s.advantage) == (9, 0, 1.5)


def test_tool_output_extends_the_sample_and_is_masked():
    t1 = Turn(prompt_ids=SYS + USER1, completion_ids=[10, 11], completion_logprobs=[-1.0, -2.0])
    t2 = Turn(prompt_ids=SYS + USER1 + [10, 11] + TOOL, completion_ids=[12], completion_logprobs=[-3.0])
    (s,) = merge_turns(Rollout(sample_id=1, group_id=0, turns=[t1, t2]))
    assert s.token_ids == SYS + USER1 + [10, 11] + TOOL + [12]
    assert s.loss_mask == [False] * 4 + [True, True] + [False] * 3 + [True]
    assert s.inference_logprobs == [0.0] * 4 + [-1.0, -2.0] + [0.0] * 3 + [-3.0]


def test_template_that_strips_earlier_reasoning_starts_a_new_sample():
    # Turn 1 sampled reasoning + answer; the chat template shows turn 2 only the answer.
    t1 = Turn(prompt_ids=SYS + USER1, completion_ids=THINK + ANSWER, completion_logprobs=[-0.1] * 4)
    t2 = Turn(prompt_ids=SYS + USER1 + ANSWER + USER2, completion_ids=[90], completion_logprobs=[-0.2])
    s1, s2 = merge_turns(Rollout(sample_id=2, group_id=0, turns=[t1, t2]))
    assert s1.token_ids == SYS + USER1 + THINK + ANSWER and sum(s1.loss_mask) == 4
    assert s2.token_ids == SYS + USER1 + ANSWER + USER2 + [90]
    assert s2.loss_mask == [False] * 7 + [True]  # the answer is context now, trained once already
    assert (s1.part, s2.part) == (0, 1)


def test_runs_of_extending_turns():
    t1 = Turn(prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1])
    t2 = Turn(prompt_ids=[7], completion_ids=[8], completion_logprobs=[-0.2])  # context reset
    t3 = Turn(prompt_ids=[7, 8, 9], completion_ids=[10], completion_logprobs=[-0.3])  # extends t2
    s1, s2 = merge_turns(Rollout(sample_id=3, group_id=0, turns=[t1, t2, t3]))
    assert s1.token_ids == [1, 2]
    assert s2.token_ids == [7, 8, 9, 10] and s2.loss_mask == [False, True, False, True]
    sampled = [t for s in (s1, s2) for t, m in zip(s.token_ids, s.loss_mask) if m]
    assert sampled == [2, 8, 10]  # every sampled token trained exactly once


def test_prompt_that_is_a_prefix_but_not_an_extension_is_a_new_sample():
    t1 = Turn(prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[-0.1])
    t2 = Turn(prompt_ids=[1, 2], completion_ids=[5], completion_logprobs=[-0.1])  # shorter: truncated context
    assert len(merge_turns(Rollout(sample_id=4, group_id=0, turns=[t1, t2]))) == 2


def test_logprob_count_must_match():
    t = Turn(prompt_ids=[1], completion_ids=[2, 3], completion_logprobs=[-0.1])
    with pytest.raises(ValueError, match="rollout 5, turn 0: 2 completion tokens but 1 logprobs"):
        merge_turns(Rollout(sample_id=5, group_id=0, turns=[t]))


def picture(value: int, h: int = 1, w: int = 2):
    from primerl_protocol.images import Image

    return Image(height=h, width=w, rgb=bytes([value]) * (h * w * 3))


def test_images_go_with_their_tokens_and_a_turn_with_other_images_starts_a_sample():
    """A tool that answers with a second picture extends the sample (its images: both, in
    order); a turn whose prompt has the same tokens but another first picture cannot extend
    it: those tokens stood for other pixels."""
    a, b, c = picture(1), picture(2), picture(3)
    t1 = Turn(prompt_ids=SYS + [99, 99], completion_ids=[10], completion_logprobs=[-1.0], images=[a])
    t2 = Turn(prompt_ids=SYS + [99, 99, 10, 99], completion_ids=[11], completion_logprobs=[-2.0], images=[a, b])
    t3 = Turn(prompt_ids=SYS + [99, 99, 10, 99, 11], completion_ids=[12], completion_logprobs=[-3.0], images=[c, b])
    first, second = merge_turns(Rollout(sample_id=4, group_id=0, turns=[t1, t2, t3]))
    assert first.token_ids == SYS + [99, 99, 10, 99, 11] and first.images == [a, b]
    assert second.token_ids == SYS + [99, 99, 10, 99, 11, 12] and second.images == [c, b]
    assert second.loss_mask == [False] * 7 + [True]
