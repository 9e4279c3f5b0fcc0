"""The inbox stream's dedup index and cursors in Spark's state store.

`decided(landing, rules)` wraps the landing source DataFrame in the JVM stateful processor
(`jobs/jvm/relay/stream/MailboxState.java`, built by `jobs/jars.relay_jar`): rows are grouped by
(protocol, mailbox), each group's state (last cursor; event ids within the dedup window) lives
in the RocksDB state store of the task that owns the mailbox's partition, checkpointed with the
stream (changelog checkpointing: each batch uploads what changed) and restored from there on
restart. Out comes every landing row with its cursor or reject reason and the batch time, the
columns `jobs.inbox_transform.finish` takes.

Why `transformWithState` in Java and not a Python stateful function: see
docs/decisions/0008-stream-state-operators.md (a Python call per mailbox per batch, and for
transformWithStateInPandas a socket round trip per state access, measured at ~2.5k rows/s).
"""

from __future__ import annotations

from .inbox_transform import StreamRules


def _spec(values: dict[str, int]) -> str:
    """{"trueseal": 65482} -> "trueseal=65482": plain strings cross Py4J without converters."""
    return ",".join(f"{k}={int(v)}" for k, v in sorted(values.items()))


def decided(landing, rules: StreamRules, initial=None):
    """The stateful DataFrame: `landing`'s rows with cursor / reason / batch_ms. `initial`:
    `seed(...)` for a new checkpoint; an empty one otherwise (the plan is the same either
    way, so a checkpoint started with a seed restarts without one)."""
    from pyspark.sql.classic.dataframe import DataFrame

    spark = landing.sparkSession
    if initial is None:
        initial = spark.createDataFrame([], _seed_schema())
    jdf = spark._jvm.relay.stream.MailboxState.apply(
        landing._jdf, rules.max_ttl_us // 1000, _spec(rules.max_envelope),
        _spec(rules.cursor_start), initial._jdf)
    return DataFrame(jdf, spark)


SEED_COLUMNS = ("protocol", "mailbox", "event_id", "value")


def _seed_schema():
    from pyspark.sql import types as T
    return T.StructType([T.StructField("protocol", T.StringType(), False),
                         T.StructField("mailbox", T.BinaryType(), False),
                         T.StructField("event_id", T.BinaryType(), True),
                         T.StructField("value", T.LongType(), False)])


def checkpoint_started(spark, checkpoint: str) -> bool:
    """Has this checkpoint committed a batch? Through Hadoop's file system, so that a
    checkpoint on S3 (s3a://) is asked the same way as a local one."""
    jvm = spark._jvm
    commits = jvm.org.apache.hadoop.fs.Path(f"{str(checkpoint).rstrip('/')}/commits")
    fs = commits.getFileSystem(spark._jsc.hadoopConfiguration())
    if not fs.exists(commits):
        return False
    return any(not s.getPath().getName().startswith(".") for s in fs.listStatus(commits))


def seed(spark, layout, now_us: int | None):
    """The initial state of a new checkpoint: each mailbox's last cursor and the live event
    ids of the inbox, read once through delta-spark. An empty frame when `now_us` is None
    (a restart: the state store has it all) or the inbox has no rows."""
    from pyspark.sql import functions as F

    from delta_tables import spark_delta
    from delta_tables.schema import INBOX
    empty = spark.createDataFrame([], _seed_schema())
    if now_us is None or not spark_delta.exists(layout, INBOX):
        return empty
    inbox = spark_delta.read(spark, layout, INBOX)
    cursors = (inbox.groupBy("protocol", "mailbox").agg(F.max("cursor").alias("value"))
               .select("protocol", "mailbox", F.lit(None).cast("binary").alias("event_id"),
                       "value"))
    live = (inbox.where(F.unix_micros("expires_at") > F.lit(now_us))
            .select("protocol", "mailbox", "event_id",
                    F.unix_micros("expires_at").alias("value")))
    return cursors.unionByName(live)


def state_locations(spark, query, partitions: int) -> dict[int, str]:
    """Which executor holds each state partition of the processor now (Spark's state store
    coordinator, in the driver): where the stream's state lives on a cluster. Partitions no
    executor holds (before the first batch, after a stop) are left out."""
    jvm = spark._jvm
    states = jvm.org.apache.spark.sql.execution.streaming.state
    coordinator = spark._jsparkSession.streams().stateStoreCoordinator()
    root = query._jsq.streamingQuery().resolvedCheckpointRoot() + "/state"
    run_id = jvm.java.util.UUID.fromString(str(query.runId))
    where = {}
    for part in range(partitions):
        provider = states.StateStoreProviderId(states.StateStoreId(root, 0, part, "default"),
                                               run_id)
        found = coordinator.getLocation(provider)
        if found.isDefined():
            where[part] = str(found.get())
    return where
