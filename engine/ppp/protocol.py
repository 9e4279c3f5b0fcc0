"""PPP command codec: MessagePack maps with a `cmd` field (spec 004 §5.1, appendix C.1/C.4).

Pure: bytes in, a command object out (or `ProtocolError`); reply objects in, bytes out.
Field names and types are appendix C's. A command's map may carry fields we do not know
(forward compatibility: ignored); a field we need with the wrong type or size is an error,
and so is a map whose keys are not all strings or that names a key twice (`maps.py`).
Commands of C.1 this relay does not serve (none today) decode to
`Unsupported`, which the session answers with a stable reason (§7.7's "feature disabled"
convention); a `cmd` not in C.1 is an error. Room commands (§7) are decoded here; what they
do is `ingress/ppp_rooms.py`. Carry-group commands (§8) likewise, done by
`ingress/ppp_carry.py`; §8 names REGISTER_CARRY_GROUP and FETCH_CARRY, and this relay adds
LEAVE_CARRY_GROUP (§8's "signed leave") and ACK_CARRY (a courier's report of delivery).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from .carry import GROUP_ID_LEN as CARRY_GROUP_ID_LEN
from .carry import MAX_CARRY_COURIERS, MAX_CARRY_MEMBERS
from .limits import DELIVERY_TOKEN_LEN, EVENT_ID_LEN, PUBKEY_LEN, SIGNATURE_LEN
from .discovery import MAX_PUBLISH_HASHES, MAX_QUERY_HASHES
from .knocks import REQUEST_ID_LEN as KNOCK_REQUEST_ID_LEN
from .rooms import MEMBER_TOKEN_LEN, ROOM_ID_LEN, ROOM_NONCE_LEN, X25519_PK_LEN

MAX_GRANT_LEN = 256   # ADMIT's encrypted_grant: §7.4's is 88 bytes; room for other grants
from .maps import MapError
from .maps import unpack_map as _unpack_map

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


class ProtocolError(ValueError):
    """Not a well-formed command. `reason` is safe to send back; `cmd` is the command name
    when the map had a string `cmd` (so the right failure reply can be chosen)."""

    def __init__(self, reason: str, cmd: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.cmd = cmd


# --- commands (client -> relay) ------------------------------------------------------------

@dataclass(frozen=True)
class Auth:
    pubkey: bytes
    sig: bytes
    name = "AUTH"

    def __repr__(self) -> str:
        return "Auth()"


@dataclass(frozen=True)
class Store:
    event: bytes          # an encoded GiftWrap (C.1: `event: bytes`)
    name = "STORE"

    def __repr__(self) -> str:
        return f"Store({len(self.event)} B)"


@dataclass(frozen=True)
class Fetch:
    since: int
    cursor: int | None = None
    name = "FETCH"


@dataclass(frozen=True)
class Ack:
    event_ids: tuple[bytes, ...]
    name = "ACK"

    def __repr__(self) -> str:
        return f"Ack({len(self.event_ids)} ids)"


@dataclass(frozen=True)
class RegisterDeliveryToken:
    delivery_token: bytes
    name = "REGISTER_DELIVERY_TOKEN"

    def __repr__(self) -> str:   # a delivery token is a bearer credential
        return "RegisterDeliveryToken()"


@dataclass(frozen=True)
class DeregisterDeliveryToken:
    delivery_token: bytes
    name = "DEREGISTER_DELIVERY_TOKEN"

    def __repr__(self) -> str:
        return "DeregisterDeliveryToken()"


@dataclass(frozen=True)
class RegisterPush:
    platform: str
    token: str
    name = "REGISTER_PUSH"

    def __repr__(self) -> str:   # a push token addresses one device: never shown
        return f"RegisterPush({self.platform})"


@dataclass(frozen=True)
class StoreBackup:
    ciphertext: bytes
    name = "STORE_BACKUP"

    def __repr__(self) -> str:
        return f"StoreBackup({len(self.ciphertext)} B)"


@dataclass(frozen=True)
class FetchBackup:
    name = "FETCH_BACKUP"


@dataclass(frozen=True)
class DeleteBackup:
    name = "DELETE_BACKUP"


# --- rooms (§7, C.1) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class CreateRoom:
    """`name`, `description` and `description_public` (C.1) are read past: the relay shows
    them nowhere (RoomInfo has none), so it does not keep them."""
    room_id: bytes
    s2_cell_id: str
    s2_coarse_id: str
    gated: bool
    proximity_required: bool
    ble_enabled: bool
    max_members: int
    expires_at: int
    name = "CREATE_ROOM"

    def __repr__(self) -> str:   # no place
        return f"CreateRoom(max_members={self.max_members}, expires_at={self.expires_at})"


@dataclass(frozen=True)
class UpdateRoom:
    room_id: bytes
    gated: bool | None
    proximity_required: bool | None
    name = "UPDATE_ROOM"


@dataclass(frozen=True)
class DiscoverRooms:
    s2_cell_id: str
    name = "DISCOVER_ROOMS"

    def __repr__(self) -> str:
        return "DiscoverRooms()"


@dataclass(frozen=True)
class RegisterToken:
    room_id: bytes
    member_token: bytes
    admin_signature: bytes
    name = "REGISTER_TOKEN"

    def __repr__(self) -> str:   # a member token is a bearer credential
        return "RegisterToken()"


@dataclass(frozen=True)
class RevokeTokens:
    room_id: bytes
    name = "REVOKE_TOKENS"


@dataclass(frozen=True)
class RotateRoomKey:
    room_id: bytes
    grace_seconds: int
    name = "ROTATE_ROOM_KEY"


@dataclass(frozen=True)
class StoreRoom:
    """`member_token` is this relay's optional extension: a gated room takes STORE_ROOM from
    its admin, or from a caller naming a valid member token (C.1 has no token field)."""
    room_id: bytes
    nonce: bytes
    ciphertext: bytes
    member_token: bytes | None = None
    name = "STORE_ROOM"

    def __repr__(self) -> str:
        return f"StoreRoom({len(self.ciphertext)} B)"


@dataclass(frozen=True)
class FetchRoom:
    room_id: bytes
    since_id: int
    name = "FETCH_ROOM"


@dataclass(frozen=True)
class Knock:
    """`request_id` is C.1's (the client names its knock); a client following §7.4's prose
    sends none and the relay draws one."""
    room_id: bytes
    knocker_eph_x25519_pk: bytes
    request_id: bytes | None = None
    handle: str | None = None
    name = "KNOCK"

    def __repr__(self) -> str:
        return "Knock()"


@dataclass(frozen=True)
class Admit:
    room_id: bytes
    request_id: bytes
    encrypted_grant: bytes | None = None
    name = "ADMIT"

    def __repr__(self) -> str:
        return "Admit()"


@dataclass(frozen=True)
class CreateGroup:
    room_id: bytes
    gated: bool
    max_members: int
    name = "CREATE_GROUP"


@dataclass(frozen=True)
class DeleteGroup:
    room_id: bytes
    name = "DELETE_GROUP"


@dataclass(frozen=True)
class KickMember:
    room_id: bytes
    member_pubkey: bytes
    name = "KICK_MEMBER"

    def __repr__(self) -> str:
        return "KickMember()"


@dataclass(frozen=True)
class BanMember:
    room_id: bytes
    member_pubkey: bytes
    name = "BAN_MEMBER"

    def __repr__(self) -> str:
        return "BanMember()"


# --- contact discovery (§9; not in appendix C) --------------------------------------------------

@dataclass(frozen=True)
class DiscoveryPepper:
    """This relay's command for §9's "relay-provided, rotated" pepper (`discovery.py`)."""
    name = "DISCOVERY_PEPPER"


@dataclass(frozen=True)
class DiscoveryPublish:
    hashes: tuple[bytes, ...]
    pubkey: bytes
    pepper_id: int | None = None
    name = "DISCOVERY_PUBLISH"

    def __repr__(self) -> str:
        return f"DiscoveryPublish({len(self.hashes)} hashes)"


@dataclass(frozen=True)
class DiscoveryQuery:
    hashes: tuple[bytes, ...]
    pepper_id: int | None = None
    name = "DISCOVERY_QUERY"

    def __repr__(self) -> str:
        return f"DiscoveryQuery({len(self.hashes)} hashes)"


# --- carry groups (§8; signatures and rules in engine/ppp/carry.py) ---------------------------

@dataclass(frozen=True)
class RegisterCarryGroup:
    group_id: bytes
    members: tuple[bytes, ...]
    couriers: tuple[bytes, ...]
    sig: bytes
    name = "REGISTER_CARRY_GROUP"

    def __repr__(self) -> str:
        return f"RegisterCarryGroup({len(self.members)} members, {len(self.couriers)} couriers)"


@dataclass(frozen=True)
class LeaveCarryGroup:
    group_id: bytes
    sig: bytes
    name = "LEAVE_CARRY_GROUP"


@dataclass(frozen=True)
class FetchCarry:
    group_id: bytes
    since: int
    sig: bytes | None           # WebSocket: required (§8); HTTP: the Authorization header's
    cursor: int | None = None
    name = "FETCH_CARRY"


@dataclass(frozen=True)
class AckCarry:
    """A courier's report of events it handed over (its recipients' EVENT_ACKs): the relay
    stops offering them to couriers. Not in §8, which has no way back for a courier."""
    group_id: bytes
    event_ids: tuple[bytes, ...]
    name = "ACK_CARRY"


@dataclass(frozen=True)
class Unsupported:
    """A C.1 command this relay does not serve."""
    cmd: str

    @property
    def name(self) -> str:
        return self.cmd


RoomCommand = (CreateRoom | UpdateRoom | DiscoverRooms | RegisterToken | RevokeTokens
               | RotateRoomKey | StoreRoom | FetchRoom | Knock | Admit | CreateGroup
               | DeleteGroup | KickMember | BanMember)
DiscoveryCommand = DiscoveryPepper | DiscoveryPublish | DiscoveryQuery
CarryCommand = RegisterCarryGroup | LeaveCarryGroup | FetchCarry | AckCarry
Command = (Auth | Store | Fetch | Ack | RegisterDeliveryToken | DeregisterDeliveryToken
           | RegisterPush | StoreBackup | FetchBackup | DeleteBackup | RoomCommand | DiscoveryCommand
           | CarryCommand | Unsupported)

# C.1 commands not served here: none (KICK_MEMBER / BAN_MEMBER are decoded, and refused
# while `ppp.moderation` is off).
UNSUPPORTED: frozenset[str] = frozenset()
BACKUP_COMMANDS = frozenset({"STORE_BACKUP", "FETCH_BACKUP", "DELETE_BACKUP"})


def _bytes(m: dict, key: str, cmd: str, size: int | None = None, *, optional=False):
    v = m.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, bytes):
        raise ProtocolError(f"{key} must be bytes", cmd)
    if size is not None and len(v) != size:
        raise ProtocolError(f"{key} must be {size} bytes", cmd)
    return v


def _uint(m: dict, key: str, cmd: str, top: int = _U64, *, optional=False):
    v = m.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
        raise ProtocolError(f"{key} must be an unsigned integer", cmd)
    return v


def _bool(m: dict, key: str, cmd: str, *, optional=False):
    v = m.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, bool):
        raise ProtocolError(f"{key} must be a boolean", cmd)
    return v


def _str(m: dict, key: str, cmd: str, max_len: int = 64) -> str:
    v = m.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"{key} must be a string", cmd)
    return v


def _int64(m: dict, key: str, cmd: str) -> int:
    v = m.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not -(1 << 63) <= v < (1 << 63):
        raise ProtocolError(f"{key} must be an int64", cmd)
    return v


def _auth(m, c): return Auth(_bytes(m, "pubkey", c, PUBKEY_LEN), _bytes(m, "sig", c, SIGNATURE_LEN))
def _store(m, c): return Store(_bytes(m, "event", c))
def _fetch(m, c): return Fetch(_uint(m, "since", c), _uint(m, "cursor", c, optional=True))


def _ack(m, c):
    ids = m.get("event_ids")
    if not isinstance(ids, list) or not all(isinstance(i, bytes) for i in ids):
        raise ProtocolError("event_ids must be a list of bytes", c)
    if not all(len(i) == EVENT_ID_LEN for i in ids):   # §4.5: every event id is 32 bytes
        raise ProtocolError(f"event_ids must be {EVENT_ID_LEN} bytes each", c)
    return Ack(tuple(ids))


def _reg(m, c): return RegisterDeliveryToken(_bytes(m, "delivery_token", c, DELIVERY_TOKEN_LEN))
def _dereg(m, c): return DeregisterDeliveryToken(_bytes(m, "delivery_token", c, DELIVERY_TOKEN_LEN))
def _store_backup(m, c): return StoreBackup(_bytes(m, "ciphertext", c))
def _register_push(m, c): return RegisterPush(_str(m, "platform", c, 16), _str(m, "token", c, 4096))


def _room_id(m, c): return _bytes(m, "room_id", c, ROOM_ID_LEN)


def _create_room(m, c):
    return CreateRoom(_room_id(m, c), _str(m, "s2_cell_id", c), _str(m, "s2_coarse_id", c),
                      _bool(m, "gated", c), _bool(m, "proximity_required", c),
                      _bool(m, "ble_enabled", c), _uint(m, "max_members", c, _U32),
                      _uint(m, "expires_at", c))


def _update_room(m, c):
    return UpdateRoom(_room_id(m, c), _bool(m, "gated", c, optional=True),
                      _bool(m, "proximity_required", c, optional=True))


def _register_token(m, c):
    return RegisterToken(_room_id(m, c), _bytes(m, "member_token", c, MEMBER_TOKEN_LEN),
                         _bytes(m, "admin_signature", c, SIGNATURE_LEN))


def _store_room(m, c):
    return StoreRoom(_room_id(m, c), _bytes(m, "nonce", c, ROOM_NONCE_LEN),
                     _bytes(m, "ciphertext", c),
                     _bytes(m, "member_token", c, MEMBER_TOKEN_LEN, optional=True))


def _str_opt(m: dict, key: str, cmd: str, max_len: int = 64) -> str | None:
    return None if m.get(key) is None else _str(m, key, cmd, max_len)


def _knock(m, c):
    return Knock(_room_id(m, c), _bytes(m, "knocker_eph_x25519_pk", c, X25519_PK_LEN),
                 _bytes(m, "request_id", c, KNOCK_REQUEST_ID_LEN, optional=True),
                 _str_opt(m, "handle", c))


def _admit(m, c):
    grant = _bytes(m, "encrypted_grant", c, optional=True)
    if grant is not None and len(grant) > MAX_GRANT_LEN:
        raise ProtocolError("encrypted_grant too large", c)
    return Admit(_room_id(m, c), _bytes(m, "request_id", c, KNOCK_REQUEST_ID_LEN), grant)


def _hashes(m, c, top: int) -> tuple[bytes, ...]:
    hs = m.get("hashes")
    if not isinstance(hs, list) or not all(isinstance(h, bytes) and len(h) == 32 for h in hs):
        raise ProtocolError("hashes must be a list of 32-byte hashes", c)
    if len(hs) > top:
        raise ProtocolError(f"at most {top} hashes", c)
    return tuple(hs)


def _member(cls):
    return lambda m, c: cls(_room_id(m, c), _bytes(m, "member_pubkey", c, PUBKEY_LEN))


def _keys(m: dict, key: str, cmd: str, top: int) -> tuple[bytes, ...]:
    ks = m.get(key)
    if not isinstance(ks, list) or not all(isinstance(k, bytes) and len(k) == PUBKEY_LEN
                                           for k in ks):
        raise ProtocolError(f"{key} must be a list of {PUBKEY_LEN}-byte keys", cmd)
    if len(ks) > top:
        raise ProtocolError(f"at most {top} {key}", cmd)
    return tuple(ks)


def _group_id(m, c): return _bytes(m, "group_id", c, CARRY_GROUP_ID_LEN)


def _register_carry(m, c):
    return RegisterCarryGroup(_group_id(m, c), _keys(m, "members", c, MAX_CARRY_MEMBERS),
                              _keys(m, "couriers", c, MAX_CARRY_COURIERS),
                              _bytes(m, "sig", c, SIGNATURE_LEN))


def _fetch_carry(m, c):
    return FetchCarry(_group_id(m, c), _uint(m, "since", c), _bytes(m, "sig", c, SIGNATURE_LEN),
                      _uint(m, "cursor", c, optional=True))


def _ack_carry(m, c):
    return AckCarry(_group_id(m, c), _ack(m, c).event_ids)


_DECODERS = {
    "AUTH": _auth, "STORE": _store, "FETCH": _fetch, "ACK": _ack,
    "REGISTER_DELIVERY_TOKEN": _reg, "DEREGISTER_DELIVERY_TOKEN": _dereg,
    "REGISTER_PUSH": _register_push,
    "STORE_BACKUP": _store_backup, "FETCH_BACKUP": lambda m, c: FetchBackup(),
    "DELETE_BACKUP": lambda m, c: DeleteBackup(),
    "CREATE_ROOM": _create_room, "UPDATE_ROOM": _update_room,
    "DISCOVER_ROOMS": lambda m, c: DiscoverRooms(_str(m, "s2_cell_id", c)),
    "REGISTER_TOKEN": _register_token,
    "REVOKE_TOKENS": lambda m, c: RevokeTokens(_room_id(m, c)),
    "ROTATE_ROOM_KEY": lambda m, c: RotateRoomKey(_room_id(m, c),
                                                  _uint(m, "grace_seconds", c, _U32)),
    "STORE_ROOM": _store_room,
    "FETCH_ROOM": lambda m, c: FetchRoom(_room_id(m, c), _int64(m, "since_id", c)),
    "KNOCK": _knock, "ADMIT": _admit,
    "CREATE_GROUP": lambda m, c: CreateGroup(_room_id(m, c), _bool(m, "gated", c),
                                             _uint(m, "max_members", c, _U32)),
    "DELETE_GROUP": lambda m, c: DeleteGroup(_room_id(m, c)),
    "KICK_MEMBER": _member(KickMember), "BAN_MEMBER": _member(BanMember),
    "REGISTER_CARRY_GROUP": _register_carry,
    "LEAVE_CARRY_GROUP": lambda m, c: LeaveCarryGroup(_group_id(m, c),
                                                      _bytes(m, "sig", c, SIGNATURE_LEN)),
    "FETCH_CARRY": _fetch_carry, "ACK_CARRY": _ack_carry,
    "DISCOVERY_PEPPER": lambda m, c: DiscoveryPepper(),
    "DISCOVERY_PUBLISH": lambda m, c: DiscoveryPublish(
        _hashes(m, c, MAX_PUBLISH_HASHES), _bytes(m, "pubkey", c, PUBKEY_LEN),
        _uint(m, "pepper_id", c, optional=True)),
    "DISCOVERY_QUERY": lambda m, c: DiscoveryQuery(
        _hashes(m, c, MAX_QUERY_HASHES), _uint(m, "pepper_id", c, optional=True)),
}


def unpack_map(data: bytes) -> dict:
    """One MessagePack map with string keys, each once, nothing after it."""
    try:
        return _unpack_map(data, str)
    except MapError as e:
        raise ProtocolError(e.args[0]) from e


def decode_map(m: dict, implied: str | None = None) -> Command:
    """A command from its map. `implied`: the command an HTTP endpoint stands for (§5.2),
    used when the map has no `cmd` and required to match when it has one."""
    cmd = m.get("cmd", implied)
    if not isinstance(cmd, str):
        raise ProtocolError("cmd must be a string")
    if implied is not None and cmd != implied:
        raise ProtocolError(f"this endpoint takes {implied}", cmd)
    dec = _DECODERS.get(cmd)
    if dec is not None:
        return dec(m, cmd)
    if cmd in UNSUPPORTED:
        return Unsupported(cmd)
    raise ProtocolError("unknown command", cmd)


def decode_command(data: bytes) -> Command:
    return decode_map(unpack_map(data))


# --- sealed Note submission (C.6 SealedNoteSubmit) --------------------------------------------

@dataclass(frozen=True)
class SealedNoteSubmit:
    delivery_token: bytes
    ephemeral_pk: bytes
    nonce: bytes
    ciphertext: bytes
    created_at: int
    expires_at: int

    def __repr__(self) -> str:   # never the token, never the ciphertext
        return f"SealedNoteSubmit({len(self.ciphertext)} B, expires_at={self.expires_at})"


def decode_sealed_note(data: bytes) -> SealedNoteSubmit:
    m = unpack_map(data)
    c = "note/submit"
    return SealedNoteSubmit(
        _bytes(m, "delivery_token", c, DELIVERY_TOKEN_LEN), _bytes(m, "ephemeral_pk", c, 32),
        _bytes(m, "nonce", c, 24), _bytes(m, "ciphertext", c), _uint(m, "created_at", c),
        _uint(m, "expires_at", c))


# --- sealed room submission (C.6 SealedRoomSubmit) --------------------------------------------

@dataclass(frozen=True)
class SealedRoomSubmit:
    room_id: bytes
    member_token: bytes
    nonce: bytes
    ciphertext: bytes

    def __repr__(self) -> str:   # never the token, never the ciphertext
        return f"SealedRoomSubmit({len(self.ciphertext)} B)"


def decode_sealed_room(data: bytes) -> SealedRoomSubmit:
    m = unpack_map(data)
    c = "room/submit"
    return SealedRoomSubmit(_room_id(m, c), _bytes(m, "member_token", c, MEMBER_TOKEN_LEN),
                            _bytes(m, "nonce", c, ROOM_NONCE_LEN), _bytes(m, "ciphertext", c))


# --- replies (relay -> client, C.4) -----------------------------------------------------------

def _pack(cmd: str, **fields: Any) -> bytes:
    return msgpack.packb({"cmd": cmd, **fields}, use_bin_type=True)


@dataclass(frozen=True)
class Reply:
    """A reply map; `encode()` is the frame. Kept as data so HTTP and tests can read it."""
    cmd: str
    fields: dict = field(default_factory=dict)

    def encode(self) -> bytes:
        return _pack(self.cmd, **self.fields)

    @property
    def ok(self) -> bool:
        return not self.cmd.endswith("_FAIL")

    def __repr__(self) -> str:
        return f"Reply({self.cmd})"


def challenge(nonce: bytes) -> Reply: return Reply("CHALLENGE", {"nonce": nonce})
def auth_ok() -> Reply: return Reply("AUTH_OK")
def auth_fail(reason: str) -> Reply: return Reply("AUTH_FAIL", {"reason": reason})
def stored(event_id: bytes) -> Reply: return Reply("STORED", {"event_id": event_id})
def store_fail(reason: str) -> Reply: return Reply("STORE_FAIL", {"reason": reason})


def events(evts: list[bytes], cursor: int | None = None, cmd: str = "EVENTS") -> Reply:
    """EVENTS (FETCH) or CARRY_EVENTS (FETCH_CARRY): a page, and `cursor` if more remain."""
    fields: dict[str, Any] = {"events": list(evts)}
    if cursor is not None:
        fields["cursor"] = cursor
    return Reply(cmd, fields)


def acked(count: int) -> Reply: return Reply("ACKED", {"count": min(count, _U32)})


def carry_group_registered(group_id: bytes) -> Reply:
    return Reply("CARRY_GROUP_REGISTERED", {"group_id": group_id})


def carry_group_left(group_id: bytes) -> Reply:
    return Reply("CARRY_GROUP_LEFT", {"group_id": group_id})
def notify(count: int) -> Reply: return Reply("NOTIFY", {"count": min(count, _U32)})
def delivery_token_registered() -> Reply: return Reply("DELIVERY_TOKEN_REGISTERED")
def delivery_token_deregistered() -> Reply: return Reply("DELIVERY_TOKEN_DEREGISTERED")
def push_registered() -> Reply: return Reply("PUSH_REGISTERED")


def backup_stored(version: int, stored_at: int) -> Reply:
    return Reply("BACKUP_STORED", {"version": version, "stored_at": stored_at})


def backup(ciphertext: bytes, version: int, stored_at: int) -> Reply:
    return Reply("BACKUP", {"ciphertext": ciphertext, "version": version, "stored_at": stored_at})


def backup_empty() -> Reply: return Reply("BACKUP_EMPTY")
def backup_deleted() -> Reply: return Reply("BACKUP_DELETED")
def backup_fail(reason: str) -> Reply: return Reply("BACKUP_FAIL", {"reason": reason})


def room_created(room_id: bytes) -> Reply: return Reply("ROOM_CREATED", {"room_id": room_id})
def room_updated(room_id: bytes) -> Reply: return Reply("ROOM_UPDATED", {"room_id": room_id})
def rooms(infos: list[dict]) -> Reply: return Reply("ROOMS", {"rooms": list(infos)})
def token_registered() -> Reply: return Reply("TOKEN_REGISTERED")
def tokens_revoked(count: int) -> Reply:
    return Reply("TOKENS_REVOKED", {"count": min(count, _U32)})


def key_rotated(room_id: bytes, revoked_count: int, grace_until: int) -> Reply:
    return Reply("KEY_ROTATED", {"room_id": room_id, "revoked_count": min(revoked_count, _U32),
                                 "grace_until": grace_until})


def key_rotation_notify(room_id: bytes, grace_until: int) -> Reply:
    return Reply("KEY_ROTATION_NOTIFY", {"room_id": room_id, "grace_until": grace_until})


def room_stored(room_id: bytes, sequence_number: int) -> Reply:
    return Reply("ROOM_STORED", {"room_id": room_id, "sequence_number": sequence_number})


def room_messages(room_id: bytes, messages: list[dict]) -> Reply:
    """RoomMessageWire (§7.3): id (sequence number), nonce, ciphertext, stored_at."""
    return Reply("ROOM_MESSAGES", {"room_id": room_id, "messages": list(messages)})


def room_notify(room_id: bytes, count: int) -> Reply:
    return Reply("ROOM_NOTIFY", {"room_id": room_id, "count": min(count, _U32)})


def knock_ok(request_id: bytes) -> Reply: return Reply("KNOCK_OK", {"request_id": request_id})


def knock_notify(room_id: bytes, eph_pk: bytes, request_id: bytes, handle: str | None) -> Reply:
    fields = {"room_id": room_id, "knocker_eph_x25519_pk": eph_pk, "request_id": request_id}
    if handle is not None:
        fields["handle"] = handle
    return Reply("KNOCK_NOTIFY", fields)


def admit_ok(request_id: bytes, grant: bytes | None) -> Reply:
    fields: dict[str, Any] = {"request_id": request_id}
    if grant is not None:
        fields["encrypted_grant"] = grant
    return Reply("ADMIT_OK", fields)


def admitted(room_id: bytes, request_id: bytes, admin_pubkey: bytes,
             grant: bytes | None) -> Reply:
    fields: dict[str, Any] = {"room_id": room_id, "request_id": request_id,
                              "admin_pubkey": admin_pubkey}
    if grant is not None:
        fields["encrypted_grant"] = grant
    return Reply("ADMITTED", fields)


def group_created(room_id: bytes) -> Reply: return Reply("GROUP_CREATED", {"room_id": room_id})
def group_deleted(room_id: bytes) -> Reply: return Reply("GROUP_DELETED", {"room_id": room_id})


def member_kicked(room_id: bytes, member: bytes) -> Reply:
    return Reply("MEMBER_KICKED", {"room_id": room_id, "member_pubkey": member})


def member_banned(room_id: bytes, member: bytes) -> Reply:
    return Reply("MEMBER_BANNED", {"room_id": room_id, "member_pubkey": member})


def kicked(room_id: bytes) -> Reply: return Reply("KICKED", {"room_id": room_id})


def discovery_pepper(pepper: bytes, pepper_id: int, rotates_at: int) -> Reply:
    return Reply("DISCOVERY_PEPPER", {"pepper": pepper, "pepper_id": pepper_id,
                                      "rotates_at": rotates_at})


def discovery_published(count: int, pepper_id: int) -> Reply:
    return Reply("DISCOVERY_PUBLISHED", {"count": count, "pepper_id": pepper_id})


def discovery_matches(matches: list[tuple[bytes, bytes]]) -> Reply:
    """§9: matches: [{hash, pubkey}]."""
    return Reply("DISCOVERY_MATCHES", {"matches": [{"hash": h, "pubkey": pk}
                                                   for h, pk in matches]})


def failure(cmd: str | None, reason: str) -> Reply:
    """The failure reply of a command: C.4 has AUTH_FAIL and BACKUP_FAIL; every other command
    fails with STORE_FAIL (the spec's generic refusal, §7.7)."""
    if cmd == "AUTH":
        return auth_fail(reason)
    if cmd in BACKUP_COMMANDS:
        return backup_fail(reason)
    return store_fail(reason)


# --- HTTP polling authentication (§5.2) -------------------------------------------------------

AUTH_SCHEME = "PPP-Ed25519"
# §5.2 signs `request_body || timestamp` but names no header for the timestamp; this relay
# reads it from `X-PPP-Timestamp` as decimal unix seconds, signed as those ASCII digits.
TIMESTAMP_HEADER = "x-ppp-timestamp"


def http_signed_message(body: bytes, timestamp: str) -> bytes:
    return body + timestamp.encode("ascii")


def http_get_signed_body(target: bytes) -> bytes:
    """What a polling GET signs in place of its (empty) body: `GET <request-target>` (path
    and query exactly as sent). §5.2 signs body || timestamp, which for a GET is the
    timestamp alone: one captured signature would then read any other GET (another carry
    group's events, another cursor) for the whole window. Covering the target binds it to
    the one request the client made."""
    return b"GET " + target


def http_auth(authorization: str | None, timestamp: str | None, body: bytes, now: float,
              window: float) -> bytes | None:
    """The pubkey of a valid `Authorization: PPP-Ed25519 <pubkey_hex>:<sig_hex>` over
    body || timestamp with |now - timestamp| <= window, else None."""
    from nacl.exceptions import CryptoError
    from nacl.signing import VerifyKey
    # isascii: str.isdigit() is also true for "²" and other digits int() or ascii refuse.
    if (not authorization or not timestamp or not timestamp.isascii()
            or not timestamp.isdigit() or len(timestamp) > 20):
        return None
    if abs(now - int(timestamp)) > window:
        return None
    scheme, _, cred = authorization.partition(" ")
    if scheme != AUTH_SCHEME:
        return None
    pk_hex, _, sig_hex = cred.strip().partition(":")
    try:
        pk, sig = bytes.fromhex(pk_hex), bytes.fromhex(sig_hex)
    except ValueError:
        return None
    if len(pk) != PUBKEY_LEN or len(sig) != SIGNATURE_LEN:
        return None
    try:
        VerifyKey(pk).verify(http_signed_message(body, timestamp), sig)
    except (CryptoError, ValueError, TypeError):
        return None
    return pk
