"""Encode messages to ZeroMQ multipart frames and back, zero-copy for arrays.

Wire format of one message:
  frame 0      msgpack header: the Struct, where each numpy array is replaced by a reference
               [frame index, dtype, shape]
  frames 1..N  the arrays' raw bytes (C order, native little-endian), one frame per array

Decoding checks, before anything reaches the caller: the header is msgpack, its `type` is one
this socket accepts, its `version` is ours, every field has the right type (no unknown ones),
every array reference points at an existing frame whose size matches dtype x shape, and no
frame is left over. Any failure raises ProtocolError naming the socket, the message type and
the field. Decoded arrays are read-only views on the received frames (no copy).
"""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence

import msgspec
import numpy as np

from primerl_protocol.messages import PROTOCOL_VERSION

# dtypes an array frame may carry (numpy names); anything else is refused on decode.
WIRE_DTYPES = frozenset(
    ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
)

Frame = bytes | memoryview


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


_PATH_RE = re.compile(r"^(?P<detail>.*) - at `\$(?P<path>[^`]*)`$", re.S)


def _split_msgspec_error(err: Exception) -> tuple[str | None, str]:
    """'Expected `int`, got `str` - at `$.a[0].b`' -> ('a[0].b', 'Expected `int`, got `str`')."""
    text = str(err)
    m = _PATH_RE.match(text)
    if not m:
        return None, text
    path = m.group("path").lstrip(".")
    detail = m.group("detail")
    # "Object contains unknown field `x`" is reported at the parent: name the field itself.
    unknown = re.match(r"Object contains unknown field `([^`]*)`", detail)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
    return path or None, detail


def union_members(message_type: typing.Any) -> tuple[type, ...]:
    """The Struct classes of a union type (or a single class)."""
    args = typing.get_args(message_type)
    return tuple(args) if args else (message_type,)


class Encoder:
    """Turns a message into frames. One per socket; not thread-safe (neither are sockets)."""

    def __init__(self) -> None:
        self._frames: list[Frame] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def _enc_hook(self, obj: typing.Any) -> typing.Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.name not in WIRE_DTYPES:
                raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
            arr = np.ascontiguousarray(obj)
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            self._frames.append(arr.data.cast("B") if arr.size else b"")
            return (len(self._frames), arr.dtype.name, arr.shape)
        raise TypeError(f"cannot encode objects of type {type(obj).__name__}")

    def encode(self, message: msgspec.Struct) -> list[Frame]:
        """[header, array frames...]. The array frames are views: don't mutate them until sent."""
        self._frames = []
        try:
            header = self._encoder.encode(message)
            return [header, *self._frames]
        finally:
            self._frames = []


class Decoder:
    """Turns frames back into one of the messages a socket accepts, or raises ProtocolError."""

    def __init__(self, message_type: typing.Any, channel: str):
        self.channel = channel
        self.accepted = {cls.__name__: cls for cls in union_members(message_type)}
        self._frames: Sequence[Frame] = ()
        self._used: set[int] = set()
        self._peek = msgspec.msgpack.Decoder(_Peek)
        self._decoder = msgspec.msgpack.Decoder(message_type, dec_hook=self._dec_hook)

    def _dec_hook(self, expected: type, obj: typing.Any) -> typing.Any:
        if expected is not np.ndarray:
            raise TypeError(f"unsupported type {expected}")
        if not (isinstance(obj, (list, tuple)) and len(obj) == 3):
            raise ValueError("expected an array reference [frame, dtype, shape]")
        index, dtype, shape = obj
        if not isinstance(index, int) or not 1 <= index < len(self._frames):
            raise ValueError(
                f"array refers to frame {index}, but the message has frames 1..{len(self._frames) - 1}"
            )
        if index in self._used:
            raise ValueError(f"frame {index} is referenced twice")
        if dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(n, int) and n >= 0 for n in shape
        ):
            raise ValueError(f"shape {shape!r} is not a list of non-negative integers")
        dt = np.dtype(dtype)
        buf = memoryview(self._frames[index])
        expected_bytes = dt.itemsize * int(np.prod(shape, dtype=np.int64))
        if buf.nbytes != expected_bytes:
            raise ValueError(
                f"frame {index} holds {buf.nbytes} bytes, expected {expected_bytes} "
                f"for {dtype}{list(shape)} (truncated or mismatched frame)"
            )
        self._used.add(index)
        return np.frombuffer(buf, dtype=dt).reshape(shape)

    def decode(self, frames: Sequence[Frame]) -> typing.Any:
        if not frames:
            raise ProtocolError(self.channel, None, None, "empty message (no frames)")
        header = frames[0]
        try:
            peek = self._peek.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            raise ProtocolError(self.channel, None, None, f"header is not a valid message ({err})")
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
        self._frames, self._used = frames, set()
        try:
            message = self._decoder.decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            field, detail = _split_msgspec_error(err)
            raise ProtocolError(self.channel, name, field, detail) from None
        finally:
            used, self._frames, self._used = self._used, (), set()
        if len(used) != len(frames) - 1:
            unused = sorted(set(range(1, len(frames))) - used)
            raise ProtocolError(
                self.channel, name, None, f"frames {unused} are not referenced by the header"
            )
        return message
