"""What the cursor-sync listener knows of the inbox: per group the visible blobs in cursor
order (metadata always, payloads up to a byte budget), the top cursor, the bytes stored, the
PUSH_ACK waiters, and the NOTIFY fan-out to the group's online sessions.

Fed by `egress.inbox_tail.InboxTail(protocols={"sync"})`, which calls `add` with the stream's
new inbox rows of one group in cursor order. Cursors are the stream's: per group, gap-free,
from 1, visible in order (a micro-batch commits atomically), which is what 0k-sync promises
and its SQLite relay does not deliver (interop §2.2).

* `bootstrap` reads the group rows of the inbox (tombstones for the top cursor and the
  event_id -> cursor index; acked rows, i.e. DELETEd blobs, and expired rows left out of the
  visible set), with their `meta` (blob_id, sender, timestamp).
* `add` takes new rows with their `meta` column (blob_id, sender, timestamp), as the PUSH
  that landed them wrote it.
* PUSH_ACK: `cursor_of(event_id)` answers a blob the view knows; `wait(event_id)` returns a
  future the matching `add` resolves. A re-push of a known blob id answers its original
  cursor; the stream sends the duplicate row to `rejects`.
* NOTIFY: after the rows of a group are in, every online session of the group hears
  `Notify{latest_cursor, count}` for the new blobs other devices sent.
* Expiry: `expire` (run on every `add` and before a PUSH is checked) drops blobs whose TTL
  passed, so their bytes leave the group quota and memory holds only live blobs; an event id
  is forgotten `forget_after` later (by then the stream forgot it too: a re-push after that is
  a new blob, as the stream treats it).
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterable, Protocol

import msgpack
import pyarrow as pa

from delta_tables.object_store import as_path
from delta_tables.schema import C
from .envelope_cache import EnvelopeCache
from .inbox_tail import read_protocol_rows
from .pending import PendingEnvelope
from .waiting import Waiters
from engine.sync import PROTOCOL

log = logging.getLogger("relay.ingress.sync")

META_BLOB_ID, META_SENDER, META_TIMESTAMP = "blob_id", "sender", "ts"


def encode_meta(blob_id: bytes, sender: bytes, timestamp: int) -> bytes:
    """The relay-visible fields of a PUSH, stored in the landing row's `meta`."""
    return msgpack.packb({META_BLOB_ID: blob_id, META_SENDER: sender,
                          META_TIMESTAMP: timestamp}, use_bin_type=True)


def decode_meta(meta: bytes) -> tuple[bytes, bytes, int]:
    d = msgpack.unpackb(meta, raw=False)
    return d[META_BLOB_ID], d[META_SENDER], d[META_TIMESTAMP]


@dataclass
class Blob:
    cursor: int
    seq: int
    event_id: bytes
    blob_id: bytes
    sender: bytes
    timestamp: int          # unix seconds, the relay's clock (0k-sync `current_timestamp`)
    size: int
    expires_at: datetime | None     # (the payload is in `SyncInbox.envelopes`, by seq)

    def __repr__(self) -> str:
        return f"Blob(cursor={self.cursor}, size={self.size})"


class GroupSession(Protocol):
    device_id: bytes | None

    def notify(self, latest_cursor: int, count: int) -> None: ...


class _Group:
    """Blobs arrive in cursor order (bootstrap sorts; `add` takes only cursors above `top`),
    so `cursors` stays sorted by appending, and a PULL finds its window by bisection instead
    of walking the group. DELETEd cursors stay in `cursors` until it is twice `blobs`."""
    __slots__ = ("blobs", "cursors", "by_blob_id", "top", "stored", "sessions")

    def __init__(self) -> None:
        self.blobs: dict[int, Blob] = {}      # visible blobs by cursor
        self.cursors: list[int] = []          # ascending; may hold removed cursors
        self.by_blob_id: dict[bytes, int] = {}
        self.top = 0          # highest cursor ever committed (tombstones included)
        self.stored = 0       # payload bytes of the visible blobs
        self.sessions: set[GroupSession] = set()

    def after(self, cursor: int) -> Iterable[Blob]:
        """Visible blobs with a cursor above `cursor`, in cursor order."""
        cursors, blobs = self.cursors, self.blobs
        for i in range(bisect.bisect_right(cursors, cursor), len(cursors)):
            blob = blobs.get(cursors[i])
            if blob is not None:
                yield blob

    def remove(self, cursor: int) -> Blob | None:
        blob = self.blobs.pop(cursor, None)
        if blob is not None:
            self.by_blob_id.pop(blob.blob_id, None)
            if len(self.cursors) > 2 * len(self.blobs) + 64:
                self.cursors = [c for c in self.cursors if c in self.blobs]
        return blob


class SyncInbox:   # an inbox_view.InboxView; sessions are kept with each group
    def __init__(self, inbox_path: Path, acks_path: Path, *, cache_bytes: int = 256 << 20):
        self.inbox_path = as_path(inbox_path)
        self.acks_path = as_path(acks_path)
        self.envelopes = EnvelopeCache(inbox_path, PROTOCOL, cache_bytes)   # the payloads
        self._groups: dict[bytes, _Group] = {}
        self._cursor_of: dict[bytes, int] = {}               # event_id -> cursor
        self._waiters = Waiters()
        # (expires_at, group, cursor, event_id): blobs to drop once expired, soonest first
        self._expiry: list[tuple[datetime, bytes, int, bytes]] = []
        self._forget: deque[tuple[datetime, bytes, int]] = deque()  # (when, event_id, cursor)
        self.forget_after = timedelta(hours=1)
        self.blobs_seen = 0

    def __repr__(self) -> str:
        return f"SyncInbox(groups={len(self._groups)}, cached_bytes={self.envelopes.held_bytes})"

    def _group(self, group: bytes) -> _Group:
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group()
        return g

    # --- sessions --------------------------------------------------------------------------
    def register(self, group: bytes, session: GroupSession) -> None:
        self._group(group).sessions.add(session)

    def unregister(self, group: bytes, session: GroupSession) -> None:
        g = self._groups.get(group)
        if g is not None:
            g.sessions.discard(session)
            if not (g.sessions or g.blobs or g.cursors or g.top):
                del self._groups[group]     # nothing stored: as if never seen (`_group`)

    def sessions_of(self, group: bytes) -> list[GroupSession]:
        g = self._groups.get(group)
        return list(g.sessions) if g else []

    # --- bootstrap -------------------------------------------------------------------------
    def _bootstrap_read(self) -> tuple[int, pa.Table, pa.Array]:
        return read_protocol_rows(
            self.inbox_path, self.acks_path, PROTOCOL,
            [C.MAILBOX, C.CURSOR, C.SEQ, C.EVENT_ID, C.ENVELOPE, C.META, C.EXPIRES_AT])

    async def bootstrap(self) -> int:
        """Rebuild from the inbox; returns the version read (the tail continues from it)."""
        version, t, acked = await asyncio.to_thread(self._bootstrap_read)
        acked_set = set(acked.to_pylist())
        now = datetime.now(timezone.utc)
        rows = 0
        for mb, cur, seq, eid, env, meta, exp in zip(
                *(t.column(c).to_pylist() for c in (C.MAILBOX, C.CURSOR, C.SEQ, C.EVENT_ID,
                                                      C.ENVELOPE, C.META, C.EXPIRES_AT))):
            g = self._group(mb)
            g.top = max(g.top, cur)
            if exp is None or exp + self.forget_after > now:
                self._track(mb, cur, eid, exp)
            if env is None or seq in acked_set or (exp is not None and exp <= now) \
                    or meta is None:
                continue
            blob_id, sender, ts = decode_meta(meta)
            self._insert(mb, g, Blob(cur, seq, eid, blob_id, sender, ts, len(env), exp), env)
            rows += 1
        log.info("sync inbox view rebuilt", extra={"event": "sync_inbox_bootstrap",
                                                   "version": version, "blobs": rows,
                                                   "groups": len(self._groups)})
        return version

    # --- what the stream committed ---------------------------------------------------------
    def add(self, protocol: str, mailbox: bytes, envelopes: Iterable[PendingEnvelope]) -> None:
        if protocol != PROTOCOL:
            return
        self.expire(datetime.now(timezone.utc))
        g = self._group(mailbox)
        fresh: list[Blob] = []
        for env in envelopes:
            if env.cursor <= g.top:
                continue          # known (a tail rebuild replays what it had)
            g.top = env.cursor
            self._track(mailbox, env.cursor, env.event_id, env.expires_at)
            if env.meta is None:
                continue          # not a row this listener landed
            meta = decode_meta(env.meta)
            blob = Blob(env.cursor, env.seq, env.event_id, meta[0], meta[1], meta[2],
                        len(env.envelope), env.expires_at)
            self._insert(mailbox, g, blob, env.envelope)
            fresh.append(blob)
            self._waiters.resolve(env.event_id, env.cursor)
        if not fresh:
            return
        self.blobs_seen += len(fresh)
        for session in list(g.sessions):
            theirs = [b.cursor for b in fresh if b.sender != session.device_id]
            if theirs:
                session.notify(theirs[-1], len(theirs))

    def _track(self, group: bytes, cursor: int, event_id: bytes,
               expires_at: datetime | None) -> None:
        self._cursor_of[event_id] = cursor
        if expires_at is not None:
            heapq.heappush(self._expiry, (expires_at, group, cursor, event_id))

    def expire(self, now: datetime) -> int:
        """Drop the blobs whose TTL has passed; forget event ids `forget_after` later."""
        dropped = 0
        while self._expiry and self._expiry[0][0] <= now:
            exp, group, cursor, eid = heapq.heappop(self._expiry)
            self.remove(group, cursor)
            self._forget.append((exp + self.forget_after, eid, cursor))
            dropped += 1
        while self._forget and self._forget[0][0] <= now:
            _, eid, cursor = self._forget.popleft()
            if self._cursor_of.get(eid) == cursor:
                del self._cursor_of[eid]
        return dropped

    def _insert(self, group: bytes, g: _Group, blob: Blob, payload: bytes) -> None:
        g.blobs[blob.cursor] = blob
        g.cursors.append(blob.cursor)
        g.by_blob_id[blob.blob_id] = blob.cursor
        g.stored += blob.size
        self.envelopes.put(blob.seq, payload)

    # --- PUSH_ACK --------------------------------------------------------------------------
    def cursor_of(self, event_id: bytes) -> int | None:
        return self._cursor_of.get(event_id)

    def wait(self, event_id: bytes) -> asyncio.Future:
        return self._waiters.wait(event_id, self._cursor_of.get(event_id))

    def forget_waiter(self, event_id: bytes, fut: asyncio.Future) -> None:
        self._waiters.forget(event_id, fut)

    # --- reads -----------------------------------------------------------------------------
    def top(self, group: bytes) -> int:
        g = self._groups.get(group)
        return g.top if g else 0

    def stored(self, group: bytes) -> int:
        g = self._groups.get(group)
        return g.stored if g else 0

    def blob(self, group: bytes, blob_id: bytes) -> Blob | None:
        g = self._groups.get(group)
        if g is None:
            return None
        cursor = g.by_blob_id.get(blob_id)
        return None if cursor is None else g.blobs.get(cursor)

    def visible(self, group: bytes, after: int, up_to: int, now: datetime) -> Iterable[Blob]:
        """Unexpired, undeleted blobs with after < cursor <= up_to, in cursor order."""
        g = self._groups.get(group)
        if g is None:
            return
        for blob in g.after(after):
            if blob.cursor > up_to:
                return
            if blob.expires_at is None or blob.expires_at > now:
                yield blob

    def pending_count(self, group: bytes, device: bytes, after: int, now: datetime) -> int:
        return sum(1 for b in self.visible(group, after, 1 << 63, now) if b.sender != device)

    def blobs_of(self, group: bytes) -> list[Blob]:
        g = self._groups.get(group)
        return list(g.after(0)) if g else []

    def remove(self, group: bytes, cursor: int) -> None:
        """DELETE: the blob leaves the view (its acks row makes compaction purge it)."""
        g = self._groups.get(group)
        blob = g.remove(cursor) if g else None
        if blob is None:
            return
        g.stored -= blob.size
        self.envelopes.drop(blob.seq)

    async def payloads(self, blobs: list[Blob]) -> list[bytes]:
        """Payloads of `blobs`, from memory or (evicted ones) from the inbox table."""
        found = await self.envelopes.get([b.seq for b in blobs])
        return [p if p is not None else b"" for p in found]
