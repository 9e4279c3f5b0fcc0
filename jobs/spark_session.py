"""The one place a SparkSession is configured for the relay (jobs, tests, notebooks).

Logs of the driver JVM: conf/log4j2.properties (root WARN, known noise at ERROR, lines shaped
like runtime/logs.py's: one JSON object per line, or a readable text line). In a relay process
(`runtime.logs.setup` was called) the JVM's stderr, and its Python workers', comes back through
`logs.child_stderr`: every line a record of this process, in its format, through its filter.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from delta_tables.landing_source import LandingDataSource
from runtime import logs

# Shipped with the repository (a clean checkout and an editable install both find it here).
LOG4J2_CONF = Path(__file__).resolve().parents[1] / "conf" / "log4j2.properties"


# The driver JVM gives idle heap back: a periodic G1 cycle every 30 s when nothing else ran
# one, and a heap kept within 10-30% free after a collection. Measured 2026-11-27: the JVM
# ~27 MiB smaller idle (`relay bench --startup`), and the stream over a 200k-row backlog as
# fast (medians of 4 alternating runs: 67k envelopes/s without, 71k with). HotSpot takes the
# last of a repeated flag, so `stream.jvm_options` (after these) can undo them.
IDLE_HEAP_OPTIONS = ["-XX:G1PeriodicGCInterval=30000", "-XX:MinHeapFreeRatio=10",
                     "-XX:MaxHeapFreeRatio=30",
                     # Spark's cleaner calls System.gc() every minute here (get_spark: it
                     # deletes finished batches' shuffle files): a concurrent G1 cycle, not a
                     # stop-the-world full collection of the stream's heap each time
                     "-XX:+ExplicitGCInvokesConcurrent"]

# ... and idle native memory: glibc keeps what the JVM frees (compiler arenas, class loading,
# ...) unless asked to return it; the JVM's own trimmer asks every 30 s. Measured 2026-11-27:
# `jcmd System.trim_native_heap` on the idle relay's JVM freed 23 MiB; `relay bench
# --startup`, 3 alternating rounds each, whole relay 797 -> 777 MiB PSS (JVM 330 -> 310), idle
# CPU 0.04 cores both. The option exists from JDK 17.0.9 and 21.0.1 (experimental before
# 17.0.11 and 21.0.3): `native_trim_options` asks the JVM Spark will run which form it takes.
NATIVE_TRIM_INTERVAL_MS = 30000

# ... and compiles with C1 only. A micro-batch runs short-lived code paths (planning, the
# Delta log, Python worker I/O) that C2's profiling and recompiles never pay back on 2 cores
# shared with the listeners: measured 2026-11-28 (`relay bench --quick`, cursor-sync section),
# the JVM's CPU per micro-batch 217 -> 96 ms in the first round and 45-68 -> 35-40 ms later,
# PUSH_ACKs/s 521 -> 589 in the first minute, Spark's start 11.3-12.2 -> 8.7-9.2 s, the stream
# over a backlog as fast or faster (73-84k -> 78-98k envelopes/s). `stream.jvm_options =
# "-XX:TieredStopAtLevel=4"` restores the full tiered compiler.
# C1 alone makes HotSpot size its code cache as for a client JVM, 48 MiB instead of 240: the
# operations notebook's many queries (Spark generates and compiles classes for each) filled it
# ("Out of space in CodeCache for method handle intrinsic"). 240 MiB as with the full
# compiler: reserved address space, committed only as code is compiled.
JIT_OPTIONS = ["-XX:TieredStopAtLevel=1", "-XX:ReservedCodeCacheSize=240m"]
# ... except for the stream with its state in the state store (stream.state_store): there the
# JVM runs every row through the stateful processor (sort, encoders, RocksDB calls), a hot loop
# C2 pays back. Measured 2026-12-02 (`relay bench --state --quick`, one run each, in turn): a
# warm 100k-row batch at 1 M live ids took 1.15 s with C2 against 2.72 s with C1 alone.
STATEFUL_JIT_OPTIONS = ["-XX:TieredStopAtLevel=4"]


def stream_jvm_options(state_store: bool, configured: str = "") -> str:
    """The stream's extra driver JVM options: the full JIT when its state is in the state
    store, then `stream.jvm_options` (last, so a repeated flag there wins)."""
    return " ".join([*(STATEFUL_JIT_OPTIONS if state_store else []), *configured.split()])


def _java() -> str | None:
    """The `java` Spark's launcher runs: $JAVA_HOME/bin/java, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    return os.path.join(home, "bin", "java") if home else shutil.which("java")


@functools.lru_cache(maxsize=None)
def native_trim_options(java: str | None = None) -> tuple[str, ...]:
    """The options that make this JVM trim its native heap periodically, or () when it has no
    such option (an older JDK starts as before). One `java -version` per form, ~50 ms."""
    java = java or _java()
    if not java:
        return ()
    for form in ((f"-XX:TrimNativeHeapInterval={NATIVE_TRIM_INTERVAL_MS}",),
                 ("-XX:+UnlockExperimentalVMOptions",
                  f"-XX:TrimNativeHeapInterval={NATIVE_TRIM_INTERVAL_MS}")):
        try:
            if subprocess.run([java, *form, "-version"], capture_output=True,
                              timeout=60).returncode == 0:
                return form
        except (OSError, subprocess.TimeoutExpired):
            return ()
    return ()


def driver_java_options(app_name: str, jvm_options: str = "") -> str:
    """`spark.driver.extraJavaOptions`: the log4j2 configuration and what it reads.

    `relay.log.appender` picks its layout: json, text or color (text with a coloured level);
    `relay.log.process` is each line's `process`. Under a relay process the JVM always writes
    json: `logs.child_stderr` turns each line into a record of ours (formatted as this process
    formats). `-Dlog4j2.level` only applies when no configuration file is found (the log4j
    default configuration): WARN there too. Then IDLE_HEAP_OPTIONS, JIT_OPTIONS and the native
    heap trimmer; `jvm_options` (stream.jvm_options) come last."""
    opts = ["-Dlog4j2.level=warn", *IDLE_HEAP_OPTIONS, *JIT_OPTIONS, *native_trim_options()]
    if LOG4J2_CONF.is_file():
        act = logs.active()
        if act is not None:
            appender, process = "json", act.process
        else:
            fmt = logs.resolve_format(None)
            appender = "color" if fmt == "text" and logs.use_color() else fmt
            process = app_name
        opts += [f"-Dlog4j2.configurationFile={LOG4J2_CONF.as_uri()}",   # URI: no spaces
                 f"-Drelay.log.appender={appender}",
                 f"-Drelay.log.process={re.sub(r'[^A-Za-z0-9_.-]', '_', process)}"]
    return " ".join(opts + jvm_options.split())


def delta_conf() -> dict[str, str]:
    """Delta Lake through delta-spark, from the jars `setup.sh` cached (jobs/jars.py): the SQL
    extension (DESCRIBE HISTORY, VACUUM, OPTIMIZE, time travel) and the catalog that makes
    `delta` tables first-class; S3 through hadoop-aws (`s3a://`), which the AWS SDK jars beside
    it serve. And the state store any stateful operator of ours uses: RocksDB, off the JVM heap,
    with changelog checkpointing (each batch uploads what changed, not a snapshot)."""
    from . import jars
    relay_jar = str(jars.relay_jar())
    return {
        "spark.jars": ",".join(jars.spark_jars()),
        # Hadoop loads the file system class from the JVM's own class path, before spark.jars
        "spark.driver.extraClassPath": relay_jar,
        "spark.executor.extraClassPath": relay_jar,
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # delta-rs writes the landing tables and reads what Spark writes: Spark must not raise
        # a table's protocol past what delta-rs 1.6 reads and writes (DESIGN.md: reader 1 /
        # writer 2; no deletion vectors, no timestamp-without-zone columns)
        "spark.databricks.delta.properties.defaults.enableDeletionVectors": "false",
        "spark.sql.streaming.stateStore.providerClass":
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
        # RocksDB's block cache and memtables share one budget for every state partition of
        # the JVM, so the process does not grow with the number of live event ids: the state
        # is on local disk and in the checkpoint, its hot part in memory (relay bench --state).
        # 512 MiB, not 128: with 1 M live ids a restart's first batch missed the cache on a
        # third of its lookups at 128 (29 s of gets against 0.8 s at 512, same run size)
        "spark.sql.streaming.stateStore.rocksdb.boundedMemoryUsage": "true",
        "spark.sql.streaming.stateStore.rocksdb.maxMemoryUsageMB": "512",
        # A restart loads the newest snapshot and replays the changelogs after it: a snapshot
        # every 5 batches (Spark's default 10), uploaded by the maintenance task every 15 s
        # (default 60), keeps that replay short however large the state
        "spark.sql.streaming.stateStore.minDeltasForSnapshot": "5",
        "spark.sql.streaming.stateStore.maintenanceInterval": "15s",
        # Counting the state's rows makes every put a get first (RocksDB.handleMetricsUpdate):
        # in a jstack of the stateful batches 16 of 33 samples were that get. The count is
        # only a progress metric (numRowsTotal then reads 0); relay bench --state counts ids.
        "spark.sql.streaming.stateStore.rocksdb.trackTotalNumberOfRows": "false",
    }


def get_spark(master: str = "local[2]", app_name: str = "relay", extra: dict | None = None,
              secret: str | None = None, jvm_options: str = ""):
    """`secret`: a standalone cluster's shared secret (jobs/spark_cluster.py). It reaches the
    driver JVM over Py4J after the JVM has started, never on its command line.
    `jvm_options`: more driver JVM options (stream.jvm_options)."""
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
               # A LocalFileSystem subclass (jobs/jvm), not RawLocalFileSystem: the RocksDB
               # state store casts what FileSystem.getLocal returns to LocalFileSystem.
               .config("spark.hadoop.fs.AbstractFileSystem.file.impl",
                       "org.apache.hadoop.fs.local.RawLocalFs")
               .config("spark.hadoop.fs.file.impl", "relay.fs.NoChecksumLocalFileSystem")
               # ... and written through Hadoop's FileSystem API, not FileContext: the offset
               # and commit log writes of a micro-batch took ~22 ms each through FileContext
               # on 2 cores, ~6 ms this way (jobs/batch_profile.py: Spark's floor per small
               # batch 91 -> 55 ms). Both write a temporary file and rename it; on a local
               # disk rename(2) is atomic, and one stream writes its checkpoint.
               .config("spark.sql.streaming.checkpointFileManagerClass",
                       "org.apache.spark.sql.execution.streaming.checkpointing."
                       "FileSystemBasedCheckpointFileManager")
               .config("spark.driver.extraJavaOptions",
                       driver_java_options(app_name, jvm_options))
               # Spark's own local files (shuffle, spill) are encrypted with a key that lives
               # only in this application's memory: with the state in Spark's state store the
               # envelopes travel through the shuffle, and what a batch leaves there is
               # unreadable once the key is gone, before the cleaner deletes it
               # (docs/operating/retention.md; tests/test_retention.py)
               .config("spark.io.encryption.enabled", "true")
               # the cleaner deletes a finished batch's shuffle files once the driver's GC
               # has dropped the shuffle; a GC every minute, not every 30 (Spark's default)
               .config("spark.cleaner.periodicGC.interval", "1min")
               # no "[Stage 0:>  (0 + 2) / 2]" progress bar on stderr: lines are records
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable))
    for k, v in delta_conf().items():
        builder = builder.config(k, v)
    if secret is not None:
        # the I/O encryption key goes to the executors over RPC: encrypted with the secret
        builder = (builder.config("spark.authenticate", "true")
                   .config("spark.network.crypto.enabled", "true"))
    for k, v in (extra or {}).items():
        builder = builder.config(k, v)
    with logs.child_stderr("spark.stderr"):   # the JVM and its Python workers inherit it
        _launch_jvm_in_own_session(builder)
        if secret is not None:
            builder = builder.config("spark.authenticate.secret", secret)
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark.dataSource.register(LandingDataSource)
    return spark


def _launch_jvm_in_own_session(builder) -> None:
    """Start the driver JVM in a session (process group) of its own, once per process.

    Ctrl-C in a terminal, or `kill -- -<pgid>`, signals every process of the group; a JVM in
    it would stop its SparkContext (shutdown hook) while Python is still stopping the query,
    and the stop would end in Py4J tracebacks. Outside the group only Python signals it: it
    stops the query, then Spark, and the JVM exits when its stdin (our pipe) closes, so it
    never outlives the Python driver. pyspark's own `launch_gateway` takes the Popen
    arguments for exactly this kind of customisation."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False)
    for k, v in builder._options.items():
        conf.set(k, v)
    SparkContext._ensure_initialized(gateway=launch_gateway(
        conf, popen_kwargs={"start_new_session": True}), conf=conf)
