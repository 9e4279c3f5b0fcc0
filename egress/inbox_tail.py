"""Follow the inbox table and feed the hub; read back what the hub paged out; write acks.

At start the hub is rebuilt from the inbox snapshot minus `acks` (tombstones and expired rows
left out). Afterwards only the stream's appends (`WRITE` commits) are read, version by
version, from the files they add; compaction's UPDATE/DELETE/OPTIMIZE commits rewrite rows
egress already knows and are skipped. Blocking delta-rs reads run in worker threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from delta_tables.group_commit import GroupCommitAppender
from delta_tables.landing_lag import LogFollower
from delta_tables.layout import equals
from delta_tables.object_store import as_path
from delta_tables.schema import C, INBOX
from delta_tables.small_parquet import read_small
from runtime.inbox_signal import InboxSignal, signal_dir

from .pending import MailboxHub, PendingEnvelope

log = logging.getLogger("relay.egress")
REBUILD_AFTER_FAILURES = 3
FAILURE_LOG_SECONDS = 30.0
_COLS = [C.PROTOCOL, C.MAILBOX, C.SEQ, C.CURSOR, C.EVENT_ID, C.ENVELOPE, C.EXPIRES_AT,
         C.META]
# Files of one poll are concatenated: each is cast to the declared types first, since writers
# differ in encoding (Spark's Arrow path writes large_binary, delta-rs rewrites *_view), and
# one mismatch would fail every poll of the versions that hold it.
_SCHEMA = pa.schema([INBOX.arrow_schema().field(c) for c in _COLS])


def _envelopes(t: pa.Table) -> dict[tuple[str, bytes], list[PendingEnvelope]]:
    """Group rows by mailbox in cursor order, leaving out tombstones."""
    t = t.filter(pc.is_valid(t.column(C.ENVELOPE)))
    t = t.sort_by([(C.PROTOCOL, "ascending"), (C.MAILBOX, "ascending"), (C.CURSOR, "ascending")])
    out: dict[tuple[str, bytes], list[PendingEnvelope]] = {}
    cols = [t.column(c).to_pylist() for c in _COLS]
    for p, m, seq, cur, eid, env, exp, meta in zip(*cols):
        out.setdefault((p, m), []).append(PendingEnvelope(seq, cur, eid, env, exp, meta))
    return out


class Append(NamedTuple):
    version: int
    rows: pa.Table
    committed: float | None     # the commit's own time (commitInfo.timestamp), unix s


def read_appends(table: Path, first: int, last: int, columns: list[str],
                 schema: pa.Schema) -> list[Append]:
    """The files the `WRITE` commits `first..last` of a table added, one `Append` each: the
    stream's appends; compaction's UPDATE/DELETE/OPTIMIZE commits rewrite rows a
    follower already knows and are skipped. LookupError(version) when a commit or its file
    is gone (the follower lagged past log retention or VACUUM): rebuild from a snapshot."""
    out = []
    for v in range(first, last + 1):
        log_file = table / "_delta_log" / f"{v:020d}.json"
        try:
            actions = [json.loads(line) for line in log_file.read_text().splitlines()]
        except FileNotFoundError:
            raise LookupError(v)
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        if info.get("operation") != "WRITE":
            continue
        stamp = info.get("timestamp")
        for a in actions:
            if "add" in a:
                try:   # small files: read_small, not read_table (a dataset per file)
                    rows = read_small(str(table / a["add"]["path"]), columns).cast(schema)
                except FileNotFoundError:
                    raise LookupError(v)
                out.append(Append(v, rows, None if stamp is None else stamp / 1000))
    return out


def read_protocol_rows(inbox_path: Path, acks_path: Path, protocol: str, columns: list[str],
                       row_filter: ds.Expression | None = None) -> tuple[int, pa.Table, pa.Array]:
    """A listener's bootstrap read of its own protocol: (inbox version read, the rows sorted by
    mailbox and cursor, the acked seqs). The tail then follows from that version."""
    dt = DeltaTable(str(inbox_path))
    version = dt.version()
    flt = equals(C.PROTOCOL, protocol)
    t = dt.to_pyarrow_dataset().to_table(
        columns=columns, filter=flt if row_filter is None else flt & row_filter,
        use_threads=False)
    acked = DeltaTable(str(acks_path)).to_pyarrow_dataset().to_table(
        columns=[C.SEQ], filter=flt, use_threads=False).column(C.SEQ).combine_chunks()
    return version, t.sort_by([(C.MAILBOX, "ascending"), (C.CURSOR, "ascending")]), acked


class InboxTail:
    def __init__(self, inbox_path: Path, acks_path: Path, hub: MailboxHub,
                 protocols: set[str] | None = None, exclude: set[str] | None = None):
        """`protocols`: only these (None: all); `exclude`: never these."""
        self.inbox_path = as_path(inbox_path)
        self._log = LogFollower(self.inbox_path)
        self.acks_path = as_path(acks_path)
        self.hub = hub
        self.protocols = protocols
        self.exclude = exclude
        self.version = -1
        self.lag_versions = 0
        self.woken = 0        # polls started by the stream's signal, not the interval
        # Called when the stream on this host signalled a commit: the peer channel passes
        # the wake-up to the same protocol's listeners on other hosts (runtime/peer_link.py),
        # which have no signal from a stream elsewhere and would wait for their next poll.
        self.on_signal: Callable[[], None] | None = None
        self._wake: InboxSignal | None = None
        self.peer_woken = 0   # polls started by another host's wake-up

    def _wanted(self, t: pa.Table) -> pa.Table:
        if self.protocols is not None:
            t = t.filter(pc.is_in(t.column(C.PROTOCOL), pa.array(sorted(self.protocols))))
        if self.exclude:
            t = t.filter(pc.invert(pc.is_in(t.column(C.PROTOCOL),
                                            pa.array(sorted(self.exclude)))))
        return t

    def _acked_seqs(self, mailbox: bytes | None = None) -> pa.Array:
        dset = DeltaTable(str(self.acks_path)).to_pyarrow_dataset()
        flt = equals(C.MAILBOX, mailbox) if mailbox is not None else None
        return dset.to_table(columns=[C.SEQ], filter=flt).column(C.SEQ).combine_chunks()

    def _bootstrap_read(self) -> tuple[int, pa.Table]:
        dt = DeltaTable(str(self.inbox_path))
        version = dt.version()
        now = pa.scalar(datetime.now(timezone.utc), pa.timestamp("us", tz="UTC"))
        t = dt.to_pyarrow_dataset().to_table(
            columns=_COLS, filter=ds.field(C.ENVELOPE).is_valid() & (ds.field(C.EXPIRES_AT) > now))
        t = self._wanted(t)
        acked = self._acked_seqs()
        if len(acked):
            t = t.filter(pc.invert(pc.is_in(t.column(C.SEQ), acked)))
        return version, t

    async def bootstrap(self) -> int:
        version, t = await asyncio.to_thread(self._bootstrap_read)
        for (p, m), envs in _envelopes(t).items():
            self.hub.add(p, m, envs)
        self.version = version
        log.info("egress rebuilt from inbox", extra={"event": "egress_bootstrap",
                                                     "version": version, "rows": t.num_rows})
        return t.num_rows

    def _read_new(self) -> pa.Table | None:
        latest = self._log.latest(self.version)
        self.lag_versions = max(0, latest - self.version)
        if latest <= self.version:
            return None
        tables = [a.rows for a in read_appends(self.inbox_path, self.version + 1, latest,
                                               _COLS, _SCHEMA)]
        self.version = latest
        return pa.concat_tables(tables) if tables else None

    async def poll_once(self) -> int:
        try:
            t = await asyncio.to_thread(self._read_new)
        except LookupError:
            log.warning("inbox tail lost its place, rebuilding", extra={"event": "egress_rebuild"})
            return await self.bootstrap()
        if t is None:
            return 0
        t = self._wanted(t)
        for (p, m), envs in _envelopes(t).items():
            self.hub.add(p, m, envs)
        return t.num_rows

    async def follow(self, settings, stop: asyncio.Event, name: str) -> None:
        """`run` as a process runs it: woken by the stream's inbox commits
        (runtime/inbox_signal.py, when `egress.inbox_signal`), polling every
        `egress.poll_interval_ms` besides."""
        wake = None
        if settings.egress.inbox_signal:
            wake = self._wake = await InboxSignal.open(signal_dir(settings.data_dir), name)
        try:
            await self.run(settings.egress.poll_interval_ms / 1000, stop, wake)
        finally:
            self._wake = None
            if wake is not None:
                wake.close()

    def poke(self) -> None:
        """Another host's stream committed (a peer's wake-up): poll now, not at the interval
        (without `egress.inbox_signal` the interval only)."""
        if self._wake is not None:
            self.peer_woken += 1
            self._wake.poke()

    async def run(self, interval: float, stop: asyncio.Event,
                  wake: InboxSignal | None = None) -> None:
        """Poll until `stop`: at once when `wake` says the stream committed, else every
        `interval`. A view never stays behind the inbox: a poll that keeps failing
        (a file or log entry it cannot read) is followed, after `REBUILD_AFTER_FAILURES`
        tries, by a rebuild from the current snapshot, which no longer names what was
        unreadable; and the failures are logged once per `FAILURE_LOG_SECONDS`, not per poll."""
        failures = 0
        logged_at = float("-inf")
        stopping = None
        if wake is not None:
            stopping = asyncio.ensure_future(stop.wait())
            stopping.add_done_callback(lambda _: wake.poke())
        try:
            while not stop.is_set():
                try:
                    if failures >= REBUILD_AFTER_FAILURES:
                        log.warning("inbox tail kept failing, rebuilding",
                                    extra={"event": "egress_rebuild", "failures": failures})
                        await self.bootstrap()
                    else:
                        await self.poll_once()
                    failures = 0
                except Exception as e:
                    failures += 1
                    now = time.monotonic()
                    if now - logged_at >= FAILURE_LOG_SECONDS:
                        logged_at = now
                        log.warning("inbox tail poll failed", extra={
                            "event": "egress_poll_failed", "failures": failures,
                            "error": type(e).__name__})
                if wake is not None:
                    signals = wake.received
                    if await wake.wait(interval):
                        self.woken += 1
                        if wake.received > signals and self.on_signal is not None \
                                and not stop.is_set():
                            self.on_signal()    # this host's stream, not a poke
                    continue
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass
        finally:
            if stopping is not None:
                stopping.cancel()

    # -- the hub's loader: page in an overflowing mailbox -------------------------------------
    def _load(self, protocol: str, mailbox: bytes, after: int, limit: int) -> list[PendingEnvelope]:
        dset = DeltaTable(str(self.inbox_path)).to_pyarrow_dataset()
        t = dset.to_table(columns=_COLS, filter=equals(C.MAILBOX, mailbox)
                          & equals(C.PROTOCOL, protocol) & (ds.field(C.CURSOR) > after)
                          & ds.field(C.ENVELOPE).is_valid())
        acked = self._acked_seqs(mailbox)
        if len(acked):
            t = t.filter(pc.invert(pc.is_in(t.column(C.SEQ), acked)))
        t = t.sort_by([(C.CURSOR, "ascending")]).slice(0, limit)
        return _envelopes(t).get((protocol, mailbox), [])

    async def load(self, protocol: str, mailbox: bytes, after: int,
                   limit: int) -> list[PendingEnvelope]:
        return await asyncio.to_thread(self._load, protocol, mailbox, after, limit)


class AckWriter:
    """The hub's ack sink: one `acks` row per acknowledged envelope, group-committed."""

    def __init__(self, appender: GroupCommitAppender):
        self.appender = appender

    async def __call__(self, protocol: str, mailbox: bytes, env: PendingEnvelope,
                       device: bytes | None) -> None:
        await self.appender.append({
            C.PROTOCOL: protocol, C.MAILBOX: mailbox, C.EVENT_ID: env.event_id, C.SEQ: env.seq,
            C.CURSOR: env.cursor, C.DEVICE: device, C.ACKED_AT: datetime.now(timezone.utc)})
