"""ZeroMQ PUSH/PULL transport for protocol messages, blocking and asyncio.

PUSH/PULL is the pattern on purpose: when the trainer falls behind, the high-water marks fill
and `send` blocks, so a slow trainer slows the orchestrator. A send that cannot hand its
message over within `send_timeout_s` raises TransportTimeout and the message stays with the
caller; nothing is dropped silently. A receiver that gets a malformed message logs it, counts
it (`num_rejected`, `last_rejection`) and goes on waiting for the next one.

    sender = Sender("tcp://127.0.0.1:5555", BatchMessage, channel="batches", bind=True)
    receiver = Receiver("tcp://127.0.0.1:5555", BatchMessage, channel="batches")
    sender.send(batch); batch = receiver.recv(timeout_s=60)

With `settings.curve` (or $PRIMERL_TRANSPORT_KEYS) the sockets authenticate with CURVE: the
binding side admits only the run's client key, and counts every peer it refuses
(`num_refused_peers`, `last_refused_peer`); see primerl_protocol.auth. Without keys a socket
runs unauthenticated on a loopback address (with one warning per process) and refuses to
open on any other.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import typing

import msgspec
import zmq
import zmq.asyncio

from primerl_protocol import auth
from primerl_protocol.auth import CurveKeys
from primerl_protocol.codec import Decoder, Encoder, ProtocolError, union_members

log = logging.getLogger("primerl.protocol")


class TransportTimeout(TimeoutError):
    """A send or receive did not complete in time. The message (if sending) was not sent."""


class SocketSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Socket options set explicitly on every socket (ZeroMQ's defaults suit neither side)."""

    hwm: int = 2
    """High-water mark in messages, on each side: how many messages may queue before `send` blocks."""
    linger_ms: int = 2000
    """How long `close` waits to deliver queued messages before dropping them."""
    send_timeout_s: float = 600.0
    """A send blocked longer than this raises TransportTimeout (inf: wait forever)."""
    recv_timeout_s: float = math.inf
    """Default timeout of `recv` (inf: wait forever)."""
    buffer_bytes: int = 4 << 20
    """Kernel socket buffers (SO_SNDBUF/SO_RCVBUF); 0 keeps the OS default. Larger buffers
    roughly doubled loopback throughput of multi-MB batches (bench/transport.py); they hold
    data beyond the high-water marks, so the queue bound is hwm messages plus these bytes."""
    curve: CurveKeys | None = None
    """The run's CURVE keys (default: $PRIMERL_TRANSPORT_KEYS). `primerl rl` and `--slurm` make
    them per run. Without keys the sockets are unauthenticated and open on loopback only."""

    def resolved_curve(self) -> CurveKeys | None:
        """`curve`, else the keys in $PRIMERL_TRANSPORT_KEYS, else None."""
        return self.curve if self.curve is not None else CurveKeys.from_env()


_warned_unauthenticated = False


def _finite(timeout_s: float) -> float | None:
    """None (wait forever) for an infinite timeout, else the timeout."""
    return None if math.isinf(timeout_s) else timeout_s


class _Endpoint:
    """Socket set-up shared by the four transport classes."""

    socket_type: int

    def __init__(
        self,
        endpoint: str,
        message_type: typing.Any,
        *,
        channel: str,
        bind: bool = False,
        settings: SocketSettings = SocketSettings(),
        context: zmq.Context | None = None,
    ):
        self.endpoint = endpoint
        self.channel = channel
        self.settings = settings
        self.message_type = message_type
        ctx = context if context is not None else self._default_context()
        self.socket = ctx.socket(self.socket_type)
        self.socket.setsockopt(zmq.LINGER, settings.linger_ms)
        self.socket.setsockopt(zmq.SNDHWM, settings.hwm)
        self.socket.setsockopt(zmq.RCVHWM, settings.hwm)
        if settings.buffer_bytes:
            self.socket.setsockopt(zmq.SNDBUF, settings.buffer_bytes)
            self.socket.setsockopt(zmq.RCVBUF, settings.buffer_bytes)
        self.refusals = auth.Refusals(f"'{channel}' ({endpoint})")
        self._zap_domain: bytes | None = None
        try:
            self._secure(settings.resolved_curve(), bind)
        except Exception:
            self.socket.close(linger=0)
            raise
        try:
            if bind:
                self.socket.bind(endpoint)
            else:
                self.socket.connect(endpoint)
        except zmq.ZMQError as err:
            self.close(linger_ms=0)
            verb = "bind" if bind else "connect"
            raise OSError(f"socket '{channel}': cannot {verb} {endpoint}: {err}") from err

    def _secure(self, keys: CurveKeys | None, bind: bool) -> None:
        global _warned_unauthenticated
        if keys is None:
            if not auth.endpoint_is_local(self.endpoint):
                raise ValueError(
                    f"socket '{self.channel}': refusing to open {self.endpoint} without authentication: it is not "
                    f"a loopback address. Set transport.sockets.curve or ${auth.KEYS_ENV} "
                    "(`CurveKeys.generate().to_toml()` makes keys; `primerl rl` makes them per run)"
                )
            if not _warned_unauthenticated:
                _warned_unauthenticated = True
                log.warning(
                    "transport sockets are unauthenticated (no transport.sockets.curve keys): any local "
                    "process can talk to %s; `primerl rl` sets per-run keys",
                    self.endpoint,
                )
        elif bind:
            self._zap_domain = auth.secure_server(self.socket, keys, self.refusals)
        else:
            auth.secure_client(self.socket, keys, f"'{self.channel}'")

    @property
    def num_refused_peers(self) -> int:
        """Peers this (binding, authenticated) socket refused: no CURVE, a wrong key, not ZMTP."""
        return self.refusals.count

    @property
    def last_refused_peer(self) -> str | None:
        """Why the last refused peer was refused (its address and key, when it offered one)."""
        return self.refusals.last

    @staticmethod
    def _default_context() -> zmq.Context:
        return zmq.Context.instance()

    def close(self, linger_ms: int | None = None) -> None:
        if self._zap_domain is not None:
            auth.release(self.socket, self._zap_domain)
            self._zap_domain = None
        self.socket.close(linger=self.settings.linger_ms if linger_ms is None else linger_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send_timeout_error(self, timeout_s: float | None) -> TransportTimeout:
        return TransportTimeout(
            f"socket '{self.channel}' ({self.endpoint}): the peer did not take the message "
            f"within {timeout_s}s (not running, or not keeping up); it was not sent"
        )

    def _recv_timeout_error(self, timeout_s: float | None) -> TransportTimeout:
        return TransportTimeout(f"socket '{self.channel}' ({self.endpoint}): no valid message within {timeout_s}s")


class _SenderBase(_Endpoint):
    socket_type = zmq.PUSH

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._encoder = Encoder()
        self._accepted = union_members(self.message_type)

    def _frames(self, message: msgspec.Struct) -> list:
        if not isinstance(message, self._accepted):
            raise TypeError(
                f"socket '{self.channel}' does not carry {type(message).__name__}; "
                f"it carries {[c.__name__ for c in self._accepted]}"
            )
        return self._encoder.encode(message)

    def _timeout(self, timeout_s: float | None) -> float | None:
        return _finite(self.settings.send_timeout_s if timeout_s is None else timeout_s)


class _ReceiverBase(_Endpoint):
    socket_type = zmq.PULL

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._decoder = Decoder(self.message_type, self.channel)
        self.num_received = 0
        self.num_rejected = 0
        self.last_rejection: ProtocolError | None = None

    def _decode_or_reject(self, frames: list[zmq.Frame]) -> typing.Any | None:
        try:
            message = self._decoder.decode([f.buffer for f in frames])
        except ProtocolError as err:
            self.num_rejected += 1
            self.last_rejection = err
            log.error("dropped a message: %s", err)
            return None
        self.num_received += 1
        return message

    def _timeout(self, timeout_s: float | None) -> float | None:
        return _finite(self.settings.recv_timeout_s if timeout_s is None else timeout_s)


class Sender(_SenderBase):
    """Blocking PUSH side."""

    def send(self, message: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Hand `message` to ZeroMQ, blocking while the queue is full, at most `timeout_s`."""
        frames = self._frames(message)
        timeout = self._timeout(timeout_s)
        self.socket.setsockopt(zmq.SNDTIMEO, -1 if timeout is None else int(timeout * 1000))
        try:
            self.socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise self._send_timeout_error(timeout) from None


class Receiver(_ReceiverBase):
    """Blocking PULL side."""

    def recv(self, timeout_s: float | None = None) -> typing.Any:
        """The next valid message; malformed ones are logged, counted and skipped."""
        timeout = self._timeout(timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not self.socket.poll(wait_ms, zmq.POLLIN):
                raise self._recv_timeout_error(timeout)
            message = self._decode_or_reject(self.socket.recv_multipart(copy=False))
            if message is not None:
                return message


class AsyncSender(_SenderBase):
    """asyncio PUSH side (zmq.asyncio)."""

    @staticmethod
    def _default_context() -> zmq.Context:
        return zmq.asyncio.Context.instance()

    async def send(self, message: msgspec.Struct, timeout_s: float | None = None) -> None:
        frames = self._frames(message)
        timeout = self._timeout(timeout_s)
        try:
            await asyncio.wait_for(self.socket.send_multipart(frames, copy=False), timeout)
        except TimeoutError:
            raise self._send_timeout_error(timeout) from None


class AsyncReceiver(_ReceiverBase):
    """asyncio PULL side (zmq.asyncio)."""

    @staticmethod
    def _default_context() -> zmq.Context:
        return zmq.asyncio.Context.instance()

    async def recv(self, timeout_s: float | None = None) -> typing.Any:
        timeout = self._timeout(timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                frames = await asyncio.wait_for(self.socket.recv_multipart(copy=False), remaining)
            except TimeoutError:
                raise self._recv_timeout_error(timeout) from None
            message = self._decode_or_reject(frames)
            if message is not None:
                return message
