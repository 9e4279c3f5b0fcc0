"""The one place a SparkSession is configured for the relay (jobs, tests, notebooks)."""

from __future__ import annotations

import os
import sys

from delta_tables.landing_source import LandingDataSource


def get_spark(master: str = "local[2]", app_name: str = "relay", extra: dict | None = None):
    # Executors must run the same interpreter that has the project installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Everything runs on this machine by default: never bind Spark to a public interface.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
               # metadata logs of the checkpoint: keep few, so restart and commit stay quick
               .config("spark.sql.streaming.minBatchesToRetain", "20")
               .config("spark.python.worker.reuse", "true")
               # Local checkpoints without Hadoop's .crc side files: each offset and commit
               # log write is one file and one rename instead of two, ~50 ms less per
               # micro-batch on 2 cores (push->deliver latency). Object stores are unaffected.
               .config("spark.hadoop.fs.AbstractFileSystem.file.impl",
                       "org.apache.hadoop.fs.local.RawLocalFs")
               .config("spark.hadoop.fs.file.impl", "org.apache.hadoop.fs.RawLocalFileSystem")
               .config("spark.driver.extraJavaOptions", "-Dlog4j2.level=warn")
               .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable))
    for k, v in (extra or {}).items():
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(LandingDataSource)
    return spark
