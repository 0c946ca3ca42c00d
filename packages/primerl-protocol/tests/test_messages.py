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
