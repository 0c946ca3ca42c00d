"""Encode messages to ZeroMQ multipart frames and back, zero-copy for arrays.

Wire format of one message:
  frame 0      msgpack header: the Struct, where each numpy array is replaced by a reference
               [byte offset, dtype, shape] into frame 1
  frame 1      (only if the message has arrays) the arrays' raw bytes, C order, little-endian,
               each starting at a multiple of 64 bytes

One payload frame rather than one frame per array: a batch holds hundreds of arrays, and
ZeroMQ's cost per frame (not per byte) dominated when each travelled alone (bench/transport.py).
Packing costs one memcpy on the sending side; receiving is zero-copy.

Decoding checks, before anything reaches the caller: the header is msgpack, its `type` is one
this socket accepts, its `version` is ours, every field has the right type (no unknown ones),
every array reference lies inside the payload frame, no two overlap, and no frame is left
over. Any failure raises ProtocolError naming the socket, the message type and
the field; nothing else escapes (a header nested too deep for msgspec's recursion is one too,
tested by tests/test_codec_fuzz.py). Decoded arrays are read-only views on the received frames (no copy).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence

import msgspec
import numpy as np

from primerl_protocol.errors import split_validation_error
from primerl_protocol.messages import PROTOCOL_VERSION

# dtypes an array frame may carry (numpy names); anything else is refused on decode.
WIRE_DTYPES = frozenset(["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"])

# numpy's dtype.name is slow (Python code); these maps are looked up once per array instead.
_DTYPES = {name: np.dtype(name) for name in WIRE_DTYPES}
_NAMES = {dt: name for name, dt in _DTYPES.items()}

Frame = bytes | memoryview
ALIGN = 64
_ZEROS = bytes(ALIGN)


class ProtocolError(ValueError):
    """A message could not be decoded: says which socket, message type and field."""

    def __init__(self, channel: str, message_type: str | None, field: str | None, detail: str):
        self.channel = channel
        self.message_type = message_type
        self.field = field
        self.detail = detail
        what = message_type or "message"
        where = f" at field `{field}`" if field else ""
        super().__init__(f"malformed {what} on socket '{channel}'{where}: {detail}")


class _Peek(msgspec.Struct):
    """Just the envelope of a header, to name the message before validating all of it."""

    type: str = ""
    version: int = -1


def union_members(message_type: typing.Any) -> tuple[type, ...]:
    """The Struct classes of a union type (or a single class)."""
    args = typing.get_args(message_type)
    return tuple(args) if args else (message_type,)


class Encoder:
    """Turns a message into frames. One per socket; not thread-safe (neither are sockets)."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._size = 0
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: typing.Any) -> typing.Any:
        if isinstance(obj, np.ndarray):
            arr, name = obj, _NAMES.get(obj.dtype)
            if name is None:  # a byte-swapped array of a wire dtype travels little-endian
                name = _NAMES.get(obj.dtype.newbyteorder("="))
                if name is None:
                    raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
                arr = obj.astype(_DTYPES[name])
            if not arr.nbytes:  # an empty array (a row without images) takes no bytes
                return (0, name, arr.shape)
            offset = -(-self._size // ALIGN) * ALIGN
            self._arrays.append(arr)
            self._size = offset + arr.nbytes
            return (offset, name, arr.shape)
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")

    def encode(self, message: msgspec.Struct) -> list[Frame]:
        """[header] or [header, payload]."""
        self._arrays, self._size = [], 0
        try:
            header = self._encoder.encode(message)
            if not self._arrays:
                return [header]
            parts: list[Frame] = []
            offset = 0
            for arr in self._arrays:
                pad = -offset % ALIGN
                if pad:
                    parts.append(_ZEROS[:pad])
                parts.append(np.ascontiguousarray(arr).data.cast("B"))
                offset += pad + arr.nbytes
            return [header, b"".join(parts)]
        finally:
            self._arrays = []


class Decoder:
    """Turns frames back into one of the messages a socket accepts, or raises ProtocolError."""

    def __init__(self, message_type: typing.Any, channel: str):
        self.channel = channel
        self.accepted = {cls.__name__: cls for cls in union_members(message_type)}
        self._payload: memoryview | None = None
        self._spans: list[tuple[int, int]] = []
        self._peek = msgspec.msgpack.Decoder(_Peek)
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)

    def _dec_hook(self, expected: type, obj: typing.Any) -> typing.Any:
        if expected is not np.ndarray:
            raise TypeError(f"unsupported type {expected}")
        if not (isinstance(obj, (list, tuple)) and len(obj) == 3):
            raise ValueError("expected an array reference [offset, dtype, shape]")
        offset, dtype, shape = obj
        if self._payload is None:
            raise ValueError("the message has an array but no payload frame")
        dt = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        if dt is None:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
        nbytes = dt.itemsize * math.prod(shape)
        size = self._payload.nbytes
        if not isinstance(offset, int) or offset < 0 or offset + nbytes > size:
            raise ValueError(
                f"{dtype}{list(shape)} at byte {offset} needs {nbytes} bytes, but the payload "
                f"frame holds {size} (truncated or mismatched frame)"
            )
        self._spans.append((offset, offset + nbytes))
        return np.frombuffer(self._payload, dtype=dt, count=nbytes // dt.itemsize, offset=offset).reshape(shape)

    def _check_spans(self) -> str | None:
        spans = sorted(s for s in self._spans if s[0] != s[1])
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                return f"two arrays overlap in the payload frame at byte {start}"
        return None

    def decode(self, frames: Sequence[Frame]) -> typing.Any:
        if not frames:
            raise ProtocolError(self.channel, None, None, "empty message (no frames)")
        header = frames[0]
        try:
            peek = self._peek.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise ProtocolError(self.channel, None, None, f"header is not a valid message ({err})") from None
        except RecursionError:  # msgspec walks even fields it skips; a few KB can nest thousands deep
            raise ProtocolError(self.channel, None, None, "header nests too deep to decode") from None
        name = peek.type
        if name not in self.accepted:
            raise ProtocolError(
                self.channel,
                name or None,
                "type",
                f"unexpected message type {name!r}; this socket accepts {sorted(self.accepted)}",
            )
        if peek.version != PROTOCOL_VERSION:
            raise ProtocolError(
                self.channel,
                name,
                "version",
                f"protocol version {peek.version}, this process speaks {PROTOCOL_VERSION}",
            )
        if len(frames) > 2:
            raise ProtocolError(self.channel, name, None, f"{len(frames)} frames; a message has at most 2")
        self._payload = memoryview(frames[1]).cast("B") if len(frames) == 2 else None
        self._spans = []
        try:
            message = self._decoder.decode(header)
            overlap = self._check_spans()
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            field, detail = split_validation_error(err)
            raise ProtocolError(self.channel, name, field or None, detail) from None
        except RecursionError:
            raise ProtocolError(self.channel, name, None, "header nests too deep to decode") from None
        finally:
            self._payload, spans, self._spans = None, self._spans, []
        if overlap:
            raise ProtocolError(self.channel, name, None, overlap)
        if len(frames) == 2 and not spans:
            raise ProtocolError(self.channel, name, None, "a payload frame but no array refers to it")
        return message
