"""What the owners of a protocol's control tables share (`heya_control.py`, `ppp_control.py`,
`sync_control.py`): the interface they implement, the writing and the following they have in
common. Several hosts serve one protocol at once, each with its own `ControlTables` over the
same tables (decision 0009).

A control plane (tokens, mailboxes, members, backups, push registrations: DESIGN.md
"Control-plane state") is a few small append-only tables (`schema_<protocol>.py`) folded into
memory (`<protocol>_state.py`). A change is a read-modify-write run by `change(body)`: `body`
checks memory, writes its rows (`write`, one commit, fsync'ed like a landing commit) and
applies them to memory only after the commit returned, with the fold the loader uses, so
what a client was told survives a crash and a restart rebuilds the same state.

Concurrent writers on other hosts are fenced through the Delta log (`writer_fence.py`): every
commit to a control table carries the next value of that table's counter (a Delta app
transaction), so of two hosts committing to one table from the same version exactly one wins;
delta-rs fails the other ("Concurrent transaction failed"), which then folds what the others
committed (`refresh`) and runs `body` again on the fresh state (at most `CHANGE_ATTEMPTS`
times). Changes to one table are thereby linearisable across hosts: two hosts racing for one
inbox token, one registration cap or one backup version cannot both win. Changes of one host
are also serialised by `lock` (they are rare next to the protocol's messages, which never
take it).

Row times (`at`, unix microseconds) are strictly increasing per table in commit order, across
hosts: a row's `at` is above every `at` its writer folded, and its commit fails if anyone
committed to that table since. So `at` stays unique (compaction's MERGE key,
`jobs/compact_step.py`) and a host catches up by reading the rows after the newest `at` it
holds (`_catch_up`). A table written without the fence (sync's ack progress, group-committed
per host) is read again over `unfenced[name]` microseconds back, for a fold that is
order-independent and idempotent.

Memory follows the others' commits three ways: a lost commit race refreshes; a read that
misses (`known`: a token or mailbox created on another host) refreshes before refusing; and
`start_following` refreshes every `FOLLOW_SECONDS` (a stat or HEAD per table when nothing
changed), so a revocation on another host is honoured here
within about that long.

An owner sets `tables` (in fold order), implements `fold(name, rows)`, calls `open()` from
its `load()`, changes through `change` with `write`, and stores: policy is the shell's.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from . import log_retention, object_store, writer_fence
from .group_commit import fsync_version
from .layout import Layout, ensure_table
from .query import sql
from .schema import TableDef

log = logging.getLogger("relay.control")

T = TypeVar("T")

# A change that loses its commit to other hosts this many times in a row gives up
# (ControlBusy): the client hears the protocol's transient failure and retries.
CHANGE_ATTEMPTS = 8
# How often a host folds what the other hosts committed, when nothing else made it
# (ingress.control_follow_seconds).
FOLLOW_SECONDS = 1.0
# Every this many refreshes, each table's handle is brought up to date even if its next
# commit file is not there (a handle older than the log retention finds no next file).
FULL_LOOK_EVERY = 60
# A table's handle is opened afresh (from its last checkpoint) after this many commits through
# it: a long-lived delta-rs handle slows as the log grows (group_commit.DeltaAppendTarget).
REOPEN_EVERY = 100


def utc_micros() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1_000_000)


class ControlConflict(Exception):
    """Another host committed to the table since this host's handle: refresh and decide again."""


class ControlBusy(RuntimeError):
    """A change lost its commit to other hosts `CHANGE_ATTEMPTS` times in a row."""


def fence_of(table: str) -> str:
    """The app id of a control table's writer counter."""
    return writer_fence.fence_id(f"control:{table}")


def fenced_append(dt: DeltaTable, name: str, path: Path, data: pa.Table, *,
                  fsync: bool) -> int:
    """Append `data` through `dt` carrying the table's next counter value; ControlConflict if
    any commit landed since `dt`'s version (another host's, or compaction's). Returns the
    version written (`dt` is then at it)."""
    fence = fence_of(name)
    props = CommitProperties(app_transactions=[
        writer_fence.Transaction(fence, writer_fence.read(dt, fence) + 1)])
    try:
        write_deltalake(dt, data, mode="append", commit_properties=props)
    except DeltaError as exc:
        if isinstance(exc, CommitFailedError) or log_retention.outlived(exc):
            raise ControlConflict(name) from None
        raise
    version = dt.version()
    if fsync:
        fsync_version(path, version)
    return version


def rows_after(dt: DeltaTable, after: int, columns: str = "*") -> pa.Table:
    """The rows of `dt`'s snapshot with `at` above `after` (unix µs), in `at` order."""
    return sql({"t": dt}, f"SELECT {columns} FROM t WHERE at > to_timestamp_micros({int(after)}) "
                          f"ORDER BY at")


def max_at(t: pa.Table) -> int:
    if t.num_rows == 0:
        return 0
    import pyarrow.compute as pc
    return int(pc.max(pc.cast(t.column("at"), pa.int64())).as_py())


class ControlTables:
    tables: Mapping[str, TableDef] = {}   # the protocol's control tables, in fold order
    unfenced: Mapping[str, int] = {}      # table -> µs read again on each refresh (see above)
    columns: Mapping[str, str] = {}       # table -> the columns folded, if not all (payloads)

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros):
        """`clock` returns unix microseconds (row times; tests move it)."""
        self.layout = layout
        self.fsync = fsync
        self.clock = clock
        self.lock = asyncio.Lock()
        self.paths: dict[str, Path] = {}
        self.writes = 0
        self.conflicts = 0          # commits lost to another host (then decided again)
        self.refreshes = 0          # refreshes that found another host's commits
        self.last_at = 0            # the newest `at` folded or written, any table
        self._dt: dict[str, DeltaTable] = {}
        self._table_at: dict[str, int] = {}     # per table: the newest `at` folded
        self._commits: dict[str, int] = {}      # per table: commits through its handle
        self._queued: asyncio.Task | None = None     # the next refresh, not started
        self._current: asyncio.Task | None = None    # the refresh started last
        self._follower: asyncio.Task | None = None
        self._looks = 0

    # --- for the owner -------------------------------------------------------------------------
    def fold(self, found: dict[str, pa.Table]) -> None:
        """Apply the rows found (table name -> its new rows, in `at` order) to memory, as the
        loader does."""
        raise NotImplementedError

    async def open(self) -> dict[str, Path]:
        """Create the tables if needed, open a handle on each and fold every row (the owner
        resets its state before). Returns the tables' paths."""
        def opened() -> dict[str, DeltaTable]:
            paths = self.layout.table_paths(self.tables)
            return {name: ensure_table(paths[name], tdef) for name, tdef in self.tables.items()}
        self.paths = self.layout.table_paths(self.tables)
        self._dt = await asyncio.to_thread(opened)
        self._table_at = {name: 0 for name in self.tables}
        self._commits = {name: 0 for name in self.tables}
        async with self.lock:
            await self._catch_up(initial=True)
        return self.paths

    def next_at(self, state=None) -> int:
        """The next row time: the clock, but after every `at` folded or written."""
        seen = self.last_at if state is None else max(self.last_at, state.last_at)
        at = max(self.clock(), seen + 1)
        self.last_at = at
        if state is not None:
            state.last_at = at
        return at

    async def change(self, body: Callable[[], Awaitable[T]]) -> T:
        """Run `body` (check memory, `write`, apply) under the lock; when its commit loses to
        another host's, fold what they committed and run it again."""
        async with self.lock:
            for _ in range(CHANGE_ATTEMPTS):
                try:
                    return await body()
                except ControlConflict:
                    self.conflicts += 1
                    await self._catch_up()
            raise ControlBusy("control change lost to other hosts' commits "
                              f"{CHANGE_ATTEMPTS} times")

    async def write(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Append `rows` to `table` as one fenced commit (durable when it returns);
        ControlConflict if another host committed to it first (nothing written)."""
        dt = self._dt[table]
        data = pa.Table.from_pylist(rows, schema=self.tables[table].arrow_schema())
        await asyncio.to_thread(fenced_append, dt, table, self.paths[table], data,
                                fsync=self.fsync)
        self._table_at[table] = max(self._table_at[table], max_at(data))
        self._commits[table] += 1
        self.writes += 1

    async def fresh(self, check: Callable[[], bool]) -> bool:
        """In a change (under the lock): `check()`, and if it fails, again after folding the
        other hosts' commits, so a change never refuses what another host just made."""
        if check():
            return True
        await self._catch_up()
        return check()

    async def known(self, check: Callable[[], bool]) -> bool:
        """`check()`, and if it fails, again after folding the other hosts' commits (a
        token, mailbox or member made on another host). Concurrent misses share a refresh."""
        if check():
            return True
        await self.refresh()
        return check()

    async def refresh(self) -> None:
        """Fold what other hosts committed. A call waits for a refresh that starts after it
        (one queued at most, shared by every caller meanwhile)."""
        if self._queued is None:
            before = self._current

            async def run() -> None:
                if before is not None:
                    await asyncio.gather(before, return_exceptions=True)
                self._queued, self._current = None, asyncio.current_task()
                async with self.lock:
                    await self._catch_up()
            self._queued = asyncio.create_task(run(), name="control-refresh")
        task = self._queued
        await asyncio.shield(task)

    def start_following(self, interval: float = FOLLOW_SECONDS) -> None:
        async def follow() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.refresh()
                except Exception as exc:     # noqa: BLE001 - a store hiccup: next round
                    log.warning("control tables not refreshed", extra={
                        "event": "control_refresh_failed", "error": type(exc).__name__})
        if self._follower is None:
            self._follower = asyncio.create_task(follow(), name="control-follow")

    async def stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None

    # --- catching up ---------------------------------------------------------------------------
    async def _catch_up(self, initial: bool = False) -> None:
        """Under the lock: per table in fold order, the rows committed since this host's
        handle, folded. The handle and memory move together, so a commit through the handle
        (fenced) is a commit on top of everything memory holds of that table."""
        found = await asyncio.to_thread(self._read_new, initial)
        for name, rows in found.items():
            self._table_at[name] = max(self._table_at[name], max_at(rows))
            self.last_at = max(self.last_at, self._table_at[name])
        if found:
            self.fold(found)
        if found and not initial:
            self.refreshes += 1

    def _moved(self, name: str, version: int) -> bool:
        """Whether the table has a commit after `version`: a stat on a local disk, a HEAD on
        S3 (a follow that finds nothing new LISTs nothing)."""
        return (self.paths[name] / "_delta_log" / f"{version + 1:020d}.json").exists()

    def _read_new(self, initial: bool) -> dict[str, pa.Table]:
        self._looks += 1
        names = list(self.tables)
        look = (map if not self.layout.remote else object_store.concurrently)  # HEADs at once
        moved = ({} if initial else dict(zip(names, look(
            lambda n: self._moved(n, self._dt[n].version()), names))))
        out = {}
        for name in names:
            dt = self._dt[name]
            before = dt.version()
            if not initial:
                if self._commits[name] >= REOPEN_EVERY:
                    # a fresh handle at the newest version: what it shows is folded below
                    dt = self._dt[name] = DeltaTable(dt.table_uri)
                    self._commits[name] = 0
                elif self._looks % FULL_LOOK_EVERY and not moved[name]:
                    continue
                else:
                    try:
                        dt.update_incremental()
                    except DeltaError as exc:     # its log was cleaned past it: reopen
                        if not log_retention.outlived(exc):
                            raise
                        dt = self._dt[name] = DeltaTable(dt.table_uri)
                    if dt.version() == before:
                        continue
            after = self._table_at[name] - (self.unfenced.get(name, 0) if not initial else 0)
            rows = rows_after(dt, max(0, after) if not initial else 0,
                              self.columns.get(name, "*"))
            if rows.num_rows:
                out[name] = rows
        return out
