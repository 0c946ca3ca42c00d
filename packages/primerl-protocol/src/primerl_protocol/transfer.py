"""Weights in memory: the stream the trainer sends to the inference servers' workers
(`trainer.weights.transport = "memory"`), defined once for both sides.

The trainer's rank 0 and the workers of a server form one process group (gloo on CPU; its
rendezvous is a TCP store on the trainer). The secret itself never enters the store, which any
client can list: the rendezvous keys are under a hash of it, and once the group has met, every
member proves it holds the secret (an HMAC of a nonce from rank 0 and its rank, all-gathered
and checked by every member), so a process that read the hash from the store and took a rank
with it is refused, as is a trainer that is not the run's. An update is a sequence of broadcasts from
rank 0, one group of tensors (a decoder layer, or the embeddings, or the head) at a time:

    for each group:   [header size] [header: GroupHeader, JSON] [the group's bytes]
    at the end:       [header size] [header: GroupHeader with end = true and the checksum]

Each group's bytes are its tensors in HF's names and layout, cast to the published dtype,
back to back (each at a 16-byte aligned offset). The checksum (xxh3-128 over every group's
bytes in order) lets the receiver verify what it got before it serves it; a receiver that
reads a header naming another step than the one it was told to receive refuses the update.
Everything in a header is checked (dtypes from a fixed list, offsets inside the buffer, sizes
that add up) before a byte of it is used: the stream is input from another process.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from typing import TYPE_CHECKING, Protocol, cast

import msgspec
import xxhash

if TYPE_CHECKING:
    from torch import Tensor
    from torch.distributed.distributed_c10d import BroadcastOptions, Work
    from torch.types import Device

BACKEND = "primerl_gloo"
"""The name of the servers' weight-transfer engine (vLLM's `--weight-transfer-config`)."""

ALIGN = 16
"""Every tensor starts at a multiple of this in its group's buffer (any dtype can view it)."""

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int64": 8, "int32": 4, "uint8": 1}
"""The dtypes a stream may carry, with their sizes in bytes."""

MAX_HEADER_BYTES = 64 << 20
"""A header longer than this is refused (a sane one is a few KB per layer)."""


class TensorSpec(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]
    offset: int


class GroupHeader(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    step: int
    """The policy step the update holds (the same in every header of an update)."""
    tensors: list[TensorSpec] = []
    nbytes: int = 0
    """Size of the group's buffer, which follows this header."""
    end: bool = False
    """The last header of an update: no buffer follows; `checksum` covers every group's bytes."""
    checksum: str | None = None


def nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * DTYPES[spec.dtype]


def layout(specs: list[tuple[str, str, list[int]]]) -> tuple[list[TensorSpec], int]:
    """Offsets of (name, dtype, shape) packed back to back at ALIGN; (specs, buffer size)."""
    out, at = [], 0
    for name, dtype, shape in specs:
        out.append(TensorSpec(name, dtype, list(shape), at))
        at += -(-nbytes(out[-1]) // ALIGN) * ALIGN
    return out, at


def encode_header(header: GroupHeader) -> bytes:
    return msgspec.json.encode(header)


def decode_header(data: bytes, step: int) -> GroupHeader:
    """A received header, checked; ValueError saying what is wrong with it."""
    try:
        header = msgspec.json.decode(data, type=GroupHeader)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ValueError(f"the weight stream's header is malformed: {err}") from None
    if header.step != step:
        raise ValueError(
            f"the trainer sent the weights of step {header.step}, this server was told to receive step {step}"
        )
    if header.end:
        if header.checksum is None or header.tensors or header.nbytes:
            raise ValueError("the weight stream's end header must carry the checksum and nothing else")
        return header
    if header.nbytes < 0:
        raise ValueError(f"the weight stream's header gives a negative size ({header.nbytes})")
    for spec in header.tensors:
        if spec.dtype not in DTYPES:
            raise ValueError(f"the weight stream carries {spec.name} as {spec.dtype!r}, not one of {sorted(DTYPES)}")
        if any(d < 0 for d in spec.shape) or spec.offset < 0 or spec.offset % ALIGN:
            raise ValueError(f"the weight stream places {spec.name} at offset {spec.offset} with shape {spec.shape}")
        if spec.offset + nbytes(spec) > header.nbytes:
            raise ValueError(f"the weight stream's {spec.name} ends past its group's {header.nbytes} bytes")
    return header


def new_checksum():
    """The running checksum of an update (feed it each group's bytes, in order)."""
    return xxhash.xxh3_128()


# -- the broadcasts (torch is imported here only: the rest of primerl_protocol is torch-free) --


def _torch():
    """torch, with torch.distributed: the trainer's and the servers' environments have it;
    primerl-protocol alone does not need it (nor declare it) but for streaming weights."""
    try:
        import torch
        import torch.distributed
    except ImportError:
        raise RuntimeError("streaming weights in memory needs torch, which this environment lacks") from None
    return torch


def host_store(port: int, world_size: int, timeout_s: float):
    """Rank 0's rendezvous store, listening on `port` of every interface (0: a free one; `.port`
    says which)."""
    from datetime import timedelta

    dist = _torch().distributed

    # torch.distributed.TCPStore is public (documented) API, but torch.distributed imports it from
    # torch._C without re-exporting it (no __all__, no `as`), which pyright reads as private.
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        "127.0.0.1", port, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


KEYS = "primerl-weights/"
"""Every rendezvous key of a transfer group starts with this, then the hash of the run's secret."""


class Stranger(RuntimeError):
    """A member of the transfer group does not hold the run's secret (`ranks`: which)."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"rank(s) {ranks} of the weight transfer group do not hold the run's secret: refused")
        self.ranks = ranks


def _prefix(secret: str) -> str:
    return f"{KEYS}{hashlib.sha256(secret.encode()).hexdigest()[:32]}/"


def _tag(secret: str, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret.encode(), nonce + rank.to_bytes(4, "little"), hashlib.sha256).digest()


def open_group(host: str, port: int, secret: str, rank: int, world_size: int, timeout_s: float, store=None):
    """This process's member of the transfer group: rank 0 (the trainer) hosts the rendezvous
    store (`store`, from `host_store`, or one made here on `port`), the others join it on
    (host, port). Blocks until all `world_size` ranks are in, at most `timeout_s`
    (RuntimeError); then every member proves it holds `secret` (Stranger if one does not).
    Each later operation waits at most `timeout_s` on rank 0, twice that on the others: rank 0
    may be held up to `timeout_s` by another group's member (a stalled server) before it sends
    to this group again."""
    from datetime import timedelta

    torch = _torch()  # first: without torch, its clear error rather than an ImportError
    dist = torch.distributed
    PrefixStore = dist.distributed_c10d.PrefixStore  # public API that torch.distributed's stub does not re-export

    timeout = timedelta(seconds=timeout_s if rank == 0 else 2 * timeout_s)
    if store is None:
        store = (
            host_store(port, world_size, timeout_s)
            if rank == 0
            else dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)  # pyright: ignore[reportPrivateImportUsage]  # as in host_store
        )
    pg = dist.ProcessGroupGloo(PrefixStore(_prefix(secret), store), rank, world_size, timeout)
    # cast: torch's stub of ProcessGroupGloo (its Backend base) omits the collectives the C++
    # class binds (broadcast, allgather), which _Collectives names.
    group = Group(cast(_Collectives, pg), store)
    # The handshake: rank 0's nonce, then every member's HMAC of it and its rank, to all.
    nonce = torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8)
    broadcast(group, nonce)
    mine = torch.frombuffer(bytearray(_tag(secret, nonce.numpy().tobytes(), rank)), dtype=torch.uint8)
    tags = [torch.empty_like(mine) for _ in range(world_size)]
    group.pg.allgather([tags], [mine]).wait()
    bad = [
        r
        for r, t in enumerate(tags)
        if not hmac.compare_digest(t.numpy().tobytes(), _tag(secret, nonce.numpy().tobytes(), r))
    ]
    if bad:
        raise Stranger(bad)
    return group


def strangers(store, secret: str) -> int:
    """How many rendezvous keys in rank 0's `store` are not the run's: ranks taken, or tried, by
    processes that do not know the secret (0 where the store cannot list its keys)."""
    try:
        keys = store.list_keys()
    except (AttributeError, RuntimeError):
        return 0
    return sum(1 for k in keys if not k.lstrip("/").startswith(_prefix(secret)))


class _Collectives(Protocol):
    """What a transfer group uses of gloo's process group (torch.distributed's ProcessGroupGloo)."""

    def broadcast(self, tensors: list[Tensor], opts: BroadcastOptions, /) -> Work: ...

    def allgather(self, output_tensors: list[list[Tensor]], input_tensors: list[Tensor], /) -> Work: ...


class Group:
    """A member of a transfer group: gloo's process group and the store it met through (which
    must live as long as it does; `store.port` is the port rank 0 hosts it on)."""

    def __init__(self, pg: _Collectives, store):
        self.pg, self.store = pg, store


def broadcast(group: Group, tensor) -> None:
    dist = _torch().distributed

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.pg.broadcast([tensor], opts).wait()


def send_bytes(group, data: bytes) -> None:
    torch = _torch()

    broadcast(group, torch.tensor([len(data)], dtype=torch.int64))
    broadcast(group, torch.frombuffer(bytearray(data), dtype=torch.uint8))


def recv_bytes(group, limit: int = MAX_HEADER_BYTES) -> bytes:
    torch = _torch()

    size = torch.zeros(1, dtype=torch.int64)
    broadcast(group, size)
    n = int(size[0])
    if not 0 < n <= limit:
        raise ValueError(f"the weight stream announced a header of {n} bytes (at most {limit})")
    data = torch.empty(n, dtype=torch.uint8)
    broadcast(group, data)
    return data.numpy().tobytes()


def scratch(buffer, size: int, device: Device = "cpu", pin: bool = False):
    """`size` bytes of `buffer` (a uint8 tensor kept between groups), or of a new one when it is
    too small: an update reuses one buffer, not fresh memory (and its page faults) per group."""
    torch = _torch()

    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
    return buffer


def pack(tensors: list[tuple[str, Tensor]], out=None):
    """(specs, buffer) of tensors on one device: one uint8 tensor there (`out`, or the front of
    it, when it is large enough) holding them at their offsets (one copy each on the device; the
    buffer then crosses to the host in one piece)."""
    specs, size = layout([(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors])
    device = tensors[0][1].device if tensors else "cpu"
    buffer = scratch(out if out is not None and out.device == device else None, size, device)[:size]
    for spec, (_, t) in zip(specs, tensors):
        buffer[spec.offset : spec.offset + nbytes(spec)].view(t.dtype).view(t.shape).copy_(t)
    return specs, buffer


def unpack(header: GroupHeader, buffer) -> list[tuple[str, Tensor]]:
    """The (name, tensor) views of a received group's buffer (checked by decode_header)."""
    torch = _torch()

    return [
        (s.name, buffer[s.offset : s.offset + nbytes(s)].view(getattr(torch, s.dtype)).view(s.shape))
        for s in header.tensors
    ]


def pack_update(step: int, tensors, hosts: list | None = None):
    """An update's groups as they are sent: (GroupHeader, host buffer) for each layer group
    `tensors` yields ([(HF name, tensor)], all on one device). Each group is packed on its
    device and crosses to host memory (pinned where CUDA is) in one copy. `hosts`: None, one
    host buffer for every group (each valid until the next is taken); a list, group i's own
    buffer, kept there for the caller and reused by the next update of the same model (its size
    per group does not change), so an update can be held whole while it is sent in the
    background."""
    torch = _torch()

    on_device = shared = None
    for i, group_tensors in enumerate(tensors):
        own = None if hosts is None else (hosts[i] if i < len(hosts) else None)
        if not group_tensors or group_tensors[0][1].device.type == "cpu":
            specs, buffer = pack(group_tensors, out=shared if hosts is None else own)
        else:
            specs, packed = pack(group_tensors, out=on_device)
            on_device = packed._base if packed._base is not None else packed
            host = scratch(shared if hosts is None else own, packed.numel(), pin=torch.cuda.is_available())
            buffer = host[: packed.numel()].copy_(packed)
        base = buffer._base if buffer._base is not None else buffer
        if hosts is None:
            shared = base
        elif i < len(hosts):
            hosts[i] = base
        else:
            hosts.append(base)
        yield GroupHeader(step=step, tensors=specs, nbytes=buffer.numel()), buffer


def send_packed(groups: list[Group], step: int, update) -> tuple[str, dict[int, str]]:
    """Send an update of `step` (rank 0; `update` as pack_update yields it) to every group in
    `groups` at once, group by group in lockstep (each group's part sent in parallel), then the
    end header with the checksum over every group's bytes (taken here, as they go: off the
    trainer's step when this runs in the background). Returns the checksum and, by index in
    `groups`, why the groups that failed did (a member gone, a timeout: each waits at most its
    group's timeout, and is then left out of the rest): the others got it all."""
    from concurrent.futures import ThreadPoolExecutor

    failed: dict[int, str] = {}

    def one(i: int, fn) -> None:
        try:
            fn(groups[i])
        except RuntimeError as err:  # gloo: a closed connection, a timeout
            failed[i] = str(err).splitlines()[0][:300]

    def to_all(fn) -> None:
        # To every group at once (gloo waits without the GIL): a stalled member holds up the
        # others by at most its timeout, once, and the bytes go to several servers in parallel.
        live = [i for i in range(len(groups)) if i not in failed]
        if len(live) == 1:
            one(live[0], fn)
        else:
            list(pool.map(lambda i: one(i, fn), live))

    digest = new_checksum()
    with ThreadPoolExecutor(max(1, len(groups)), thread_name_prefix="primerl-weights") as pool:
        for header, buffer in update:
            data = encode_header(header)
            to_all(lambda g: (send_bytes(g, data), broadcast(g, buffer)))
            digest.update(buffer.numpy().data)  # .data: the array's memoryview
        checksum = digest.hexdigest()
        end = encode_header(GroupHeader(step=step, end=True, checksum=checksum))
        to_all(lambda g: send_bytes(g, end))
    return checksum, failed


def send_update(groups: list[Group], step: int, tensors) -> tuple[str, dict[int, str]]:
    """Pack and send an update as it is packed, one group at a time (send_packed, pack_update)."""
    return send_packed(groups, step, pack_update(step, tensors))


def receive_update(group, step: int, load, ahead: int = 2) -> tuple[str, int]:
    """Receive an update of `step` (a worker), giving each group's tensors to `load`; returns
    (checksum, bytes). ValueError if a header is malformed or the checksum does not match: the
    tensors already given to `load` are then not the trainer's.

    The stream is read by a thread of its own, up to `ahead` groups ahead of `load`: the next
    layer crosses the wire while this one is loaded, instead of the trainer waiting for each
    load (the checks are the same, in the same order)."""
    import queue
    import threading

    torch = _torch()

    received: queue.Queue = queue.Queue(maxsize=max(1, ahead))
    stop = threading.Event()

    def read() -> None:
        digest, size = new_checksum(), 0
        try:
            while not stop.is_set():
                header = decode_header(recv_bytes(group), step)
                if header.end:
                    if digest.hexdigest() != header.checksum:
                        raise ValueError(
                            f"the weights of step {step} arrived damaged: checksum {digest.hexdigest()}, "
                            f"the trainer sent {header.checksum}"
                        )
                    received.put((None, (header.checksum, size)))
                    return
                # A fresh buffer per group, never reused: vLLM's layer-wise reload keeps the
                # tensors it is given (views of this buffer) until their layer is complete,
                # attention layers until the update's end (as vLLM's own NCCL consumer does).
                buffer = torch.empty(header.nbytes, dtype=torch.uint8)
                broadcast(group, buffer)
                digest.update(buffer.numpy().data)  # .data: the array's memoryview
                size += header.nbytes
                received.put((header, buffer))
        except BaseException as err:  # handed to the loading side, which raises it
            received.put((err, None))

    reader = threading.Thread(target=read, name="primerl-weights-receive", daemon=True)
    reader.start()
    try:
        while True:
            header, item = received.get()
            if header is None:
                return item
            if isinstance(header, BaseException):
                raise header
            load(unpack(header, item))
    finally:
        stop.set()  # a load that failed: the reader stops at its next group (or at the stream's error)
