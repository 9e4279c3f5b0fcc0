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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Awaitable, Callable, Iterable

log = logging.getLogger("relay.egress")


@dataclass(frozen=True)
class PendingEnvelope:
    seq: int
    cursor: int
    event_id: bytes
    envelope: bytes
    expires_at: datetime | None = None
    meta: bytes | None = None      # the row's relay-visible protocol fields (schema `meta`)

    def __repr__(self) -> str:  # never show envelope bytes
        return f"PendingEnvelope(seq={self.seq}, cursor={self.cursor}, size={len(self.envelope)})"


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
        self._wake(box)
        return session

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
        self._wake(box)
        self._gc(session.protocol, session.mailbox, box)

    def _gc(self, protocol: str, mailbox: bytes, box: _Box) -> None:
        # A mailbox with nothing pending and nobody connected costs no memory.
        if not box.pending and not box.sessions and box.overflow_after is None:
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
                if env.cursor > box.max_cursor:
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
            box.pending.pop(seq, None)
            box.owner.pop(seq, None)
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
        await self.hub.ack_sink(self.protocol, self.mailbox, env, self.device)
        if box.pending.pop(seq, None) is not None:
            self.hub.acked_by[self.protocol] += 1
        box.owner.pop(seq, None)
        if box.overflow_after is not None:
            self._event.set()
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._event.set()
            self.hub._release(self)
