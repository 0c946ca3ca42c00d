"""primerl-protocol: the messages, transport and configs shared by every primerl process."""

from primerl_protocol.auth import CurveKeys
from primerl_protocol.codec import Decoder, Encoder, ProtocolError
from primerl_protocol.messages import (
    PROTOCOL_VERSION,
    BatchMessage,
    Heartbeat,
    Message,
    MicroBatch,
    PolicyMessage,
    PolicyReady,
    Shutdown,
    TrainBatch,
)
from primerl_protocol.transport import (
    AsyncReceiver,
    AsyncSender,
    Receiver,
    Sender,
    SocketSettings,
    TransportTimeout,
)

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncReceiver",
    "AsyncSender",
    "BatchMessage",
    "CurveKeys",
    "Decoder",
    "Encoder",
    "Heartbeat",
    "Message",
    "MicroBatch",
    "PolicyMessage",
    "PolicyReady",
    "ProtocolError",
    "Receiver",
    "Sender",
    "Shutdown",
    "SocketSettings",
    "TrainBatch",
    "TransportTimeout",
]
