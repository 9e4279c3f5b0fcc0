"""Where a small micro-batch's time goes, against Spark's own floor (issue 13).

A trickle of landing commits (one small commit every `gap` seconds, as a quiet relay sees)
runs through the real stream twice in one process: once with the relay's sink, once with a
no-op foreachBatch over the same source and trigger (Spark's floor: offset log, planning,
the Python data source, the callback round trip, the commit log). For each, the medians of
Spark's `durationMs` parts over the batches that had rows, the batch's own time
(`batch_ms`: triggerExecution less latestOffset, which holds the source's wait for data) and
for the relay's sink its own time; then ours as a ratio of the floor. `relay bench` runs it
(`spark_floor`); alone:

    python -m jobs.batch_profile [seconds]
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa

from delta_tables.group_commit import LandingTarget
from delta_tables.layout import Layout
from delta_tables.schema import C, LANDING
from runtime import config
from runtime.metrics import batch_work_ms

from .inbox_stream import landing_stream, start_inbox_stream

PARTS = ("triggerExecution", "latestOffset", "walCommit", "queryPlanning", "getBatch",
         "addBatch", "commitOffsets")


def _trickle(layout: Layout, stop: threading.Event, gap: float, rows: int = 4) -> None:
    target = LandingTarget(layout, "profile-0", fsync=True)
    n = 0
    while not stop.wait(gap):
        now = datetime.now(timezone.utc)
        batch = []
        for _ in range(rows):
            n += 1
            env = n.to_bytes(8, "big") + os.urandom(592)
            mailbox = hashlib.blake2s(b"%d" % (n % 100)).digest()
            batch.append({C.EVENT_ID: hashlib.blake2b(env, digest_size=32).digest(),
                          C.PROTOCOL: "trueseal", C.MAILBOX: mailbox, C.ENVELOPE: env,
                          C.META: None, C.RECEIVED_AT: now,
                          C.EXPIRES_AT: now + timedelta(days=1)})
        target.commit(pa.Table.from_pylist(batch, schema=LANDING.arrow_schema()))


def _medians(progress: list[dict]) -> dict:
    # every batch has new landing commits: empty micro-batches are off (spark_session.py)
    busy = [p for p in progress if "addBatch" in p.get("durationMs", {})]
    out = {"batches": len(busy)}
    for part in PARTS:
        values = [p["durationMs"].get(part) for p in busy if part in p["durationMs"]]
        out[f"{part}_ms_p50"] = statistics.median(values) if values else None
    work = [batch_work_ms(p["durationMs"]) for p in busy]
    out["batch_ms_p50"] = statistics.median(work) if work else None
    return out


def _run(spark, settings: config.Settings, sink: str, seconds: float, gap: float) -> dict:
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    stop = threading.Event()
    feeder = threading.Thread(target=_trickle, args=(layout, stop, gap), daemon=True)
    relay_sink = None
    if sink == "relay":
        query, relay_sink = start_inbox_stream(spark, settings)
    else:
        query = (landing_stream(spark, layout, settings.stream, record_consumed=False)
                 .writeStream.queryName(f"floor_{os.getpid()}")
                 .foreachBatch(lambda df, batch_id: None)
                 .option("checkpointLocation", str(Path(settings.data_dir) / "floor-ckpt"))
                 .trigger(processingTime=f"{settings.stream.trigger_interval_ms} milliseconds")
                 .start())
    feeder.start()
    progress: list[dict] = []
    seen = set()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(0.5)
            for p in query.recentProgress:
                if p["batchId"] not in seen:
                    seen.add(p["batchId"])
                    progress.append(p)
    finally:
        stop.set()
        feeder.join()
        query.stop()
    out = _medians(progress[2:])   # the first batches pay one-off costs
    if relay_sink is not None:
        ours = [s.seconds * 1000 for s in relay_sink.history[2:] if s.rows_in]
        out["sink_ms_p50"] = round(statistics.median(ours), 1) if ours else None
    return out


def measure(spark, seconds: float = 30.0, gap: float = 0.3,
            trigger_interval_ms: int | None = None) -> dict:
    """Spark's floor and the relay's stream over the same trickle, one after the other."""
    out: dict = {"seconds_each": seconds, "commit_every_s": gap}
    for sink in ("noop", "relay"):
        with tempfile.TemporaryDirectory(prefix=f"batch-profile-{sink}-") as d:
            settings = config.load(None, env={}, data_dir=d)
            if trigger_interval_ms is not None:
                settings.stream.trigger_interval_ms = trigger_interval_ms
            settings.egress.inbox_signal = False
            out["trigger_interval_ms"] = settings.stream.trigger_interval_ms
            out["floor" if sink == "noop" else "relay"] = _run(spark, settings, sink, seconds, gap)
    floor = out["floor"].get("batch_ms_p50")
    ours = out["relay"].get("batch_ms_p50")
    out["relay_over_floor"] = round(ours / floor, 2) if floor and ours else None
    return out


if __name__ == "__main__":
    import json
    import sys

    from .spark_session import get_spark
    result = measure(get_spark("local[2]", "batch-profile",
                               jvm_options=config.load(None).stream.jvm_options),
                     float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
    print(json.dumps(result, indent=1))
