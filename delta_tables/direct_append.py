"""A blind append to a Delta table in ~2 ms: pyarrow writes the file, we write the commit.

Why not delta-rs. The ack of every accepted envelope waits for one landing commit, and a lone
client feels its whole cost. Measured here (2026-11-26, 1-row commits with fsync, medians):
`write_deltalake` 18-22 ms; delta-rs's own transaction API (`create_write_transaction` with
a pyarrow-written file) starts at 2-3 ms but grows by ~0.7 ms per commit in the table (25-30 ms
median over 60 commits, checkpoint hook on or off): it brings the handle's snapshot up to date
on every commit. A blind append needs none of that: the Delta protocol's commit is one JSON
file, `_delta_log/<version>.json`, created only if absent. So this module does exactly that and
nothing else, the way delta-rs itself commits on a local file system:

1. write the rows as one Parquet file with pyarrow (the table's own arrow schema), and the
   commit (`commitInfo` + `add`) to a temporary file in `_delta_log`;
2. fsync the data file, the commit file and the table directory (the data file's name), all
   three at once: the commit must never name data that a crash could lose, and must never be
   empty, so nothing is linked before all three are durable;
3. `link()` the commit to the version's name: atomic and never replacing (EEXIST means another
   writer took that version: blind appends do not conflict, so retry at the next one); fsync
   `_delta_log`, and only then is the version acked.

Why at once: with the stream running beside it on 2 cores (as `relay up` runs), each fsync
slows several-fold (measured in the PPP ingress: data file p50 0.28 -> 0.56 ms, p90 0.35 ->
2.9 ms), and the three in a row took ~3.3 ms of a 1-row commit's ~3.9 ms of fsyncs (mean).
Issued together they wait for one another's journal commits instead of queueing: a lone PPP
sender (one STORE after another, relay ingress + the stream) went from 130 to 166 acked
events/s, ack p50 5.8 -> 4.2 ms (medians of 3 alternating rounds, 2026-11-27). Without the
stream, the fsyncs cost ~0.9 ms in all and the same sender gets ~300-390/s: what remains is
the stream's CPU on a 2-core machine, not this file.

Four fsyncs, no log reading, no handle: the cost does not grow with the table. Only what a
blind append may do is done: no schema change, no removes, no checkpoint (a landing
generation holds 250 commits and is dropped once consumed; the stream reads commit files
directly, `landing_source.version_adds`). delta-rs and Spark read the result as any other
version (tests/test_direct_append.py).
"""

from __future__ import annotations

import errno
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable, Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from .landing_lag import latest_version
from .small_parquet import write_options

CLIENT = "spark-relay/direct_append"

# Two threads per process, shared by every appender: with the caller's own thread, the three
# fsyncs before a link run at once. fsync releases the GIL. Made per process: a forked child
# inherits the pool's bookkeeping but not its threads.
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _fsync_pool() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():
        _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fsync")
        _pool_pid = os.getpid()
    return _pool


def fsync_all(fds: list[int]) -> None:
    """fsync every fd, concurrently; returns once all are durable (each one, when one fails:
    the caller may close the fds), then raises the first failure."""
    pending = [_fsync_pool().submit(os.fsync, fd) for fd in fds[1:]]
    errors: list[OSError] = []
    try:
        os.fsync(fds[0])
    except OSError as exc:
        errors.append(exc)
    for f in pending:
        try:
            f.result()
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _write_new(path: Path, data) -> int:
    """Create `path` (never an existing file), write `data`, return the open fd."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        os.close(fd)
        raise
    return fd


def stats_columns_of(schema: pa.Schema) -> tuple[str, ...]:
    """The columns delta-rs keeps min/max stats for (not binary): strings, integers,
    timestamps and booleans."""
    return tuple(f.name for f in schema
                 if pa.types.is_string(f.type) or pa.types.is_integer(f.type)
                 or pa.types.is_timestamp(f.type) or pa.types.is_boolean(f.type))


def _stat_value(value, up: bool):
    """A min (`up` False) or max as Delta's stats JSON holds it: a timestamp as UTC ISO to the
    millisecond (as delta-rs writes it), a max rounded up so it stays an upper bound."""
    if isinstance(value, datetime):
        us = value.microsecond % 1000
        if up and us:
            value += timedelta(microseconds=1000 - us)
        return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return value


def column_stats(table: pa.Table, columns: tuple[str, ...] = ()) -> dict:
    """An add action's `stats`: numRecords, and for `columns` (strings, integers, timestamps,
    booleans) their minValues, maxValues and nullCount, as Delta writers record them for data
    skipping."""
    stats: dict = {"numRecords": table.num_rows}
    if columns and table.num_rows:
        import pyarrow.compute as pc
        mins, maxs, nulls = {}, {}, {}
        for name in columns:
            col = table.column(name)
            mm = pc.min_max(col)
            if mm["min"].is_valid:
                mins[name] = _stat_value(mm["min"].as_py(), up=False)
                maxs[name] = _stat_value(mm["max"].as_py(), up=True)
            nulls[name] = col.null_count
        stats.update(minValues=mins, maxValues=maxs, nullCount=nulls)
    return stats


class DirectAppender:
    """Appends to one existing Delta table; one instance per writer process and table. Holds
    the table's and its log's directories open, to fsync them without reopening."""

    def __init__(self, path: Path, schema: pa.Schema, *, fsync: bool = True,
                 stats_columns: tuple[str, ...] = (), version: int | None = None):
        self.path = Path(path)
        self.log_dir = self.path / "_delta_log"
        self.schema = schema
        self.fsync = fsync
        # Columns whose min/max each add action's stats carry (Delta's minValues and
        # maxValues): the landing source reads the protocols of a commit from them without
        # opening its file; readers of the sink's tables skip files by them.
        self.stats_columns = stats_columns
        self._write_options = write_options(schema)   # once: every commit writes the same way
        # the newest version we know of (a caller that read the table passes its version)
        self.version = latest_version(self.path) if version is None else version
        if self.version < 0:
            raise FileNotFoundError(f"no Delta table at {self.path}")
        self._dir_fd = os.open(self.path, os.O_RDONLY)
        self._log_fd = os.open(self.log_dir, os.O_RDONLY)

    def close(self) -> None:
        for fd in (self._dir_fd, self._log_fd):
            os.close(fd)
        self._dir_fd = self._log_fd = -1

    def __del__(self) -> None:
        if getattr(self, "_log_fd", -1) >= 0:
            self.close()

    def append(self, table: pa.Table, *, txns: Mapping[str, int] | None = None,
               on_taken: Callable[[int], int] | None = None) -> int:
        """Commit `table` as a new version (returned) once it and its data are durable.

        `txns`: Delta app transactions (app id -> version) the commit carries, for writers that
        commit exactly once (delta_tables/txn_append.py). Such a commit is not a blind append:
        when its version is taken, `on_taken(version)` decides, from the table as it now is,
        whether it may still go ahead (returns the version to try next) or raises; the data
        file, never named by a commit, is removed then. Without `on_taken` a taken version
        just moves the commit to the next free one (blind appends never conflict)."""
        if table.schema != self.schema:
            table = table.cast(self.schema)
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, **self._write_options)
        parquet = sink.getvalue()
        name = f"part-00000-{uuid.uuid4()}-c000.parquet"
        now_ms = int(time.time() * 1000)
        stats = json.dumps(column_stats(table, self.stats_columns), separators=(",", ":"))
        info = {"timestamp": now_ms, "operation": "WRITE",
                "operationParameters": {"mode": "Append"}, "clientVersion": CLIENT}
        if not txns:
            info["isBlindAppend"] = True
        actions = [
            {"commitInfo": info},
            {"add": {"path": name, "partitionValues": {}, "size": parquet.size,
                     "modificationTime": now_ms, "dataChange": True, "stats": stats}},
        ]
        actions += [{"txn": {"appId": app, "version": v}} for app, v in (txns or {}).items()]
        body = "\n".join(json.dumps(a, separators=(",", ":")) for a in actions) + "\n"
        tmp = self.log_dir / f"_commit_{uuid.uuid4()}.json.tmp"
        data_fd = _write_new(self.path / name, parquet)
        try:
            tmp_fd = _write_new(tmp, body.encode())
        except BaseException:
            os.close(data_fd)
            raise
        linked = False
        try:
            try:
                if self.fsync:   # data, its name, the commit's content: all before the link
                    fsync_all([data_fd, tmp_fd, self._dir_fd])
            finally:
                os.close(data_fd)
                os.close(tmp_fd)
            version = self.version + 1
            while True:
                try:
                    os.link(tmp, self.log_dir / f"{version:020d}.json")
                    linked = True
                    break
                except OSError as exc:
                    if exc.errno != errno.EEXIST:
                        raise
                    version = (on_taken(version) if on_taken is not None
                               else max(version + 1, latest_version(self.path) + 1))
        finally:
            os.unlink(tmp)
            if not linked and on_taken is not None:
                try:
                    os.unlink(self.path / name)
                except OSError:
                    pass
        if self.fsync:
            os.fsync(self._log_fd)
        self.version = version
        return version
