"""PPP rooms as data: the fold of the `ppp_rooms` and `ppp_room_tokens` rows (spec 004 §7).

Pure, like `ppp_state.py` (which holds one `RoomState`): the owner (`ppp_control.py`) applies
each row it writes with the methods the loader replays, so memory and a rebuild agree.

* A `create` or `update` row is the room's whole record (`Room`). A `create` also starts the
  room's token history afresh: a room id reused after its room expired and was purged gets
  none of the old room's tokens.
* Tokens: `register` adds one (valid until revoked or rotated; registering again is a no-op,
  or, for a token a rotation marked, makes it valid again: the admin signed it anew);
  `revoke` drops all of the room's; `rotate` marks every unmarked token valid until
  `grace_until` (the grace period of §7.3: valid before it, refused from it on).
  "Members" (RoomInfo `member_count`, the `max_members` cap) are the unmarked tokens: during
  a grace period the members re-register tokens of the new key, which must fit.
* `delete` (DELETE_GROUP) removes the group, its tokens and bans at once: that one row is
  the delete's commit point (Delta has no multi-table transaction; one append is atomic),
  so a reader sees the whole group or none of it. The room's id is remembered in `deleted`
  until its messages have expired (MAX_EVENT_TTL_SECS), so compaction can purge them first.
* `ban` (BAN_MEMBER) adds a pubkey that may not knock, store or fetch; a revoke does not
  lift it (a ban outlives re-knocks), a new incarnation of the room id starts without.
* `member` remembers a pubkey as a member of a gated room: the admin ADMITted its knock, or
  it sent STORE_ROOM with a valid member token. Such a pubkey may send a spec-literal
  STORE_ROOM (C.1 gives it no token field) without one. `unmember` (KICK_MEMBER) forgets it;
  a revoke or a rotation forgets every one (members re-prove themselves under the new key).
* Discovery index: rooms (never groups) by fine cell id, sorted, and by coarse cell id, so a
  query is one range scan plus one lookup per level, which is `engine.ppp.rooms.matches`.
* `needed_at`: the rows compaction keeps: each live room's newest row and its token rows
  since its last create or revoke, and its bans; a deleted group its delete row for as
  long as it is in `deleted`. An expired room needs nothing, so compaction purges its
  record and tokens (§7.1 expiry); its messages expire with their inbox rows.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.ppp.limits import MAX_EVENT_TTL_SECS
from engine.ppp.rooms import MIN_DISCOVERY_LEVEL, TYPE_ROOM, Room, parse_cell

from .schema_ppp import (OP_BAN, OP_CREATE, OP_DELETE, OP_MEMBER, OP_REGISTER, OP_REVOKE,
                         OP_ROTATE, OP_UNMEMBER,
                         PPP_ROOM_TOKENS, PPP_ROOMS)


@dataclass
class _Tokens:
    valid_until: dict[bytes, int | None] = field(default_factory=dict)  # token -> µs or None
    rows: list[int] = field(default_factory=list)   # `at` of the rows the set rests on
    bans: dict[bytes, int] = field(default_factory=dict)   # pubkey -> `at` of its ban row
    known: dict[bytes, int] = field(default_factory=dict)  # member pubkey -> its row's `at`

    def members(self) -> int:
        return sum(1 for v in self.valid_until.values() if v is None)


@dataclass
class RoomState:
    rooms: dict[bytes, Room] = field(default_factory=dict)
    room_at: dict[bytes, int] = field(default_factory=dict)     # newest row of each room
    tokens: dict[bytes, _Tokens] = field(default_factory=dict)
    deleted: dict[bytes, int] = field(default_factory=dict)      # group id -> delete row's at
    _fine: list[tuple[int, bytes]] = field(default_factory=list)   # (fine cell id, room id)
    _coarse: dict[int, set[bytes]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"RoomState(rooms={len(self.rooms)})"

    # --- the fold --------------------------------------------------------------------------------
    def room_row(self, op: str, room: Room, at: int) -> None:
        self._unindex(room.room_id)
        if op == OP_DELETE:
            self.rooms.pop(room.room_id, None)
            self.room_at.pop(room.room_id, None)
            self.tokens.pop(room.room_id, None)
            self.deleted[room.room_id] = at
            return
        self.deleted.pop(room.room_id, None)
        if op == OP_CREATE:
            self.tokens[room.room_id] = _Tokens(rows=[])
        self.rooms[room.room_id] = room
        self.room_at[room.room_id] = at
        if room.room_type == TYPE_ROOM and room.fine is not None:
            fine, coarse = parse_cell(room.fine), parse_cell(room.coarse)
            bisect.insort(self._fine, (fine.id(), room.room_id))
            self._coarse.setdefault(coarse.id(), set()).add(room.room_id)

    def token_row(self, op: str, room_id: bytes, token: bytes | None,
                  grace_until: int | None, at: int) -> None:
        t = self.tokens.setdefault(room_id, _Tokens())
        if op == OP_BAN and token is not None:
            t.bans[token] = at
            return
        if op == OP_MEMBER and token is not None:
            t.known[token] = at
            return
        if op == OP_UNMEMBER:
            t.known.pop(token, None)
            return
        if op in (OP_REVOKE, OP_ROTATE):
            t.known.clear()
        if op == OP_REVOKE:
            t.valid_until.clear()
            t.rows = []
            return
        t.rows.append(at)
        if op == OP_REGISTER and token is not None:
            t.valid_until[token] = None
        elif op == OP_ROTATE:
            for k, v in t.valid_until.items():
                if v is None:
                    t.valid_until[k] = grace_until

    def _unindex(self, room_id: bytes) -> None:
        old = self.rooms.get(room_id)
        if old is None or old.fine is None:
            return
        fine, coarse = parse_cell(old.fine), parse_cell(old.coarse)
        i = bisect.bisect_left(self._fine, (fine.id(), room_id))
        if i < len(self._fine) and self._fine[i] == (fine.id(), room_id):
            del self._fine[i]
        mine = self._coarse.get(coarse.id())
        if mine is not None:
            mine.discard(room_id)
            if not mine:
                del self._coarse[coarse.id()]

    def forget(self, room_id: bytes) -> None:
        """Drop a room from memory (expired: `sweep`)."""
        self._unindex(room_id)
        self.rooms.pop(room_id, None)
        self.room_at.pop(room_id, None)
        self.tokens.pop(room_id, None)

    def sweep(self, before: float) -> list[bytes]:
        """Forget rooms that expired before `before`; returns their ids."""
        gone = [r for r, room in self.rooms.items() if room.expires_at <= before]
        for r in gone:
            self.forget(r)
        return gone

    # --- queries ---------------------------------------------------------------------------------
    def live(self, room_id: bytes, now: float) -> Room | None:
        room = self.rooms.get(room_id)
        return None if room is None or room.expired(now) else room

    def banned(self, room_id: bytes, pubkey: bytes) -> bool:
        t = self.tokens.get(room_id)
        return t is not None and pubkey in t.bans

    def known_member(self, room_id: bytes, pubkey: bytes) -> bool:
        t = self.tokens.get(room_id)
        return t is not None and pubkey in t.known

    def members(self, room_id: bytes) -> int:
        t = self.tokens.get(room_id)
        return 0 if t is None else t.members()

    def token_valid_until(self, room_id: bytes, token: bytes) -> int | None | bool:
        """False: not registered; None: valid without end; else valid before that (µs)."""
        t = self.tokens.get(room_id)
        if t is None or token not in t.valid_until:
            return False
        return t.valid_until[token]

    def token_valid(self, room_id: bytes, token: bytes, now_us: int) -> bool:
        v = self.token_valid_until(room_id, token)
        return v is None or (v is not False and now_us < v)

    def discover(self, query, now: float, limit: int) -> list[Room]:
        """Live rooms the cell `query` (an s2sphere.CellId) matches, newest first."""
        found: set[bytes] = set()
        lo = bisect.bisect_left(self._fine, (query.range_min().id(), b""))
        hi = bisect.bisect_right(self._fine, (query.range_max().id(), b"\xff" * 17))
        found.update(r for _, r in self._fine[lo:hi])
        for level in range(MIN_DISCOVERY_LEVEL, query.level() + 1):
            found.update(self._coarse.get(query.parent(level).id(), ()))
        # The two lookups are `engine.ppp.rooms.matches` itself: a fine cell id within the
        # query's range is a fine cell the query contains, and a coarse cell among the
        # query's ancestors (from level 8, the coarsest a room may announce) contains it.
        out = [self.rooms[r] for r in found if not self.rooms[r].expired(now)]
        out.sort(key=lambda room: (-room.created_at, room.room_id))
        return out[:limit]

    def needed_at(self, now: float) -> dict[str, set[int]]:
        live = [r for r, room in self.rooms.items() if not room.expired(now)]
        keep_deleted = now * 1_000_000 - MAX_EVENT_TTL_SECS * 1_000_000
        return {PPP_ROOMS.name: {self.room_at[r] for r in live}
                | {at for at in self.deleted.values() if at > keep_deleted},
                PPP_ROOM_TOKENS.name: {at for r in live if r in self.tokens
                                       for at in (*self.tokens[r].rows,
                                                  *self.tokens[r].bans.values(),
                                                  *self.tokens[r].known.values())}}
