"""What the PPP listener knows of the inbox: per recipient the unacked events in cursor
order, the event ids the relay already holds (the synchronous duplicate check of STORE), and
the batched NOTIFY fan-out to connected sessions.

Fed like the Heya view by `egress.inbox_tail.InboxTail(protocols={"ppp"})` (`add` gets the
stream's new inbox rows, per mailbox in cursor order).

* `bootstrap` reads the protocol's inbox rows once: every unexpired event id (tombstones too:
  an acked, purged event is still a duplicate until it expires) and the unacked envelopes.
* The duplicate check is this index plus the ids this process landed (`remember`) and those
  being landed right now. Across ingress nodes it is not synchronous: two nodes racing the
  same event both answer STORED and the stream keeps one (the other goes to `rejects`).
* Memory: per unacked, unexpired event its metadata (cursor, both ids, created_at, expiry),
  plus one id per unexpired event; `sweep` drops expired entries. Envelope bytes are held up
  to `ppp.cache_bytes` (`egress.envelope_cache`); FETCH reads the rest back from the inbox,
  so an offline recipient's backlog costs disk, not RAM (bootstrap still reads the live
  envelopes once, to learn each GiftWrap's id).
* NOTIFY (§5.1) is batched per recipient (§8 "batch windows"): the first new event starts a
  `window` timer, later ones add to the count, and when it fires every connected session of
  the recipient gets one NOTIFY(count). No session connected: nothing is queued (the client
  FETCHes after AUTH anyway).
* Early events (issue 20): an event this process just landed for a recipient with a session
  open here is added at once (`land_early`), NOTIFY'd and served by FETCH before the stream
  has given it a cursor, instead of a micro-batch later. The stream stays the authority: when
  the event's inbox row arrives (`add`) it takes the early entry's place without a second
  NOTIFY, so a session never sees it twice; an ACK of an early event is kept and its ack row
  written when the row (and so its seq) arrives (`on_deferred_acks`). Early events sort after
  the inbox's in FETCH; a page that ends among them continues at `EARLY_BASE + n`, their
  landing order. They cost memory only until their row arrives, and at most
  `early_max_bytes`; without room, or in a process the recipient is not connected to, the
  event waits for the stream as before.
* Early events from other hosts (runtime/peer_link.py): the PPP process that landed an event
  hands it over the peer channel to the hosts where its recipient has a session, which add it
  the same way (`land_handed`), unless its inbox row has arrived here already (its id is
  known): a late hand-off is dropped, so the event is served by its row alone.
* ACK ids: a fetched event can be acked by its stored id or by the authenticated-path id of
  its GiftWrap (`event_id(ephemeral_pk, nonce, ciphertext)`): a sealed note is stored under
  the sealed-path id, which the recipient cannot compute (it does not know which of its
  delivery tokens was used), while the GiftWrap it fetched gives it the other one.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Protocol

import pyarrow as pa
import pyarrow.dataset as ds

from delta_tables.object_store import as_path
from delta_tables.schema import C
from .envelope_cache import EnvelopeCache
from .inbox_tail import read_protocol_rows
from .inbox_view import Sessions
from .pending import PendingEnvelope
from .waiting import NotifyBatcher
from engine.ppp.giftwrap import GiftWrap, GiftWrapError
from engine.ppp.ids import PROTOCOL

log = logging.getLogger("relay.ingress.ppp")


class Session(Protocol):
    def notify(self, count: int) -> None: ...


@dataclass(frozen=True)
class PppEvent:
    seq: int
    cursor: int
    event_id: bytes        # as stored (the inbox / acks key)
    wrap_id: bytes         # authenticated-path id of the GiftWrap
    size: int              # envelope bytes (held in `PppInbox.envelopes` or on disk)
    created_at: int
    expires: float         # unix seconds
    early_no: int | None = None   # its landing order, if it was served early (see module)

    def __repr__(self) -> str:
        return f"PppEvent(cursor={self.cursor}, size={self.size})"


# FETCH continuation cursors at or above this name a place among the early events.
EARLY_BASE = 1 << 53
EARLY_MAX_BYTES = 32 << 20
EARLY_MAX_AGE_SECONDS = 600.0   # a row this late means the stream is down: stop holding it


@dataclass
class EarlyEvent:
    """Landed by this process, not yet in the inbox (module docstring)."""
    no: int
    event_id: bytes
    wrap_id: bytes
    envelope: bytes
    created_at: int
    expires: float
    landed: float          # monotonic seconds

    def __repr__(self) -> str:
        return f"EarlyEvent(no={self.no}, size={len(self.envelope)})"


def _unix(t: datetime | None) -> float:
    return float("inf") if t is None else t.timestamp()


def _index(index: dict, ev: PppEvent | EarlyEvent, member) -> None:
    """File `member` under both of the event's ids (stored and GiftWrap)."""
    for i in (ev.event_id, ev.wrap_id):
        index.setdefault(i, set()).add(member)


def _unindex(index: dict, ev: PppEvent | EarlyEvent, member) -> None:
    for i in (ev.event_id, ev.wrap_id):
        mine = index.get(i)
        if mine is not None:
            mine.discard(member)
            if not mine:
                del index[i]


class _Box:
    def __init__(self) -> None:
        self.cursors: list[int] = []
        self.events: dict[int, PppEvent] = {}
        self.ids: dict[bytes, set[int]] = {}   # either id -> cursors (a sealed re-send
        # with a new created_at is a new event with the same GiftWrap id)
        self.max_cursor = 0
        self.early: dict[bytes, EarlyEvent] = {}        # stored id -> event, landing order
        self.early_ids: dict[bytes, set[bytes]] = {}    # either id -> stored ids
        self.early_acked: dict[bytes, EarlyEvent] = {}  # acked before their row arrived
        self.next_no = 0

    def put_early(self, e: EarlyEvent) -> None:
        self.early[e.event_id] = e
        _index(self.early_ids, e, e.event_id)

    def drop_early(self, event_id: bytes) -> EarlyEvent | None:
        e = self.early.pop(event_id, None)
        if e is not None:
            _unindex(self.early_ids, e, event_id)
        return e

    def put(self, ev: PppEvent) -> None:
        bisect.insort(self.cursors, ev.cursor)
        self.events[ev.cursor] = ev
        _index(self.ids, ev, ev.cursor)

    def drop(self, cursor: int) -> PppEvent | None:
        ev = self.events.pop(cursor, None)
        if ev is None:
            return None
        i = bisect.bisect_left(self.cursors, cursor)
        if i < len(self.cursors) and self.cursors[i] == cursor:
            del self.cursors[i]
        _unindex(self.ids, ev, cursor)
        return ev


class PppInbox:   # an inbox_view.InboxView
    def __init__(self, inbox_path: Path, acks_path: Path, *, notify_window: float = 30.0,
                 cache_bytes: int = 256 << 20, early_max_bytes: int = EARLY_MAX_BYTES,
                 remember: Callable[[bytes], bool] | None = None):
        """`remember(pubkey)`: whether its departure is kept for the push job (`Sessions`)."""
        self.inbox_path = as_path(inbox_path)
        self.acks_path = as_path(acks_path)
        self.envelopes = EnvelopeCache(inbox_path, PROTOCOL, cache_bytes)
        self._notices = NotifyBatcher(notify_window, self._flush_notify)
        self.known: dict[bytes, float] = {}     # event id -> expiry (unix s)
        self._boxes: dict[bytes, _Box] = {}
        self.sessions: Sessions[Session] = Sessions(remember)     # by recipient pubkey
        self.events_seen = 0
        self.notifies_sent = 0
        self.early_max_bytes = early_max_bytes
        self.early_bytes = 0
        self.early_landed = 0     # events served before their inbox row
        # Called with (recipient, events) when the inbox rows of events acked early arrive:
        # their ack rows can be written now that their seq is known (PppService sets it).
        self.on_deferred_acks: Callable[[bytes, list[PppEvent]], None] | None = None

    def __repr__(self) -> str:
        return f"PppInbox(recipients={len(self._boxes)}, known_ids={len(self.known)})"

    # --- sessions ------------------------------------------------------------------------------
    def register(self, pubkey: bytes, session: Session) -> None:
        self.sessions.register(pubkey, session)

    def unregister(self, pubkey: bytes, session: Session) -> None:
        self.sessions.unregister(pubkey, session)

    # --- duplicates ----------------------------------------------------------------------------
    def is_known(self, event_id: bytes) -> bool:
        return event_id in self.known

    def remember(self, event_id: bytes, expires: float) -> None:
        self.known[event_id] = expires

    # --- what the stream committed -------------------------------------------------------------
    def _bootstrap_read(self) -> tuple[int, pa.Table, pa.Array]:
        now = pa.scalar(datetime.now(timezone.utc), pa.timestamp("us", tz="UTC"))
        return read_protocol_rows(
            self.inbox_path, self.acks_path, PROTOCOL,
            [C.MAILBOX, C.SEQ, C.CURSOR, C.EVENT_ID, C.ENVELOPE, C.EXPIRES_AT],
            ds.field(C.EXPIRES_AT) > now)

    async def bootstrap(self) -> int:
        """Rebuild from the inbox; returns the version read (the tail goes on from there)."""
        version, t, acked = await asyncio.to_thread(self._bootstrap_read)
        acked_set = set(acked.to_pylist())
        self.known.clear()
        self._boxes.clear()
        self.early_bytes = 0
        pending = 0
        for m, seq, cur, eid, env, exp in zip(*(t.column(c).to_pylist() for c in (
                C.MAILBOX, C.SEQ, C.CURSOR, C.EVENT_ID, C.ENVELOPE, C.EXPIRES_AT))):
            self.known[eid] = _unix(exp)
            box = self._boxes.setdefault(m, _Box())
            box.max_cursor = max(box.max_cursor, cur)
            if env is not None and seq not in acked_set:
                ev = self._event(seq, cur, eid, env, exp)
                if ev is not None:
                    box.put(ev)
                    self.envelopes.put(seq, env)
                    pending += 1
        log.info("ppp inbox view rebuilt", extra={"event": "ppp_inbox_bootstrap",
                                                  "version": version, "rows": t.num_rows,
                                                  "pending": pending})
        return version

    @staticmethod
    def _event(seq, cursor, eid, envelope, expires_at) -> PppEvent | None:
        try:
            gw = GiftWrap.decode(envelope)
        except GiftWrapError:
            return None   # never landed by this relay; not servable as a GiftWrap
        return PppEvent(seq, cursor, eid, gw.event_id, len(envelope), gw.created_at,
                        _unix(expires_at))

    def add(self, protocol: str, mailbox: bytes, envelopes: Iterable[PendingEnvelope]) -> None:
        """New inbox rows of one recipient, in cursor order (InboxTail's hub interface)."""
        if protocol != PROTOCOL:
            return
        box = self._boxes.setdefault(mailbox, _Box())
        fresh = 0
        deferred: list[PppEvent] = []
        for env in envelopes:
            if env.cursor <= box.max_cursor:
                continue   # known already (the tail rebuilt after losing its place)
            box.max_cursor = env.cursor
            self.known[env.event_id] = _unix(env.expires_at)
            ev = self._event(env.seq, env.cursor, env.event_id, env.envelope, env.expires_at)
            if ev is None:
                continue
            early = box.drop_early(env.event_id)
            acked = box.early_acked.pop(env.event_id, None)
            served = early or acked
            if served is not None:
                self.early_bytes -= len(served.envelope)
                ev = dataclasses.replace(ev, early_no=served.no)
            self.events_seen += 1
            if acked is not None:
                deferred.append(ev)      # acked already: its ack row can be written now
                continue
            box.put(ev)
            self.envelopes.put(env.seq, env.envelope)
            if early is None:
                fresh += 1               # an early event was NOTIFY'd when it landed
        if fresh:
            self._queue_notify(mailbox, fresh)
        if deferred and self.on_deferred_acks is not None:
            self.on_deferred_acks(mailbox, deferred)

    def land_early(self, recipient: bytes, event_id: bytes, wrap_id: bytes, envelope: bytes,
                   created_at: int, expires: float) -> bool:
        """Serve an event this process just committed to landing before its inbox row (see
        the module); False when the recipient has no session here or there is no room."""
        if recipient not in self.sessions or \
                self.early_bytes + len(envelope) > self.early_max_bytes:
            return False
        box = self._boxes.setdefault(recipient, _Box())
        if event_id in box.early or event_id in box.early_acked or event_id in box.ids:
            return False
        box.next_no += 1
        box.put_early(EarlyEvent(box.next_no, event_id, wrap_id, envelope, created_at,
                                 expires, time.monotonic()))
        self.early_bytes += len(envelope)
        self.early_landed += 1
        self._queue_notify(recipient, 1)
        return True

    def land_handed(self, recipient: bytes, event_id: bytes, envelope: bytes,
                    expires: float) -> bool:
        """An event another host just landed (the peer channel): early, as `land_early`,
        unless its row came first; False when it is not served early."""
        if event_id in self.known:
            return False
        try:
            gw = GiftWrap.decode(envelope)
        except GiftWrapError:
            return False
        if gw.recipient != recipient:
            return False
        return self.land_early(recipient, event_id, gw.event_id, envelope, gw.created_at,
                               expires)

    # --- NOTIFY batching -----------------------------------------------------------------------
    def _queue_notify(self, pubkey: bytes, count: int) -> None:
        if pubkey in self.sessions:
            self._notices.add(pubkey, count)

    def _flush_notify(self, pubkey: bytes, count: int) -> None:
        for s in self.sessions.of(pubkey):
            s.notify(count)
            self.notifies_sent += 1

    def cancel_timers(self) -> None:
        self._notices.cancel()

    # --- FETCH / ACK ---------------------------------------------------------------------------
    def fetch(self, pubkey: bytes, since: int, after: int | None, limit: int,
              now: float) -> tuple[list[PppEvent | EarlyEvent], int | None]:
        """Unacked, unexpired events of `pubkey` with created_at > since, after the place
        `after` names, at most `limit`: the inbox's in cursor order, then the early ones in
        landing order; and the place to continue from if more remain."""
        box = self._boxes.get(pubkey)
        if box is None:
            return [], None
        if after is not None and after >= EARLY_BASE:
            # Continuing among the early events: those landed after the place, whether their
            # inbox row has arrived since (then they are in `events`) or not.
            k = after - EARLY_BASE
            later: list[PppEvent | EarlyEvent] = [
                ev for ev in box.events.values() if ev.early_no is not None and ev.early_no > k]
            later += [e for e in box.early.values() if e.no > k]
            later.sort(key=lambda e: e.no if isinstance(e, EarlyEvent) else e.early_no)
            candidates: Iterable[PppEvent | EarlyEvent] = later
        else:
            i = 0 if after is None else bisect.bisect_right(box.cursors, after)
            candidates = itertools.chain((box.events[c] for c in box.cursors[i:]),
                                         list(box.early.values()))
        out: list[PppEvent | EarlyEvent] = []
        for ev in candidates:
            if ev.expires <= now or ev.created_at <= since:
                continue
            if len(out) == limit:
                return out, self._place(out[-1])
            out.append(ev)
        return out, None

    def inbox_events(self, pubkey: bytes, since: int, now: float) -> list[PppEvent]:
        """Unacked, unexpired events of `pubkey` with an inbox row and created_at > since, in
        cursor order: what a courier may carry (early ones are left to the recipient's own
        session: the inbox is the authority a courier is served from)."""
        box = self._boxes.get(pubkey)
        if box is None:
            return []
        return [ev for ev in (box.events[c] for c in box.cursors)
                if ev.expires > now and ev.created_at > since]

    def pending_event(self, pubkey: bytes, event_id: bytes) -> PppEvent | None:
        """`pubkey`'s unacked inbox event with this id (either form), if any."""
        box = self._boxes.get(pubkey)
        for cursor in sorted(box.ids.get(event_id, ())) if box is not None else ():
            ev = box.events.get(cursor)
            if ev is not None:
                return ev
        return None

    @staticmethod
    def _place(ev: PppEvent | EarlyEvent) -> int:
        if isinstance(ev, EarlyEvent):
            return EARLY_BASE + ev.no
        if ev.early_no is not None:
            return EARLY_BASE + ev.early_no
        return ev.cursor

    async def envelopes_of(self, events: list[PppEvent | EarlyEvent]) -> list[bytes | None]:
        """The envelopes of `fetch`'s events, in order; None for a row gone since."""
        stored = await self.envelopes.get([e.seq for e in events if isinstance(e, PppEvent)])
        it = iter(stored)
        return [e.envelope if isinstance(e, EarlyEvent) else next(it) for e in events]

    def take(self, pubkey: bytes, ids: Iterable[bytes]) -> tuple[list[PppEvent],
                                                                list[EarlyEvent]]:
        """Remove and return the caller's own unacked events named by `ids` (either id form):
        those with an inbox row, and early ones (kept until their row arrives, see
        `on_deferred_acks`); anything else (another recipient's, unknown, already acked) is
        not counted."""
        box = self._boxes.get(pubkey)
        if box is None:
            return [], []
        out: list[PppEvent] = []
        early: list[EarlyEvent] = []
        for i in ids:
            for cursor in sorted(box.ids.get(i, ())):
                ev = box.drop(cursor)
                if ev is not None:
                    self.envelopes.drop(ev.seq)   # read back from disk if put back
                    out.append(ev)
            for eid in sorted(box.early_ids.get(i, ())):
                e = box.drop_early(eid)
                if e is not None:
                    box.early_acked[eid] = e
                    early.append(e)
        return out, early

    def put_back(self, pubkey: bytes, events: list[PppEvent],
                 early: Iterable[EarlyEvent] = ()) -> None:
        """An ACK whose rows could not be written: the events stay pending."""
        box = self._boxes.setdefault(pubkey, _Box())
        for ev in events:
            if ev.cursor not in box.events:
                box.put(ev)
        for e in early:
            if box.early_acked.pop(e.event_id, None) is not None:
                box.put_early(e)

    def owed(self, pubkey: bytes, cursor: int) -> bool:
        """Whether the recipient still has to fetch the event at `cursor`: unacked, or not in
        this view yet (the push job may read the inbox before this process's tail does)."""
        box = self._boxes.get(pubkey)
        return box is None or cursor > box.max_cursor or cursor in box.events

    def pending_count(self, pubkey: bytes) -> int:
        """Unacked events with an inbox row (early ones are not counted)."""
        box = self._boxes.get(pubkey)
        return 0 if box is None else len(box.events)

    def sweep(self, now: float) -> int:
        """Drop expired events and ids; returns how many ids were dropped."""
        gone = [i for i, exp in self.known.items() if exp <= now]
        for i in gone:
            del self.known[i]
        stale = time.monotonic() - EARLY_MAX_AGE_SECONDS
        for box in self._boxes.values():
            for cursor in [c for c, ev in box.events.items() if ev.expires <= now]:
                self.envelopes.drop(box.drop(cursor).seq)
            for e in [e for e in box.early.values() if e.expires <= now or e.landed < stale]:
                box.drop_early(e.event_id)
                self.early_bytes -= len(e.envelope)
            for e in [e for e in box.early_acked.values()
                      if e.expires <= now or e.landed < stale]:
                del box.early_acked[e.event_id]
                self.early_bytes -= len(e.envelope)
        return len(gone)
