"""delta-spark and delta-rs on the same tables: each reads what the other wrote.

The stream commits the inbox with the relay's direct append (commit files written by us,
delta_tables/txn_append.py), ingress its landing with the same; analysts and notebooks read
with delta-spark. So these tests write through the relay's real paths and read through Spark,
and write through Spark and read through delta-rs."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from chispa import assert_df_equality
from deltalake import DeltaTable

from delta_tables import spark_delta
from delta_tables.schema import C, INBOX
from jobs import jars
from jobs.inbox_stream import start_inbox_stream
from jobs.table_views import private_view, register_views

from landing_rows import envelope, land, landing_row

MAILBOXES = [bytes([i]) * 32 for i in range(1, 4)]


def run_stream(spark, settings):
    query, _ = start_inbox_stream(spark, settings, available_now=True, fsync=False)
    query.awaitTermination(120)
    assert query.exception() is None


def test_spark_reads_the_inbox_the_stream_committed_and_its_history(spark, settings, layout):
    land(layout, [landing_row(MAILBOXES[i % 3], envelope(i)) for i in range(30)],
         per_commit=10)
    run_stream(spark, settings)
    land(layout, [landing_row(MAILBOXES[i % 3], envelope(100 + i)) for i in range(12)])
    run_stream(spark, settings)

    by_rs = DeltaTable(str(layout.inbox)).to_pyarrow_table().sort_by(C.SEQ)
    by_spark = spark_delta.read(spark, layout, INBOX).orderBy(C.SEQ)
    assert by_spark.count() == by_rs.num_rows == 42
    assert_df_equality(by_spark, spark.createDataFrame(by_rs), ignore_nullable=True)

    # every commit is in DESCRIBE HISTORY, and time travel sees the first stream run's rows
    history = spark_delta.history(spark, layout, INBOX).collect()
    versions = sorted(r["version"] for r in history)
    assert versions == list(range(DeltaTable(str(layout.inbox)).version() + 1))
    first_data = min(v for v in versions
                     if spark_delta.read(spark, layout, INBOX, version=v).count())
    assert spark_delta.read(spark, layout, INBOX, version=first_data).count() == 30


def test_delta_rs_reads_what_spark_wrote(spark, tmp_path):
    path = str(tmp_path / "inbox_copy")
    rows = pa.Table.from_pylist([{
        C.EVENT_ID: bytes([i]) * 32, C.PROTOCOL: "trueseal", C.MAILBOX: MAILBOXES[0],
        C.ENVELOPE: envelope(i), C.META: None,
        C.RECEIVED_AT: pa.scalar(1_800_000_000_000_000 + i, pa.timestamp("us", "UTC")).as_py(),
        C.EXPIRES_AT: pa.scalar(1_900_000_000_000_000, pa.timestamp("us", "UTC")).as_py(),
        C.CURSOR: i + 1, C.SEQ: i + 1,
        C.COMMITTED_AT: pa.scalar(1_800_000_000_000_000, pa.timestamp("us", "UTC")).as_py(),
        C.LANDING_TABLE: "node-t/g000001", C.LANDING_VERSION: 1, C.BATCH_ID: 0,
    } for i in range(5)], schema=INBOX.arrow_schema())
    spark.createDataFrame(rows).write.format("delta").save(path)

    dt = DeltaTable(path)
    protocol = dt.protocol()
    # what delta-rs 1.6 and the relay's own direct append read and write (DESIGN.md)
    assert (protocol.min_reader_version, protocol.min_writer_version) == (1, 2)
    back = dt.to_pyarrow_table().sort_by(C.SEQ)
    assert back.column(C.ENVELOPE).to_pylist() == rows.column(C.ENVELOPE).to_pylist()
    assert back.column(C.MAILBOX).to_pylist() == rows.column(C.MAILBOX).to_pylist()
    assert pc.equal(back.column(C.RECEIVED_AT).cast(pa.int64()),
                    rows.column(C.RECEIVED_AT).cast(pa.int64())).to_pylist() == [True] * 5


def test_analyst_views_are_delta_scans_without_keys_or_envelopes(spark, settings, layout):
    land(layout, [landing_row(MAILBOXES[i % 3], envelope(i)) for i in range(9)])
    run_stream(spark, settings)
    counts = register_views(spark, settings.data_dir, landing=False)
    assert counts["inbox"] == 9
    view = spark.table("inbox")
    assert C.MAILBOX not in view.columns and C.ENVELOPE not in view.columns
    # the Spark view hashes and sizes exactly as the Arrow path does (rooms, landing use it)
    arrow = private_view(DeltaTable(str(layout.inbox)).to_pyarrow_table())
    assert_df_equality(view.orderBy(C.SEQ), spark.createDataFrame(arrow.sort_by(C.SEQ)),
                       ignore_nullable=True)
    plan = view._jdf.queryExecution().optimizedPlan().toString()
    assert "LocalRelation" not in plan and "parquet" in plan   # a scan of the table's files,
    #                                                           not rows copied into the driver


def test_the_jvm_parts_come_from_the_local_cache(spark):
    conf = spark.sparkContext.getConf()
    assert not conf.get("spark.jars.packages", "")      # no Maven/Ivy resolution at start
    named = conf.get("spark.jars").split(",")
    assert any("delta-spark_" in j for j in named) and any("hadoop-aws-" in j for j in named)
    assert any("relay-jvm-" in j for j in named)         # ours, compiled by set-up (jobs/jvm)
    assert all(j.startswith(str(jars.cache_dir().parent)) for j in named)
