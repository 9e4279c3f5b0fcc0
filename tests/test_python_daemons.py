"""Spark's query-start Python daemons are stopped once the stream runs, and stay stopped
while it goes on, through driver and executor reads (jobs/python_daemons.py): the processes
themselves, under the shared session's real JVM."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from deltalake import DeltaTable
from pyspark import SparkContext

from jobs.inbox_stream import start_inbox_stream
from jobs.python_daemons import QUERY_START_MODULES, retire_query_start_daemons
from jobs.stream_main import wait_first_batch
from relay.bench.startup import parent_pid

from landing_rows import envelope, land, landing_row


def daemons() -> set[str]:
    """The worker modules of the `pyspark.daemon` processes the driver JVM runs."""
    jvm = SparkContext._gateway.proc.pid
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = parent_pid(int(d.name))
            argv = [a for a in (d / "cmdline").read_bytes().decode().split("\0") if a]
        except (OSError, IndexError, ValueError):
            continue
        if ppid == jvm and "pyspark.daemon" in argv:
            rest = argv[argv.index("pyspark.daemon") + 1:]
            out.add(rest[0] if rest else "pyspark.worker")
    return out


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def inbox_rows(layout) -> int:
    return DeltaTable(str(layout.inbox)).to_pyarrow_table().num_rows


def test_query_start_daemons_stop_and_stay_stopped(spark, settings, layout):
    settings.stream.wait_for_data_ms = 500
    settings.stream.driver_read_max_bytes = 0      # every batch read by Spark's read tasks
    rows = [landing_row(bytes([9]) * 32, envelope(i)) for i in range(30)]
    land(layout, rows[:10], node="node-d")
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        assert wait_first_batch(query, threading.Event(), timeout=120)
        before = daemons()
        assert {"pyspark.sql.worker.create_data_source",
                "pyspark.sql.worker.plan_data_source_read"} <= before, before
        stopped = retire_query_start_daemons(spark)
        assert set(stopped) == set(QUERY_START_MODULES) & before
        wait_until(lambda: not daemons() & set(QUERY_START_MODULES))
        # micro-batches go on, and do not need the stopped daemons back
        land(layout, rows[10:20], node="node-d")
        wait_until(lambda: inbox_rows(layout) == 20, timeout=60)
        land(layout, rows[20:], node="node-d")
        wait_until(lambda: inbox_rows(layout) == 30, timeout=60)
        assert not daemons() & set(QUERY_START_MODULES)
        assert "pyspark.worker" in daemons()         # the read tasks' daemon: untouched
        assert query.exception() is None
    finally:
        query.stop()
    # a new query in the same session gets its daemon again from Spark's factory
    query, _ = start_inbox_stream(spark, settings, available_now=True, fsync=False)
    query.awaitTermination(120)
    assert query.exception() is None
    assert "pyspark.sql.worker.create_data_source" in daemons()


def test_nothing_to_stop_is_not_an_error(spark):
    assert retire_query_start_daemons(spark, modules=("no.such.module",)) == []
