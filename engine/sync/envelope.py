"""The seed spec's message form (002 §5.1-5.3): an `Envelope` with a numeric `msg_type` whose
`payload` holds the spec's struct, beside 0k-sync's tagged form (`messages.py`).

0k-sync's code never puts an Envelope on the wire (cursor-sync-interop §0), and its structs
differ from the spec's: WELCOME has no `relay_id`, PUSH_ACK no `timestamp`, a pulled blob no
`sender_id`, NOTIFY is `{latest_cursor, count}`. A client written from the spec sends and expects
the spec's shapes. Both are offered: a request that arrives as an Envelope is answered as one,
with the spec's structs; a tagged request gets 0k-sync's (stock clients never see an Envelope).

Encoding, by the same rmp_serde rules as `messages.py` (structs as arrays, `[u8; N]` and
`Vec<u8>` as arrays of uints):

    Envelope := [version u8, msg_type u8, sender_id [u8;32], group_id [u8;32], cursor u64,
                 timestamp u64, nonce [u8;24], payload Vec<u8>]
    payload  := the spec struct for msg_type, an untagged array (below)

An 8-element array whose first element is an integer is an Envelope: no tagged message, in its
integer-variant-index form, has seven fields. In a request only `msg_type` and `payload` are
read (the sender is the connection's authenticated id, the cursor the relay's: 002 §5.1 says
"assigned by relay"); the relay's Envelopes carry its own values: `sender_id` the blob's sender
(zero for replies), `group_id` the session's group, `cursor` the reply's cursor (or 0),
`timestamp` the relay's clock (unix seconds), `nonce` zero (the relay encrypts nothing).

A spec blob id is `[u8; 16]`: an array of 16 uints in the spec's form; bin16 is accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from . import messages as m

VERSION = 1

# 002 §5.2
HELLO, WELCOME = 0x01, 0x02
PUSH, PUSH_ACK = 0x10, 0x11
PULL, PULL_RESPONSE = 0x20, 0x21
PRESENCE, NOTIFY = 0x30, 0x31
DELETE = 0x40
REVOKE_DEVICE, DEVICE_REVOKED = 0x50, 0x51
REGISTER_PUSH, UNREGISTER_PUSH = 0x60, 0x61
CONTENT_REF, CONTENT_ACK = 0x70, 0x71
ERROR = 0xFF

ZERO32, ZERO24 = bytes(32), bytes(24)

_u8, _u32, _u64 = m.u8, m.u32, m.u64
_str, _bool = m.string, m.boolean
_b32, _b24, _vec = m.b32, m.b24, m.byte_vec


class _SpecBlobId(m._Kind):
    """`[u8; 16]` (002 §5.3 Push.blob_id): an array of uints out; that, bin16 or a UUID string in."""
    name = "[u8;16]"

    def enc(self, v: bytes) -> list[int]:
        return m.b16.enc(v)

    def dec(self, v: Any) -> bytes:
        if isinstance(v, list):
            if not m._bytes_ok(v):
                raise m.DecodeError("invalid value in [u8;16]")
            return m.b16.dec(v)
        return m.blob_id.dec(v)


_bid = _SpecBlobId()

# request msg_type -> (the tagged message it is, its payload kinds in the spec's field order)
REQUESTS: dict[int, tuple[type[m.Message], tuple]] = {
    HELLO: (m.Hello, (_u8, _str, _b32, _u64)),
    PUSH: (m.Push, (_bid, _vec, _u32)),
    PULL: (m.Pull, (_u64, _u32)),
    PRESENCE: (m.Presence, (_bool,)),
    DELETE: (m.Delete, (_bid,)),
    REVOKE_DEVICE: (m.RevokeDevice, (_b32,)),
    REGISTER_PUSH: (m.RegisterPush, (_str, _str)),
    UNREGISTER_PUSH: (m.UnregisterPush, (_str, _str)),
    CONTENT_REF: (m.ContentRef, (_b32, _b24, _u64, _u64)),
    CONTENT_ACK: (m.ContentAck, (_b32,)),
}


@dataclass
class Request:
    msg: m.Message
    msg_type: int


def is_envelope(obj: Any) -> bool:
    return (isinstance(obj, list) and len(obj) == 8 and isinstance(obj[0], int)
            and not isinstance(obj[0], bool))


def decode_request(obj: list) -> Request:
    """An Envelope (already unpacked) -> the request it carries, or `DecodeError`."""
    version, msg_type, payload = obj[0], obj[1], obj[7]
    _u8.dec(version)
    _u8.dec(msg_type)
    for x, kind in zip(obj[2:7], (_b32, _b32, _u64, _u64, _b24)):
        if isinstance(x, list) and not m._bytes_ok(x):
            raise m.DecodeError("invalid value in an Envelope field")
        kind.dec(x)
    body = _vec.dec(payload) if not isinstance(payload, list) or m._bytes_ok(payload) else None
    if body is None:
        raise m.DecodeError("invalid value in Envelope.payload")
    entry = REQUESTS.get(msg_type)
    if entry is None:
        raise m.DecodeError("unknown msg_type")
    cls, kinds = entry
    try:
        fields = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=False)
    except Exception:
        raise m.DecodeError("invalid msgpack in Envelope.payload") from None
    if not isinstance(fields, list) or len(fields) != len(kinds):
        raise m.DecodeError("payload does not match msg_type")
    for x, kind in zip(fields, kinds):
        if isinstance(x, list) and isinstance(kind, m._ByteArray) and not m._bytes_ok(x):
            raise m.DecodeError("invalid value in payload")
    return Request(cls(*(kind.dec(x) for kind, x in zip(kinds, fields))), msg_type)


def envelope(msg_type: int, payload: list, *, group_id: bytes = ZERO32,
             sender_id: bytes = ZERO32, cursor: int = 0, timestamp: int = 0) -> bytes:
    """The relay's Envelope: `payload` (already in msgpack objects) packed as the spec struct."""
    body = msgpack.packb(payload, use_bin_type=True)
    return msgpack.packb([VERSION, msg_type, list(sender_id), list(group_id), cursor, timestamp,
                          list(ZERO24), list(body)], use_bin_type=True)


@dataclass
class SpecBlob:
    """What the relay knows of a stored blob, for the spec's PULL_RESPONSE and NOTIFY."""
    blob_id: bytes
    cursor: int
    sender_id: bytes
    payload_size: int
    timestamp: int


def welcome(version: int, relay_id: str, max_cursor: int, pending: int, **env) -> bytes:
    return envelope(WELCOME, [version, relay_id, max_cursor, pending], **env)


def push_ack(blob_id: bytes, cursor: int, stored_at: int, **env) -> bytes:
    """`stored_at`: PushAck.timestamp, the relay's clock when the blob was received."""
    return envelope(PUSH_ACK, [list(blob_id), cursor, stored_at], cursor=cursor, **env)


def pull_response(entries: list[tuple[bytes, int, bytes, bytes, int]], has_more: bool,
                  max_cursor: int, **env) -> bytes:
    """`entries`: (blob_id, cursor, sender_id, payload, timestamp), BlobEntry's order."""
    blobs = [[list(b), c, list(s), list(p), t] for b, c, s, p, t in entries]
    return envelope(PULL_RESPONSE, [blobs, has_more, max_cursor], cursor=max_cursor, **env)


def notify(blob: SpecBlob, **env) -> bytes:
    return envelope(NOTIFY, [list(blob.blob_id), blob.cursor, list(blob.sender_id),
                             blob.timestamp, blob.payload_size],
                    sender_id=blob.sender_id, cursor=blob.cursor, **env)


def error(code: int, message: str, **env) -> bytes:
    return envelope(ERROR, [code, message], **env)


# Replies of ours (extensions) in the spec's form: the tagged message's fields as the payload.
EXTENSION_TYPES: dict[type[m.Message], int] = {
    m.DeviceRevoked: DEVICE_REVOKED, m.ContentRef: CONTENT_REF, m.ContentAck: CONTENT_ACK,
}
