import msgspec
import numpy as np
import pytest
from primerl_protocol import (
    PROTOCOL_VERSION,
    BatchMessage,
    Decoder,
    Encoder,
    Heartbeat,
    PolicyReady,
    ProtocolError,
    Shutdown,
)
from primerl_protocol.testing import assert_same_batch, micro_batch, train_batch


@pytest.fixture
def decoder():
    return Decoder(BatchMessage, "batches")


def test_round_trip_preserves_every_array_and_field(decoder):
    batch = train_batch(num_micro_batches=3)
    frames = Encoder().encode(batch)
    # A small header and one payload frame holding every array's raw bytes.
    assert len(frames) == 2
    assert_same_batch(decoder.decode(frames), batch)


def test_arrays_travel_as_raw_bytes_not_lists(decoder):
    batch = train_batch(num_micro_batches=1)
    header, payload = Encoder().encode(batch)
    mb = batch.micro_batches[0]
    # The header is small: it holds references, not the tokens (the 12 arrays of a micro-batch).
    assert len(header) < 450
    assert bytes(payload)[: mb.input_ids.nbytes] == mb.input_ids.tobytes()
    # Every array starts on a 64-byte boundary; the payload is the arrays and their padding.
    # (Empty arrays, the image fields of a row without images, take none.)
    sizes = [getattr(mb, f).nbytes for f in mb.__struct_fields__ if getattr(mb, f).nbytes]
    assert len(payload) == sum(-(-n // 64) * 64 for n in sizes[:-1]) + sizes[-1]
    decoded = decoder.decode([header, bytes(payload)])
    # Decoded arrays are views on the received (immutable) frames: no copy, hence read-only.
    assert not decoded.micro_batches[0].input_ids.flags.writeable


def test_control_messages_round_trip(decoder):
    for msg in [Heartbeat(sender="orchestrator", seq=3), Shutdown(sender="orchestrator", reason="done")]:
        assert decoder.decode(Encoder().encode(msg)) == msg


def test_truncated_payload_names_message_and_field(decoder):
    header, payload = Encoder().encode(train_batch())
    with pytest.raises(ProtocolError) as err:
        decoder.decode([header, bytes(payload)[:-4]])
    assert err.value.message_type == "TrainBatch"
    assert err.value.field == "micro_batches[1].parents"  # the last array is cut short
    assert "truncated" in str(err.value)


def test_missing_payload_frame_is_refused(decoder):
    header, _ = Encoder().encode(train_batch())
    with pytest.raises(ProtocolError) as err:
        decoder.decode([header])
    assert err.value.field == "micro_batches[0].input_ids"
    assert "no payload frame" in str(err.value)


def test_extra_frames_are_refused(decoder):
    frames = Encoder().encode(train_batch())
    with pytest.raises(ProtocolError, match="3 frames; a message has at most 2"):
        decoder.decode([*frames, b"junk"])


def test_overlapping_arrays_are_refused(decoder):
    header, payload = Encoder().encode(train_batch())
    tree = msgspec.msgpack.decode(header)
    mb = tree["micro_batches"][0]
    mb["advantages"] = mb["inference_logprobs"]  # same offset, dtype and shape
    with pytest.raises(ProtocolError, match="two arrays overlap"):
        decoder.decode([msgspec.msgpack.encode(tree), payload])


def test_truncated_header_is_refused(decoder):
    frames = Encoder().encode(train_batch())
    with pytest.raises(ProtocolError, match="header is not a valid message"):
        decoder.decode([frames[0][: len(frames[0]) // 2], *frames[1:]])


def test_random_bytes_are_refused(decoder):
    rng = np.random.default_rng(0)
    for _ in range(200):
        junk = rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8).tobytes()
        with pytest.raises(ProtocolError):
            decoder.decode([junk])


def test_message_of_another_socket_is_refused_by_type(decoder):
    frames = Encoder().encode(PolicyReady(step=1, location="/w", checksum="ab"))
    with pytest.raises(ProtocolError) as err:
        decoder.decode(frames)
    assert err.value.message_type == "PolicyReady"
    assert err.value.field == "type"
    assert "accepts ['Heartbeat', 'Shutdown', 'TrainBatch']" in str(err.value)


def test_unknown_field_is_named(decoder):
    header = msgspec.msgpack.encode({"type": "Heartbeat", "version": PROTOCOL_VERSION, "sender": "x", "priority": 3})
    with pytest.raises(ProtocolError) as err:
        decoder.decode([header])
    assert (err.value.message_type, err.value.field) == ("Heartbeat", "priority")


def test_wrong_version_is_refused_naming_the_version_field(decoder):
    header = msgspec.msgpack.encode({"type": "Heartbeat", "version": PROTOCOL_VERSION + 1, "sender": "x"})
    with pytest.raises(ProtocolError) as err:
        decoder.decode([header])
    assert (err.value.message_type, err.value.field) == ("Heartbeat", "version")
    assert f"this process speaks {PROTOCOL_VERSION}" in str(err.value)


def test_wrong_field_type_is_named(decoder):
    header = msgspec.msgpack.encode({"type": "Heartbeat", "version": PROTOCOL_VERSION, "sender": 7})
    with pytest.raises(ProtocolError) as err:
        decoder.decode([header])
    assert err.value.field == "sender"
    assert "Expected `str`, got `int`" in str(err.value)


def test_inconsistent_arrays_inside_a_valid_encoding_are_refused(decoder):
    """A peer that frames correctly but sends a row whose arrays disagree in length."""
    mb = micro_batch()
    # Assigning a field skips the checks, as a buggy peer's own code might.
    mb.advantages = mb.advantages[:-1]
    batch = train_batch(num_micro_batches=1)
    batch.micro_batches[0] = mb
    with pytest.raises(ProtocolError) as err:
        decoder.decode(Encoder().encode(batch))
    assert err.value.field == "micro_batches[0]"
    assert "`advantages` has 7 tokens" in str(err.value)


def test_empty_message_is_refused(decoder):
    with pytest.raises(ProtocolError, match="empty message"):
        decoder.decode([])
