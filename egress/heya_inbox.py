"""What the Heya listener knows of the inbox: per send token the next sequence number, a
bounded cache of recent bodies for WANT, and the HAVE fan-out to connected sessions.

Heya is "WANT by seq", not push delivery, so this is not the egress `MailboxHub`: nothing is
claimed or acked, a message stays until TRIM, DEAU, DALL or expiry. Fed like the hub by
`egress.inbox_tail.InboxTail(protocols={"heya"})` (it calls `add` with the stream's new inbox
rows); the seq of a message is its inbox cursor (the stream assigns them per send token,
contiguous from 0: `stream.cursor_start.heya = 0`).

* `bootstrap` reads next_seq per token from the inbox (max cursor + 1, tombstones included,
  so TRIM never lowers it: interop §2) without reading any body.
* `add` advances next_seq and sends one HAVE per new message, `HAVE <token> <seq + 1>`
  (interop §3; the upstream tests expect one per message), to every connected session of the
  token's owner certificate, whichever connection minted the token and across reconnects
  (the public server only tells the connection that ran AUTH, interop §5.7).
* Memory: next_seq per token, and at most `cache_bytes` of bodies (least recently used out).
  A WANT whose body is not cached reads it from the inbox table (`body`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Protocol

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import DeltaTable

from delta_tables.layout import equals
from delta_tables.object_store import as_path
from delta_tables.schema import C
from .inbox_view import Sessions
from .pending import PendingEnvelope
from engine.heya.ids import PROTOCOL

log = logging.getLogger("relay.ingress.heya")


class Session(Protocol):
    def notify_have(self, token: bytes, next_seq: int) -> None: ...


class Owners(Protocol):   # delta_tables.heya_control.HeyaControl
    def owner_of(self, token: bytes) -> bytes | None: ...
    def trimmed(self, token: bytes) -> int: ...
    def push_tokens(self, owner: bytes) -> list: ...


class HeyaInbox:   # an inbox_view.InboxView
    def __init__(self, inbox_path: Path, owners: Owners, *, cache_bytes: int = 64 << 20):
        self.inbox_path = as_path(inbox_path)
        self.owners = owners
        self.cache_bytes = cache_bytes
        self._next: dict[bytes, int] = {}
        self._cache: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()
        self._cached = 0
        # by owner certificate; a departure is kept only for an owner with a push token
        self.sessions: Sessions[Session] = Sessions(
            lambda owner: bool(owners.push_tokens(owner)))
        self.messages_seen = 0
        self.disk_reads = 0

    # --- sessions ------------------------------------------------------------------------------
    def register(self, owner: bytes, session: Session) -> None:
        self.sessions.register(owner, session)

    def unregister(self, owner: bytes, session: Session) -> None:
        self.sessions.unregister(owner, session)

    def sessions_of(self, owner: bytes) -> set[Session]:
        return self.sessions.of(owner)

    # --- what the stream committed -------------------------------------------------------------
    def next_seq(self, token: bytes) -> int:
        return self._next.get(token, 0)

    def _bootstrap_read(self) -> tuple[int, dict[bytes, int]]:
        dt = DeltaTable(str(self.inbox_path))
        version = dt.version()
        t = dt.to_pyarrow_dataset().to_table(
            columns=[C.MAILBOX, C.CURSOR], filter=equals(C.PROTOCOL, PROTOCOL),
            use_threads=False)
        if t.num_rows == 0:
            return version, {}
        top = t.group_by([C.MAILBOX], use_threads=False).aggregate([(C.CURSOR, "max")])
        return version, {m: c + 1 for m, c in zip(top.column(C.MAILBOX).to_pylist(),
                                                  top.column(f"{C.CURSOR}_max").to_pylist())}

    async def bootstrap(self) -> int:
        """Load next_seq per token; returns the inbox version read (the tail goes on from
        there)."""
        version, nxt = await asyncio.to_thread(self._bootstrap_read)
        self._next = nxt
        log.info("heya inbox view rebuilt", extra={"event": "heya_inbox_bootstrap",
                                                   "version": version, "tokens": len(nxt)})
        return version

    def add(self, protocol: str, mailbox: bytes, envelopes: Iterable[PendingEnvelope]) -> None:
        """New inbox rows of one send token, in cursor order (InboxTail's hub interface)."""
        if protocol != PROTOCOL:
            return
        token = mailbox
        owner = self.owners.owner_of(token)
        fresh: list[int] = []
        nxt = self._next.get(token, 0)
        for env in envelopes:
            if env.cursor + 1 <= nxt:
                continue   # already known (a rebuild after the tail lost its place)
            nxt = env.cursor + 1
            fresh.append(env.cursor)
            if owner is not None:   # a revoked token's late messages are not kept
                self._remember(token, env.cursor, env.envelope)
        if not fresh:
            return
        self._next[token] = nxt
        self.messages_seen += len(fresh)
        if owner is None:
            return
        for session in self.sessions_of(owner):
            for seq in fresh:
                session.notify_have(token, seq + 1)

    # --- bodies --------------------------------------------------------------------------------
    def _remember(self, token: bytes, seq: int, body: bytes) -> None:
        if len(body) > self.cache_bytes:
            return
        self._cache[(token, seq)] = body
        self._cached += len(body)
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)

    def _drop(self, keys: list[tuple[bytes, int]]) -> None:
        for key in keys:
            body = self._cache.pop(key, None)
            if body is not None:
                self._cached -= len(body)

    def forget(self, token: bytes) -> None:
        """DEAU / DALL: the token's messages are gone (compaction removes them from disk)."""
        self._drop([k for k in self._cache if k[0] == token])
        self._next.pop(token, None)

    def trim(self, token: bytes, up_to: int) -> None:
        self._drop([k for k in self._cache if k[0] == token and k[1] <= up_to])

    async def body(self, token: bytes, seq: int) -> bytes | None:
        """The message, or None if it does not exist (any more): not landed yet, trimmed,
        revoked, expired."""
        if seq >= self._next.get(token, 0) or seq <= self.owners.trimmed(token):
            return None
        body = self._cache.get((token, seq))
        if body is not None:
            self._cache.move_to_end((token, seq))
            return body
        self.disk_reads += 1
        return await asyncio.to_thread(self._read_body, token, seq)

    def _read_body(self, token: bytes, seq: int) -> bytes | None:
        now = pa.scalar(datetime.now(timezone.utc), pa.timestamp("us", tz="UTC"))
        t = DeltaTable(str(self.inbox_path)).to_pyarrow_dataset().to_table(
            columns=[C.ENVELOPE],
            filter=equals(C.MAILBOX, token) & equals(C.PROTOCOL, PROTOCOL)
            & (ds.field(C.CURSOR) == seq) & ds.field(C.ENVELOPE).is_valid()
            & (ds.field(C.EXPIRES_AT) > now),
            use_threads=False)
        if t.num_rows == 0:
            return None
        return t.column(C.ENVELOPE)[0].as_py()

    def __repr__(self) -> str:
        return (f"HeyaInbox(tokens={len(self._next)}, cached={len(self._cache)}, "
                f"cached_bytes={self._cached})")
