"""The three-layer Gift Wrap (spec §3): Rumor -> Seal -> GiftWrap, and back with the signature check.

    rumor   = {7 sender, 8 kind, 9 content, 5 created_at}                  (unsigned)
    seal    = {2 ephemeral_pk, 3 nonce, 4 ciphertext, 10 sender_sig}
              ciphertext = XChaCha20-Poly1305(rumor, nonce, kdf(X25519(e1, R), "ppp-seal-v1"))
              sender_sig = Ed25519-sign(ciphertext, sender)
    giftwrap= {1 recipient, 2 ephemeral_pk, 3 nonce, 4 ciphertext, 5 created_at, 6 expires_at}
              ciphertext = XChaCha20-Poly1305(pad(seal), nonce, kdf(X25519(e2, R), "ppp-wrap-v1"))

Choices where the spec is silent (also in the README):
- Integer keys from the §3.x table wherever the table has the field; fields it does not list
  (the PRESENCE content's event_id, message, region's latitude/longitude/radius_m, time_window,
  recipients) are keyed by their spec names as strings. Region's region_type is key 14.
  Maps are written in the struct's field order.
- `ephemeral_pk` fields carry the ephemeral *Ed25519* public key (as the spec's structs say);
  both sides convert it with crypto_sign_ed25519_pk_to_curve25519 before X25519.
- Padding (`padding.py`) is applied to the serialised Seal, right before the outer (wrap)
  encryption, so the relay sees a ciphertext of exactly bucket + 16 bytes.
- Randomness is drawn through one `randbytes(n)` callable in a fixed order: seal ephemeral
  seed (32), seal nonce (24), padding (bucket - len - 2), wrap ephemeral seed (32), wrap nonce
  (24). Test vectors inject a deterministic one; everything else uses the OS CSPRNG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable

import msgpack
import nacl.utils

from . import crypto, padding
from .giftwrap import GiftWrap, GiftWrapError
from .keys import Identity, KeyMaterialError, verify, x25519, x25519_public

# §3.x integer field keys (1-6 live in giftwrap.py).
K_RECIPIENT, K_EPHEMERAL_PK, K_NONCE, K_CIPHERTEXT, K_CREATED_AT, K_EXPIRES_AT = range(1, 7)
K_SENDER, K_KIND, K_CONTENT, K_SENDER_SIG = 7, 8, 9, 10
K_GROUP_ID, K_HOP_COUNT, K_MAX_HOPS, K_REGION_TYPE = 11, 12, 13, 14

RADIUS_MIN_M, RADIUS_MAX_M = 10, 50_000   # §4.4
_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class Kind(IntEnum):
    """Rumor kinds, appendix C.5."""
    PRESENCE = 0x01
    REVOKE = 0x02
    ACK = 0x03
    KEY_ROTATION = 0x04
    CONTACT_DISCOVERY = 0x05
    CARRY_GROUP_INVITE = 0x06
    CARRY_GROUP_ACCEPT = 0x07
    KEY_EXCHANGE_RETURN = 0x08
    GROUP_INVITE = 0x09


class WrapError(ValueError):
    """An event cannot be built, or an incoming one cannot be opened; args[0] says why."""


def _u(v: Any, name: str, top: int = _U64) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
        raise WrapError(f"{name} must be an unsigned integer")
    return v


def _b(v: Any, name: str, n: int | None = None) -> bytes:
    if not isinstance(v, bytes) or (n is not None and len(v) != n):
        raise WrapError(f"{name} must be {n if n is not None else 'some'} bytes")
    return v


def _f(v: Any, name: str) -> float:
    # float64 on the wire; an integral value some encoders write as an int is accepted too.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WrapError(f"{name} must be a number")
    return float(v)


def _exact_keys(m: Any, keys: set, name: str) -> dict:
    if not isinstance(m, dict) or set(m) != keys:
        raise WrapError(f"{name} must be a map with exactly keys {sorted(map(str, keys))}")
    return m


@dataclass(frozen=True)
class Region:
    """§4.4 circle region; the bounds are checked on construction and on decode."""
    latitude: float
    longitude: float
    radius_m: int
    region_type: int = 0

    def __post_init__(self):
        if self.region_type != 0:
            raise WrapError("only region_type 0 (circle) is known; the event is discarded")
        if not -90.0 <= self.latitude <= 90.0 or not -180.0 <= self.longitude <= 180.0:
            raise WrapError("latitude must be in [-90, 90] and longitude in [-180, 180]")
        if not RADIUS_MIN_M <= self.radius_m <= RADIUS_MAX_M:
            raise WrapError(f"radius_m must be in [{RADIUS_MIN_M}, {RADIUS_MAX_M}]")

    def to_map(self) -> dict:
        return {K_REGION_TYPE: self.region_type, "latitude": float(self.latitude),
                "longitude": float(self.longitude), "radius_m": self.radius_m}

    @classmethod
    def from_map(cls, m: Any) -> "Region":
        m = _exact_keys(m, {K_REGION_TYPE, "latitude", "longitude", "radius_m"}, "region")
        return cls(_f(m["latitude"], "latitude"), _f(m["longitude"], "longitude"),
                   _u(m["radius_m"], "radius_m", _U32), _u(m[K_REGION_TYPE], "region_type", 255))

    def contains(self, lat: float, lon: float) -> bool:
        """Receiver-side presence check (§4.4, haversine on a 6,371,008.8 m sphere)."""
        p1, p2 = math.radians(lat), math.radians(self.latitude)
        dp, dl = p2 - p1, math.radians(self.longitude - lon)
        a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
        return 2 * 6_371_008.8 * math.asin(min(1.0, math.sqrt(a))) <= self.radius_m


@dataclass(frozen=True)
class TimeWindow:
    starts_at: int
    ends_at: int
    timezone: str = "UTC"

    def to_map(self) -> dict:
        return {"starts_at": self.starts_at, "ends_at": self.ends_at, "timezone": self.timezone}

    @classmethod
    def from_map(cls, m: Any) -> "TimeWindow":
        m = _exact_keys(m, {"starts_at", "ends_at", "timezone"}, "time_window")
        if not isinstance(m["timezone"], str):
            raise WrapError("timezone must be a string")
        return cls(_u(m["starts_at"], "starts_at"), _u(m["ends_at"], "ends_at"), m["timezone"])


@dataclass(frozen=True)
class PresenceContent:
    """§4.3 PRESENCE payload."""
    event_id: bytes          # 16 bytes (a UUID)
    message: str
    region: Region
    time_window: TimeWindow
    recipients: tuple[bytes, ...] = field(default_factory=tuple)

    def to_map(self) -> dict:
        return {"event_id": _b(self.event_id, "event_id", 16), "message": self.message,
                "region": self.region.to_map(), "time_window": self.time_window.to_map(),
                "recipients": [_b(r, "recipient", 32) for r in self.recipients]}

    @classmethod
    def from_map(cls, m: Any) -> "PresenceContent":
        m = _exact_keys(m, {"event_id", "message", "region", "time_window", "recipients"},
                        "presence content")
        if not isinstance(m["message"], str):
            raise WrapError("message must be a string")
        if not isinstance(m["recipients"], list):
            raise WrapError("recipients must be a list")
        return cls(_b(m["event_id"], "event_id", 16), m["message"],
                   Region.from_map(m["region"]), TimeWindow.from_map(m["time_window"]),
                   tuple(_b(r, "recipient", 32) for r in m["recipients"]))


@dataclass(frozen=True)
class GroupInviteContent:
    """§4.3 GROUP_INVITE (0x09) payload: what a member needs to read and write a group (§7.6).
    Keyed by the spec's field names, like PresenceContent."""
    room_id: bytes           # 16 bytes
    room_key: bytes          # 32 bytes
    group_name: str

    def __repr__(self) -> str:   # never the key
        return f"GroupInviteContent({self.room_id.hex()}, key=<redacted>)"

    def to_map(self) -> dict:
        return {"room_id": _b(self.room_id, "room_id", 16),
                "room_key": _b(self.room_key, "room_key", 32), "group_name": self.group_name}

    @classmethod
    def from_map(cls, m: Any) -> "GroupInviteContent":
        m = _exact_keys(m, {"room_id", "room_key", "group_name"}, "group invite content")
        if not isinstance(m["group_name"], str):
            raise WrapError("group_name must be a string")
        return cls(_b(m["room_id"], "room_id", 16), _b(m["room_key"], "room_key", 32),
                   m["group_name"])


def _pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:   # msgpack raises several unrelated types
        raise WrapError(f"{what} is not one MessagePack object") from e


@dataclass(frozen=True)
class Rumor:
    """Layer 1: cleartext content, unsigned (deniability). `content` is a PresenceContent for
    PRESENCE; other kinds carry their decoded MessagePack value as is."""
    sender: bytes
    kind: int
    content: Any
    created_at: int

    def to_map(self) -> dict:
        content = self.content.to_map() if hasattr(self.content, "to_map") else self.content
        return {K_SENDER: _b(self.sender, "sender", 32), K_KIND: _u(self.kind, "kind", 255),
                K_CONTENT: content, K_CREATED_AT: _u(self.created_at, "created_at")}

    def encode(self) -> bytes:
        return _pack(self.to_map())

    @classmethod
    def decode(cls, data: bytes) -> "Rumor":
        m = _exact_keys(_unpack(data, "rumor"), {K_SENDER, K_KIND, K_CONTENT, K_CREATED_AT},
                        "rumor")
        kind = _u(m[K_KIND], "kind", 255)
        content = m[K_CONTENT]
        if kind == Kind.PRESENCE:
            content = PresenceContent.from_map(content)
        elif kind == Kind.GROUP_INVITE:
            content = GroupInviteContent.from_map(content)
        return cls(_b(m[K_SENDER], "sender", 32), kind, content,
                   _u(m[K_CREATED_AT], "created_at"))


@dataclass(frozen=True)
class Seal:
    """Layer 2: the rumor encrypted to the recipient under an ephemeral key, signed by the
    sender over the ciphertext."""
    ephemeral_pk: bytes
    nonce: bytes
    ciphertext: bytes
    sender_sig: bytes

    def __repr__(self) -> str:
        return f"Seal(ciphertext={len(self.ciphertext)} B)"

    def to_map(self) -> dict:
        return {K_EPHEMERAL_PK: self.ephemeral_pk, K_NONCE: self.nonce,
                K_CIPHERTEXT: self.ciphertext, K_SENDER_SIG: self.sender_sig}

    def encode(self) -> bytes:
        return _pack(self.to_map())

    @classmethod
    def decode(cls, data: bytes) -> "Seal":
        m = _exact_keys(_unpack(data, "seal"),
                        {K_EPHEMERAL_PK, K_NONCE, K_CIPHERTEXT, K_SENDER_SIG}, "seal")
        ct = _b(m[K_CIPHERTEXT], "ciphertext")
        if len(ct) < crypto.TAG_LEN:
            raise WrapError("seal ciphertext shorter than the tag")
        return cls(_b(m[K_EPHEMERAL_PK], "ephemeral_pk", 32), _b(m[K_NONCE], "nonce", 24),
                   ct, _b(m[K_SENDER_SIG], "sender_sig", 64))


Randbytes = Callable[[int], bytes]


def _draw(randbytes: Randbytes, n: int) -> bytes:
    out = randbytes(n)
    if len(out) != n:
        raise ValueError("randbytes returned the wrong length")
    return out


def _layer_key(ephemeral: Identity, recipient_pk: bytes, context: bytes) -> bytes:
    try:
        return crypto.kdf(x25519(ephemeral.x25519_sk, x25519_public(recipient_pk)), context)
    except KeyMaterialError as e:
        raise WrapError(f"recipient key unusable: {e}") from e


def seal(rumor: Rumor, sender: Identity, recipient_pk: bytes,
         randbytes: Randbytes = nacl.utils.random) -> Seal:
    if rumor.sender != sender.pubkey:
        raise WrapError("rumor.sender must be the signing identity's public key")
    eph = Identity.from_seed(_draw(randbytes, 32))
    key = _layer_key(eph, recipient_pk, crypto.CTX_SEAL)
    nonce = _draw(randbytes, crypto.NONCE_LEN)
    ct = crypto.encrypt(rumor.encode(), nonce, key)
    return Seal(eph.ed25519_pk, nonce, ct, sender.sign(ct))


def wrap(rumor: Rumor, sender: Identity, recipient_pk: bytes, *, created_at: int,
         expires_at: int, randbytes: Randbytes = nacl.utils.random,
         route_to: bytes | None = None) -> GiftWrap:
    """All three layers: the GiftWrap to STORE (or to submit sealed) for `recipient_pk`.
    `route_to`: the mailbox the relay files it under, when not the recipient's own key (a
    blinded mailbox, `blinded.py`); the layers are still encrypted to `recipient_pk`."""
    if len(recipient_pk) != 32:
        raise WrapError("recipient must be a 32-byte Ed25519 public key")
    s = seal(rumor, sender, recipient_pk, randbytes)
    try:
        padded = padding.pad(s.encode(), lambda n: _draw(randbytes, n))
    except padding.PaddingError as e:
        raise WrapError(str(e)) from e
    eph = Identity.from_seed(_draw(randbytes, 32))
    key = _layer_key(eph, recipient_pk, crypto.CTX_WRAP)
    nonce = _draw(randbytes, crypto.NONCE_LEN)
    if route_to is not None and len(route_to) != 32:
        raise WrapError("a mailbox id is 32 bytes")
    return GiftWrap(route_to or recipient_pk, eph.ed25519_pk, nonce,
                    crypto.encrypt(padded, nonce, key),
                    _u(created_at, "created_at"), _u(expires_at, "expires_at"))


@dataclass(frozen=True)
class Opened:
    rumor: Rumor
    seal: Seal
    giftwrap: GiftWrap

    @property
    def sender(self) -> bytes:
        return self.rumor.sender


def open_seal(s: Seal, me: Identity) -> Rumor:
    """Decrypt layer 2 and verify sender_sig against rumor.sender (§3 steps 4-7)."""
    try:
        key = crypto.kdf(me.dh(s.ephemeral_pk), crypto.CTX_SEAL)
        rumor = Rumor.decode(crypto.decrypt(s.ciphertext, s.nonce, key))
    except KeyMaterialError as e:
        raise WrapError(f"seal ephemeral key unusable: {e}") from e
    except crypto.DecryptError as e:
        raise WrapError("seal does not decrypt") from e
    if not verify(rumor.sender, s.ciphertext, s.sender_sig):
        raise WrapError("sender signature does not verify")
    return rumor


def unwrap(event: GiftWrap | bytes, me: Identity, *, mailbox: bytes | None = None) -> Opened:
    """Open a GiftWrap addressed to `me` (or routed to my blinded `mailbox`): layers 3 and
    2, unpad, signature check."""
    try:
        gw = event if isinstance(event, GiftWrap) else GiftWrap.decode(event)
    except GiftWrapError as e:
        raise WrapError(f"giftwrap: {e}") from e
    if gw.recipient != me.pubkey and (mailbox is None or gw.recipient != mailbox):
        raise WrapError("event is addressed to another recipient")
    try:
        key = crypto.kdf(me.dh(gw.ephemeral_pk), crypto.CTX_WRAP)
        padded = crypto.decrypt(gw.ciphertext, gw.nonce, key)
    except KeyMaterialError as e:
        raise WrapError(f"wrap ephemeral key unusable: {e}") from e
    except crypto.DecryptError as e:
        raise WrapError("giftwrap does not decrypt") from e
    try:
        s = Seal.decode(padding.unpad(padded))
    except padding.PaddingError as e:
        raise WrapError(f"padding: {e}") from e
    return Opened(open_seal(s, me), s, gw)
