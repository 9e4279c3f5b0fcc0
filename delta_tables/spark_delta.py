"""The relay's Delta tables through delta-spark: what analysts, notebooks and Spark jobs read.

delta-rs (`deltalake`) stays where a thin process commits (ingress's landing appends, egress's
acks, the control tables); Spark reads the same tables with delta-spark, so `DESCRIBE HISTORY`,
time travel (`versionAsOf`, `timestampAsOf`) and `spark.read.format("delta")` work on all of
them (tests/test_spark_delta.py shows each library reading what the other wrote).

Tables on S3 (`s3://bucket/prefix`, delta_tables/object_store.py) are read as `s3a://` through
hadoop-aws, configured here from the same endpoint and region settings; credentials come from
the environment (hadoop-aws's default chain reads `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`),
never from a file.
"""

from __future__ import annotations

from . import object_store
from .layout import Layout
from .schema import C, TableDef

HASH_HEX = 12

# Columns that identify a person's device or carry ciphertext, as analysts see them
# (jobs/table_views.py says why): replaced by a short hash or a size on the way in.
HASHED = {C.MAILBOX: "mailbox_hash", C.EVENT_ID: "event_hash", C.DEVICE: "device_hash"}
SIZED = {C.ENVELOPE: "envelope_size", C.META: "meta_size"}


def configure_s3(spark, s3: object_store.S3Location) -> None:
    """Point this session's `s3a://` file system at the relay's object store."""
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    conf.set("fs.s3a.endpoint.region", s3.region)
    if s3.endpoint:
        conf.set("fs.s3a.endpoint", s3.endpoint)
        conf.set("fs.s3a.path.style.access", "true")
        conf.set("fs.s3a.connection.ssl.enabled",
                 "false" if s3.endpoint.startswith("http://") else "true")
    conf.set("fs.s3a.aws.credentials.provider",
             "software.amazon.awssdk.auth.credentials.EnvironmentVariableCredentialsProvider")


def table_uri(spark, layout: Layout, tdef: TableDef) -> str:
    """Where Spark finds `tdef`: a local path, or its `s3a://` URI (the session configured)."""
    path = layout.table(tdef)
    if not layout.remote:
        return str(path)
    configure_s3(spark, layout.s3)
    return "s3a://" + str(path).removeprefix("s3://")


def exists(layout: Layout, tdef: TableDef) -> bool:
    return (layout.table(tdef) / "_delta_log").exists()


def read(spark, layout: Layout, tdef: TableDef, version: int | None = None):
    """`tdef` as a Spark DataFrame (as of `version`, if given: time travel)."""
    reader = spark.read.format("delta")
    if version is not None:
        reader = reader.option("versionAsOf", version)
    return reader.load(table_uri(spark, layout, tdef))


def private(df):
    """`df` with keys hashed and envelopes reduced to their size, in Spark: the same columns
    `jobs.table_views.private_view` gives from Arrow."""
    from pyspark.sql import functions as F
    cols = []
    for name in df.columns:
        if name in HASHED:
            cols.append(F.substring(F.sha2(F.col(name), 256), 1, HASH_HEX).alias(HASHED[name]))
        elif name in SIZED:
            cols.append(F.length(F.col(name)).cast("long").alias(SIZED[name]))
        else:
            cols.append(F.col(name))
    return df.select(cols)


def history(spark, layout: Layout, tdef: TableDef):
    """`DESCRIBE HISTORY` of `tdef`: one row per commit (version, timestamp, operation, ...)."""
    return spark.sql(f"DESCRIBE HISTORY delta.`{table_uri(spark, layout, tdef)}`")
