"""The relay-visible outer layer of a PPP event: `GiftWrap`, MessagePack with integer keys.

Spec §3.x field table: 1 recipient, 2 ephemeral_pk, 3 nonce, 4 ciphertext, 5 created_at,
6 expires_at. This is all the relay ever parses of an event; the seal inside `ciphertext`
is opaque to it. `decode` accepts exactly these keys with exactly these types and sizes and
raises `GiftWrapError` with a short reason otherwise (no partial objects). Keys are integers
exactly: `1.0` or `true` in place of `1` is refused, as is a key given twice (`maps.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from .ids import event_id
from .maps import MapError, unpack_map

K_RECIPIENT, K_EPHEMERAL_PK, K_NONCE, K_CIPHERTEXT, K_CREATED_AT, K_EXPIRES_AT = range(1, 7)
_KEYS = frozenset(range(1, 7))
PUBKEY_LEN = 32
NONCE_LEN = 24
_U64 = (1 << 64) - 1


class GiftWrapError(ValueError):
    """The bytes or map are not a well-formed GiftWrap; `args[0]` is a short reason."""


@dataclass(frozen=True)
class GiftWrap:
    recipient: bytes
    ephemeral_pk: bytes
    nonce: bytes
    ciphertext: bytes
    created_at: int
    expires_at: int

    def __repr__(self) -> str:   # never print ciphertext
        return (f"GiftWrap(recipient={self.recipient[:4].hex()}…, "
                f"ciphertext={len(self.ciphertext)} B, expires_at={self.expires_at})")

    @property
    def event_id(self) -> bytes:
        return event_id(self.ephemeral_pk, self.nonce, self.ciphertext)

    def to_map(self) -> dict[int, object]:
        return {K_RECIPIENT: self.recipient, K_EPHEMERAL_PK: self.ephemeral_pk,
                K_NONCE: self.nonce, K_CIPHERTEXT: self.ciphertext,
                K_CREATED_AT: self.created_at, K_EXPIRES_AT: self.expires_at}

    def encode(self) -> bytes:
        return msgpack.packb(self.to_map(), use_bin_type=True)

    @classmethod
    def from_map(cls, m: object) -> "GiftWrap":
        if not isinstance(m, dict):
            raise GiftWrapError("event is not a map")
        # `type(k) is int`: a set of 1.0-6.0 or {True, 2, ...} compares equal to {1, ..., 6}
        if any(type(k) is not int for k in m) or set(m) != _KEYS:
            raise GiftWrapError("event must have exactly keys 1-6")
        rec, epk, nonce, ct = (m[K_RECIPIENT], m[K_EPHEMERAL_PK], m[K_NONCE], m[K_CIPHERTEXT])
        for name, v, n in (("recipient", rec, PUBKEY_LEN), ("ephemeral_pk", epk, PUBKEY_LEN),
                           ("nonce", nonce, NONCE_LEN)):
            if not isinstance(v, bytes) or len(v) != n:
                raise GiftWrapError(f"{name} must be {n} bytes")
        if not isinstance(ct, bytes) or not ct:
            raise GiftWrapError("ciphertext must be non-empty bytes")
        for name, v in (("created_at", m[K_CREATED_AT]), ("expires_at", m[K_EXPIRES_AT])):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= _U64:
                raise GiftWrapError(f"{name} must be a u64")
        return cls(rec, epk, nonce, ct, m[K_CREATED_AT], m[K_EXPIRES_AT])

    @classmethod
    def decode(cls, data: bytes) -> "GiftWrap":
        if not isinstance(data, bytes):
            raise GiftWrapError("event must be bytes")
        try:
            m = unpack_map(data, int)
        except MapError as e:
            raise GiftWrapError(e.args[0]) from e
        return cls.from_map(m)
