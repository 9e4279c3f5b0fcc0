"""`relay stream`: run the inbox stream until told to stop."""

from __future__ import annotations

import logging
import threading

from delta_tables.layout import Layout
from relay import metrics
from relay.config import Settings

from .inbox_stream import start_inbox_stream
from .spark_session import get_spark

log = logging.getLogger("relay.stream")


def run(settings: Settings, stop: threading.Event, *, available_now: bool = False,
        ready=None) -> None:
    spark = get_spark(settings.stream.master, "relay-inbox-stream")
    stream_metrics = metrics.StreamMetrics(Layout(settings.data_dir), settings.stream_checkpoint)
    query, sink = start_inbox_stream(spark, settings, available_now=available_now,
                                     on_batch=stream_metrics.observe_batch)
    exporter = metrics.serve_role(settings, "stream", stream_metrics.registry)
    if ready:
        metrics.announce(ready, exporter, settings.metrics.bind)(
            {"checkpoint": str(settings.stream_checkpoint), "spark": settings.stream.master})
    try:
        while query.isActive and not stop.is_set():
            stop.wait(0.5)
            stream_metrics.observe_progress(query.lastProgress)
        if query.exception():
            raise RuntimeError(f"inbox stream failed: {query.exception()}")
    finally:
        if query.isActive:
            # A batch interrupted here is replayed on the next start; its marker makes the
            # replay write nothing twice.
            query.stop()
        metrics.stop(exporter)
        log.info("stream stopped", extra={"event": "stream_stopped",
                                          "batches": len(sink.history)})
        spark.stop()
