"""`landing`: a PySpark streaming data source over every landing table, read through delta-rs.

The delta-spark jars cannot be loaded here (no Maven), so Spark reads Delta through this
Python Data Source (DESIGN.md). Offsets are Delta versions per landing table
(`{"v": {"node-0/g000001": 17, ...}}`); a micro-batch's partitions are the data files added by
the versions in (start, end], spread over at most `maxPartitions` tasks; `read` yields Arrow
record batches (2x faster than tuples). Everything a task needs travels in its partition, so
executors on another machine only need to reach the files: no driver state is assumed.

Warm-up: Spark plans its first micro-batch only when the latest offset differs from the last
committed one, and that first batch pays seconds of one-off costs (the data source's Python
worker, the foreachBatch callback path, JIT). So every reader reports a `boot` key, new per
query run, in its latest offsets: the first trigger after any start is an (often empty) batch
that pays those costs before `relay stream` says it is ready (jobs/stream_main.py), instead
of delaying the first messages a client sends. `boot` carries no position; readers ignore it.

Waiting for data (`waitForDataMs`, stream.wait_for_data_ms): Spark asks a source for its
latest offset every trigger, 10 times a second at the old 100 ms interval, which kept the
driver JVM at ~0.16 cores with nothing to do. With the option, the query triggers
back to back (interval 0) and `latestOffset`, finding nothing new, waits on a loopback UDP
socket (`runtime/inbox_signal.BlockingSignal`) that every landing writer pokes after each
landing commit, up to `waitForDataMs` (so a signal that cannot come, from another host,
costs at most that delay, and a stop waits at most that long). It paces the batches itself:
at most one start per `minBatchGapMs` (stream.trigger_interval_ms), as the trigger did.

Early gap (`earlyGapMs`, stream.early_batch_gap_ms; `earlyProtocols`): a commit whose rows
are all of a protocol served early (a PPP STORE, a trueseal push: ingress handed it to the
recipient's session right after the landing commit, runtime/handoff.py) needs its inbox row
soon, not at once. When every commit waiting is such, batches start at most one per early
gap, so a lone sender's trickle does not run a micro-batch every trigger interval beside the
listeners on two cores; the protocols come from each add's stats (the landing writer records
the `protocol` column's min and max). A commit that needs the stream (Heya and cursor-sync
replies carry its cursors, a PPP room message waits for its number, a commit without stats)
ends the early gap within one usual gap.

Batch size: a micro-batch takes whole commits, in order, up to `maxFilesPerTrigger` files (the
read limit Spark passes) and `maxBytesPerTrigger` bytes of them (ours: Spark's Python sources
take one limit); the first commit is taken whatever its size, so the stream always moves.

On an object store (tables on S3) every read is a billed round trip, a few ms on a server
nearby and tens on S3. So the commits a batch takes and its data files are fetched
object_store.READ_THREADS at a time, each one GET where its size is known (from the log's
listing, or the add), and used in order (a refusal is raised at the version that holds it).
The driver takes the batch's file list from the source's plan on this host (`planned_files`)
instead of reading the commits again. And finding what is new costs no LIST while nothing
changes: each table's next commit and each node's next generation are looked for by reading
them (one HEAD each when absent; a commit found is kept for the batch), a table's log is
LISTed only once it has a new commit, a sealed generation never again, and the landing
prefixes at most once per `listIntervalMs` (stream.landing_list_interval_ms: how long a new
node's first landing can wait to be seen), or at once when a writer on this host signals a
commit that no table known explains (UNEXPLAINED_LIST_S bounds that). Locally, listing stays
as cheap as it is and is done every time.

Rules for the log: landing tables are append-only. An OPTIMIZE add (`dataChange=false`) is
skipped; any other remove is refused rather than silently re-read or lost. A table that
disappears was dropped by compaction after the stream consumed it, and is skipped.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable, ReadLimit, ReadMaxFiles, SupportsTriggerAvailableNow,
)

from runtime.inbox_signal import BlockingSignal, landing_signal_dir

from . import object_store
from .landing_lag import commit_version, latest_version
from .layout import Layout
from .schema import C, LANDING, LANDING_SOURCE
from .small_parquet import read_buffer, read_small

SOURCE_NAME = "relay_landing"
# Object stores: a landing writer's signal that the known tables do not explain lists the
# landing prefixes at once, but at most once per this many seconds.
UNEXPLAINED_LIST_S = 1.0
# Object stores: the commits of a table fetched ahead, with the one a batch reaches
PREFETCH = 4 * object_store.READ_THREADS


class LandingLogError(RuntimeError):
    """The landing log holds something an append-only source cannot follow."""


class DataFile(NamedTuple):
    path: str       # absolute path (or s3:// URI) of the parquet file
    size: int       # bytes, from the commit's add action
    # (min, max) of the file's `protocol` column from the add's stats; None when not recorded
    protocols: tuple[str, str] | None = None


def _protocols(add: dict) -> tuple[str, str] | None:
    try:
        stats = json.loads(add.get("stats") or "{}")
        return stats["minValues"][C.PROTOCOL], stats["maxValues"][C.PROTOCOL]
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class FileRef:
    table: str      # "<node>/g<NNNNNN>"
    version: int
    path: str       # absolute path (or s3:// URI) of the parquet file
    size: int       # bytes: sizing a batch needs no stat (or HEAD request on S3) per file


class LandingPartition(InputPartition):
    def __init__(self, files: list[FileRef], s3=None):
        super().__init__(None)
        self.files = files
        self.s3 = s3     # object_store.S3Location when the tables are on S3


def _log_file(table_path: Path, version: int) -> Path:
    return table_path / "_delta_log" / f"{version:020d}.json"


def _gone(log_file) -> LandingLogError:
    return LandingLogError(
        f"{log_file} is gone: the stream fell behind the landing log retention "
        "(delta.logRetentionDuration); replay from a newer version")


def version_adds(table_path: Path, version: int) -> list[DataFile]:
    """The data files a commit adds; see the module docstring for what is refused."""
    log_file = _log_file(table_path, version)
    try:
        text = log_file.read_text()
    except FileNotFoundError as exc:
        raise _gone(log_file) from exc
    return parse_adds(table_path, version, text)


def commits_adds(table_path: Path, versions, s3=None,
                 sizes: dict[int, int] | None = None) -> list[list[DataFile] | LandingLogError]:
    """`version_adds` of each of `versions`, in order, each a result or the LandingLogError it
    raised. On an object store (`s3`) READ_THREADS at a time, one GET for a commit file whose
    size a listing gave (`sizes`)."""
    versions = list(versions)
    if s3 is None:
        return [_or_error(version_adds, table_path, v) for v in versions]
    files = [_log_file(table_path, v) for v in versions]
    texts = object_store.read_objects(s3, [(str(f), (sizes or {}).get(v))
                                           for f, v in zip(files, versions)])
    return [_gone(f) if text is None else _or_error(parse_adds, table_path, v, text.decode())
            for f, v, text in zip(files, versions, texts)]


def parse_adds(table_path: Path, version: int, text: str) -> list[DataFile]:
    """`version_adds` of a commit file's text."""
    adds = []
    for line in text.splitlines():
        action = json.loads(line)
        if "add" in action:
            if action["add"].get("dataChange", True):
                add = action["add"]
                adds.append(DataFile(str(table_path / add["path"]), int(add["size"]),
                                     _protocols(add)))
        elif "remove" in action and action["remove"].get("dataChange", True):
            raise LandingLogError(f"{table_path} version {version} removes data; "
                                  "landing tables are append-only")
    return adds


class LandingStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]):
        self.layout = Layout.at(options["data_dir"], options.get("tables_dir", ""),
                                options.get("s3_endpoint", ""),
                                options.get("s3_region", "us-east-1"))
        self.max_files = int(options.get("maxFilesPerTrigger", "2000"))
        self.max_bytes = int(options.get("maxBytesPerTrigger", "0"))   # 0: no byte bound
        self.max_partitions = max(1, int(options.get("maxPartitions", "4")))
        self.record_consumed = options.get("recordConsumed", "true") == "true"
        self.start_versions = options.get("startVersions", "")
        self._target: dict[str, int] | None = None
        # (table, version) -> its adds, or the LandingLogError reading it raised
        self._adds_cache: dict[tuple[str, int], list[DataFile] | LandingLogError] = {}
        self._sealed: dict[str, int] = {}   # generation -> its final version
        self._reported: dict[str, int] | None = None   # the newest `_latest`, for Spark's report
        # object stores (module docstring): the tables as last listed, when, and the newest
        # version seen in each live one (-1: none yet)
        self.remote = self.layout.remote
        self.list_interval_s = int(options.get("listIntervalMs", "0")) / 1000.0
        self._tables: dict[str, Path] = {}
        self._listed_at = float("-inf")
        self._known: dict[str, int] = {}
        self._log_sizes: dict[tuple[str, int], int] = {}   # commit file bytes, from a listing
        self._woken = False     # a landing writer on this host signalled a commit
        self._boot = secrets.token_hex(4)   # see the module docstring: one warm-up batch
        self.wait_s = int(options.get("waitForDataMs", "0")) / 1000.0
        self.min_gap_s = int(options.get("minBatchGapMs", "0")) / 1000.0
        self.early_gap_s = int(options.get("earlyGapMs", "0")) / 1000.0
        self.early_protocols = frozenset(p for p in options.get("earlyProtocols", "").split(",")
                                         if p)
        self._signal: BlockingSignal | None = None
        self._last_start = 0.0

    # -- offsets ----------------------------------------------------------------------------
    def initialOffset(self) -> dict:
        # A new checkpoint reads every landing table from its first version; what an earlier
        # checkpoint already put in the inbox is recognised by the stream's dedup. `startVersions`
        # (JSON `{"<node>/g<N>": version}`) starts after given versions, for incident replays.
        return {"v": json.loads(self.start_versions) if self.start_versions else {}}

    def _latest(self) -> dict[str, int]:
        self._reported = self._latest_remote() if self.remote else self._latest_local()
        return self._reported

    def _latest_local(self) -> dict[str, int]:
        tables = self.layout.landing_tables()
        newest: dict[str, str] = {}
        for key in tables:                      # keys sort by node, then generation
            newest[key.split("/")[0]] = key
        out = {}
        for key, path in tables.items():
            v = self._sealed.get(key)
            if v is None:
                v = latest_version(path)
                if v >= 0 and newest[key.split("/")[0]] != key:
                    # The node writes a newer generation: this one never changes again.
                    self._sealed[key] = v
            if v >= 0:
                out[key] = v
        for key in [k for k in self._sealed if k not in tables]:
            del self._sealed[key]               # dropped by compaction
        return out

    def _latest_remote(self) -> dict[str, int]:
        """`_latest_local` on an object store, with as few requests as the module docstring
        says: LISTs only for what changed, HEADs (GET-priced) while nothing does."""
        now = time.monotonic()
        woken, self._woken = self._woken, False
        if now - self._listed_at >= self.list_interval_s:
            self._tables = self.layout.landing_tables(require_log=False)
            self._listed_at = now
            for known in (self._sealed, self._known):
                for key in [k for k in known if k not in self._tables]:
                    del known[key]              # dropped by compaction
        newest: dict[str, str] = {}
        for key in sorted(self._tables):
            newest[key.split("/")[0]] = key
        # each node's next generation (a process starts one, a full one is followed by one)
        # and each live table's next commit, read at once
        next_gens = [f"{node}/g{int(key.rsplit('/g', 1)[1]) + 1:06d}"
                     for node, key in newest.items()]
        probes = [(key, 0) for key in next_gens] + [
            (key, v + 1) for key, v in self._known.items() if key not in self._sealed]
        found = self._probe(probes)
        if woken and not found and now - self._listed_at >= UNEXPLAINED_LIST_S:
            # a commit on this host, in no table known: a new node's (or a generation
            # not numbered next), found by listing now rather than at the interval
            self._listed_at = float("-inf")
            return self._latest_remote()
        for key in next_gens:
            if key in found:
                self._tables[key] = self.layout.landing_root / key
                newest[key.split("/")[0]] = key
        out = {}
        for key in sorted(self._tables):
            v = self._sealed.get(key)
            if v is None:
                sealed = newest[key.split("/")[0]] != key
                v = self._known.get(key)
                if v is None or key in found or sealed:
                    v = self._list_log(key)
                if sealed:      # (with no log, -1: never written again either)
                    self._sealed[key] = v
                    self._known.pop(key, None)
                else:
                    self._known[key] = v
            if v >= 0:
                out[key] = v
        return out

    def _probe(self, probes: list[tuple[str, int]]) -> set[str]:
        """The tables of `(table, version)` pairs whose commit `version` exists, looked for at
        once (a HEAD each when absent); a commit found is read and kept for the batch (a
        LandingLogError too: raised when the stream reaches that commit)."""
        root = self.layout.landing_root
        todo = [(k, v) for k, v in probes if (k, v) not in self._adds_cache]
        texts = object_store.read_objects(
            self.layout.s3, [(str(_log_file(root / k, v)), None) for k, v in todo])
        for (key, version), text in zip(todo, texts):
            if text is not None:
                self._adds_cache[(key, version)] = _or_error(
                    parse_adds, root / key, version, text.decode())
        return {key for key, version in probes if (key, version) in self._adds_cache}

    def _list_log(self, key: str) -> int:
        """A table's newest version (-1: none yet, or gone) and the size of each commit file
        (a read of known size is one GET), from one LIST of its log."""
        best = -1
        for name, size in (self._tables[key] / "_delta_log").sizes().items():
            version = commit_version(name)
            if version is not None:
                best = max(best, version)
                self._log_sizes[(key, version)] = size
        return best

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxFiles(self.max_files)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def reportLatestOffset(self) -> dict:
        # for Spark's progress report only: what the last look found, not another look
        latest = self._reported if self._reported is not None else self._latest()
        return {"v": dict(latest), "boot": self._boot}

    def _adds(self, key: str, version: int, prefetch: int = 0) -> list[DataFile]:
        """The adds of a commit; on an object store, the next `prefetch` commits of the table
        are fetched with it, concurrently."""
        cached = self._adds_cache.get((key, version))
        if cached is None:
            path = self.layout.landing_root / key
            wanted = [v for v in range(version, version + max(1, prefetch + 1))
                      if (key, v) not in self._adds_cache] if self.remote else [version]
            sizes = {v: self._log_sizes.get((key, v)) for v in wanted}
            for v, adds in zip(wanted, commits_adds(path, wanted, self.layout.s3, sizes)):
                self._adds_cache[(key, v)] = adds
            cached = self._adds_cache[(key, version)]
        if isinstance(cached, LandingLogError):
            raise cached
        return cached

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        end = self._latest_offset(start, limit)
        if self.remote and end["v"] != start.get("v", {}):
            write_plan(self.layout, start, end, batch_files(self.layout, start, end, self._adds))
        return end

    def _latest_offset(self, start: dict, limit: ReadLimit) -> dict:
        if self._target is not None or self.wait_s <= 0:
            return self._end(start, limit)
        # Waiting for data (module docstring): the first batch after a start at once, later
        # ones at most one per `min_gap_s`, and none before something landed.
        end = self._end(start, limit)
        if end["v"] == start.get("v", {}) and start.get("boot") == self._boot:
            if self._signal is None:
                self._signal = BlockingSignal(landing_signal_dir(self.layout.root),
                                              "landing-source")
            if not self._signal.wait(self.wait_s):
                return end
            self._woken = True
            end = self._end(start, limit)       # what woke it decides the gap
        gap_s = self._gap_s(start, end)
        while (left := self._last_start + gap_s - time.monotonic()) > 0:
            # The early gap is slept in slices of the usual one: a commit that needs the
            # stream (Heya, cursor-sync, a room message) ends it within one slice.
            time.sleep(min(left, self.min_gap_s) if gap_s > self.min_gap_s > 0 else left)
            end = self._end(start, limit)       # more may have landed meanwhile
            gap_s = self._gap_s(start, end)
        if end["v"] != start.get("v", {}):
            self._last_start = time.monotonic()
        return end

    def _gap_s(self, start: dict, end: dict) -> float:
        """The least time between two batch starts for the commits in (start, end]: the early
        gap when every one of them holds only protocols whose online recipients were served
        from the landing commit (`earlyProtocols`), else the usual one."""
        if self.early_gap_s <= self.min_gap_s:
            return self.min_gap_s
        begin = start.get("v", {})
        changed = False
        for key, v_end in end.get("v", {}).items():
            for version in range(begin.get(key, -1) + 1, v_end + 1):
                changed = True
                for f in self._adds(key, version):
                    if (f.protocols is None or f.protocols[0] != f.protocols[1]
                            or f.protocols[0] not in self.early_protocols):
                        return self.min_gap_s
        return self.early_gap_s if changed else self.min_gap_s

    def stop(self) -> None:
        if self._signal is not None:
            self._signal.close()
            self._signal = None

    def _end(self, start: dict, limit: ReadLimit) -> dict:
        begin: dict[str, int] = dict(start.get("v", {}))
        latest = self._latest() if self._target is None else dict(self._target)
        budget = None if isinstance(limit, ReadAllAvailable) else (
            limit.max_files if isinstance(limit, ReadMaxFiles) else self.max_files)
        max_bytes = self.max_bytes if budget is not None and self.max_bytes > 0 else None
        end = dict(begin)
        taken = taken_bytes = 0
        # Tables in key order (node, generation): older generations drain first. A commit is
        # never split, so one larger than both bounds is a batch of its own.
        for key in sorted(latest):
            v = begin.get(key, -1)
            while v < latest[key]:
                adds = self._adds(key, v + 1, prefetch=min(latest[key] - v - 1, PREFETCH))
                n, size = len(adds), sum(f.size for f in adds)
                if taken > 0 and ((budget is not None and taken + n > budget) or
                                  (max_bytes is not None and taken_bytes + size > max_bytes)):
                    return {"v": end, "boot": self._boot}
                v += 1
                taken += n
                taken_bytes += size
                end[key] = v
        return {"v": end, "boot": self._boot}

    # -- planning and reading ----------------------------------------------------------------
    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin = start.get("v", {})
        files = batch_files(self.layout, start, end, self._adds)
        for cache in (self._adds_cache, self._log_sizes):
            for k in [k for k in cache if k[1] <= begin.get(k[0], -1)]:
                del cache[k]
        if not files:
            return []
        n = min(self.max_partitions, len(files))
        size = -(-len(files) // n)
        return [LandingPartition(files[i:i + size], self.layout.s3)
                for i in range(0, len(files), size)]

    def read(self, partition: LandingPartition) -> Iterator[pa.RecordBatch]:
        if partition.s3 is not None:    # an executor's worker: point pyarrow at the store
            object_store.configure_env(partition.s3)
        return read_files(partition.files, s3=partition.s3)

    def commit(self, end: dict) -> None:
        # Compaction drops a sealed landing generation only once it is consumed (layout.py).
        if self.record_consumed:
            self.layout.write_landing_consumed(end.get("v", {}))


def batch_files(layout: Layout, start: dict, end: dict, adds=None) -> list[FileRef]:
    """The data files of the versions in (start, end] of every landing table, in table and
    version order: what one micro-batch reads, wherever it is read. `adds(key, version,
    prefetch)`: the source's cache (`LandingStreamReader._adds`)."""
    begin = start.get("v", {})
    files: list[FileRef] = []
    for key, last in sorted(end.get("v", {}).items()):
        table_path = layout.landing_root / key
        versions = range(begin.get(key, -1) + 1, last + 1)
        if adds is None:
            read = commits_adds(table_path, versions, layout.s3)
        else:
            read = [_or_error(adds, key, v, last - v) for v in versions]
        failed = next((r for r in read if isinstance(r, LandingLogError)), None)
        if failed is not None:
            if not (table_path / "_delta_log").exists():
                continue  # dropped by compaction after it was consumed
            raise failed
        for version, added in zip(versions, read):
            files.extend(FileRef(key, version, f.path, f.size) for f in added)
    return files


def _plan_file(layout: Layout) -> Path:
    return Path(layout.root) / "run" / "landing-plan.json"


def write_plan(layout: Layout, start: dict, end: dict, files: list[FileRef]) -> None:
    """The files of the batch (start, end] as the source found them, for the driver's read
    on this host (`planned_files`): on an object store, two fewer requests per commit."""
    path = _plan_file(layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"start": start.get("v", {}), "end": end.get("v", {}),
                               "files": [[f.table, f.version, f.path, f.size] for f in files]}))
    os.replace(tmp, path)


def planned_files(layout: Layout, start: dict, end: dict) -> list[FileRef]:
    """`batch_files`, taken from the source's plan when it is of this very batch (the files
    of (start, end] never change: a commit file is written once), else read from the log."""
    if layout.remote:
        try:
            plan = json.loads(_plan_file(layout).read_text())
        except (FileNotFoundError, ValueError):
            plan = None
        if plan and plan["start"] == start.get("v", {}) and plan["end"] == end.get("v", {}):
            return [FileRef(*f) for f in plan["files"]]
    return batch_files(layout, start, end)


def _or_error(fn, *args):
    try:
        return fn(*args)
    except LandingLogError as exc:
        return exc


def read_files(files: list[FileRef], chunk_rows: int = 65536,
               s3=None) -> Iterator[pa.RecordBatch]:
    """The rows of `files`, tagged with their landing table and version, in their order. A
    landing file is small (a lone client's commit is one row): each is read as
    `small_parquet.read_small` says (on an object store, `s3`: fetched whole, one GET each,
    READ_THREADS at once), and the files of a chunk (up to `chunk_rows` rows) are tagged
    together, not one by one. (pyarrow.parquet is imported there, not here: the
    source runner, a process of its own that only plans, does without it, ~6 MiB.)"""
    schema = LANDING_SOURCE.arrow_schema()
    names = LANDING.names
    file_schema = LANDING.arrow_schema()
    required = [f.name for f in file_schema if not f.nullable]
    tables: list[pa.Table] = []
    keys: list[str] = []
    versions: list[int] = []
    counts: list[int] = []
    pending = 0

    def tagged() -> pa.Table:
        data = pa.concat_tables(tables)
        if len(tables) > 1 and data.num_rows < 4096 * len(tables):
            # small files: one chunk, not one per file, so what follows walks fewer chunks;
            # big files stay as read (combining would copy their envelopes once more)
            data = data.combine_chunks()
        rows = np.asarray(counts)   # each file's rows, tagged by repeating its table and version
        which = pa.array(np.repeat(np.arange(len(keys), dtype=np.int32), rows))
        columns = data.columns + [
            pa.DictionaryArray.from_arrays(which, pa.array(keys, pa.string())).cast(pa.string()),
            pa.array(np.repeat(np.asarray(versions, np.int64), rows))]
        for tagging in (tables, keys, versions, counts):
            tagging.clear()
        if not any(data.column(n).null_count for n in required):
            return pa.Table.from_arrays(columns, schema=schema)   # as written: no cast
        # cast, which refuses a null where the schema has none
        return pa.Table.from_arrays(columns, names=schema.names).cast(schema)

    if s3 is not None:
        fetched = object_store.read_objects(s3, [(f.path, f.size) for f in files])
        if None in fetched:
            raise FileNotFoundError(files[fetched.index(None)].path)
        read = map(lambda data: read_buffer(data, names), fetched)
    else:
        read = map(lambda f: read_small(f.path, names), files)
    for ref, table in zip(files, read):
        n = table.num_rows
        if n == 0:
            continue
        if table.schema != file_schema:   # written otherwise (types): cast, then tagged as any
            table = table.cast(file_schema)
        tables.append(table)
        keys.append(ref.table)
        versions.append(ref.version)
        counts.append(n)
        pending += n
        if pending >= chunk_rows:
            pending = 0
            yield from tagged().to_batches()
    if tables:
        yield from tagged().to_batches()


class LandingDataSource(DataSource):
    """`spark.readStream.format("relay_landing").option("data_dir", ...)`."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self):
        return LANDING_SOURCE.spark_schema()

    def streamReader(self, schema) -> LandingStreamReader:
        return LandingStreamReader(self.options)
