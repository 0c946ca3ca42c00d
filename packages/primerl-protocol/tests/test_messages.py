import numpy as np
import pytest
from primerl_protocol import MicroBatch, TrainBatch
from primerl_protocol.testing import micro_batch


def test_position_ids_restart_at_each_sequence():
    mb = micro_batch(seq_lens=(3, 1, 4))
    assert mb.position_ids().tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert mb.cu_seqlens().tolist() == [0, 3, 4, 8]


def _fields(mb: MicroBatch) -> dict:
    return {name: getattr(mb, name) for name in mb.__struct_fields__}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"advantages": np.zeros(7, np.float32)}, "`advantages` has 7 tokens but `input_ids` has 8"),
        ({"input_ids": np.zeros(8, np.int64)}, "`input_ids` must have dtype int32, got int64"),
        ({"seq_lens": np.array([3, 4], np.int32)}, "`seq_lens` sum to 7 but the row has 8 tokens"),
        ({"sample_ids": np.arange(3)}, "`sample_ids` has 3 entries but `seq_lens` has 2"),
        ({"loss_mask": [True] * 8}, "`loss_mask` must be a numpy array, got list"),
        ({"seq_lens": np.array([8, 0], np.int32)}, "`seq_lens` must all be positive"),
    ],
)
def test_inconsistent_micro_batch_is_refused_naming_the_field(change, message):
    fields = _fields(micro_batch()) | change
    with pytest.raises((ValueError, TypeError)) as err:
        MicroBatch(**fields)
    assert message in str(err.value)


def test_train_batch_rank_must_be_within_world():
    with pytest.raises(ValueError, match="`rank` 2 is outside"):
        TrainBatch(step=0, rank=2, num_ranks=2, micro_batches=[], num_loss_tokens=0)


def shared_row(prefix_lens=(0, 3, 0, 2), parents=(-1, 0, -1, 2), seq_lens=(5, 2, 4, 3)) -> MicroBatch:
    """A row of four samples: the second continues the first 3 tokens of the first, the fourth
    the first 2 of the third."""
    fields = _fields(micro_batch(seq_lens=seq_lens))
    return MicroBatch(
        **fields | {"prefix_lens": np.array(prefix_lens, np.int32), "parents": np.array(parents, np.int32)}
    )


def test_samples_that_share_a_prompt_continue_its_positions_and_follow_its_last_token():
    mb = shared_row()
    assert mb.shares_prompts and not micro_batch().shares_prompts
    # the second sample's tokens are its 4th and 5th (positions 3, 4); the fourth's its 3rd to 5th
    assert mb.position_ids().tolist() == [0, 1, 2, 3, 4, 3, 4, 0, 1, 2, 3, 2, 3, 4]
    # each token is predicted from the one before it in its sample: a shared prompt's last token
    # (row index 2 in the first sample, 8 in the third) for the first token after it
    assert mb.predecessors().tolist() == [0, 0, 1, 2, 3, 2, 5, 6, 7, 8, 9, 8, 11, 12]
    # without sharing: t - 1
    assert micro_batch(seq_lens=(3, 2)).predecessors().tolist() == [0, 0, 1, 2, 3]


@pytest.mark.parametrize(
    "prefix_lens, parents, message",
    [
        ((0, 3, 0, 2), (-1, 1, -1, 2), "sample 1: `parents` 1 with `prefix_lens` 3: a shared prompt needs both"),
        ((0, 3, 0, 0), (-1, 0, -1, 2), "sample 3: `parents` 2 with `prefix_lens` 0"),
        ((0, 3, 0, 2), (-1, 0, -1, 1), "sample 3: its parent 1 shares a prompt itself"),
        ((0, 6, 0, 0), (-1, 0, -1, -1), "sample 1: `prefix_lens` 6 is longer than its parent 0 (5)"),
        ((0, -1, 0, 0), (-1, 0, -1, -1), "`prefix_lens` must all be >= 0"),
        ((0, 3), (-1, 0), "`prefix_lens` has 2 entries but `seq_lens` has 4"),
    ],
)
def test_a_shared_prompt_that_is_not_an_earlier_samples_is_refused(prefix_lens, parents, message):
    with pytest.raises(ValueError) as err:
        shared_row(prefix_lens, parents)
    assert message in str(err.value)
