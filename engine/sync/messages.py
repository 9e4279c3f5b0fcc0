"""cursor-sync messages: 0k-sync's wire form, byte for byte, plus the seed's missing messages.

0k-sync encodes `enum Message` (`#[serde(tag = "type")]`) with `rmp_serde::to_vec`: every
message is a MessagePack **array** `[tag, field1, field2, ...]` in declaration order
(cursor-sync-interop §1.3). Field encodings:

* integers: the smallest uint form; `bool` c2/c3; `Option<String>` nil or str;
* `[u8; N]` and `Vec<u8>` (group ids, hashes, nonces, payloads): an **array of uints**, not bin;
* `BlobId` (a UUID): **bin8 of 16 bytes**.

Decoding follows what the Rust side accepts (serde's `ContentDeserializer`): the map form
`{"type": tag, field: ...}` (unknown keys ignored) and an integer variant index as the tag are
accepted; `bin` where a byte array is expected, a blob id as 16 ints, a wrong element count,
an unknown tag, an int out of its type's range are refused with `DecodeError`. One stricter
rule: bytes after the message are refused (rmp_serde ignores them; no client sends any).

Messages 0k-sync lacks (the seed's PRESENCE, DELETE, REVOKE_DEVICE, DEVICE_REVOKED,
REGISTER_PUSH, UNREGISTER_PUSH, ERROR, and the identity / membership exchange) get new tags
with the same encoding rules; 0k-sync clients never send them and never receive them (see
README "cursor-sync"). Keys, signatures, push tokens and content hashes are redacted in reprs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

U8, U32, U64 = (1 << 8) - 1, (1 << 32) - 1, (1 << 64) - 1


class DecodeError(ValueError):
    """The bytes are not a message the Rust decoder would accept (or not ours)."""


# --- field kinds: (encode python value -> msgpack object, decode msgpack object -> value) -----

class _Kind:
    name = "?"

    def enc(self, v: Any) -> Any:
        return v

    def dec(self, v: Any) -> Any:
        raise NotImplementedError


class _Uint(_Kind):
    def __init__(self, top: int, name: str):
        self.top, self.name = top, name

    def enc(self, v: int) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= self.top:
            raise ValueError(f"{self.name} out of range")
        return v

    def dec(self, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= self.top:
            raise DecodeError(f"invalid value for {self.name}")
        return v


class _Bool(_Kind):
    name = "bool"

    def dec(self, v: Any) -> bool:
        if not isinstance(v, bool):
            raise DecodeError("invalid type: expected a boolean")
        return v


class _Str(_Kind):
    name = "str"

    def enc(self, v: str) -> str:
        if not isinstance(v, str):
            raise ValueError("expected str")
        return v

    def dec(self, v: Any) -> str:
        if not isinstance(v, str):
            raise DecodeError("invalid type: expected a string")
        return v


class _OptStr(_Str):
    name = "Option<str>"

    def enc(self, v: str | None) -> str | None:
        return None if v is None else super().enc(v)

    def dec(self, v: Any) -> str | None:
        return None if v is None else super().dec(v)


class _ByteArray(_Kind):
    """`[u8; N]` (length fixed) or `Vec<u8>` (length None): a msgpack array of uints."""

    def __init__(self, length: int | None):
        self.length = length
        self.name = f"[u8;{length}]" if length else "Vec<u8>"

    def enc(self, v: bytes) -> list[int]:
        if not isinstance(v, (bytes, bytearray)) or (self.length and len(v) != self.length):
            raise ValueError(f"expected {self.name}")
        return list(v)

    def dec(self, v: Any) -> bytes:
        if not isinstance(v, list):   # serde: "invalid type: byte array, expected a sequence"
            raise DecodeError(f"invalid type: expected a sequence for {self.name}")
        if self.length is not None and len(v) != self.length:
            raise DecodeError(f"invalid length {len(v)}, expected {self.name}")
        try:
            return bytes(v)           # raises on non-ints, negatives, > 255 and bools? see below
        except (TypeError, ValueError):
            raise DecodeError(f"invalid value in {self.name}") from None


class _BlobId(_Kind):
    """`uuid::Uuid` in a non-human-readable format: bin16 out; bin16 or a UUID string in."""
    name = "BlobId"

    def enc(self, v: bytes) -> bytes:
        if not isinstance(v, (bytes, bytearray)) or len(v) != 16:
            raise ValueError("blob_id is 16 bytes")
        return bytes(v)

    def dec(self, v: Any) -> bytes:
        if isinstance(v, bytes):
            if len(v) != 16:
                raise DecodeError("invalid length for a UUID")
            return v
        if isinstance(v, str):
            try:
                return uuid.UUID(v).bytes
            except ValueError:
                raise DecodeError("invalid UUID string") from None
        raise DecodeError("invalid type: expected a UUID string")


class _List(_Kind):
    """`Vec<Struct>`: an array of untagged arrays (inner structs carry no tag)."""

    def __init__(self, item: type["Message"]):
        self.item = item
        self.name = f"Vec<{item.__name__}>"

    def enc(self, v: list) -> list:
        return [x._fields_out() for x in v]

    def dec(self, v: Any) -> list:
        if not isinstance(v, list):
            raise DecodeError(f"invalid type: expected a sequence for {self.name}")
        return [self.item._from_fields(x) for x in v]


u8, u32, u64 = _Uint(U8, "u8"), _Uint(U32, "u32"), _Uint(U64, "u64")
boolean, string, opt_string = _Bool(), _Str(), _OptStr()
b16, b24, b32, b64 = _ByteArray(16), _ByteArray(24), _ByteArray(32), _ByteArray(64)
byte_vec = _ByteArray(None)
blob_id = _BlobId()


def _bytes_ok(v: list) -> bool:
    """A byte array decoded as a list holds ints only (`type`, not isinstance: a bool is an
    int to isinstance). One set of the types, not a test per element: 11.8 -> 6.8 us for a
    600-byte payload here."""
    return set(map(type, v)) <= {int}


# --- messages ------------------------------------------------------------------------------

class Message:
    TAG: ClassVar[str] = ""
    KINDS: ClassVar[tuple[_Kind, ...]] = ()
    SECRET: ClassVar[frozenset[str]] = frozenset()   # fields redacted in repr

    def _fields_out(self) -> list:
        return [k.enc(getattr(self, f.name)) for k, f in zip(self.KINDS, fields(self))]

    @classmethod
    def _from_fields(cls, v: Any) -> "Message":
        names = [f.name for f in fields(cls)]
        if isinstance(v, dict):                      # map form: by name, unknown keys ignored
            try:
                v = [v[n] for n in names]
            except KeyError as e:
                raise DecodeError(f"missing field {e}") from None
        if not isinstance(v, list):
            raise DecodeError(f"invalid type: expected struct {cls.__name__}")
        if len(v) != len(names):
            raise DecodeError(f"invalid length {len(v)}, expected {len(names)} for "
                              f"{cls.__name__}")
        for x, kind in zip(v, cls.KINDS):
            if isinstance(kind, _ByteArray) and isinstance(x, list) and not _bytes_ok(x):
                raise DecodeError(f"invalid value in {kind.name}")
        return cls(*(kind.dec(x) for kind, x in zip(cls.KINDS, v)))

    def __repr__(self) -> str:
        parts = []
        for f in fields(self):
            val = getattr(self, f.name)
            if f.name in self.SECRET:
                shown = "<redacted>"
            elif isinstance(val, (bytes, bytearray)):
                shown = f"<{len(val)} bytes>"
            else:
                shown = repr(val)
            parts.append(f"{f.name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _msg(tag: str, *kinds: _Kind, secret: tuple[str, ...] = ()):
    def wrap(cls):
        cls = dataclass(cls, repr=False)
        cls.TAG, cls.KINDS, cls.SECRET = tag, kinds, frozenset(secret)
        assert len(fields(cls)) == len(kinds), cls
        return cls
    return wrap


# 0k-sync's ten variants, in declaration order (the integer variant index is this order).

@_msg("Hello", u8, string, b32, u64)
class Hello(Message):
    version: int
    device_name: str
    group_id: bytes
    last_cursor: int


@_msg("Welcome", u8, u64, u32)
class Welcome(Message):
    version: int
    max_cursor: int
    pending_count: int


@_msg("Push", blob_id, byte_vec, u32)
class Push(Message):
    blob_id: bytes
    payload: bytes
    ttl: int


@_msg("PushAck", blob_id, u64)
class PushAck(Message):
    blob_id: bytes
    cursor: int


@_msg("Pull", u64, u32)
class Pull(Message):
    after_cursor: int
    limit: int


@_msg("PullBlob", blob_id, u64, byte_vec, u64)
class PullBlob(Message):      # inner struct of PullResponse (no tag of its own on the wire)
    blob_id: bytes
    cursor: int
    payload: bytes
    timestamp: int


@_msg("PullResponse", _List(PullBlob), boolean, u64)
class PullResponse(Message):
    blobs: list
    has_more: bool
    max_cursor: int


@_msg("Notify", u64, u32)
class Notify(Message):
    latest_cursor: int
    count: int


@_msg("Bye", opt_string)
class Bye(Message):
    reason: str | None


@_msg("ContentRef", b32, b24, u64, u64, secret=("content_hash", "encryption_nonce"))
class ContentRef(Message):    # seed F-016: hash and nonce redacted in Debug output
    content_hash: bytes
    encryption_nonce: bytes
    content_size: int
    encrypted_size: int


@_msg("ContentAck", b32, secret=("content_hash",))
class ContentAck(Message):
    content_hash: bytes


# Extensions (not in 0k-sync): new tags, so a 0k-sync peer never sees them.

@_msg("Auth", u8)
class Auth(Message):          # first stream, client -> relay: start the identity challenge
    version: int


@_msg("AuthChallenge", b32)
class AuthChallenge(Message):  # relay -> client, same stream: 32 random bytes
    nonce: bytes


@_msg("AuthProof", b32, b64, secret=("signature",))
class AuthProof(Message):     # client -> relay: Ed25519 key and signature (engine/sync/identity)
    device_id: bytes
    signature: bytes


@_msg("Join", b32, b32, u64, b64, secret=("signature",))
class Join(Message):          # an admission signed by an existing member (identity.py)
    group_id: bytes
    admitter: bytes
    expires_at: int
    signature: bytes


@_msg("Done", string)
class Done(Message):          # relay -> client: the request named here took effect
    request: str


@_msg("Error", u32, string)
class Error(Message):         # seed 5.3; only to clients that ask (README "cursor-sync")
    code: int
    message: str


@_msg("Presence", boolean)
class Presence(Message):      # client heartbeat / online status
    online: bool


@_msg("PresenceEntry", b32, string, boolean, u64)
class PresenceEntry(Message):
    device_id: bytes
    device_name: str
    online: bool
    last_seen: int


@_msg("PresenceList", _List(PresenceEntry))
class PresenceList(Message):  # relay -> client: the group's devices
    devices: list


@_msg("Ack", u64)
class Ack(Message):           # "I hold every blob up to this cursor" (DELETE waits for all)
    cursor: int


@_msg("Delete", blob_id)
class Delete(Message):
    blob_id: bytes


@_msg("RevokeDevice", b32)
class RevokeDevice(Message):
    device_id: bytes


@_msg("DeviceRevoked", b32)
class DeviceRevoked(Message):
    device_id: bytes


@_msg("RegisterPush", string, string, secret=("token",))
class RegisterPush(Message):
    platform: str
    token: str


@_msg("UnregisterPush", string, string, secret=("token",))
class UnregisterPush(Message):
    platform: str
    token: str


ZEROK = (Hello, Welcome, Push, PushAck, Pull, PullResponse, Notify, Bye, ContentRef, ContentAck)
EXTENSIONS = (Auth, AuthChallenge, AuthProof, Join, Done, Error, Presence, PresenceList, Ack,
              Delete, RevokeDevice, DeviceRevoked, RegisterPush, UnregisterPush)
BY_TAG: dict[str, type[Message]] = {m.TAG: m for m in ZEROK + EXTENSIONS}
BY_INDEX: dict[int, type[Message]] = dict(enumerate(ZEROK))   # serde variant index


def encode(msg: Message) -> bytes:
    """`rmp_serde::to_vec` of the tagged enum: `[tag, fields...]`."""
    return msgpack.packb([msg.TAG, *msg._fields_out()], use_bin_type=True)


def decode(data: bytes) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=False)
    except Exception as exc:   # truncated, invalid UTF-8, trailing bytes, ...
        raise DecodeError(f"invalid msgpack: {type(exc).__name__}") from None
    return decode_unpacked(obj)


def decode_unpacked(obj: Any) -> Message:
    """`decode` of an already unpacked message (the spec's Envelope is told apart first)."""
    if isinstance(obj, dict):
        if "type" not in obj:
            raise DecodeError("missing field `type`")
        cls = _variant(obj["type"])
        return cls._from_fields(obj)
    if not isinstance(obj, list) or not obj:
        raise DecodeError("invalid type: expected an internally tagged enum")
    cls = _variant(obj[0])
    return cls._from_fields(obj[1:])


def _variant(tag: Any) -> type[Message]:
    if isinstance(tag, str):
        cls = BY_TAG.get(tag)
    elif isinstance(tag, int) and not isinstance(tag, bool):
        cls = BY_INDEX.get(tag)
    else:
        cls = None
    if cls is None or cls in (PullBlob, PresenceEntry):
        raise DecodeError("unknown variant")
    return cls
