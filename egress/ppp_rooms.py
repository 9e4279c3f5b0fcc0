"""What the PPP listener knows of room messages: per room the live messages in sequence
order, who is waiting for a message's sequence number, and the ROOM_NOTIFY fan-out.

Room messages are inbox rows of protocol `ppp_room` (mailbox = room id, envelope = nonce ||
ciphertext, meta = MessagePack stored_at; `engine/ppp/rooms.py`). The stream gives each its
per-room cursor, gap-free from 1: that cursor is the message's `sequence_number` / `id`
(§7.3). Fed like `ppp_inbox.PppInbox` by the listener's `InboxTail` (`add`).

* ROOM_STORED carries the sequence number, so it waits for the inbox commit that assigned
  it: `waiter(event_id)` is taken before the landing append and resolved by `add`.
* FETCH_ROOM: messages with id > since_id, unexpired, at most `limit`. Room messages are
  never acked (a room has no single recipient); they leave with their expiry (the room's,
  at most MAX_EVENT_TTL_SECS after they were stored), which compaction purges. Envelope
  bytes are held up to a budget (`EnvelopeCache`) and read back from the inbox past it.
* Subscribers (this relay's definition, §7.3 leaves it open): an authenticated WebSocket
  that created, fetched or stored to the room in its life, at most MAX_SUBSCRIPTIONS rooms
  per session. The relay cannot know a room's members by pubkey (member tokens are derived
  from per-room keys it cannot link), and it should not: subscribing is what a client does
  by reading the room. ROOM_NOTIFY(count) is batched per room on the same window as NOTIFY
  (`ppp.notify_window_ms`); KEY_ROTATION_NOTIFY goes out at once.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Protocol

import msgpack
import pyarrow as pa
import pyarrow.dataset as ds

from delta_tables.object_store import as_path
from delta_tables.schema import C
from engine.ppp.rooms import MAX_SUBSCRIPTIONS, ROOM_PROTOCOL

from .envelope_cache import EnvelopeCache
from .inbox_tail import read_protocol_rows
from .pending import PendingEnvelope
from .waiting import NotifyBatcher, Waiters

log = logging.getLogger("relay.ingress.ppp")


class Subscriber(Protocol):
    pubkey: bytes | None

    def room_notify(self, room_id: bytes, count: int) -> None: ...
    def key_rotation(self, room_id: bytes, grace_until: int) -> None: ...


@dataclass(frozen=True)
class RoomMessage:
    seq: int
    cursor: int          # the sequence number
    event_id: bytes
    stored_at: int       # unix seconds
    expires: float       # unix seconds

    def __repr__(self) -> str:
        return f"RoomMessage(id={self.cursor})"


class _Room:
    def __init__(self) -> None:
        self.cursors: list[int] = []
        self.messages: dict[int, RoomMessage] = {}
        self.max_cursor = 0


def _stored_at(meta: bytes | None, fallback: float) -> int:
    try:
        v = msgpack.unpackb(meta) if meta is not None else None
    except Exception:
        v = None
    return v if isinstance(v, int) and not isinstance(v, bool) else int(fallback)


class RoomInbox:   # an inbox_view.InboxView
    def __init__(self, inbox_path: Path, acks_path: Path, *, notify_window: float = 30.0,
                 cache_bytes: int = 64 << 20):
        self.inbox_path = as_path(inbox_path)
        self.acks_path = as_path(acks_path)
        self.envelopes = EnvelopeCache(inbox_path, ROOM_PROTOCOL, cache_bytes)
        self._rooms: dict[bytes, _Room] = {}
        self._ids: dict[bytes, int] = {}          # event id -> cursor (its room's)
        self._waiters = Waiters()
        self._subs: dict[bytes, set[Subscriber]] = {}        # room -> sessions
        self._subscribed: dict[Subscriber, set[bytes]] = {}  # session -> rooms
        self._notices = NotifyBatcher(notify_window, self._flush)
        self.messages_seen = 0
        self.notifies_sent = 0

    def __repr__(self) -> str:
        return f"RoomInbox(rooms={len(self._rooms)}, messages={len(self._ids)})"

    # --- what the stream committed -------------------------------------------------------------
    def _bootstrap_read(self):
        now = pa.scalar(datetime.now(timezone.utc), pa.timestamp("us", tz="UTC"))
        return read_protocol_rows(
            self.inbox_path, self.acks_path, ROOM_PROTOCOL,
            [C.MAILBOX, C.SEQ, C.CURSOR, C.EVENT_ID, C.ENVELOPE, C.META, C.RECEIVED_AT,
             C.EXPIRES_AT], ds.field(C.EXPIRES_AT) > now)

    async def bootstrap(self) -> int:
        version, t, _ = await asyncio.to_thread(self._bootstrap_read)
        self._rooms.clear()
        self._ids.clear()
        for m, seq, cur, eid, env, meta, recv, exp in zip(*(t.column(c).to_pylist() for c in (
                C.MAILBOX, C.SEQ, C.CURSOR, C.EVENT_ID, C.ENVELOPE, C.META, C.RECEIVED_AT,
                C.EXPIRES_AT))):
            if env is None:
                continue
            self._put(m, RoomMessage(seq, cur, eid, _stored_at(meta, recv.timestamp()),
                                     exp.timestamp()), env)
        log.info("ppp room view rebuilt", extra={"event": "ppp_rooms_bootstrap",
                                                 "version": version, "rows": t.num_rows})
        return version

    def _put(self, room_id: bytes, msg: RoomMessage, envelope: bytes) -> bool:
        room = self._rooms.setdefault(room_id, _Room())
        if msg.cursor <= room.max_cursor:
            return False   # known already (the tail rebuilt after losing its place)
        room.max_cursor = msg.cursor
        room.cursors.append(msg.cursor)
        room.messages[msg.cursor] = msg
        self._ids[msg.event_id] = msg.cursor
        self.envelopes.put(msg.seq, envelope)
        self._waiters.resolve(msg.event_id, msg.cursor)
        return True

    def add(self, protocol: str, mailbox: bytes, envelopes: Iterable[PendingEnvelope]) -> None:
        """New inbox rows of one room, in cursor order (InboxTail's hub interface)."""
        if protocol != ROOM_PROTOCOL:
            return
        fresh = 0
        for env in envelopes:
            exp = env.expires_at.timestamp() if env.expires_at is not None else float("inf")
            msg = RoomMessage(env.seq, env.cursor, env.event_id,
                              _stored_at(env.meta, exp), exp)
            if self._put(mailbox, msg, env.envelope):
                fresh += 1
                self.messages_seen += 1
        if fresh:
            self._queue_notify(mailbox, fresh)

    # --- sequence numbers ----------------------------------------------------------------------
    def sequence_of(self, event_id: bytes) -> int | None:
        return self._ids.get(event_id)

    def wait(self, event_id: bytes) -> asyncio.Future:
        """Resolved with the message's sequence number when its inbox row arrives. Take it
        before landing the message: the row may arrive before the append returns."""
        return self._waiters.wait(event_id, self._ids.get(event_id))

    def forget_waiter(self, event_id: bytes, fut: asyncio.Future) -> None:
        self._waiters.forget(event_id, fut)

    # --- FETCH_ROOM ----------------------------------------------------------------------------
    def fetch(self, room_id: bytes, since_id: int, limit: int, now: float) -> list[RoomMessage]:
        room = self._rooms.get(room_id)
        if room is None:
            return []
        out = []
        for c in room.cursors[bisect.bisect_right(room.cursors, since_id):]:
            msg = room.messages[c]
            if msg.expires > now:
                out.append(msg)
                if len(out) == limit:
                    break
        return out

    async def envelopes_of(self, msgs: list[RoomMessage]) -> list[bytes | None]:
        return await self.envelopes.get([m.seq for m in msgs])

    # --- subscribers -----------------------------------------------------------------------------
    def subscribe(self, room_id: bytes, session: Subscriber) -> None:
        mine = self._subscribed.setdefault(session, set())
        if room_id in mine or len(mine) >= MAX_SUBSCRIPTIONS:
            return
        mine.add(room_id)
        self._subs.setdefault(room_id, set()).add(session)

    def unsubscribe(self, session: Subscriber) -> None:
        """The session closed."""
        for room_id in self._subscribed.pop(session, ()):
            subs = self._subs.get(room_id)
            if subs is not None:
                subs.discard(session)
                if not subs:
                    del self._subs[room_id]

    def unsubscribe_pubkey(self, room_id: bytes, pubkey: bytes) -> None:
        """A kicked member's sessions stop hearing the room."""
        for s in self.subscribers(room_id):
            if getattr(s, "pubkey", None) == pubkey:
                self._subs[room_id].discard(s)
                self._subscribed.get(s, set()).discard(room_id)
        if not self._subs.get(room_id, True):
            del self._subs[room_id]

    def forget_room(self, room_id: bytes) -> None:
        """A deleted group: its messages leave memory, its subscribers hear no more."""
        for s in self._subs.pop(room_id, ()):
            self._subscribed.get(s, set()).discard(room_id)
        room = self._rooms.pop(room_id, None)
        if room is not None:
            for msg in room.messages.values():
                self._ids.pop(msg.event_id, None)
                self.envelopes.drop(msg.seq)
        self._notices.drop(room_id)

    def subscribers(self, room_id: bytes) -> set[Subscriber]:
        return set(self._subs.get(room_id, ()))

    def key_rotated(self, room_id: bytes, grace_until: int, caller: Subscriber | None) -> int:
        """KEY_ROTATION_NOTIFY to every subscriber but the admin's session that asked."""
        told = 0
        for s in self.subscribers(room_id):
            if s is not caller:
                s.key_rotation(room_id, grace_until)
                told += 1
        return told

    def _queue_notify(self, room_id: bytes, count: int) -> None:
        if room_id in self._subs:
            self._notices.add(room_id, count)

    def _flush(self, room_id: bytes, count: int) -> None:
        for s in self.subscribers(room_id):
            s.room_notify(room_id, count)
            self.notifies_sent += 1

    def cancel_timers(self) -> None:
        self._notices.cancel()
        self._waiters.cancel_all()

    def sweep(self, now: float, expired_rooms: Iterable[bytes] = ()) -> int:
        """Drop expired messages, and everything of rooms that expired (their subscribers
        hear nothing more). Returns how many messages were dropped."""
        dropped = 0
        for room_id in list(expired_rooms):
            for s in list(self._subs.pop(room_id, ())):
                self._subscribed.get(s, set()).discard(room_id)
        for room_id, room in list(self._rooms.items()):
            gone = [c for c in room.cursors if room.messages[c].expires <= now]
            if not gone:
                continue
            for c in gone:
                msg = room.messages.pop(c)
                self._ids.pop(msg.event_id, None)
                self.envelopes.drop(msg.seq)
            room.cursors = [c for c in room.cursors if c in room.messages]
            dropped += len(gone)
            if not room.cursors and room_id not in self._subs:
                # max_cursor is forgotten with it: the stream's cursors only grow, and a row
                # older than this is expired, so no late row is mistaken for a new one.
                del self._rooms[room_id]
        return dropped
