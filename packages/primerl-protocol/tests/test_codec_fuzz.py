"""Fuzzing the decoder with thousands of mutated real messages: every one either decodes or
raises ProtocolError, nothing else (a RecursionError or IndexError here would kill the
trainer or the orchestrator that received it)."""

import random

import msgspec
import pytest
from primerl_protocol import (
    BatchMessage,
    Decoder,
    Encoder,
    Heartbeat,
    PolicyMessage,
    PolicyReady,
    ProtocolError,
    Shutdown,
)
from primerl_protocol.testing import train_batch


def _key(name: str) -> bytes:
    return msgspec.msgpack.encode(name)


def deep(levels: int, kind: str) -> bytes:
    """msgpack of a value nested `levels` deep: maps {"a": {"a": ...}} or lists [[...]]."""
    opener = b"\x81" + _key("a") if kind == "map" else b"\x91"
    return opener * levels + b"\xc0"


def with_field(header: bytes, name: str, value: bytes) -> bytes:
    """The header (a msgpack map of < 16 fields) with one more field `name` = raw `value`."""
    assert 0x80 <= header[0] < 0x8F
    return bytes([header[0] + 1]) + header[1:] + _key(name) + value


def mutants(frames: list, rng: random.Random, n: int):
    header, rest = bytes(frames[0]), [bytes(f) for f in frames[1:]]
    for i in range(n):
        kind = i % 6
        h, r = bytearray(header), [bytearray(f) for f in rest]
        target = h if (kind != 1 or not r) else r[0]
        if kind in (0, 1):  # bit flips in the header or the payload
            for _ in range(rng.randint(1, 8)):
                pos = rng.randrange(len(target))
                target[pos] ^= 1 << rng.randrange(8)
        elif kind == 2:  # truncation of one frame
            victim = rng.choice([h, *r])
            del victim[rng.randrange(len(victim) + 1) :]
        elif kind == 3:  # a splice: a slice of the message pasted elsewhere in the header
            a, b = sorted(rng.randrange(len(h) + 1) for _ in range(2))
            at = rng.randrange(len(h) + 1)
            h[at:at] = h[a:b]
        elif kind == 4:  # frames dropped, duplicated or swapped
            frames_ = [bytes(h), *map(bytes, r)]
            choice = rng.randrange(3)
            if choice == 0:
                frames_.pop(rng.randrange(len(frames_)))
            elif choice == 1:
                frames_.insert(rng.randrange(len(frames_) + 1), rng.choice(frames_))
            else:
                frames_.reverse()
            yield frames_
            continue
        else:  # huge declared sizes: a map/array/str/bin header claiming 2^32 - 1 elements/bytes
            at = rng.randrange(len(h) + 1)
            h[at:at] = rng.choice([b"\xdf", b"\xdd", b"\xdb", b"\xc6"]) + b"\xff\xff\xff\xff"
        yield [bytes(h), *map(bytes, r)]


CASES = [
    (BatchMessage, "batches", lambda: train_batch(num_micro_batches=3)),
    (BatchMessage, "batches", lambda: Heartbeat(sender="orchestrator", seq=7)),
    (PolicyMessage, "policy", lambda: PolicyReady(step=3, location="/runs/x/weights/step_3", checksum="ab" * 16)),
    (PolicyMessage, "policy", lambda: Shutdown(sender="trainer/0", reason="done")),
]


@pytest.mark.parametrize("union, channel, make", CASES, ids=["TrainBatch", "Heartbeat", "PolicyReady", "Shutdown"])
def test_mutated_messages_decode_or_raise_protocol_error(union, channel, make):
    rng = random.Random(channel + type(make()).__name__)
    decoder = Decoder(union, channel)
    frames = Encoder().encode(make())
    refused = 0
    for frames_ in mutants(frames, rng, 1500):
        try:
            decoder.decode(frames_)
        except ProtocolError:
            refused += 1
    assert refused > 1000  # the mutations mostly break the message: the loop did test refusals
    assert type(decoder.decode(frames)) is type(make())  # and the decoder still works


@pytest.mark.parametrize("kind", ["map", "list"])
@pytest.mark.parametrize("levels", [100, 5000, 200_000])
def test_deeply_nested_headers_are_protocol_errors(kind, levels):
    """A few KB nested thousands deep, in TrainBatch.state (typed Any) or in an unknown field
    of any message: msgspec recurses into both."""
    batches, policy = Decoder(BatchMessage, "batches"), Decoder(PolicyMessage, "policy")
    header, payload = Encoder().encode(train_batch(num_micro_batches=1))
    tree = msgspec.msgpack.decode(header)
    tree.pop("state", None)
    base = msgspec.msgpack.encode(tree)
    nested = deep(levels, kind)
    for frames_ in ([with_field(base, "state", nested), payload], [with_field(base, "junk", nested), payload]):
        try:
            batches.decode(frames_)
        except ProtocolError:
            pass  # refused
        else:
            assert levels == 100 and frames_[0].find(b"junk") < 0  # a shallow `state` is a valid message
    ready = Encoder().encode(PolicyReady(step=1, location="/x", checksum="c"))[0]
    with pytest.raises(ProtocolError):
        policy.decode([with_field(ready, "junk", nested)])
