"""Knocks waiting for their room's admin (spec 004 §7.4), pure: `now` is passed in.

A knock lives KNOCK_TTL_SECS (120 s, C.2). It is held in the memory of the process that
serves PPP, not in a table: it is a live request between two people online at the same
time (the admin is told at once, over its WebSocket), and one that outlives a restart of
the relay would be answered after the knocker gave up. A knocker whose knock was lost
knocks again. Bounded: at most MAX_KNOCKS_PER_ROOM waiting per room (the oldest give way:
a flood of knocks cannot keep a room's newest knocker out), and each knocker's KNOCKs are
charged to its C.3 command budget by the session.

An admitted knock is kept, for the rest of its TTL, until the knocker has a session to
hear ADMITTED on (`admitted_for`), so a knocker that reconnects in time still gets its grant.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .limits import KNOCK_TTL_SECS

MAX_KNOCKS_PER_ROOM = 100
REQUEST_ID_LEN = 16


@dataclass(frozen=True)
class Knock:
    room_id: bytes
    request_id: bytes
    knocker: bytes            # the knocker's authenticated Ed25519 pubkey
    eph_pk: bytes             # knocker_eph_x25519_pk: what the grant is encrypted to
    handle: str | None
    at: float                 # unix seconds

    def __repr__(self) -> str:   # no keys, no handle
        return f"Knock(at={self.at:.0f})"

    def live(self, now: float) -> bool:
        return now < self.at + KNOCK_TTL_SECS


@dataclass(frozen=True)
class Admission:
    knock: Knock
    admin: bytes
    grant: bytes | None


class KnockBook:
    def __init__(self) -> None:
        self._rooms: dict[bytes, OrderedDict[bytes, Knock]] = {}
        self._admitted: dict[bytes, list[Admission]] = {}   # knocker -> not yet told

    def __repr__(self) -> str:
        return f"KnockBook(rooms={len(self._rooms)})"

    def add(self, knock: Knock) -> bool:
        """False if the room already has a live knock with this request id."""
        room = self._rooms.setdefault(knock.room_id, OrderedDict())
        old = room.get(knock.request_id)
        if old is not None and old.live(knock.at):
            return False
        room[knock.request_id] = knock
        while len(room) > MAX_KNOCKS_PER_ROOM:
            room.popitem(last=False)
        return True

    def take(self, room_id: bytes, request_id: bytes, now: float) -> Knock | None:
        """The live knock, removed (ADMIT answers it once)."""
        room = self._rooms.get(room_id)
        knock = None if room is None else room.pop(request_id, None)
        if room is not None and not room:
            del self._rooms[room_id]
        return knock if knock is not None and knock.live(now) else None

    def admitted(self, adm: Admission) -> None:
        self._admitted.setdefault(adm.knock.knocker, []).append(adm)

    def admitted_for(self, knocker: bytes, now: float) -> list[Admission]:
        """Admissions the knocker has not heard yet (removed), live ones only."""
        return [a for a in self._admitted.pop(knocker, ()) if a.knock.live(now)]

    def drop_knocker(self, room_id: bytes, knocker: bytes) -> None:
        """A kicked or banned member's waiting knocks on the room."""
        room = self._rooms.get(room_id)
        if room is None:
            return
        for rid in [r for r, k in room.items() if k.knocker == knocker]:
            del room[rid]
        if not room:
            del self._rooms[room_id]

    def drop_room(self, room_id: bytes) -> None:
        self._rooms.pop(room_id, None)

    def sweep(self, now: float) -> int:
        dropped = 0
        for room_id in list(self._rooms):
            room = self._rooms[room_id]
            for rid in [r for r, k in room.items() if not k.live(now)]:
                del room[rid]
                dropped += 1
            if not room:
                del self._rooms[room_id]
        for knocker in list(self._admitted):
            live = [a for a in self._admitted[knocker] if a.knock.live(now)]
            if live:
                self._admitted[knocker] = live
            else:
                del self._admitted[knocker]
        return dropped

    def waiting(self, room_id: bytes) -> int:
        return len(self._rooms.get(room_id, ()))
