"""PPP rooms, pure (spec 004 §7, appendix C): S2 cells, discovery, room message ids and the
rules every room command checks. No I/O, no clock: `now` is passed in.

S2 cells are **tokens**. The spec types `s2_cell_id` / `s2_coarse_id` as `string` and never
says which string; an S2 cell id is a u64 and every S2 library (C++ `ToToken`, Go `ToToken`,
Java `toToken`, s2sphere `to_token`) names the string form of a cell its token: the id in
hex with trailing zeros dropped. A decimal id would also be a string, but the two cannot be
told apart ("1234" is both), so one had to be chosen: the token. Parsing is strict: 1-16 hex
digits, no trailing zero (the canonical form, so one cell has one spelling), a valid cell.
Upper-case hex is accepted and stored lower-case.

Discovery. A room is placed by its fine cell (the spot) and announces its coarse cell (the
area it wants to be found from), which must contain the fine cell. A DISCOVER_ROOMS query
cell Q matches a room when

    Q contains the room's fine cell        (the room lies inside the area asked about), or
    the room's coarse cell contains Q      (the asker is inside the area the room announced)

Both "same fine cell" and "same coarse cell" are cases of this (a cell contains itself). A
query or coarse cell coarser than `MIN_DISCOVERY_LEVEL` (level 8, cells ~40 km across) is
refused: a face-sized query would list every room on a sixth of the Earth, which is the
enumeration the budget of C.3 exists to prevent. At most `MAX_DISCOVERED` rooms are returned,
newest first.

Room messages are inbox rows of protocol `ppp_room`, mailbox = room id (16 bytes, so never a
pubkey mailbox); the envelope is nonce (24) || ciphertext and the event id is
BLAKE2b-256("ppp-room-event-id-v1" || room_id || nonce || ciphertext): the spec gives room
messages no id, and this one makes a retried STORE_ROOM (same nonce, same ciphertext) the
same message, answered with the sequence number it already has.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import s2sphere

from .limits import MAX_CIPHERTEXT_SIZE

ROOM_PROTOCOL = "ppp_room"
ROOM_ID_LEN = 16
MEMBER_TOKEN_LEN = 12
ROOM_NONCE_LEN = 24
X25519_PK_LEN = 32
MIN_MEMBERS, MAX_MEMBERS = 1, 100          # §7.1 CREATE_ROOM max_members: 1-100
MAX_GRACE_SECS = 600                       # §7.3 ROTATE_ROOM_KEY: clamped to [0, 600]
FETCH_ROOM_LIMIT = 100                     # §7.3 FETCH_ROOM: up to 100 messages
# §7.6: groups carry expires_at in the year 9999 (10000-01-01T00:00:00Z - 1 s).
GROUP_EXPIRES_AT = 253402300799
MIN_DISCOVERY_LEVEL = 8                    # this relay's choice (module docstring)
MAX_DISCOVERED = 100                       # this relay's choice: one ROOMS reply
# Rooms one WebSocket session hears ROOM_NOTIFY / KEY_ROTATION_NOTIFY for (its subscriptions).
MAX_SUBSCRIPTIONS = 100
ROOM_EVENT_DOMAIN = b"ppp-room-event-id-v1"
TYPE_ROOM = "room"
TYPE_GROUP = "group"

_TOKEN = re.compile(r"[0-9a-fA-F]{1,16}")


class CellError(ValueError):
    """Not an S2 cell token this relay accepts; `args[0]` is safe to send back."""


def parse_cell(token: object) -> s2sphere.CellId:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise CellError("s2 cell must be an S2 token (1-16 hex digits)")
    if token.endswith("0"):
        raise CellError("s2 cell token is not canonical (trailing zero)")
    cell = s2sphere.CellId(int(token.ljust(16, "0"), 16))
    if not cell.is_valid():
        raise CellError("s2 cell token names no cell")
    return cell


def cell_token(lat: float, lon: float, level: int) -> str:
    """The token of the level-`level` cell holding (lat, lon): what a client computes."""
    if not (-90 <= lat <= 90 and -180 <= lon <= 180 and 0 <= level <= 30):
        raise ValueError("latitude, longitude or level out of range")
    return s2sphere.CellId.from_lat_lng(
        s2sphere.LatLng.from_degrees(lat, lon)).parent(level).to_token()


def check_placement(fine: s2sphere.CellId, coarse: s2sphere.CellId) -> str | None:
    """CREATE_ROOM's cells: the refusal reason or None."""
    if coarse.level() < MIN_DISCOVERY_LEVEL:
        return f"s2 coarse cell coarser than level {MIN_DISCOVERY_LEVEL}"
    if coarse.level() >= fine.level() or not coarse.contains(fine):
        return "s2 coarse cell must contain the fine cell"
    return None


def matches(query: s2sphere.CellId, fine: s2sphere.CellId, coarse: s2sphere.CellId) -> bool:
    """The discovery rule of the module docstring."""
    return query.contains(fine) or coarse.contains(query)


def room_event_id(room_id: bytes, nonce: bytes, ciphertext: bytes) -> bytes:
    return hashlib.blake2b(ROOM_EVENT_DOMAIN + room_id + nonce + ciphertext,
                           digest_size=32).digest()


def room_envelope(nonce: bytes, ciphertext: bytes) -> bytes:
    return nonce + ciphertext


def split_envelope(envelope: bytes) -> tuple[bytes, bytes]:
    """(nonce, ciphertext) of a `ppp_room` inbox row."""
    return envelope[:ROOM_NONCE_LEN], envelope[ROOM_NONCE_LEN:]


def check_message(nonce: bytes, ciphertext: bytes) -> str | None:
    """STORE_ROOM / sealed submit sizes (C.2 MAX_CIPHERTEXT_SIZE)."""
    if len(nonce) != ROOM_NONCE_LEN:
        return f"nonce must be {ROOM_NONCE_LEN} bytes"
    if not ciphertext:
        return "empty ciphertext"
    if len(ciphertext) > MAX_CIPHERTEXT_SIZE:
        return "ciphertext too large"
    return None


def token_signed_message(member_token: bytes, room_id: bytes) -> bytes:
    """§7.3 REGISTER_TOKEN: the admin signs member_token || room_id."""
    return member_token + room_id


def clamp_grace(grace_seconds: int) -> int:
    return max(0, min(MAX_GRACE_SECS, grace_seconds))


@dataclass(frozen=True)
class Room:
    """A room or group as the relay may see it (§7.1 RoomInfo, plus its admin)."""
    room_id: bytes
    admin: bytes
    room_type: str
    fine: str | None             # S2 tokens; None for a group (never discoverable)
    coarse: str | None
    gated: bool
    proximity_required: bool
    ble_enabled: bool
    max_members: int
    created_at: int              # unix seconds
    expires_at: int              # unix seconds (a group: GROUP_EXPIRES_AT)

    def __repr__(self) -> str:   # no admin key, no place
        return f"Room({self.room_type}, expires_at={self.expires_at})"

    def expired(self, now: float) -> bool:
        return self.expires_at <= now

    def info(self, member_count: int) -> dict:
        """RoomInfoWire (§7.1: room_id, s2_cell_id, gated, proximity_required, ble_enabled,
        member_count, created_at, expires_at)."""
        return {"room_id": self.room_id, "s2_cell_id": self.fine, "gated": self.gated,
                "proximity_required": self.proximity_required,
                "ble_enabled": self.ble_enabled, "member_count": member_count,
                "created_at": self.created_at, "expires_at": self.expires_at}
