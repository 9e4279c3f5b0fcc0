"""Incident replay: re-run the inbox stream over landing from a given version into a fresh
inbox, next to the live one, to see what the stream makes of those envelopes now.

The source is the relay's own landing (read only, and `recordConsumed=false`, so compaction's
view of what the live stream consumed is untouched); the sink is an `InboxSink` on another
data directory with its own checkpoint and exactly-once markers. The fresh inbox starts with
no dedup state and no cursors: every envelope after the start version is accepted once and
numbered from the protocol's first cursor, which is what "replay into a fresh inbox" means.
"""

from __future__ import annotations

import json
from pathlib import Path

from delta_tables.landing_lag import latest_version
from delta_tables.layout import Layout
from runtime.config import Settings

from .inbox_stream import InboxSink, landing_stream
from .inbox_transform import StreamRules

QUERY_NAME = "inbox_replay"


def start_versions_from(layout: Layout, table: str, after_version: int) -> dict[str, int]:
    """Source offsets that replay only `table` after `after_version`: every other landing
    table starts at its newest version (a table missing from the offsets would be read from
    its first version)."""
    tables = layout.landing_tables()
    if table not in tables:
        raise KeyError(f"no landing table {table!r}; have {sorted(tables)}")
    offsets = {key: latest_version(path) for key, path in tables.items()}
    offsets[table] = after_version
    return offsets


def start_replay(spark, settings: Settings, into: str | Path, start_versions: dict[str, int],
                 *, available_now: bool = True, fsync: bool = False):
    """Start the replay query; returns (query, sink). `into` must be a new directory."""
    target = Layout(into)
    if (target.inbox / "_delta_log").exists():
        raise FileExistsError(f"{target.inbox} exists: replay into a fresh directory")
    target.ensure_shared_tables()
    checkpoint = target.root / "checkpoints" / QUERY_NAME
    rules = StreamRules.from_conf(settings.stream,
                                  max_envelope={"trueseal": settings.trueseal.max_envelope})
    source_layout = Layout.of(settings)
    sink = InboxSink(target, rules, checkpoint, f"{settings.stream.app_id}-replay", fsync=fsync,
                     start_versions=json.dumps(start_versions),
                     driver_read_max_bytes=settings.stream.driver_read_max_bytes,
                     landing=source_layout)
    source = landing_stream(spark, source_layout, settings.stream, json.dumps(start_versions),
                            record_consumed=False)
    writer = (source.writeStream.queryName(QUERY_NAME).foreachBatch(sink)
              .option("checkpointLocation", str(checkpoint)))
    writer = writer.trigger(availableNow=True) if available_now else writer.trigger(
        processingTime=f"{settings.stream.trigger_interval_ms} milliseconds")
    return writer.start(), sink
