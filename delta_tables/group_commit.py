"""Group commit: many concurrent appenders share one Delta commit.

A commit costs about the same whether it carries 1 row or 1,000 (a delta-rs append ~10-20 ms,
a landing direct append ~2-4 ms: `direct_append.py`), so acking one push per commit would cap
a node at a few hundred pushes/s. Callers `await append(row)`; a single writer task takes
everything queued, commits it in a worker thread, and only then releases the callers, so an
ack sent after `append` returns is an ack of durable data. While one commit is in flight the
next group accumulates: under load, groups grow by themselves and latency stays ~one commit.
A group of at most `inline_rows` rows (ingress.inline_commit_rows) commits on the loop's own
thread instead, where the target allows it (a local landing table): a lone client's ack
skips the hop to a worker thread and back (~0.1 ms each way on this machine), and whoever
sends meanwhile waits in its socket and joins the next group, which goes to the thread.

Durability: the new data files, the commit file and their directories are fsync'ed before the
callers are released (delta-rs writes through the page cache, so `DeltaAppendTarget` fsyncs
after it returns; `DirectAppendTarget` fsyncs as it writes), so an acked envelope survives a
machine crash as well as a process crash. `fsync=False` trades that for latency (tests,
benchmarks say which they use).
"""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from runtime.inbox_signal import InboxSignalSender, landing_signal_dir

from . import log_retention, object_store
from .direct_append import DirectAppender, fsync_all
from .layout import Layout, ensure_table
from .node_lease import LEASE_APP, LeaseLost, NodeLease
from .schema import C, LANDING, TableDef

log = logging.getLogger("relay.group_commit")

# delta-rs refuses an append made through a handle older than a commit that removed files
# (compaction's MERGE/DELETE), and retrying through the same handle fails again. A failed
# commit writes nothing to the log, so reopening the table and retrying is safe.
COMMIT_ATTEMPTS = 5


def fsync_version(table_path: Path, version: int) -> None:
    """fsync the commit file of `version`, every data file it adds, and their directories, all
    at once (`direct_append.fsync_all`: on a busy 2-core machine each fsync waits for the
    journal, and one after another they add up). The commit is already visible, so their
    order does not matter: all are durable when this returns. On an object store there is
    nothing to do: a PUT is durable once it returned."""
    if object_store.is_remote(table_path):
        return
    log_file = table_path / "_delta_log" / f"{version:020d}.json"
    paths = [log_file]
    dirs = {log_file.parent}
    for line in log_file.read_text().splitlines():
        action = json.loads(line)
        if "add" in action:
            data = table_path / action["add"]["path"]
            paths.append(data)
            dirs.add(data.parent)
    fds = []
    try:
        for path in paths + sorted(dirs):
            fds.append(os.open(path, os.O_RDONLY))
        fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)


@dataclass
class CommitResult:
    table: str     # which table took the commit (landing generation key, or the table path)
    version: int
    rows: int
    seconds: float


class _Fencing:
    """What both landing targets do for a node's lease (node_lease.py)."""

    def fence(self) -> None:
        """An empty commit with the lease holder's token: the former holder's next commit to
        this table fails."""
        self.commit(self.schema.empty_table())
        self.commits -= 1

    def _lost(self) -> LeaseLost:
        return LeaseLost(f"node {self.lease.node!r}: another process took over its lease and "
                         f"fenced {self.key}; this one stops writing")


class DeltaAppendTarget(_Fencing):
    """Appends to one Delta table through a handle that is reopened every `refresh_every`
    commits: a long-lived delta-rs handle slows as the log grows (14 -> 95 ms over 1,250
    commits, DESIGN.md), a fresh one loads from the last checkpoint."""

    def __init__(self, path: Path, tdef: TableDef, *, refresh_every: int = 100,
                 fsync: bool = True, key: str | None = None, lease: NodeLease | None = None):
        """`lease`: every commit carries the holder's fencing token, and fails (LeaseLost)
        once another holder's commit is in the table (node_lease.py)."""
        self.path = object_store.as_path(path)
        self.lease = lease
        self.tdef = tdef
        self.schema = tdef.arrow_schema()
        self.refresh_every = refresh_every
        self.fsync = fsync
        self.key = key or str(self.path)
        self._dt: DeltaTable | None = None
        self._since_refresh = 0
        self.commits = 0

    def _handle(self) -> DeltaTable:
        if self._dt is None or self._since_refresh >= self.refresh_every:
            self._dt = ensure_table(self.path, self.tdef)
            self._since_refresh = 0
        return self._dt

    def inline_ok(self) -> bool:
        return False    # a delta-rs commit: ~10-20 ms, or a network round trip

    def _fenced(self, dt: DeltaTable) -> None:
        if (dt.transaction_version(LEASE_APP) or 0) > self.lease.epoch:
            raise self._lost()

    def commit(self, table: pa.Table) -> CommitResult:
        t0 = time.perf_counter()
        props = None
        if self.lease is not None:
            self.lease.check()
            props = CommitProperties(app_transactions=[Transaction(LEASE_APP, self.lease.epoch)])
        for attempt in range(COMMIT_ATTEMPTS):
            dt = self._handle()
            if self.lease is not None:
                self._fenced(dt)
            try:
                write_deltalake(dt, table, mode="append", commit_properties=props)
                break
            except DeltaError as exc:
                # a lost race, or a handle older than the log compaction kept
                # (log_retention.py): reopen at the newest version and try again
                if attempt == COMMIT_ATTEMPTS - 1 or not (
                        isinstance(exc, CommitFailedError) or log_retention.outlived(exc)):
                    raise
                self._dt = None
        version = dt.version()
        if self.fsync:
            fsync_version(self.path, version)
        self._since_refresh += 1
        self.commits += 1
        return CommitResult(self.key, version, table.num_rows, time.perf_counter() - t0)


class DirectAppendTarget(_Fencing):
    """`DeltaAppendTarget`'s interface over `DirectAppender`: a blind append in ~2 ms that does
    not slow as the log grows (direct_append.py says why not delta-rs here)."""

    def __init__(self, path: Path, tdef: TableDef, *, fsync: bool = True,
                 key: str | None = None, stats_columns: tuple[str, ...] = (),
                 lease: NodeLease | None = None):
        self.path = Path(path)
        self.lease = lease
        self.schema = tdef.arrow_schema()
        self.key = key or str(self.path)
        dt = ensure_table(self.path, tdef)
        version = None
        if lease is not None:
            # from this version on, a commit we did not make is seen by `_taken`; up to it,
            # the snapshot says whether a newer holder fenced the table already
            version = dt.version()
            if (dt.transaction_version(LEASE_APP) or 0) > lease.epoch:
                raise self._lost()
        self._appender = DirectAppender(self.path, self.schema, fsync=fsync,
                                        stats_columns=stats_columns, version=version)
        self.commits = 0

    def inline_ok(self) -> bool:
        return True     # four fsyncs on a local disk, no log reading

    def _taken(self, version: int) -> int:
        """A version another writer took: fenced if its commit carries a newer holder's
        token (node_lease.py), else the next version is tried (appends do not conflict)."""
        log_file = self.path / "_delta_log" / f"{version:020d}.json"
        for line in log_file.read_text().splitlines():
            txn = json.loads(line).get("txn")
            if txn and txn["appId"] == LEASE_APP and txn["version"] > self.lease.epoch:
                raise self._lost()
        return version + 1

    def commit(self, table: pa.Table) -> CommitResult:
        t0 = time.perf_counter()
        if self.lease is None:
            version = self._appender.append(table)
        else:
            self.lease.check()
            version = self._appender.append(table, txns={LEASE_APP: self.lease.epoch},
                                            on_taken=self._taken)
        self.commits += 1
        return CommitResult(self.key, version, table.num_rows, time.perf_counter() - t0)


class LandingTarget:
    """The landing table of one ingress node, rotated to a new generation every
    `commits_per_generation` commits, each commit a direct append (`DirectAppendTarget`).
    Rotation lets compaction delete a fully consumed generation as one directory, and keeps
    each log short for the readers that list it (the stream, `relay status`); with delta-rs
    appends it also kept commit latency flat (p50 19 -> 68 ms over 4,000 commits in one
    table, flat at 13-21 ms with 250 per generation)."""

    def __init__(self, layout: Layout, node: str, *, commits_per_generation: int = 250,
                 fsync: bool = True, max_age_seconds: float = 0,
                 lease: NodeLease | None = None):
        """`max_age_seconds` (> 0): a generation holding rows is also sealed this long after it
        opened, on the next commit or, idle, by `seal_if_old`, so the envelope copies it holds
        can be dropped within the retention bound (docs/operating/retention.md).
        `lease`: the node's lease, taken (node_lease.py). Its holder fences the node's newest
        generation and each one it opens before writing there, and every commit carries its
        token: a former holder of the id, paused or cloned, cannot write after this one
        started."""
        self.layout = layout
        self.node = node
        self.commits_per_generation = commits_per_generation
        self.max_age_seconds = max_age_seconds
        self.fsync = fsync
        self.lease = lease
        self.schema = LANDING.arrow_schema()
        gens = layout.generations(node)
        if lease is not None and gens:
            self._target_of(gens[-1]).fence()
        # Always start a new generation: the previous one is sealed and can be dropped once
        # the stream consumed it, and we never need to count a dead process's commits.
        self.generation = (gens[-1] + 1) if gens else 1
        self._target = self._open(self.generation)
        # Every landing commit wakes the stream's source, which waits for data
        # (stream.wait_for_data_ms, landing_source.py).
        self.signal = InboxSignalSender(landing_signal_dir(layout.root))

    def _target_of(self, generation: int) -> DirectAppendTarget | DeltaAppendTarget:
        path = self.layout.landing_generation(self.node, generation)
        key = f"{self.node}/g{generation:06d}"
        if self.layout.remote:
            # A direct append creates its commit with link(), which S3 lacks; delta-rs commits
            # there with a conditional PUT (object_store.py).
            return DeltaAppendTarget(path, LANDING, fsync=self.fsync, key=key, lease=self.lease)
        # Each commit's protocols in its stats: the stream's source paces commits whose
        # recipients were served at once differently (landing_source.py, early_batch_gap_ms).
        return DirectAppendTarget(path, LANDING, fsync=self.fsync, key=key,
                                  stats_columns=(C.PROTOCOL,), lease=self.lease)

    def _open(self, generation: int) -> DirectAppendTarget | DeltaAppendTarget:
        if self.lease is not None:
            self.lease.check()      # a generation is opened by the lease's holder only
        self._opened = time.monotonic()
        target = self._target_of(generation)
        if self.lease is not None:
            target.fence()
            self.lease.generation = generation
        return target

    @property
    def current_key(self) -> str:
        return self._target.key

    def _generation_full(self) -> bool:
        """The next commit opens a new generation (delta-rs creates its table, ~5 ms)."""
        return (self._target.commits >= self.commits_per_generation
                or self._too_old())

    def _too_old(self) -> bool:
        return (self.max_age_seconds > 0 and self._target.commits > 0
                and time.monotonic() - self._opened >= self.max_age_seconds)

    def seal_if_old(self) -> bool:
        """Open the next generation now if this one holds rows and is past its age (an idle
        node would otherwise keep its last envelopes in landing until its next push)."""
        if not self._too_old():
            return False
        self.generation += 1
        self._target = self._open(self.generation)
        return True

    def inline_ok(self) -> bool:
        return not self._generation_full() and self._target.inline_ok()

    def commit(self, table: pa.Table) -> CommitResult:
        if self._generation_full():
            self.generation += 1
            self._target = self._open(self.generation)
        result = self._target.commit(table)
        self.signal.notify(result.version)
        return result


class GroupCommitAppender:
    """`await append(row)` returns once `row` is in a committed Delta version.

    `max_rows` bounds one commit (and the memory of one group); callers beyond it wait for the
    next commit. `max_queue` bounds how many rows may wait in total: past it `append` waits for
    room, which pushes back on the sockets instead of growing memory without bound.
    """

    def __init__(self, target: DeltaAppendTarget | LandingTarget, *, max_rows: int = 20000,
                 max_queue: int = 200_000, latency_window: int = 4096, inline_rows: int = 0):
        self.target = target
        self.inline_rows = inline_rows
        self.schema: pa.Schema = target.schema
        self.max_rows = max_rows
        self.max_queue = max_queue
        # a row's values in schema order, picked in C (a generator per row showed in profiles)
        self._values = operator.itemgetter(*self.schema.names)
        self._rows: list[tuple] = []
        self._futures: list[asyncio.Future] = []
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.commit_seconds: deque[float] = deque(maxlen=latency_window)
        self.rows_committed = 0
        self.commits = 0
        self.failures = 0
        # Optional callback(CommitResult) after each commit, before its callers are released:
        # the metrics endpoint's commit-latency histogram (runtime/metrics.py).
        self.on_commit: Callable[[CommitResult], None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="group-commit")

    async def close(self) -> None:
        """Commit what is queued, then stop."""
        self._closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def append(self, row: Mapping[str, Any]) -> CommitResult:
        if self._closing:
            raise RuntimeError("appender is closing")
        while len(self._rows) >= self.max_queue:
            self._room.clear()
            await self._room.wait()
        fut = asyncio.get_running_loop().create_future()
        self._rows.append(self._values(row))
        self._futures.append(fut)
        self._wakeup.set()
        return await fut

    async def _seal_idle(self) -> None:
        try:
            await asyncio.to_thread(self.target.seal_if_old)
        except Exception as exc:   # the next commit opens it, or the next tick retries
            log.warning("sealing an idle landing generation failed",
                        extra={"event": "landing_seal_failed", "error": type(exc).__name__})

    def _build(self, rows: list[tuple]) -> pa.Table:
        cols = list(zip(*rows))
        return pa.Table.from_arrays(
            [pa.array(col, type=f.type) for col, f in zip(cols, self.schema)],
            schema=self.schema)

    async def _run(self) -> None:
        seal_every = getattr(self.target, "max_age_seconds", 0)
        while True:
            if seal_every > 0:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), seal_every / 2)
                except asyncio.TimeoutError:
                    await self._seal_idle()
                    continue
            else:
                await self._wakeup.wait()
            self._wakeup.clear()
            while self._rows:
                rows, futs = self._rows[:self.max_rows], self._futures[:self.max_rows]
                del self._rows[:self.max_rows], self._futures[:self.max_rows]
                if len(self._rows) < self.max_queue:
                    self._room.set()
                try:
                    table = self._build(rows)
                    if len(rows) <= self.inline_rows and self.target.inline_ok():
                        result = self.target.commit(table)
                    else:
                        result = await asyncio.to_thread(self.target.commit, table)
                except Exception as exc:  # the callers hear it; nothing is acked
                    self.failures += 1
                    log.error("group commit failed", extra={"event": "commit_failed",
                                                            "rows": len(rows)}, exc_info=exc)
                    for f in futs:
                        if not f.done():
                            f.set_exception(exc)
                    continue
                self.commits += 1
                self.rows_committed += len(rows)
                self.commit_seconds.append(result.seconds)
                if self.on_commit is not None:
                    self.on_commit(result)
                for f in futs:
                    if not f.done():
                        f.set_result(result)
            if self._closing:
                return
