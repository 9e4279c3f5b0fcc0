"""`relay stream`: run the inbox stream until told to stop.

Ready means ready: the stream announces itself only after its first micro-batch has committed
(the source forces one warm-up batch on every start, delta_tables/landing_source.py), so a
message acked from that moment is in the inbox at the steady-state latency, not after the
seconds of one-off costs a cold first batch pays.

Stopping: the caller's `stop` event (SIGINT / SIGTERM) ends the loop; the query is stopped
from Python while the JVM is still up (the JVM runs in a session of its own,
jobs/spark_session.py, so a signal to our process group does not reach it first), then Spark.
"""

from __future__ import annotations

import logging
import threading
import time

from delta_tables.landing_lag import landing_lag
from delta_tables.layout import Layout
from runtime import metrics
from runtime.config import Settings

from . import python_daemons, spark_cluster
from .inbox_stream import start_inbox_stream
from .stream_state import state_locations
from .spark_session import get_spark, stream_jvm_options

log = logging.getLogger("relay.stream")

WARM_UP_TIMEOUT_SECONDS = 300.0


def wait_first_batch(query, stop: threading.Event, timeout: float = WARM_UP_TIMEOUT_SECONDS
                     ) -> bool:
    """Block until the query has finished a micro-batch (its progress is reported after the
    batch's sink commit). False if it stopped or `stop` was set first."""
    deadline = time.monotonic() + timeout
    while query.isActive and not stop.is_set():
        if query.lastProgress is not None:
            return True
        if time.monotonic() > deadline:
            raise RuntimeError(f"inbox stream ran no batch in {timeout:.0f} s")
        stop.wait(0.05)
    return False


def _log_state_locations(spark, query, known: dict[int, str]) -> dict[int, str]:
    """Log where the state partitions are when that changes (a cluster's executors came or
    went): an operator sees which executors hold the stream's state."""
    try:
        where = state_locations(spark, query, int(spark.conf.get("spark.sql.shuffle.partitions")))
    except Exception:   # the query stopping meanwhile: nothing to tell
        return known
    if where and where != known:
        log.info("state partitions placed", extra={
            "event": "stream_state_partitions",
            "executors": {str(k): v for k, v in sorted(where.items())}})
        return where
    return known


def run(settings: Settings, stop: threading.Event, *, available_now: bool = False,
        ready=None, on_spark_started=None) -> None:
    """`on_spark_started`: called once the SparkSession exists (the CLI re-installs its signal
    handlers there: pyspark replaces the SIGINT handler when it creates a SparkContext)."""
    master = settings.stream.master
    spark = get_spark(master, "relay-inbox-stream", secret=(
        spark_cluster.secret(settings.data_dir) if spark_cluster.is_standalone(master) else None),
        jvm_options=stream_jvm_options(settings.stream_state_in_spark, settings.stream.jvm_options),
        extra={k: str(v) for k, v in settings.stream.spark_conf.items()})
    if on_spark_started:
        on_spark_started()
    layout = Layout.of(settings)
    stream_metrics = metrics.StreamMetrics(
        settings.data_dir, lambda: landing_lag(layout, settings.stream_checkpoint))
    exporter = None
    query = None
    sink = None
    try:
        query, sink = start_inbox_stream(spark, settings, available_now=available_now,
                                         on_batch=stream_metrics.observe_batch)
        exporter = metrics.serve_role(settings, "stream", stream_metrics.registry)
        if wait_first_batch(query, stop):
            python_daemons.retire_query_start_daemons(spark)
            if ready:
                metrics.announce(ready, exporter, settings.metrics.bind)(
                    {"checkpoint": str(settings.stream_checkpoint),
                     # which path stream.state_store ("auto") chose
                     "state": "state_store" if settings.stream_state_in_spark else "driver",
                     "spark": settings.stream.master})
        located: dict[int, str] = {}
        seen_batch = None
        while query.isActive and not stop.is_set():
            stop.wait(0.5)
            progress = query.lastProgress
            stream_metrics.observe_progress(progress)
            if progress and progress.get("batchId") != seen_batch:   # once a batch
                seen_batch = progress.get("batchId")
                located = _log_state_locations(spark, query, located)
        if query.exception():
            raise RuntimeError(f"inbox stream failed: {query.exception()}")
    finally:
        if query is not None and query.isActive:
            # A batch interrupted here is replayed on the next start; its marker makes the
            # replay write nothing twice.
            query.stop()
        metrics.stop(exporter)
        log.info("stream stopped", extra={"event": "stream_stopped",
                                          "batches": len(sink.history) if sink else 0})
        spark.stop()
