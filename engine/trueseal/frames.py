"""trueseal frames: the wire format alone, `[type u8][len u32 BE][body]` (000 "Wire Format").

One frame is the whole plaintext of one Noise transport message (interop §4); this module
neither encrypts nor knows about sessions, so it can be tested byte by byte against the spec
tables. Parsing follows the real peers: fewer than 5 bytes, an unknown tag or a body shorter
than `len` is malformed; bytes after `5+len` are ignored (interop §4).

Frame reprs never show envelope bytes: only sizes and short key fingerprints.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

HEADER_LEN = 5
RECIPIENT_LEN = 32
BLOB_ID_LEN = 8
_HEADER = struct.Struct(">BI")
_U64 = struct.Struct(">Q")


class Tag(IntEnum):
    PUSH = 0x01
    DELIVER = 0x02
    HEARTBEAT = 0x03
    ACK = 0x04
    ERROR = 0x05
    DELIVER_ACK = 0x06


class MalformedFrame(ValueError):
    """The plaintext is not a trueseal frame; the session must close (000 "Message Types")."""


class UnknownTag(MalformedFrame):
    """000: unknown type tags must be treated as malformed and the connection closed."""


def fingerprint(key: bytes | None) -> str:
    """First 4 bytes in hex: enough to tell keys apart in a log, not to reconstruct one."""
    return "None" if key is None else key[:4].hex() + "…"


@dataclass(frozen=True)
class Push:
    recipient: bytes   # 32-byte X25519 public key of the recipient device: the mailbox
    envelope: bytes    # opaque; never inspected

    def __repr__(self) -> str:
        return f"Push(recipient={fingerprint(self.recipient)}, envelope=<{len(self.envelope)} bytes>)"


@dataclass(frozen=True)
class ShortPush:
    """A Push whose body cannot hold a recipient key. Not a parse error: 000 says the relay
    must answer it with Error and keep the session, so the session core must see it."""
    body_len: int


@dataclass(frozen=True)
class Deliver:
    blob_id: int       # u64, relay-assigned, echoed in DeliverAck
    envelope: bytes

    def __repr__(self) -> str:
        return f"Deliver(blob_id={self.blob_id}, envelope=<{len(self.envelope)} bytes>)"


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class Ack:
    pass


@dataclass(frozen=True)
class Error:
    pass


@dataclass(frozen=True)
class DeliverAck:
    blob_id: int


Frame = Push | ShortPush | Deliver | Heartbeat | Ack | Error | DeliverAck

_EMPTY = {Tag.HEARTBEAT: Heartbeat(), Tag.ACK: Ack(), Tag.ERROR: Error()}


def parse(plaintext: bytes) -> Frame:
    """One frame from the plaintext of one Noise transport message. Raises MalformedFrame."""
    if len(plaintext) < HEADER_LEN:
        raise MalformedFrame(f"frame of {len(plaintext)} bytes is shorter than the header")
    tag_byte, length = _HEADER.unpack_from(plaintext)
    try:
        tag = Tag(tag_byte)
    except ValueError:
        raise UnknownTag(f"unknown frame tag 0x{tag_byte:02x}") from None
    if len(plaintext) - HEADER_LEN < length:
        raise MalformedFrame(f"{tag.name} body shorter than its length {length}")
    body = bytes(plaintext[HEADER_LEN:HEADER_LEN + length])  # trailing bytes ignored: interop §4

    if tag is Tag.PUSH:
        if len(body) < RECIPIENT_LEN:
            return ShortPush(len(body))
        return Push(body[:RECIPIENT_LEN], body[RECIPIENT_LEN:])
    if tag is Tag.DELIVER:
        if len(body) < BLOB_ID_LEN:
            raise MalformedFrame("Deliver body shorter than its blob_id")
        return Deliver(_U64.unpack_from(body)[0], body[BLOB_ID_LEN:])
    if tag is Tag.DELIVER_ACK:
        if len(body) != BLOB_ID_LEN:
            raise MalformedFrame(f"DeliverAck body of {len(body)} bytes, expected {BLOB_ID_LEN}")
        return DeliverAck(_U64.unpack(body)[0])
    # Heartbeat, Ack, Error: "Body is always empty" (000). The real peers never send one,
    # so a body here is refused rather than guessed at.
    if body:
        raise MalformedFrame(f"{tag.name} with a {len(body)}-byte body")
    return _EMPTY[tag]


def _frame(tag: Tag, body: bytes = b"") -> bytes:
    return _HEADER.pack(tag, len(body)) + body


def serialize(frame: Frame) -> bytes:
    """The plaintext of one Noise transport message carrying `frame`."""
    match frame:
        case Push(recipient, envelope):
            if len(recipient) != RECIPIENT_LEN:
                raise ValueError("recipient must be 32 bytes")
            return _frame(Tag.PUSH, bytes(recipient) + bytes(envelope))
        case Deliver(blob_id, envelope):
            return _frame(Tag.DELIVER, _U64.pack(blob_id) + bytes(envelope))
        case DeliverAck(blob_id):
            return _frame(Tag.DELIVER_ACK, _U64.pack(blob_id))
        case Heartbeat():
            return _frame(Tag.HEARTBEAT)
        case Ack():
            return _frame(Tag.ACK)
        case Error():
            return _frame(Tag.ERROR)
    raise TypeError(f"cannot serialize {type(frame).__name__}")
