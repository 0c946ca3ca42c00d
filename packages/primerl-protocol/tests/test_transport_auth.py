"""CURVE authentication of the transport, over real ZeroMQ sockets on loopback.

The orchestrator binds (a PUSH per trainer rank for batches, a PULL for PolicyReady), the
trainer connects; a stranger is a socket of its own that does not hold the run's client keys.
"""

import asyncio
import logging
import threading
import time

import msgspec
import pytest
import zmq
from primerl_protocol import (
    AsyncReceiver,
    AsyncSender,
    BatchMessage,
    CurveKeys,
    Heartbeat,
    PolicyMessage,
    PolicyReady,
    Receiver,
    Sender,
    Shutdown,
    SocketSettings,
    TransportTimeout,
)
from primerl_protocol.codec import Encoder
from primerl_protocol.config import ConfigError, TransportConfig, validate
from primerl_protocol.testing import assert_same_batch, free_tcp_endpoint, train_batch

KEYS = CurveKeys.generate()
RUN = SocketSettings(curve=KEYS, linger_ms=0, send_timeout_s=5.0)


def stranger_socket(kind: int, how: str) -> zmq.Socket:
    """A socket of someone on the cluster without this run's client keys."""
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if how == "plain":
        return sock
    other = CurveKeys.generate()
    # "own client key": knows the server's public key (it is no secret) but not the client's secret
    sock.curve_serverkey = (KEYS.server_public if how == "own client key" else other.server_public).encode()
    sock.curve_publickey = other.client_public.encode()
    sock.curve_secretkey = other.client_secret.encode()
    return sock


def wait_for_refusal(endpoint, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while endpoint.num_refused_peers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endpoint.num_refused_peers >= 1, "the stranger was not counted"


STRANGERS = ["plain", "own client key", "wrong server key"]


def test_the_runs_sockets_carry_messages_both_ways():
    batches, policy = free_tcp_endpoint(), free_tcp_endpoint()
    batch = train_batch(num_micro_batches=3)
    with (
        Sender(batches, BatchMessage, channel="batches/rank0", bind=True, settings=RUN) as tx,
        Receiver(batches, BatchMessage, channel="batches/rank0", settings=RUN) as rx,
        Receiver(policy, PolicyMessage, channel="policy", bind=True, settings=RUN) as policy_rx,
        Sender(policy, PolicyMessage, channel="policy", settings=RUN) as policy_tx,
    ):
        tx.send(batch)
        tx.send(Heartbeat(sender="orchestrator", seq=1))
        assert_same_batch(rx.recv(timeout_s=5), batch)
        assert isinstance(rx.recv(timeout_s=5), Heartbeat)
        policy_tx.send(PolicyReady(step=1, location="/run/weights/step_1", checksum="c"))
        assert policy_rx.recv(timeout_s=5).step == 1
        assert (tx.num_refused_peers, policy_rx.num_refused_peers) == (0, 0)


def test_the_orchestrators_asyncio_sockets_authenticate_the_trainer():
    batches, policy = free_tcp_endpoint(), free_tcp_endpoint()

    # The trainer closes its sender right after sending: with linger 0 that could drop the
    # message while its CURVE handshake is still under way, so this one lingers as the trainer's do.
    lingering = msgspec.structs.replace(RUN, linger_ms=5000)

    def trainer() -> int:
        with (
            Receiver(batches, BatchMessage, channel="batches/rank0", settings=RUN) as rx,
            Sender(policy, PolicyMessage, channel="policy", settings=lingering) as tx,
        ):
            step = rx.recv(timeout_s=5).step
            tx.send(PolicyReady(step=step, location="/w", checksum="c"))
            return step

    async def orchestrator():
        with (
            AsyncSender(batches, BatchMessage, channel="batches/rank0", bind=True, settings=RUN) as tx,
            AsyncReceiver(policy, PolicyMessage, channel="policy", bind=True, settings=RUN) as rx,
        ):
            trained = asyncio.create_task(asyncio.to_thread(trainer))
            await tx.send(train_batch(step=7, num_micro_batches=1))
            ready = await rx.recv(timeout_s=5)
            assert (ready.step, await trained) == (7, 7)

    asyncio.run(orchestrator())


@pytest.mark.parametrize("how", STRANGERS)
def test_a_stranger_cannot_take_batches(how, caplog):
    endpoint = free_tcp_endpoint()
    with Sender(endpoint, BatchMessage, channel="batches/rank0", bind=True, settings=RUN) as tx:
        thief = stranger_socket(zmq.PULL, how)
        thief.connect(endpoint)  # first in line: a plain PUSH would hand it every other batch
        wait_for_refusal(tx)
        with Receiver(endpoint, BatchMessage, channel="batches/rank0", settings=RUN) as rx:
            for step in range(8):
                tx.send(train_batch(step=step, num_micro_batches=1))
                assert rx.recv(timeout_s=5).step == step
        assert thief.poll(200) == 0, "the stranger received a batch"
        thief.close()
    assert "refused a peer" in caplog.text and "batches/rank0" in caplog.text
    assert tx.last_refused_peer


@pytest.mark.parametrize("how", STRANGERS)
def test_a_stranger_cannot_deliver_a_message(how, caplog):
    endpoint = free_tcp_endpoint()
    with Receiver(endpoint, PolicyMessage, channel="policy", bind=True, settings=RUN) as rx:
        intruder = stranger_socket(zmq.PUSH, how)
        intruder.connect(endpoint)
        for frames in (
            Encoder().encode(Shutdown(sender="trainer", reason="bye")),
            Encoder().encode(PolicyReady(step=99, location="/theirs", checksum="x")),
        ):
            try:
                intruder.send_multipart(frames, flags=zmq.NOBLOCK)  # queued, never delivered
            except zmq.Again:
                pass
        wait_for_refusal(rx)
        with Sender(endpoint, PolicyMessage, channel="policy", settings=RUN) as tx:
            tx.send(PolicyReady(step=1, location="/run/weights/step_1", checksum="c"))
            assert rx.recv(timeout_s=5).location == "/run/weights/step_1"
            with pytest.raises(TransportTimeout):
                rx.recv(timeout_s=0.3)
        assert (rx.num_received, rx.num_rejected) == (1, 0)
        intruder.close()
    if how == "own client key":  # the ZAP handler saw its key: the log names it and where it came from
        assert "127.0.0.1" in rx.last_refused_peer and "not this run's" in rx.last_refused_peer
    assert "refused a peer" in caplog.text


def test_refusals_are_counted_per_socket_and_logged_sparingly(caplog):
    endpoint = free_tcp_endpoint()
    caplog.set_level(logging.WARNING, logger="primerl.protocol")
    with (
        Sender(endpoint, BatchMessage, channel="batches/rank3", bind=True, settings=RUN) as tx,
        Receiver(free_tcp_endpoint(), PolicyMessage, channel="policy", bind=True, settings=RUN) as other,
    ):
        strangers = [stranger_socket(zmq.PULL, "own client key") for _ in range(3)]
        for s in strangers:
            s.connect(endpoint)
        deadline = time.monotonic() + 5
        while tx.num_refused_peers < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tx.num_refused_peers >= 3 and other.num_refused_peers == 0
        for s in strangers:
            s.close()
    assert caplog.text.count("refused a peer") == 1  # retries every 100 ms must not flood the log


def test_a_context_with_authenticated_sockets_still_terminates():
    ctx = zmq.Context()
    endpoint = free_tcp_endpoint()
    tx = Sender(endpoint, BatchMessage, channel="batches", bind=True, settings=RUN, context=ctx)
    rx = Receiver(endpoint, BatchMessage, channel="batches", settings=RUN, context=ctx)
    tx.send(Heartbeat(sender="orchestrator", seq=1))
    assert rx.recv(timeout_s=5).seq == 1
    tx.close(), rx.close()
    done = threading.Thread(target=ctx.term, daemon=True)
    done.start()
    done.join(5)
    assert not done.is_alive(), "ctx.term() hung on the ZAP handler's sockets"


def test_without_keys_sockets_open_on_loopback_only(monkeypatch):
    monkeypatch.delenv("PRIMERL_TRANSPORT_KEYS", raising=False)
    port = free_tcp_endpoint().rsplit(":", 1)[1]
    with pytest.raises(ValueError, match="without authentication"):
        Sender(f"tcp://0.0.0.0:{port}", BatchMessage, channel="batches", bind=True)
    with pytest.raises(ConfigError, match="not a loopback address"):
        validate(TransportConfig, {"host": "10.1.2.3"})
    assert validate(TransportConfig, {"host": "127.0.0.1"}).sockets.curve is None


def test_keys_come_from_the_config_or_the_environment(monkeypatch):
    keys = CurveKeys.generate()
    table = {
        "host": "10.1.2.3",
        "sockets": {
            "curve": {
                "server_public": keys.server_public,
                "client_public": keys.client_public,
                "client_secret": keys.client_secret,
            }
        },
    }
    assert validate(TransportConfig, table).sockets.resolved_curve().client_secret == keys.client_secret
    monkeypatch.setenv("PRIMERL_TRANSPORT_KEYS", keys.env_value())
    cfg = validate(TransportConfig, {"host": "10.1.2.3"})
    assert cfg.sockets.resolved_curve() == keys
    assert cfg.with_run_keys().sockets.curve == keys  # primerl rl writes the env's keys into the configs
    monkeypatch.delenv("PRIMERL_TRANSPORT_KEYS")
    fresh = TransportConfig().with_run_keys().sockets.curve
    assert fresh.server_secret and fresh != keys


def test_bad_keys_are_config_errors():
    keys, other = CurveKeys.generate(), CurveKeys.generate()
    curve = {
        "server_public": keys.server_public,
        "server_secret": other.server_secret,
        "client_public": keys.client_public,
    }
    with pytest.raises(ConfigError, match="server_secret does not belong to server_public"):
        validate(TransportConfig, {"sockets": {"curve": curve}})
    with pytest.raises(ConfigError, match="40 Z85 characters"):
        validate(
            TransportConfig, {"sockets": {"curve": {"server_public": "short", "client_public": keys.client_public}}}
        )


def test_each_side_needs_its_own_secret():
    public_only = CurveKeys(server_public=KEYS.server_public, client_public=KEYS.client_public)
    with pytest.raises(ValueError, match="server_secret"):
        Sender(
            free_tcp_endpoint(), BatchMessage, channel="batches", bind=True, settings=SocketSettings(curve=public_only)
        )
    with pytest.raises(ValueError, match="client_secret"):
        Receiver(free_tcp_endpoint(), BatchMessage, channel="batches", settings=SocketSettings(curve=public_only))
