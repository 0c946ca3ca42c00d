"""CURVE authentication of the trainer <-> orchestrator sockets, with keys made per run.

The binding side (the orchestrator) is the CURVE server; the connecting side (each trainer
rank) is a client. A run has one server keypair and one client keypair: the server admits
only the run's client public key (answered by a ZAP handler, one thread per ZeroMQ context),
and a client that does not know the server's public key cannot even complete a handshake. So
a stranger on the cluster can neither take batches from the orchestrator's PUSH sockets nor
deliver a Shutdown or a PolicyReady to its PULL socket. Every refused peer (a plain socket, a
wrong key, garbage on the port) is counted on the binding socket and logged.

`primerl rl` and `primerl rl --slurm` make the keys and write them into the run's configs
(0600). To run the processes yourself, make a set and put it in the config or the environment
of both sides (keep it private: whoever has the client keys can act as the trainer):

    python -c "from primerl_protocol import CurveKeys; print(CurveKeys.generate().to_toml())"
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import os
import queue
import threading
import time
import urllib.parse

import msgspec
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger("primerl.protocol")

KEYS_ENV = "PRIMERL_TRANSPORT_KEYS"
"""The keys as `server_public,server_secret,client_public,client_secret` (a side's unneeded
secret may be left empty), used when the config sets none."""

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (rfc.zeromq.org/spec/27)
_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_LOG_EVERY_S = 60.0  # a stranger's socket retries every 100 ms: log the first refusal, then a count at most this often


def _check_key(name: str, value: str) -> None:
    if len(value) != 40:
        raise ValueError(f"{name}: a CURVE key is 40 Z85 characters, got {len(value)}")
    try:
        z85.decode(value)
    except (ValueError, KeyError):
        raise ValueError(f"{name}: not a Z85-encoded key") from None


class CurveKeys(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The run's CURVE keys (Z85, 40 characters each). The binding side (orchestrator) needs
    server_secret and client_public; a connecting side (trainer) needs client_secret and
    server_public. `CurveKeys.generate()` makes a set."""

    server_public: str
    """Public key of the binding side (the orchestrator): trainers check it's really the run's."""
    client_public: str
    """Public key of the connecting side (the trainer ranks): the only key the orchestrator admits."""
    server_secret: str | None = None
    """Secret key of the binding side; only the orchestrator needs it."""
    client_secret: str | None = None
    """Secret key of the connecting side; only the trainer needs it."""

    def __post_init__(self) -> None:
        pairs = [("server", self.server_public, self.server_secret), ("client", self.client_public, self.client_secret)]
        for side, public, secret in pairs:
            _check_key(f"{side}_public", public)
            if secret is not None:
                _check_key(f"{side}_secret", secret)
                if zmq.curve_public(secret.encode()).decode() != public:
                    raise ValueError(f"{side}_secret does not belong to {side}_public")

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh server keypair and client keypair."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            server_public=server_public.decode(),
            server_secret=server_secret.decode(),
            client_public=client_public.decode(),
            client_secret=client_secret.decode(),
        )

    @classmethod
    def from_env(cls) -> CurveKeys | None:
        """The keys in $PRIMERL_TRANSPORT_KEYS, or None when it is unset or empty."""
        raw = os.environ.get(KEYS_ENV, "").strip()
        if not raw:
            return None
        parts = [p.strip() for p in raw.split(",")]
        if len(parts) != 4:
            raise ValueError(
                f"${KEYS_ENV}: expected server_public,server_secret,client_public,client_secret "
                f"(a secret may be empty), got {len(parts)} comma-separated parts"
            )
        try:
            return cls(
                server_public=parts[0],
                server_secret=parts[1] or None,
                client_public=parts[2],
                client_secret=parts[3] or None,
            )
        except ValueError as err:
            raise ValueError(f"${KEYS_ENV}: {err}") from None

    def env_value(self) -> str:
        """The keys as $PRIMERL_TRANSPORT_KEYS holds them."""
        return ",".join([self.server_public, self.server_secret or "", self.client_public, self.client_secret or ""])

    def to_toml(self) -> str:
        """The keys as a config table, and as an environment line."""
        names = ("server_public", "server_secret", "client_public", "client_secret")
        lines = [f'{n} = "{getattr(self, n)}"' for n in names if getattr(self, n) is not None]
        return "\n".join(["[transport.sockets.curve]", *lines, "", f"# or: export {KEYS_ENV}='{self.env_value()}'"])


def is_loopback(host: str) -> bool:
    """Whether only this machine can reach `host` (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or * (every interface)


def endpoint_is_local(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this machine only: inproc, ipc, loopback tcp."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":
        return scheme in ("inproc", "ipc")  # ipc: the socket file's permissions guard it
    parsed = urllib.parse.urlsplit(f"//{rest}")
    return parsed.hostname is not None and is_loopback(parsed.hostname)


class Refusals:
    """Peers a binding socket refused: how many, the last one, for one channel."""

    def __init__(self, label: str):
        self.label = label
        self.count = 0
        self.last: str | None = None
        self._logged_at = float("-inf")
        self._lock = threading.Lock()

    def refuse(self, why: str) -> None:
        with self._lock:
            self.count += 1
            self.last = why
            now = time.monotonic()
            if self.count == 1 or now - self._logged_at >= _LOG_EVERY_S:
                self._logged_at = now
                log.warning("socket %s refused a peer (%d so far): %s", self.label, self.count, why)


class _Guard(threading.Thread):
    """One per ZeroMQ context: answers its ZAP requests (admits a domain's one client key)
    and reads the handshake failures of the binding sockets that registered with it."""

    _ids = itertools.count()

    def __init__(self, underlying: int):
        super().__init__(name="primerl-zap", daemon=True)
        self.ctx = zmq.Context.shadow(underlying)
        self.domains: dict[bytes, tuple[bytes, Refusals]] = {}
        self._pending: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = f"inproc://primerl-guard-wake-{next(self._ids)}"
        self._ready = threading.Event()
        self._error: zmq.ZMQError | None = None

    def start_and_wait(self) -> None:
        self.start()
        self._ready.wait()
        if self._error is not None:
            raise OSError(
                f"cannot serve ZAP on this ZeroMQ context ({ZAP_ENDPOINT}): {self._error}; "
                "another authenticator already runs on it"
            ) from self._error

    def watch(self, socket: zmq.Socket, domain: bytes, client_key: bytes, refusals: Refusals) -> None:
        """Admit `client_key` on `domain`, and count `socket`'s failed handshakes."""
        self.domains[domain] = (client_key, refusals)
        address = f"inproc://primerl-monitor-{domain.decode()}"
        socket.monitor(address, _HANDSHAKE_FAILURES | zmq.EVENT_MONITOR_STOPPED)
        pair = self.ctx.socket(zmq.PAIR)
        pair.connect(address)  # connected now, so no event is lost; the guard thread reads it from here on
        self._pending.put((pair, domain))
        wake = self.ctx.socket(zmq.PUSH)
        wake.connect(self._wake)
        wake.send(b"")
        wake.close(linger=-1)

    def forget(self, domain: bytes) -> None:
        self.domains.pop(domain, None)

    def run(self) -> None:
        zap, wake = self.ctx.socket(zmq.REP), self.ctx.socket(zmq.PULL)
        sockets = [zap, wake]
        try:
            zap.bind(ZAP_ENDPOINT)
            wake.bind(self._wake)
        except zmq.ZMQError as err:
            self._error = err
            for s in sockets:
                s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        monitors: dict[zmq.Socket, bytes] = {}
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is zap:
                        self._answer(zap)
                    elif sock is wake:
                        wake.recv()
                        while not self._pending.empty():
                            pair, domain = self._pending.get()
                            monitors[pair] = domain
                            sockets.append(pair)
                            poller.register(pair, zmq.POLLIN)
                    elif self._on_event(sock, monitors[sock]):
                        poller.unregister(sock)
                        sockets.remove(sock)
                        del monitors[sock]
                        sock.close(linger=0)
        except zmq.ContextTerminated:
            pass  # the context is being terminated: close our sockets so that it can finish
        finally:
            for s in sockets:
                s.close(linger=0)

    def _answer(self, zap: zmq.Socket) -> None:
        version, request_id, domain, address, _identity, mechanism, *credentials = zap.recv_multipart()
        allowed = self.domains.get(domain)
        ok = allowed is not None and mechanism == b"CURVE" and credentials[:1] == [allowed[0]]
        if ok:
            reply = [b"200", b"OK", b"trainer"]
        else:
            reply = [b"400", b"not this run's key", b""]
            if allowed is not None:
                key = z85.encode(credentials[0]).decode() if mechanism == b"CURVE" and credentials else "none"
                allowed[1].refuse(f"{address.decode()} offered {mechanism.decode()} key {key}, not this run's")
        zap.send_multipart([version, request_id, *reply, b""])

    def _on_event(self, pair: zmq.Socket, domain: bytes) -> bool:
        """Count a failed handshake; True when the monitor has stopped (its socket closed)."""
        event = recv_monitor_message(pair)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return True
        allowed = self.domains.get(domain)
        # A refused key was counted (with the peer's address) by _answer; here the rest:
        # plain sockets, a wrong server key, bytes that are not ZMTP at all.
        if allowed is not None and event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            kind = "protocol error" if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL else "failed"
            allowed[1].refuse(f"handshake {kind} (code {event['value']:#x}): no CURVE, or not this run's server key")
        return False


_guards: dict[int, _Guard] = {}
_guards_lock = threading.Lock()
_domain_ids = itertools.count()


def _guard(ctx: zmq.Context) -> _Guard:
    with _guards_lock:
        guard = _guards.get(ctx.underlying)
        if guard is None or not guard.is_alive():
            guard = _Guard(ctx.underlying)
            guard.start_and_wait()
            _guards[ctx.underlying] = guard
        return guard


def secure_server(socket: zmq.Socket, keys: CurveKeys, refusals: Refusals) -> bytes:
    """Make `socket` (before it binds) a CURVE server admitting only the run's client key;
    its refused peers are counted in `refusals`. Returns the ZAP domain, for `release`."""
    if keys.server_secret is None:
        raise ValueError(f"socket {refusals.label} binds, so it needs transport.sockets.curve.server_secret")
    domain = f"{os.getpid()}-{next(_domain_ids)}".encode()
    guard = _guard(socket.context)
    socket.curve_server = True
    socket.curve_secretkey = keys.server_secret.encode()
    socket.zap_domain = domain
    guard.watch(socket, domain, z85.decode(keys.client_public), refusals)
    return domain


def release(socket: zmq.Socket, domain: bytes) -> None:
    """Before a server socket closes: stop its monitor and forget its domain."""
    guard = _guards.get(socket.context.underlying)
    if guard is not None:
        guard.forget(domain)
    if not socket.closed:
        socket.disable_monitor()  # the guard closes its end on EVENT_MONITOR_STOPPED


def secure_client(socket: zmq.Socket, keys: CurveKeys, label: str) -> None:
    """Make `socket` (before it connects) a CURVE client of the run's server."""
    if keys.client_secret is None:
        raise ValueError(f"socket {label} connects, so it needs transport.sockets.curve.client_secret")
    socket.curve_serverkey = keys.server_public.encode()
    socket.curve_publickey = keys.client_public.encode()
    socket.curve_secretkey = keys.client_secret.encode()
