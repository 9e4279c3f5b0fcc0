"""The inbox stream: landing tables -> (dedup, cursors, padding audit, TTL clamp) -> inbox.

    source     spark.readStream.format("relay_landing")       delta_tables/landing_source.py
    transform  jobs/inbox_transform.transform (pure, Arrow)   unit-tested without Spark I/O
    sink       foreachBatch -> one commit per table with an app transaction marker: a direct
               append on a local disk (delta_tables/txn_append.py), delta-rs on an object store

Exactly once: every table write of batch N carries `Transaction(app_id, N)` in the same
commit as its data, and a table whose marker is already >= N is skipped, so a batch replayed
after a crash at any point writes nothing twice. The order is rejects, inbox, padding_audit:
the transform is deterministic (it sees the batch timestamp from Spark's offset log, not the
wall clock), so a replay before the inbox commit recomputes exactly what was partly written;
a replay after it finds the audit's rows in the inbox rows of that batch. The inbox commits
before the audit so the listeners are told (and deliver) one commit sooner. `app_id` embeds the
checkpoint's query id: a new checkpoint is a new stream and never skips on old markers.

The per-mailbox cursors and the dedup index live in the driver as a cache of the inbox table
(rebuilt from it at start). That is by design, not by accident of `local[*]`: foreachBatch
always runs on the driver, and the stream is the inbox's only appender.

That last sentence is enforced, not assumed (issue 18: a second stream started by mistake, on
this host or another, against the same tables): every inbox commit advances a writer counter
that all streams share whatever their checkpoint (delta_tables/writer_fence.py), from the
value read with the cache. The stream that finds the counter moved stops with
`InboxWriterLost` instead of assigning cursors from a stale cache; a restarted stream rebuilds
its cache from the inbox and goes on from there, so cursors stay gap-free and events unique
however many streams are started.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from deltalake.exceptions import CommitFailedError, DeltaError

from delta_tables import log_retention, writer_fence
from delta_tables.group_commit import COMMIT_ATTEMPTS, fsync_version
from delta_tables.txn_append import AlreadyCommitted, TxnAppender, UnsupportedTable
from delta_tables.landing_source import SOURCE_NAME, planned_files, read_files
from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX, LANDING_SOURCE, PADDING_AUDIT, REJECTS, TableDef
from runtime.inbox_signal import InboxSignalSender, signal_dir

from .inbox_transform import (InboxState, StreamRules, dedup_keys, finish, order_rows,
                              padding_audit, transform)
from .stream_state import checkpoint_started, decided, seed

log = logging.getLogger("relay.stream")
BATCH_TS = "__batch_ts"
# An app transaction in every inbox commit whose version is the last seq it assigned: the next
# seq survives compaction purging the newest rows, and a restart reads it from the log.
SEQ_MARK = "relay-inbox-seq"
QUERY_NAME = "inbox_stream"


class InboxWriterLost(writer_fence.WriterLost):
    """Another stream committed to this inbox since this one built its cursor cache."""


def landing_marks(batch: pa.Table) -> dict[str, int]:
    """App transactions for the inbox's and the rejects' commits of a batch: per landing
    table, the newest version the batch took rows from (`landing_lag.LANDING_MARK`). Every row
    lands in one of the two, so their logs say how far the stream got, to any host that can
    read the tables (relay status), with no access to the stream's checkpoint."""
    from delta_tables.landing_lag import LANDING_MARK
    if batch.num_rows == 0:
        return {}
    top = batch.group_by(C.LANDING_TABLE, use_threads=False).aggregate(
        [(C.LANDING_VERSION, "max")])
    return {LANDING_MARK + k: int(v) for k, v in zip(
        top.column(C.LANDING_TABLE).to_pylist(),
        top.column(f"{C.LANDING_VERSION}_max").to_pylist())}


def last_seq(dt: DeltaTable) -> int:
    """The newest seq the inbox was given: its `SEQ_MARK` transaction, or for an inbox written
    before that marker, the largest `seq` in its files' statistics; from the log, no row read."""
    marked = dt.transaction_version(SEQ_MARK)
    if marked is not None:
        return int(marked)
    adds = dt.get_add_actions(flatten=True)
    col = f"max.{C.SEQ}"
    if adds.num_rows == 0 or col not in adds.column_names:
        return 0
    top = pc.max(adds.column(col)).as_py()
    return int(top or 0)


def load_state(inbox_path: Path, now: datetime | None = None,
               dt: DeltaTable | None = None) -> InboxState:
    """Rebuild the stream's memory from the inbox table (tombstones included); from `dt`'s
    snapshot when given (the sink reads the writer counter from the same one)."""
    now_us = int((now or datetime.now(timezone.utc)).timestamp() * 1_000_000)
    state = InboxState()
    dt = dt if dt is not None else DeltaTable(str(inbox_path))
    t = dt.to_pyarrow_table(columns=[C.EVENT_ID, C.PROTOCOL, C.MAILBOX, C.CURSOR, C.SEQ,
                                     C.EXPIRES_AT])
    if t.num_rows == 0:
        return state
    state.last_seq = int(pc.max(t.column(C.SEQ)).as_py())
    last = t.group_by([C.PROTOCOL, C.MAILBOX], use_threads=False).aggregate([(C.CURSOR, "max")])
    state.last_cursor = {(p, m): c for p, m, c in zip(
        last.column(C.PROTOCOL).to_pylist(), last.column(C.MAILBOX).to_pylist(),
        last.column(f"{C.CURSOR}_max").to_pylist())}
    exp = pc.cast(t.column(C.EXPIRES_AT), pa.int64())
    live = t.filter(pc.greater(exp, now_us))
    for key, x in zip(dedup_keys(live).to_pylist(),
                      pc.cast(live.column(C.EXPIRES_AT), pa.int64()).to_pylist()):
        state.remember(key, x)
    return state


@dataclass(frozen=True)
class BatchPlan:
    start: dict
    end: dict
    batch_ts: datetime


def _offsets(checkpoint: Path, batch_id: int) -> tuple[dict, dict] | None:
    """(batch metadata, our source's end offset) from Spark's offset log entry
    `offsets/<id>`: a version line, the metadata with `batchTimestampMs`, then one JSON offset
    per source (ours is the only one). None when Spark has not written it or has purged it."""
    try:
        lines = (checkpoint / "offsets" / str(batch_id)).read_text().splitlines()
    except FileNotFoundError:
        return None
    return json.loads(lines[1]), json.loads(lines[2])


def _batch_ts(meta: dict) -> datetime:
    return datetime.fromtimestamp(meta["batchTimestampMs"] / 1000, timezone.utc)


def read_batch_plan(checkpoint: Path, batch_id: int,
                    start_versions: str | None = None) -> BatchPlan | None:
    """Batch `batch_id`'s source offsets from Spark's offset log. The start is the previous
    batch's end, or the source's initial offset."""
    this = _offsets(checkpoint, batch_id)
    if this is None:
        return None
    meta, end = this
    prev = _offsets(checkpoint, batch_id - 1) if batch_id > 0 else None
    if prev is None and batch_id > 0:
        return None   # purged: let Spark read it
    start = prev[1] if prev else {"v": json.loads(start_versions) if start_versions else {}}
    return BatchPlan(start, end, _batch_ts(meta))


def read_batch_ts(checkpoint: Path, batch_id: int) -> datetime:
    """Spark's timestamp for batch `batch_id` (what `current_timestamp()` is in that batch),
    from its offset log entry, which Spark writes before running the batch."""
    this = _offsets(checkpoint, batch_id)
    if this is None:
        raise FileNotFoundError(checkpoint / "offsets" / str(batch_id))
    return _batch_ts(this[0])


@dataclass
class BatchStats:
    batch_id: int
    rows_in: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)           # reason -> rows
    accepted_by_protocol: dict[str, int] = field(default_factory=dict)
    skipped_replay: bool = False
    seconds: float = 0.0


class InboxSink:
    """The foreachBatch function. Holds the driver-side state and table handles."""

    def __init__(self, layout: Layout, rules: StreamRules, checkpoint: Path,
                 app_id_prefix: str = "relay-inbox-stream", fsync: bool = True,
                 refresh_every: int = 50, start_versions: str | None = None,
                 driver_read_max_bytes: int = 64 << 20, landing: Layout | None = None,
                 spark_state: bool = False):
        self.layout = layout
        # Where the batch's landing files are: the sink's own data directory, except for an
        # incident replay, which reads the relay's landing into another inbox (jobs/replay.py).
        self.landing = landing or layout
        self.rules = rules
        self.checkpoint = checkpoint if str(checkpoint).startswith(("s3a:", "s3:")) \
            else Path(checkpoint)
        self.app_id_prefix = app_id_prefix
        self.fsync = fsync
        self.refresh_every = refresh_every
        self._app_id: str | None = None
        self._query_id = threading.Event()
        self._query_id_value: str | None = None
        if not str(checkpoint).startswith(("s3a:", "s3:")):
            self.bind(None)
        self.start_versions = start_versions
        self.driver_read_max_bytes = driver_read_max_bytes
        self.driver_reads = 0
        self._handles: dict[str, DeltaTable] = {}
        self._uses = 0
        inbox = DeltaTable(str(layout.inbox))
        # Spark's state store decides (jobs/stream_state.py) and batches come decided: the
        # sink keeps one integer, read from the inbox's log, and reads no inbox row. A sink
        # fed undecided batches (loadgen, test harnesses) decides with InboxState, rebuilt
        # from the inbox's rows.
        self.spark_state = spark_state
        self.state = None if spark_state else load_state(layout.inbox, dt=inbox)
        self.last_seq = last_seq(inbox) if spark_state else self.state.last_seq
        self._batch_last_seq = self.last_seq
        self._landing_marks: dict[str, int] = {}
        self.fence_id = writer_fence.fence_id(app_id_prefix)
        self.fence = writer_fence.read(inbox, self.fence_id)   # as of self.state
        # Direct appenders per table on a local disk, None where delta-rs commits (an object
        # store, or a table whose protocol a direct append does not honour). The inbox's
        # starts from the snapshot the cursor cache was built from, like the counter.
        self._appenders: dict[str, TxnAppender | None] = {}
        if not layout.remote:
            self._appenders[INBOX.name] = self._direct(INBOX, inbox)
        self.history: list[BatchStats] = []
        self.on_batch = None  # optional callback(BatchStats) for metrics
        # optional callback(batch_id) right after the inbox commit: wakes the listeners
        # (runtime/inbox_signal.py); it must not raise or block
        self.on_inbox_commit = None

    @property
    def app_id(self) -> str:
        if self._app_id is None:
            if self._query_id.wait(timeout=120) and self._query_id_value:
                self._app_id = f"{self.app_id_prefix}:{self._query_id_value}"
            else:
                meta = json.loads((self.checkpoint / "metadata").read_text())
                self._app_id = f"{self.app_id_prefix}:{meta['id']}"
        return self._app_id

    def bind(self, query_id: str | None) -> None:
        """The query's id (its checkpoint's), once `start()` returned: a checkpoint on an
        object store has no local `metadata` file to read it from. None: read that file."""
        self._query_id_value = query_id
        self._query_id.set()

    def _table(self, tdef: TableDef) -> DeltaTable:
        if self._uses >= self.refresh_every:
            self._handles.clear()
            self._uses = 0
        dt = self._handles.get(tdef.name)
        if dt is None:
            dt = self._handles[tdef.name] = DeltaTable(str(self.layout.table(tdef)))
        return dt

    def _direct(self, tdef: TableDef, dt: DeltaTable | None = None) -> TxnAppender | None:
        try:
            return TxnAppender(self.layout.table(tdef), tdef, dt=dt, fsync=self.fsync)
        except UnsupportedTable as exc:
            log.warning("table committed through delta-rs", extra={
                "event": "stream_direct_append_off", "table": tdef.name, "reason": str(exc)})
            return None

    def _appender(self, tdef: TableDef) -> TxnAppender | None:
        if self.layout.remote:
            return None
        if tdef.name not in self._appenders:
            self._appenders[tdef.name] = self._direct(tdef)
        return self._appenders[tdef.name]

    def _done(self, tdef: TableDef) -> int | None:
        """The newest batch id committed to `tdef` by this stream's app id."""
        appender = self._appender(tdef)
        if appender is not None:
            return appender.txn_version(self.app_id)
        return self._txn_version(tdef, self.app_id)

    def _txn_version(self, tdef: TableDef, app_id: str) -> int | None:
        """`app_id`'s newest transaction in `tdef` (delta-rs path). A handle older than the
        log compaction kept (log_retention.py) is reopened: the lookup reads its log."""
        try:
            return self._table(tdef).transaction_version(app_id)
        except DeltaError as exc:
            if not log_retention.outlived(exc):
                raise
            self._handles.pop(tdef.name, None)
            return self._table(tdef).transaction_version(app_id)

    def _write(self, tdef: TableDef, data: pa.Table, batch_id: int) -> bool:
        appender = self._appender(tdef)
        if appender is None:
            return self._write_delta_rs(tdef, data, batch_id)
        done = appender.txn_version(self.app_id)
        if done is not None and done >= batch_id:
            return False
        if data.num_rows == 0:
            return True
        txns = {self.app_id: batch_id}
        fence = None
        if tdef is INBOX:
            fence = self.fence_id
            txns[fence] = self.fence + 1
        try:
            appender.append(data, txns, fence=fence, marks=self._marks(tdef))
        except AlreadyCommitted:
            return False
        except writer_fence.WriterLost as exc:
            self._writer_lost(exc, appender.txn_version(self.fence_id))
        if tdef is INBOX:
            self.fence += 1
        return True

    def _marks(self, tdef: TableDef) -> dict[str, int]:
        """What a batch's commit records beside its exactly-once marker: the inbox its last
        seq, the inbox and rejects the landing versions the batch took (landing_marks)."""
        marks = dict(self._landing_marks) if tdef is INBOX or tdef is REJECTS else {}
        if tdef is INBOX:
            marks[SEQ_MARK] = self._batch_last_seq
        return marks

    def _write_delta_rs(self, tdef: TableDef, data: pa.Table, batch_id: int) -> bool:
        inbox = tdef is INBOX
        for attempt in range(COMMIT_ATTEMPTS):
            done = self._txn_version(tdef, self.app_id)
            dt = self._table(tdef)
            if done is not None and done >= batch_id:
                return False
            if data.num_rows == 0:
                return True
            txns = [Transaction(self.app_id, batch_id)]
            if inbox:
                txns.append(self._fence_transaction(dt))
            txns.extend(Transaction(k, v) for k, v in self._marks(tdef).items())
            try:
                write_deltalake(dt, data, mode="append", commit_properties=CommitProperties(
                    app_transactions=txns))
                break
            except DeltaError as exc:
                # compaction removed files since this handle was opened (group_commit.py) or
                # the log entries it was loaded from (log_retention.py), or another stream
                # advanced the writer counter: reopen, re-check the marker (exactly once) and
                # the counter, retry
                if not (isinstance(exc, CommitFailedError) or log_retention.outlived(exc)):
                    raise
                self._handles.pop(tdef.name, None)
                if attempt == COMMIT_ATTEMPTS - 1:
                    raise
        if inbox:
            self.fence += 1
        if self.fsync:
            fsync_version(self.layout.table(tdef), dt.version())
        return True

    def _fence_transaction(self, dt: DeltaTable) -> Transaction:
        try:
            return writer_fence.next_transaction(dt, self.fence_id, self.fence,
                                                 str(self.layout.inbox))
        except writer_fence.WriterLost as exc:
            self._writer_lost(exc, writer_fence.read(dt, self.fence_id))

    def _writer_lost(self, exc: Exception, found: int | None):
        log.error("another stream writes this inbox", extra={
            "event": "stream_writer_lost", "expected": self.fence, "found": found})
        raise InboxWriterLost(f"{exc}: stopping; a restart rebuilds from it") from None

    def _checkpoints(self) -> None:
        """Checkpoints of the tables a direct append wrote to, where one is due (delta-rs
        writes them in its commit; here they follow the batch's commits, off the inbox's)."""
        for appender in self._appenders.values():
            if appender is not None and appender.checkpoint_due():
                appender.checkpoint()

    def _read_batch(self, batch_df, batch_id: int) -> tuple[pa.Table, datetime]:
        """The micro-batch's landing rows and Spark's timestamp for it.

        Spark has written the batch's offsets, with its timestamp, to the checkpoint before
        calling us, so a batch up to `driver_read_max_bytes` is read here, straight from the
        landing files those offsets name: no Spark job, whose fixed cost (~0.2-0.5 s on 2 cores)
        would otherwise dominate push->deliver latency. A larger batch is read by the executors
        (`batch_df`), in parallel. Both paths read the same files and yield the same rows."""
        plan = read_batch_plan(self.checkpoint, batch_id, self.start_versions)
        if plan is not None:
            files = planned_files(self.landing, plan.start, plan.end)
            if sum(f.size for f in files) <= self.driver_read_max_bytes:
                self.driver_reads += 1
                return (pa.Table.from_batches(list(read_files(files, s3=self.landing.s3)),
                                              schema=LANDING_SOURCE.arrow_schema()),
                        plan.batch_ts)
        table = batch_df.toArrow()
        if BATCH_TS in table.column_names:   # a batch handed in with its time (jobs/loadgen.py)
            ts = (table.column(BATCH_TS)[0].as_py() if table.num_rows
                  else datetime.now(timezone.utc))
            return table.drop_columns([BATCH_TS]), ts
        return table, read_batch_ts(self.checkpoint, batch_id)

    def _finish_audit(self, batch_df, batch_id: int) -> None:
        """A replay of a batch whose inbox commit is done: its padding_audit commit (written
        after the inbox's) may not be. The audit is a function of the batch's accepted rows
        and timestamp: the accepted rows are, in the transform's order, the first landing
        row of each event id the inbox holds for that batch (read from landing, not the inbox,
        whose envelopes may be tombstones by now)."""
        audit_done = self._done(PADDING_AUDIT)
        if self.spark_state:
            # Spark replays the batch's decisions from the state store's previous version;
            # the DataFrame is always run, so that the state store commits this version
            decided = batch_df.toArrow()
            if audit_done is None or audit_done < batch_id:
                self._write(PADDING_AUDIT, finish(decided, 0, self.rules, batch_id).audit,
                            batch_id)
            return
        if audit_done is not None and audit_done >= batch_id:
            return
        table, batch_ts = self._read_batch(batch_df, batch_id)
        committed = set(DeltaTable(str(self.layout.inbox)).to_pyarrow_dataset().to_table(
            columns=[C.EVENT_ID], filter=ds.field(C.BATCH_ID) == batch_id).column(C.EVENT_ID)
            .to_pylist())
        ordered, keep = order_rows(table), []
        for i, event_id in enumerate(ordered.column(C.EVENT_ID).to_pylist()):
            if event_id in committed:
                committed.discard(event_id)
                keep.append(i)
        accepted = ordered.take(pa.array(keep, pa.int64()))
        size = pc.binary_length(accepted.column(C.ENVELOPE)).to_numpy(
            zero_copy_only=False).astype(np.int64)
        self._write(PADDING_AUDIT, padding_audit(accepted, size, self.rules, batch_id,
                                                 int(batch_ts.timestamp() * 1_000_000)),
                    batch_id)

    def __call__(self, batch_df, batch_id: int) -> None:
        t0 = time.perf_counter()
        stats = BatchStats(batch_id)
        self._uses += 1
        inbox_done = self._done(INBOX)
        if inbox_done is not None and inbox_done >= batch_id:
            stats.skipped_replay = True
            self._finish_audit(batch_df, batch_id)
            log.info("batch already committed", extra={"event": "stream_batch_replay_skipped",
                                                       "batch_id": batch_id})
            return
        if self.spark_state:
            table = batch_df.toArrow()
        else:
            table, batch_ts = self._read_batch(batch_df, batch_id)
        stats.rows_in = table.num_rows
        if table.num_rows:
            result = (finish(table, self.last_seq, self.rules, batch_id) if self.spark_state
                      else transform(table, self.state, self.rules, batch_id, batch_ts))
            self._batch_last_seq = result.last_seq
            self._landing_marks = landing_marks(table)
            self._write(REJECTS, result.rejects, batch_id)
            if (self._write(INBOX, result.inbox, batch_id) and result.inbox.num_rows
                    and self.on_inbox_commit):
                self.on_inbox_commit(batch_id)
            self._write(PADDING_AUDIT, result.audit, batch_id)   # after: off the critical path
            self._checkpoints()
            self.last_seq = result.last_seq
            if self.state is not None:
                self.state.apply(result)
                self.state.evict(int(batch_ts.timestamp() * 1_000_000))
            stats.accepted = result.inbox.num_rows
            stats.accepted_by_protocol = _counts(result.inbox.column(C.PROTOCOL))
            stats.rejected = _counts(result.rejects.column(C.REASON))
        stats.seconds = time.perf_counter() - t0
        self.history = (self.history + [stats])[-200:]
        log.info("batch committed", extra={
            "event": "stream_batch", "batch_id": batch_id, "rows_in": stats.rows_in,
            "accepted": stats.accepted, "rejected": stats.rejected,
            "ms": round(stats.seconds * 1000, 1)})
        if self.on_batch:
            self.on_batch(stats)


def _counts(col) -> dict[str, int]:
    """Rows per distinct value, counted by Arrow (a batch can be 100k rows)."""
    return {v["values"]: v["counts"] for v in pc.value_counts(col).to_pylist()}


def landing_stream(spark, layout: Layout, stream_conf, start_versions: str | None = None,
                   record_consumed: bool = True, early_protocols: tuple[str, ...] = ()):
    """The source DataFrame. `record_consumed=False` for a stream that is not the relay's own
    (an incident replay into another inbox): only the relay's stream may tell compaction what
    landing it can drop.

    The batch's timestamp is read from Spark's offset log (`read_batch_ts`: replay-stable, the
    same value `current_timestamp()` takes), not attached as a column: that column made each
    batch's plan differ by a literal, so Spark generated and compiled new code for every
    micro-batch (foreachBatch plans its DataFrame even when the sink reads the files itself).
    A JFR profile of the driver JVM at a trickle (one PPP sender) had the Janino compiler in 30
    of the 79 samples of `ForeachBatchSink.addBatch`."""
    reader = spark.readStream.format(SOURCE_NAME)
    for key, value in layout.options().items():
        reader = reader.option(key, value)
    reader = (reader
              .option("maxFilesPerTrigger", str(stream_conf.max_files_per_trigger))
              .option("maxBytesPerTrigger", str(stream_conf.max_bytes_per_trigger))
              .option("maxPartitions", str(stream_conf.max_partitions))
              .option("recordConsumed", "true" if record_consumed else "false")
              .option("waitForDataMs", str(stream_conf.wait_for_data_ms))
              .option("listIntervalMs", str(stream_conf.landing_list_interval_ms))
              .option("minBatchGapMs", str(stream_conf.trigger_interval_ms))
              .option("earlyGapMs", str(stream_conf.early_batch_gap_ms if early_protocols else 0))
              .option("earlyProtocols", ",".join(early_protocols)))
    if start_versions:
        reader = reader.option("startVersions", start_versions)
    return reader.load()


def early_protocols(settings) -> tuple[str, ...]:
    """Protocols whose online recipients ingress serves from the landing commit, before the
    inbox row: PPP's STORE (`PppInbox.land_early`), trueseal's push with early_delivery."""
    from engine.ppp.ids import PROTOCOL as PPP
    from engine.trueseal.ids import PROTOCOL as TRUESEAL
    return (PPP,) + ((TRUESEAL,) if settings.trueseal.early_delivery else ())


def start_inbox_stream(spark, settings, *, checkpoint: Path | None = None,
                       available_now: bool = False, fsync: bool = True,
                       start_versions: str | None = None, on_batch=None):
    """Wire source -> sink with the knobs from conf/; returns (query, sink). `on_batch`:
    called with each batch's BatchStats (metrics), set before the first batch can run."""
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    checkpoint = checkpoint or settings.stream_checkpoint
    checkpoint = checkpoint if "://" in str(checkpoint) else Path(checkpoint)
    if layout.remote:   # the seed's reads and a checkpoint beside the tables go through s3a
        from delta_tables import spark_delta
        spark_delta.configure_s3(spark, layout.s3)
    rules = StreamRules.from_conf(settings.stream,
                                  max_envelope={"trueseal": settings.trueseal.max_envelope})
    in_spark = settings.stream_state_in_spark
    sink = InboxSink(layout, rules, checkpoint, settings.stream.app_id, fsync=fsync,
                     start_versions=start_versions,
                     driver_read_max_bytes=settings.stream.driver_read_max_bytes,
                     spark_state=in_spark)
    sink.on_batch = on_batch
    if settings.egress.inbox_signal:
        sink.on_inbox_commit = InboxSignalSender(signal_dir(settings.data_dir)).notify
    landing = landing_stream(spark, layout, settings.stream, start_versions,
                             early_protocols=early_protocols(settings))
    # a new checkpoint over an inbox with rows starts from the inbox, read once; a restart
    # from its checkpoint reads no inbox row (jobs/stream_state.py)
    # (an inbox that never had a row, as at a relay's first start, has nothing to seed: no
    # Spark job for it, so the first batch is not held up by delta-spark's first read)
    if in_spark:
        fresh = not checkpoint_started(spark, str(checkpoint)) and sink.last_seq > 0
        initial = seed(spark, layout, int(time.time() * 1_000_000) if fresh else None)
        landing = decided(landing, rules, initial)
    writer = (landing.writeStream
              .queryName(QUERY_NAME)
              .foreachBatch(sink)
              .option("checkpointLocation", str(checkpoint)))
    # Waiting for data, the source paces the batches itself (landing_source.py): Spark's
    # trigger must not, or it would warn "falling behind" after every wait.
    interval = 0 if settings.stream.wait_for_data_ms > 0 else settings.stream.trigger_interval_ms
    writer = (writer.trigger(availableNow=True) if available_now else
              writer.trigger(processingTime=f"{interval} milliseconds"))
    query = writer.start()
    sink.bind(query.id)
    return query, sink
