"""Pending envelopes per mailbox, and which connected session delivers each.

Fed by the inbox tail (`add`), drained by protocol shells through `DeliverySession`:

* An envelope is claimed by exactly one live session at a time, and a session never gets the
  same seq twice. When several sessions for one mailbox are open (a reconnect overlapping the
  old connection), the newest one delivers; an older session keeps what it already holds until
  it acks or closes, and the newest delivers nothing past such an envelope meanwhile, so each
  session sees its mailbox in FIFO order and one session wins each flush. The older session is
  marked `superseded` so its shell can probe it at once instead of waiting for the idle timer.
* `ack` is scoped to the session's own mailbox; it returns only after the ack row is durable
  in the `acks` table (the compaction job then deletes the envelope).
* Memory is bounded: at most `max_pending` envelopes per mailbox are held; beyond that the
  mailbox is marked as overflowing and the rest is paged in from the inbox table (`loader`)
  as held envelopes are acked. Egress memory ~ mailboxes_online x max_pending x envelope size.

Early envelopes (issue 20, `runtime/handoff.py`): ingress hands an envelope over right after
its landing commit, before the stream has given it an inbox row. `add_early` takes it only
for a mailbox with a session open here, under a provisional seq (`EARLY_BASE` + n, which the
session sends as its blob_id), so an online receiver has it in milliseconds. When the inbox
row arrives it is matched by `event_id`: the envelope is not added again (a session never
gets it twice) but learns its row's seq and cursor, which the ack row carries. An ack that
comes before the row is kept (`early_acked`) and written when the row arrives; if egress
stops first, the row is delivered again after the restart (the client dedups, trueseal
000 "Deliver"). An early envelope whose row never comes (the stream dropped it as a
duplicate of one delivered long ago) is forgotten after `EARLY_MAX_AGE_SECONDS`; ids acked
in the last `EARLY_MAX_AGE_SECONDS` are remembered so a client's retry of an acked push is
not delivered again early. Order: early envelopes go out in landing-commit order, but one can
overtake an envelope that landed before the receiver connected and is still in the
micro-batch (the public relay is FIFO by row id; spec 000 promises no order, blob ids are
opaque to the client and deduplication is its job, 000 "Deliver").
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Awaitable, Callable, Iterable

log = logging.getLogger("relay.egress")

# Provisional seqs of early envelopes: past any inbox seq, inside trueseal's u64 blob_id.
EARLY_BASE = 1 << 62
# Early envelopes held in all (a budget across mailboxes): past it, the row delivers them.
EARLY_MAX_BYTES = 32 * 1024 * 1024
# An early envelope without its inbox row, or an early ack without its row, is dropped after
# this long; acked ids are remembered this long against retried pushes (at most
# `RECENT_ACKS_MAX` of them).
EARLY_MAX_AGE_SECONDS = 600.0
RECENT_ACKS_MAX = 200_000


@dataclass(frozen=True)
class PendingEnvelope:
    seq: int
    cursor: int
    event_id: bytes
    envelope: bytes
    expires_at: datetime | None = None
    meta: bytes | None = None      # the row's relay-visible protocol fields (schema `meta`)
    row_seq: int | None = None     # an early envelope whose inbox row arrived: the row's seq

    def __repr__(self) -> str:  # never show envelope bytes
        return f"PendingEnvelope(seq={self.seq}, cursor={self.cursor}, size={len(self.envelope)})"

    @property
    def early(self) -> bool:
        """Handed over by ingress before its inbox row: `seq` is provisional."""
        return self.seq >= EARLY_BASE

    def as_row(self) -> "PendingEnvelope":
        """This envelope as its inbox row (what an ack row records)."""
        return dataclasses.replace(self, seq=self.row_seq) if self.early else self


MailboxKey = tuple[str, bytes]
# loader(protocol, mailbox, after_cursor, limit) -> envelopes with cursor > after_cursor, unacked
Loader = Callable[[str, bytes, int, int], Awaitable[list[PendingEnvelope]]]
# ack_sink(protocol, mailbox, envelope, device) -> None once durable
AckSink = Callable[[str, bytes, PendingEnvelope, bytes | None], Awaitable[None]]


@dataclass
class _Box:
    pending: dict[int, PendingEnvelope] = field(default_factory=dict)  # seq -> env, seq order
    owner: dict[int, "DeliverySession"] = field(default_factory=dict)   # claimed seq -> session
    sessions: list["DeliverySession"] = field(default_factory=list)     # oldest first
    overflow_after: int | None = None   # cursor after which rows exist in Delta but not here
    skipped_max: int = 0                # newest cursor the tail skipped while overflowing
    loading: bool = False
    max_cursor: int = 0
    early: dict[bytes, tuple[int, float]] = field(default_factory=dict)  # id -> (seq, since)
    early_acked: dict[bytes, tuple[bytes | None, float]] = field(default_factory=dict)


class MailboxHub:
    def __init__(self, ack_sink: AckSink, *, max_pending: int = 1000,
                 loader: Loader | None = None, clock=lambda: datetime.now(timezone.utc)):
        self.ack_sink = ack_sink
        self.max_pending = max_pending
        self.loader = loader
        self.clock = clock
        self._boxes: dict[MailboxKey, _Box] = {}
        self._ids = itertools.count(1)
        # Per protocol, read by the metrics endpoint (runtime/metrics.py) from another thread.
        self.delivered_by: Counter[str] = Counter()
        self.acked_by: Counter[str] = Counter()
        self.early_taken_by: Counter[str] = Counter()
        self.early_bytes = 0
        self.early_max_bytes = EARLY_MAX_BYTES
        self._early_ids = itertools.count(EARLY_BASE)
        self._recent_acks: OrderedDict[bytes, float] = OrderedDict()   # event id -> acked at
        self._deferred: set[asyncio.Task] = set()
        self._swept_at = time.monotonic()
        # Told (protocol, mailbox, online) when a mailbox gets its first session here and when
        # its last one closes: the peer channel subscribes it on other hosts' ingress.
        self.watch: Callable[[str, bytes, bool], None] | None = None

    @property
    def delivered(self) -> int:
        return sum(self.delivered_by.values())

    @property
    def acked(self) -> int:
        return sum(self.acked_by.values())

    # -- feeding -----------------------------------------------------------------------------
    def add(self, protocol: str, mailbox: bytes, envelopes: Iterable[PendingEnvelope]) -> None:
        """New inbox rows for one mailbox, in cursor order. Rows already seen are ignored."""
        box = self._boxes.setdefault((protocol, mailbox), _Box())
        added = False
        for env in envelopes:
            if env.cursor <= box.max_cursor:
                continue
            if self._row_of_early(protocol, mailbox, box, env):
                continue
            if box.overflow_after is not None or len(box.pending) >= self.max_pending:
                if box.overflow_after is None:
                    box.overflow_after = box.max_cursor
                box.skipped_max = max(box.skipped_max, env.cursor)
                continue
            box.pending[env.seq] = env
            box.max_cursor = env.cursor
            added = True
        if added:
            self._wake(box)
        self._gc(protocol, mailbox, box)

    def add_early(self, protocol: str, mailbox: bytes, event_id: bytes, envelope: bytes,
                  expires_at: datetime | None) -> bool:
        """An envelope ingress just committed to landing (see the module docstring). False
        when it is not taken: no session for the mailbox here, no room, or already known."""
        self._sweep_early()
        box = self._boxes.get((protocol, mailbox))
        if box is None or not box.sessions:
            return False
        if box.overflow_after is not None or len(box.pending) >= self.max_pending \
                or self.early_bytes + len(envelope) > self.early_max_bytes:
            return False
        if event_id in box.early or event_id in box.early_acked \
                or event_id in self._recent_acks \
                or any(e.event_id == event_id for e in box.pending.values()):
            return False
        seq = next(self._early_ids)
        box.pending[seq] = PendingEnvelope(seq, 0, event_id, envelope, expires_at)
        box.early[event_id] = (seq, time.monotonic())
        self.early_bytes += len(envelope)
        self.early_taken_by[protocol] += 1
        self._wake(box)
        return True

    def _row_of_early(self, protocol: str, mailbox: bytes, box: _Box,
                      row: PendingEnvelope, paging: bool = False) -> bool:
        """`row` is the inbox row of an early envelope: it takes the row's seq and cursor (or
        its kept ack is written now) instead of being added again. True if so. While the
        mailbox overflows, the tail's rows are skipped and matched when paged in, so that
        `max_cursor` never passes a skipped row."""
        if box.overflow_after is not None and not paging:
            return False
        if row.event_id in box.early_acked:
            device, _ = box.early_acked.pop(row.event_id)
            box.max_cursor = max(box.max_cursor, row.cursor)
            task = asyncio.get_running_loop().create_task(
                self._write_deferred_ack(protocol, mailbox, row, device))
            self._deferred.add(task)
            task.add_done_callback(self._deferred.discard)
            return True
        early = box.early.pop(row.event_id, None)
        if early is None:
            return False
        seq, _ = early
        env = box.pending.get(seq)
        if env is not None:
            box.pending[seq] = dataclasses.replace(
                env, cursor=row.cursor, row_seq=row.seq, expires_at=row.expires_at,
                meta=row.meta)
            self.early_bytes -= len(env.envelope)
        box.max_cursor = max(box.max_cursor, row.cursor)
        return True

    async def _write_deferred_ack(self, protocol: str, mailbox: bytes, row: PendingEnvelope,
                                  device: bytes | None) -> None:
        try:
            await self.ack_sink(protocol, mailbox, row, device)
        except Exception as exc:
            # Not written: the row stays undelivered as far as the tables know, so it is
            # delivered again (after a restart at the latest); the client dedups.
            log.warning("deferred ack failed", extra={"event": "ack_failed",
                                                      "error": type(exc).__name__})

    async def drain(self) -> None:
        """Let the acks written for early envelopes' rows finish (egress is stopping)."""
        if self._deferred:
            await asyncio.gather(*self._deferred, return_exceptions=True)

    @property
    def early_waiting(self) -> int:
        """Early envelopes, delivered or acked, whose inbox rows have not arrived yet."""
        return sum(len(b.early) + len(b.early_acked) for b in list(self._boxes.values()))

    @property
    def early_acks_waiting(self) -> int:
        """Acks kept until their envelopes' inbox rows arrive."""
        return sum(len(b.early_acked) for b in list(self._boxes.values()))

    def _remember_ack(self, event_id: bytes, now: float) -> None:
        self._recent_acks[event_id] = now
        self._recent_acks.move_to_end(event_id)
        while len(self._recent_acks) > RECENT_ACKS_MAX:
            self._recent_acks.popitem(last=False)

    def _sweep_early(self, now: float | None = None) -> None:
        """Forget early state older than `EARLY_MAX_AGE_SECONDS` (at most every 10 s)."""
        now = time.monotonic() if now is None else now
        if now - self._swept_at < 10.0:
            return
        self._swept_at = now
        stale = now - EARLY_MAX_AGE_SECONDS
        while self._recent_acks and next(iter(self._recent_acks.values())) < stale:
            self._recent_acks.popitem(last=False)
        for (protocol, mailbox), box in list(self._boxes.items()):
            for eid, (seq, since) in list(box.early.items()):
                if since < stale:
                    del box.early[eid]
                    self._forget(box, seq)
            for eid, (_, since) in list(box.early_acked.items()):
                if since < stale:
                    del box.early_acked[eid]
            self._gc(protocol, mailbox, box)

    def _forget(self, box: _Box, seq: int) -> None:
        """Drop a pending envelope (expired, or early with no row) without an ack."""
        env = box.pending.pop(seq, None)
        box.owner.pop(seq, None)
        if env is not None and env.early and env.row_seq is None:
            box.early.pop(env.event_id, None)
            self.early_bytes -= len(env.envelope)

    def pending_count(self, protocol: str | None = None) -> int:
        return sum(len(b.pending) for k, b in self._boxes.items()
                   if protocol is None or k[0] == protocol)

    def sessions_open(self, protocol: str | None = None) -> int:
        return sum(len(b.sessions) for k, b in self._boxes.items()
                   if protocol is None or k[0] == protocol)

    def pending_by_protocol(self) -> dict[str, int]:
        """Envelopes held per protocol. Safe from another thread: the mailbox dict is copied
        in one step (atomic under the GIL) before it is walked."""
        out: Counter[str] = Counter()
        for (protocol, _), box in list(self._boxes.items()):
            out[protocol] += len(box.pending)
        return dict(out)

    # -- sessions ----------------------------------------------------------------------------
    def open_session(self, protocol: str, mailbox: bytes,
                     device: bytes | None = None) -> "DeliverySession":
        box = self._boxes.setdefault((protocol, mailbox), _Box())
        session = DeliverySession(self, box, protocol, mailbox, device, next(self._ids))
        for older in box.sessions:
            # A reconnect usually means the older connection is dead: its shell probes it now
            # rather than after the idle timer, since its claims hold back the new session.
            older.superseded.set()
        box.sessions.append(session)
        if len(box.sessions) == 1 and self.watch is not None:
            self.watch(protocol, mailbox, True)
        self._wake(box)
        return session

    def mailboxes_online(self, protocol: str) -> list[bytes]:
        """The mailboxes of `protocol` with a session open here."""
        return [m for (p, m), box in list(self._boxes.items()) if p == protocol and box.sessions]

    def _primary(self, box: _Box) -> "DeliverySession | None":
        return box.sessions[-1] if box.sessions else None

    def _wake(self, box: _Box) -> None:
        for s in box.sessions:
            s._event.set()

    def _release(self, session: "DeliverySession") -> None:
        box = session._box
        for seq in [s for s, o in box.owner.items() if o is session]:
            del box.owner[seq]
        if session in box.sessions:
            box.sessions.remove(session)
            if not box.sessions and self.watch is not None:
                self.watch(session.protocol, session.mailbox, False)
        self._wake(box)
        self._gc(session.protocol, session.mailbox, box)

    def _gc(self, protocol: str, mailbox: bytes, box: _Box) -> None:
        # A mailbox with nothing pending and nobody connected costs no memory.
        if not box.pending and not box.sessions and box.overflow_after is None \
                and not box.early_acked:
            self._boxes.pop((protocol, mailbox), None)

    async def _page_in(self, session: "DeliverySession") -> None:
        box = session._box
        if box.overflow_after is None or box.loading or self.loader is None:
            return
        if len(box.pending) > self.max_pending // 2:
            return
        box.loading = True
        try:
            room = self.max_pending - len(box.pending)
            rows = await self.loader(session.protocol, session.mailbox, box.max_cursor, room)
            for env in rows:
                if env.cursor > box.max_cursor and not self._row_of_early(
                        session.protocol, session.mailbox, box, env, paging=True):
                    box.pending[env.seq] = env
                    box.max_cursor = env.cursor
            # Caught up with the table, and the tail skipped nothing newer meanwhile.
            if len(rows) < room and box.skipped_max <= box.max_cursor:
                box.overflow_after = None
        finally:
            box.loading = False
        self._wake(box)


class DeliverySession:
    """One connected client's view of its mailbox (see module docstring)."""

    def __init__(self, hub: MailboxHub, box: _Box, protocol: str, mailbox: bytes,
                 device: bytes | None, sid: int):
        self.hub = hub
        self._box = box
        self.protocol = protocol
        self.mailbox = mailbox
        self.device = device
        self.sid = sid
        self._sent: set[int] = set()
        self._event = asyncio.Event()
        self.superseded = asyncio.Event()   # a newer session for this mailbox opened
        self.closed = False

    @property
    def holds_claims(self) -> bool:
        """Delivered to this session and not acked yet."""
        return any(o is self for o in self._box.owner.values())

    def __repr__(self) -> str:
        return f"DeliverySession(sid={self.sid}, protocol={self.protocol})"

    def _claimable(self) -> list[PendingEnvelope]:
        box = self._box
        if self.hub._primary(box) is not self:
            return []
        now = self.hub.clock()
        out, expired = [], []
        for seq, env in box.pending.items():
            if env.expires_at is not None and env.expires_at <= now:
                expired.append(seq)
            elif box.owner.get(seq, self) is not self:
                # An older session holds this one: deliver nothing after it until that session
                # acks or closes, so this session still sees the mailbox in FIFO order.
                break
            elif seq not in box.owner and seq not in self._sent:
                out.append(env)
        for seq in expired:  # past TTL: never delivered; compaction removes the row
            self.hub._forget(box, seq)
        return out

    async def next(self) -> list[PendingEnvelope]:
        """Wait until something is deliverable by this session; claim and return it."""
        while True:
            if self.closed:
                raise ConnectionError("delivery session closed")
            self._event.clear()
            await self.hub._page_in(self)
            envs = self._claimable()
            if envs:
                for env in envs:
                    self._box.owner[env.seq] = self
                    self._sent.add(env.seq)
                self.hub.delivered_by[self.protocol] += len(envs)
                return envs
            await self._event.wait()

    async def ack(self, seq: int) -> bool:
        box = self._box
        env = box.pending.get(seq)
        if env is None:
            return False  # not this mailbox's, already acked, or unknown
        now = time.monotonic()
        if env.early and env.row_seq is None:
            # Before its inbox row: the ack row waits for the row's seq (`add`).
            box.early.pop(env.event_id, None)
            box.early_acked[env.event_id] = (self.device, now)
            self.hub.early_bytes -= len(env.envelope)
        else:
            await self.hub.ack_sink(self.protocol, self.mailbox, env.as_row(), self.device)
        if box.pending.pop(seq, None) is not None:
            self.hub.acked_by[self.protocol] += 1
            if self.hub.early_taken_by:      # only where hand-offs come (see the module)
                self.hub._remember_ack(env.event_id, now)
        box.owner.pop(seq, None)
        if box.overflow_after is not None:
            self._event.set()
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._event.set()
            self.hub._release(self)
