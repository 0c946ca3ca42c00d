"""The transport over real ZeroMQ sockets on loopback (and one real second process)."""

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import zmq
from primerl_protocol import (
    AsyncReceiver,
    AsyncSender,
    BatchMessage,
    Encoder,
    Heartbeat,
    PolicyReady,
    Receiver,
    Sender,
    SocketSettings,
    TrainBatch,
    TransportTimeout,
)
from primerl_protocol.testing import (
    assert_same_batch,
    free_tcp_endpoint,
    micro_batch,
    train_batch,
)


@pytest.fixture
def endpoint():
    return free_tcp_endpoint()


def test_batch_crosses_the_socket_intact(endpoint):
    batch = train_batch(num_micro_batches=4)
    with (
        Sender(endpoint, BatchMessage, channel="batches", bind=True) as tx,
        Receiver(endpoint, BatchMessage, channel="batches") as rx,
    ):
        tx.send(batch)
        tx.send(Heartbeat(sender="orchestrator", seq=1))
        assert_same_batch(rx.recv(timeout_s=5), batch)
        beat = rx.recv(timeout_s=5)
        assert isinstance(beat, Heartbeat) and (beat.sender, beat.seq) == ("orchestrator", 1)


def test_receiver_drops_malformed_messages_and_keeps_serving(endpoint):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.bind(endpoint)
    with Receiver(endpoint, BatchMessage, channel="batches") as rx:
        good = train_batch(num_micro_batches=1)
        frames = [bytes(f) for f in Encoder().encode(good)]
        raw.send_multipart([b"\x93garbage"])  # random bytes
        raw.send_multipart(frames[:-1])  # the payload frame missing
        raw.send_multipart([frames[0], frames[1][:-3]])  # a truncated payload
        raw.send_multipart(Encoder().encode(PolicyReady(step=1, location="x", checksum="y")))
        raw.send_multipart(frames)
        assert_same_batch(rx.recv(timeout_s=5), good)
        assert rx.num_rejected == 4 and rx.num_received == 1
        assert rx.last_rejection.message_type == "PolicyReady"
    raw.close(linger=0)


def test_recv_times_out_naming_the_socket(endpoint):
    with Receiver(endpoint, BatchMessage, channel="batches", bind=True) as rx:
        with pytest.raises(TransportTimeout, match=r"socket 'batches' .* no valid message within 0.2s"):
            rx.recv(timeout_s=0.2)


def test_sender_refuses_a_message_its_socket_does_not_carry(endpoint):
    with Sender(endpoint, BatchMessage, channel="batches", bind=True) as tx:
        with pytest.raises(TypeError, match="does not carry PolicyReady"):
            tx.send(PolicyReady(step=1, location="x", checksum="y"))


def big_batch(step: int):
    # ~4 MB: too big for socket buffers to hide the high-water marks.
    mb = micro_batch(seq_lens=(1 << 17, 1 << 17), seed=step)
    return TrainBatch(step=step, rank=0, num_ranks=1, micro_batches=[mb], num_loss_tokens=1)


def test_slow_receiver_blocks_the_sender_and_nothing_is_dropped(endpoint):
    # Kernel buffers set to 64 KiB (Linux doubles it: 128 KiB a side), far below one 4 MB batch,
    # so the queue is what ZeroMQ holds: the sender's and the receiver's pipes of hwm = 1
    # message each, plus at most one message part-way through each side's encoder and decoder.
    settings = SocketSettings(hwm=1, send_timeout_s=0.3, linger_ms=0, buffer_bytes=64 << 10)
    with (
        Sender(endpoint, BatchMessage, channel="batches", bind=True, settings=settings) as tx,
        Receiver(endpoint, BatchMessage, channel="batches", settings=settings) as rx,
    ):
        sent = []
        with pytest.raises(TransportTimeout, match="it was not sent"):
            for step in range(50):
                tx.send(big_batch(step))
                sent.append(step)
        # The queue is bounded by what the sockets hold: 2 * hwm + 2 messages.
        assert 1 <= len(sent) <= 2 * settings.hwm + 2, len(sent)
        # The receiver catches up; every batch that send accepted arrives, in order.
        got = [rx.recv(timeout_s=5).step for _ in sent]
        assert got == sent
        # With room again, the batch that timed out can be sent again (it stayed with us).
        tx.send(big_batch(len(sent)))
        assert rx.recv(timeout_s=5).step == len(sent)


SENDER_PROCESS = """
import sys
from primerl_protocol import BatchMessage, Sender
from primerl_protocol.testing import train_batch
with Sender(sys.argv[1], BatchMessage, channel="batches") as tx:
    for step in range(int(sys.argv[2])):
        tx.send(train_batch(num_micro_batches=2, step=step))
"""


def test_batches_from_another_process(endpoint):
    with Receiver(endpoint, BatchMessage, channel="batches", bind=True) as rx:
        proc = subprocess.Popen([sys.executable, "-c", SENDER_PROCESS, endpoint, "5"])
        got = [rx.recv(timeout_s=60) for _ in range(5)]
        assert proc.wait(60) == 0
    assert [b.step for b in got] == list(range(5))
    # The builder is seeded: the other process built exactly this batch.
    assert_same_batch(got[-1], train_batch(num_micro_batches=2, step=4))


def test_asyncio_sockets_round_trip_and_skip_garbage(endpoint):
    async def main():
        tx = AsyncSender(endpoint, BatchMessage, channel="batches", bind=True)
        rx = AsyncReceiver(endpoint, BatchMessage, channel="batches")
        try:
            await tx.socket.send_multipart([b"not msgpack at all"])
            batch = train_batch(num_micro_batches=2, step=9)
            await tx.send(batch)
            got = await rx.recv(timeout_s=5)
            assert_same_batch(got, batch)
            assert rx.num_rejected == 1
            with pytest.raises(TransportTimeout):
                await rx.recv(timeout_s=0.1)
        finally:
            tx.close(0)
            rx.close(0)

    asyncio.run(main())


def test_async_sender_times_out_when_nobody_receives(endpoint):
    async def main():
        settings = SocketSettings(hwm=1, linger_ms=0)
        tx = AsyncSender(endpoint, BatchMessage, channel="batches", bind=True, settings=settings)
        try:
            # No peer is connected: PUSH cannot hand anything over, so send waits, then fails.
            with pytest.raises(TransportTimeout, match="not sent"):
                await tx.send(train_batch(), timeout_s=0.2)
        finally:
            tx.close()

    asyncio.run(main())


def test_decoded_arrays_survive_after_the_next_receive(endpoint):
    """Zero-copy views keep their frame alive: earlier batches stay valid."""
    with (
        Sender(endpoint, BatchMessage, channel="batches", bind=True) as tx,
        Receiver(endpoint, BatchMessage, channel="batches") as rx,
    ):
        a, b = train_batch(step=1), train_batch(step=2)
        tx.send(a)
        tx.send(b)
        got_a = rx.recv(timeout_s=5)
        rx.recv(timeout_s=5)
        np.testing.assert_array_equal(got_a.micro_batches[1].input_ids, a.micro_batches[1].input_ids)
