"""The inbox stream through real Spark Structured Streaming and real Delta tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX, PADDING_AUDIT
from jobs.inbox_stream import InboxSink, start_inbox_stream
from jobs.inbox_transform import StreamRules

from landing_rows import envelope, land, landing_row

MB = [bytes([i]) * 32 for i in range(1, 6)]


def run_available_now(spark, settings):
    query, sink = start_inbox_stream(spark, settings, available_now=True, fsync=False)
    query.awaitTermination(120)
    assert query.exception() is None
    return sink


def read(path):
    return DeltaTable(str(path)).to_pyarrow_table()


def assert_gap_free(inbox, start=1):
    per = {}
    for r in inbox.select([C.PROTOCOL, C.MAILBOX, C.CURSOR]).to_pylist():
        per.setdefault((r[C.PROTOCOL], r[C.MAILBOX]), []).append(r[C.CURSOR])
    for key, cursors in per.items():
        assert sorted(cursors) == list(range(start, start + len(cursors))), key
    seqs = inbox.column(C.SEQ).to_pylist()
    assert len(set(seqs)) == len(seqs)
    return per


def test_two_nodes_dedup_gap_free_and_restart(spark, settings, layout):
    rows = [landing_row(MB[i % 5], envelope(i)) for i in range(300)]
    land(layout, rows[:200], node="node-a", per_commit=20)
    # node-b lands the last 100 and re-lands 50 of node-a's (client retries to another node)
    land(layout, rows[200:] + rows[:50], node="node-b", per_commit=30)
    sink = run_available_now(spark, settings)
    inbox = read(layout.inbox)
    assert inbox.num_rows == 300
    assert len(set(inbox.column(C.EVENT_ID).to_pylist())) == 300
    assert_gap_free(inbox)
    rejects = read(layout.rejects)
    assert rejects.column(C.REASON).to_pylist() == ["duplicate"] * 50
    assert sum(s.rows_in for s in sink.history) == 350

    # a restart (new sink, state rebuilt from the inbox) continues each mailbox's cursors
    more = [landing_row(MB[i % 5], envelope(1000 + i)) for i in range(50)] + rows[100:110]
    land(layout, more, node="node-a", per_commit=15)
    run_available_now(spark, settings)
    inbox = read(layout.inbox)
    assert inbox.num_rows == 350
    per = assert_gap_free(inbox)
    assert all(max(c) == 70 for c in per.values())
    assert read(layout.rejects).num_rows == 60
    audit = read(layout.padding_audit)
    assert pc.sum(audit.column(C.ENVELOPES)).as_py() == 350
    # the source recorded what it consumed (compaction drops landing only up to there)
    assert layout.read_landing_consumed()


def test_driver_and_executor_reads_build_the_same_inbox(spark, settings, tmp_path):
    """Small batches are read by the driver from the files the offsets name, large ones by
    the executors: the same landing must give the same inbox either way."""
    from runtime import config
    from delta_tables.layout import Layout
    rows = [landing_row(MB[i % 4], envelope(i)) for i in range(90)]
    rows += rows[:10]                                  # retries
    inboxes, sinks = [], []
    for name, limit in (("driver", 64 << 20), ("executors", 0)):
        s = config.load(None, env={}, data_dir=str(tmp_path / name))
        s.stream.driver_read_max_bytes = limit
        s.stream.max_files_per_trigger = 3             # several batches
        lay = Layout(s.data_dir)
        lay.ensure_shared_tables()
        land(lay, rows, per_commit=7)
        sinks.append(run_available_now(spark, s))
        inboxes.append(read(lay.inbox).select(
            [C.EVENT_ID, C.MAILBOX, C.CURSOR, C.SEQ, C.ENVELOPE, C.EXPIRES_AT]).sort_by(C.SEQ))
    assert sinks[0].driver_reads == len(sinks[0].history) > 1
    assert sinks[1].driver_reads == 0
    assert inboxes[0].num_rows == 90
    assert inboxes[0].equals(inboxes[1])


def test_a_backlog_is_taken_in_batches_bounded_by_bytes(spark, tmp_path):
    """Under a backlog a batch grows over many commits up to `max_bytes_per_trigger` (here
    about two and a half commits' files) whatever `max_files_per_trigger` allows, so it stays
    on the driver's read path: unbounded, a 1M-row backlog was one batch the executors
    collected into the driver JVM, which died of OutOfMemoryError. A commit larger than the
    bound is a batch of its own, so the stream still moves."""
    from runtime import config
    from delta_tables.landing_source import version_adds
    rows = [landing_row(MB[i % 4], envelope(i)) for i in range(80)]
    for name, bound in (("bounded", None), ("one-commit", 1)):
        s = config.load(None, env={}, data_dir=str(tmp_path / name))
        lay = Layout(s.data_dir)
        lay.ensure_shared_tables()
        land(lay, rows, node="node-a", per_commit=10)
        (table,) = lay.landing_tables().values()
        sizes = [sum(f.size for f in version_adds(table, v)) for v in range(1, 9)]
        assert len(set(sizes)) <= 2 and min(sizes) > 0.9 * max(sizes)   # commits alike
        s.stream.max_files_per_trigger = 2000
        s.stream.max_bytes_per_trigger = bound or max(sizes) * 5 // 2
        sink = run_available_now(spark, s)
        batches = [b.rows_in for b in sink.history if b.rows_in]
        assert sum(batches) == 80
        assert batches == ([20] * 4 if bound is None else [10] * 8)
        assert sink.driver_reads == len(sink.history)
        inbox = read(lay.inbox)
        assert inbox.num_rows == 80
        assert_gap_free(inbox)


def test_spark_replay_of_a_committed_batch_writes_nothing(spark, settings, layout):
    land(layout, [landing_row(MB[0], envelope(i)) for i in range(40)], per_commit=10)
    run_available_now(spark, settings)
    before = read(layout.inbox).num_rows
    commits = Path(settings.stream_checkpoint) / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    (commits / str(last)).unlink()              # Spark forgets it finished the batch
    (commits / f".{last}.crc").unlink(missing_ok=True)
    sink = run_available_now(spark, settings)   # ... and runs it again
    assert [s.batch_id for s in sink.history] == [] or all(s.rows_in == 0 for s in sink.history)
    assert read(layout.inbox).num_rows == before == 40
    assert_gap_free(read(layout.inbox))


def _frozen_batch(spark, layout):
    """The landed rows as a foreachBatch DataFrame (no offsets in the checkpoint: the sink
    reads it through Spark), its batch timestamp frozen, as Spark's offset log does."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F
    # read by pyarrow, not Spark's parquet reader: it also reaches tables on S3
    df = spark.createDataFrame(pa.concat_tables(
        pq.read_table(str(p)) for p in layout.landing_root.rglob("*.parquet")))
    df = df.withColumn(C.LANDING_TABLE, F.lit("node-t/g000001")) \
           .withColumn(C.LANDING_VERSION, F.lit(1).cast("long")) \
           .withColumn("__batch_ts", F.current_timestamp())
    df = df.select(*(INBOX.names[:7]), C.LANDING_TABLE, C.LANDING_VERSION, "__batch_ts")
    return spark.createDataFrame(df.toArrow())


class CrashAt(InboxSink):
    """Fault injection: the process dies as it is about to commit `table`."""

    table = INBOX

    def _write(self, tdef, data, batch_id):
        if tdef is self.table:
            raise SystemExit("crash")
        return super()._write(tdef, data, batch_id)


def _crash_then_replay(spark, settings, layout, tmp_path, rows, table, before_replay):
    """Batch 7 of `rows` crashes at `table`; `before_replay()` checks what it left; then a
    restart replays it twice. Returns (rules, checkpoint, batch) for more checks."""
    land(layout, rows)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"test-query"}')
    df = _frozen_batch(spark, layout)
    rules = StreamRules.from_conf(settings.stream, {"trueseal": 65482})
    crash = type("Crash", (CrashAt,), {"table": table})
    with pytest.raises(SystemExit):
        crash(layout, rules, checkpoint, fsync=False)(df, 7)
    before_replay()
    InboxSink(layout, rules, checkpoint, fsync=False)(df, 7)    # restart replays batch 7
    InboxSink(layout, rules, checkpoint, fsync=False)(df, 7)    # and once more
    return rules, checkpoint, df


def test_replay_after_partial_commit_is_exactly_once(spark, settings, layout, tmp_path):
    rows = [landing_row(MB[1], envelope(i)) for i in range(20)]
    rows.append(dict(rows[0]))  # one duplicate so that rejects is written

    def left():
        assert read(layout.rejects).num_rows == 1 and read(layout.inbox).num_rows == 0
    _crash_then_replay(spark, settings, layout, tmp_path, rows, INBOX, left)
    assert read(layout.rejects).num_rows == 1
    inbox = read(layout.inbox)
    assert inbox.num_rows == 20
    assert_gap_free(inbox)


def test_replay_after_the_inbox_commit_finishes_the_audit_exactly_once(spark, settings, layout,
                                                                        tmp_path):
    """The inbox commits before padding_audit (listeners are told sooner): a crash between
    the two leaves the audit to the replay, which rebuilds it from the batch's landing rows
    that the inbox accepted, the same rows as an uninterrupted batch audits."""
    rows = [landing_row(MB[1], envelope(i, size=300 + (i % 3) * 100)) for i in range(20)]
    rows.append(dict(rows[0], envelope=envelope(99, size=1000)))   # same event id: a duplicate

    def left():
        assert read(layout.inbox).num_rows == 20 and read(layout.padding_audit).num_rows == 0
    rules, checkpoint, df = _crash_then_replay(spark, settings, layout, tmp_path, rows,
                                               PADDING_AUDIT, left)
    assert read(layout.inbox).num_rows == 20 and read(layout.rejects).num_rows == 1
    audit = read(layout.padding_audit).sort_by([(C.PAYLOAD_SIZE, "ascending")])
    # what an uninterrupted batch writes, into a fresh data directory
    other = Layout(tmp_path / "other")
    other.ensure_shared_tables()
    InboxSink(other, rules, checkpoint, fsync=False)(df, 7)
    expected = read(other.padding_audit).sort_by([(C.PAYLOAD_SIZE, "ascending")])
    assert audit.num_rows == expected.num_rows == 3          # sizes 300, 400, 500
    assert audit.to_pylist() == expected.to_pylist()        # the same batch timestamp too


@pytest.mark.cluster
def test_stream_on_local_cluster(settings, layout, tmp_path):
    """The same job on a real (local) cluster: executors in separate JVMs and Python workers."""
    rows = [landing_row(MB[i % 3], envelope(i)) for i in range(120)]
    land(layout, rows, node="node-a", per_commit=10)
    land(layout, rows[:30], node="node-b", per_commit=10)
    env = dict(os.environ, RELAY_SPARK_MASTER="local-cluster[2,1,1024]",
               SPARK_WORKER_DIR=str(tmp_path / "worker"))
    if settings.tables_dir:     # RELAY_TEST_TABLES=s3: the executors read landing from S3
        env.update(RELAY_TABLES_DIR=settings.tables_dir,
                   RELAY_S3_ENDPOINT=settings.object_store.endpoint)
    conf = tmp_path / "relay.toml"    # every batch read by the executors, not the driver
    conf.write_text("[stream]\ndriver_read_max_bytes = 0\nmax_files_per_trigger = 4\n")
    proc = subprocess.run([sys.executable, "-m", "relay.cli", "--conf", str(conf),
                           "--data-dir", settings.data_dir, "stream", "--available-now"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    inbox = read(layout.inbox)
    assert inbox.num_rows == 120
    assert_gap_free(inbox)
    assert read(layout.rejects).num_rows == 30


def _batch_of(spark, rows):
    """`rows` as a foreachBatch DataFrame of the landing source (no offsets in the checkpoint:
    the sink reads it through Spark)."""
    from datetime import datetime, timezone

    import pyarrow as pa

    from delta_tables.schema import LANDING_SOURCE
    t = pa.Table.from_pylist([dict(r, **{C.LANDING_TABLE: "node-t/g000001",
                                         C.LANDING_VERSION: 1}) for r in rows],
                             schema=LANDING_SOURCE.arrow_schema())
    t = t.append_column("__batch_ts", pa.array([datetime.now(timezone.utc)] * t.num_rows,
                                                pa.timestamp("us", tz="UTC")))
    return spark.createDataFrame(t)


def test_a_second_stream_never_commits_from_a_stale_cache(spark, settings, layout, tmp_path):
    """Two streams on one inbox (a second one started by mistake, its own checkpoint): each
    commit advances one writer counter, so the stream whose cursor cache is stale stops with
    InboxWriterLost before writing, whether it sees the counter moved before committing or
    finds its commit's version taken by the other's (a direct append re-reads the table
    then, as delta-rs's conflict check would); a restart rebuilds and continues gap-free."""
    from delta_tables import writer_fence
    from jobs.inbox_stream import InboxWriterLost
    rules = StreamRules.from_conf(settings.stream, {"trueseal": 65482})

    def stream(name):
        checkpoint = tmp_path / name
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "metadata").write_text(f'{{"id":"{name}"}}')
        return InboxSink(layout, rules, checkpoint, fsync=False)

    rows = [landing_row(MB[i % 2], envelope(i)) for i in range(30)]
    first, second = stream("first"), stream("second")
    second._table(INBOX)                      # its handle predates the first's commit
    first(_batch_of(spark, rows[:10]), 0)
    with pytest.raises(InboxWriterLost):      # its version is taken: the counter moved
        second(_batch_of(spark, rows[10:20]), 0)
    assert read(layout.inbox).num_rows == 10

    third = stream("second")                  # the second restarted: cache rebuilt
    third(_batch_of(spark, rows[10:20] + rows[:2]), 0)   # two the first already committed
    with pytest.raises(InboxWriterLost):      # the first now sees the counter moved
        first(_batch_of(spark, rows[20:]), 1)
    third(_batch_of(spark, rows[20:]), 1)
    inbox = read(layout.inbox)
    assert inbox.num_rows == 30 and len(set(inbox.column(C.EVENT_ID).to_pylist())) == 30
    assert_gap_free(inbox)
    assert writer_fence.read(DeltaTable(str(layout.inbox)),
                             writer_fence.fence_id("relay-inbox-stream")) == 3


def _commit_clients(path) -> list[str]:
    log_dir = Path(path) / "_delta_log"
    clients = []
    for name in sorted(n for n in os.listdir(log_dir) if n.endswith(".json")):
        for line in (log_dir / name).read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info and info.get("operationParameters", {}).get("mode") == "Append":
                clients.append(info.get("clientVersion", ""))
    return clients


def test_the_sink_commits_directly_and_through_delta_rs_where_it_must(spark, settings, layout,
                                                                      tmp_path):
    """On a local disk each batch's commits are direct appends (delta_tables/txn_append.py);
    an inbox whose protocol asks more of writers (change data feed: writer version 4) is
    committed through delta-rs instead. Both are exactly once and gap-free."""
    from delta_tables.direct_append import CLIENT
    if layout.remote:
        pytest.skip("direct appends are a local disk's: on S3 delta-rs commits every batch")
    rules = StreamRules.from_conf(settings.stream, {"trueseal": 65482})
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"direct"}')
    rows = [landing_row(MB[i % 2], envelope(i)) for i in range(20)]
    rows.append(dict(rows[0]))                  # a duplicate: rejects gets a commit too

    sink = InboxSink(layout, rules, checkpoint, fsync=True)
    sink(_batch_of(spark, rows[:11]), 0)
    sink(_batch_of(spark, rows[11:]), 1)
    InboxSink(layout, rules, checkpoint, fsync=True)(_batch_of(spark, rows[11:]), 1)  # replay
    for path in (layout.inbox, layout.padding_audit, layout.rejects):
        assert set(_commit_clients(path)) == {CLIENT}, path
    inbox = read(layout.inbox)
    assert inbox.num_rows == 20 and read(layout.rejects).num_rows == 1
    assert_gap_free(inbox)

    other = Layout(tmp_path / "cdf")
    other.ensure_shared_tables()
    DeltaTable(str(other.inbox)).alter.set_table_properties(
        {"delta.enableChangeDataFeed": "true"})
    assert DeltaTable(str(other.inbox)).protocol().min_writer_version == 4
    sink = InboxSink(other, rules, checkpoint, fsync=True)
    sink(_batch_of(spark, rows[:11]), 0)
    InboxSink(other, rules, checkpoint, fsync=True)(_batch_of(spark, rows[:11]), 0)  # replay
    assert CLIENT not in _commit_clients(other.inbox)
    assert set(_commit_clients(other.padding_audit)) == {CLIENT}
    assert read(other.inbox).num_rows == 11
    assert_gap_free(read(other.inbox))
