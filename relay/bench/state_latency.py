"""The stream's cost per small micro-batch, the driver path against the state store.

`python -m relay.bench.state_latency [rounds]`: per round, one process per path in turn, each
a fresh data directory with the stream running (100 ms trigger, fsync on) while 10 landing
rows are committed every 0.6 s, 45 times; the figure is the median of Spark's `addBatch`
(the sink with, for the state store, the stateful job) over the last 30 batches that took
rows. The state store's process runs with its JVM options (the full JIT). Prints one JSON
line per process and the medians; nothing is written.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

from .state import child_result

COMMITS, ROWS, EVERY_S, LAST = 45, 10, 0.6, 30
MARKER = "LATENCY-RESULT "


def _one(path: str) -> dict:
    import pyarrow as pa

    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    from delta_tables.schema import LANDING, C
    from jobs.inbox_stream import start_inbox_stream
    from jobs.spark_session import get_spark, stream_jvm_options
    from runtime import config

    state = path == "state"
    s = config.load(None, env={}, data_dir=tempfile.mkdtemp(prefix="relay-state-latency-"))
    s.stream.state_store = state
    s.stream.trigger_interval_ms = 100
    layout = Layout.of(s)
    layout.ensure_shared_tables()
    spark = get_spark("local[2]", "relay-bench-state-latency",
                      jvm_options=stream_jvm_options(state, ""))
    query, sink = start_inbox_stream(spark, s, fsync=True)
    target = LandingTarget(layout, "bench", fsync=True)
    for _ in range(COMMITS):
        now = datetime.now(timezone.utc)
        rows = [{C.EVENT_ID: os.urandom(32), C.PROTOCOL: "trueseal",
                 C.MAILBOX: bytes([1 + j % 5]) * 32, C.ENVELOPE: os.urandom(200), C.META: None,
                 C.RECEIVED_AT: now, C.EXPIRES_AT: now + timedelta(days=1)}
                for j in range(ROWS)]
        target.commit(pa.Table.from_pylist(rows, schema=LANDING.arrow_schema()))
        time.sleep(EVERY_S)
    time.sleep(2)
    took = {h.batch_id for h in sink.history if h.rows_in}
    progress = [p for p in query.recentProgress if p["batchId"] in took][-LAST:]
    query.stop()
    spark.stop()
    return {"path": path, "batches": len(progress),
            "add_batch_ms_p50": statistics.median(p["durationMs"]["addBatch"] for p in progress)}


def main(rounds: int = 2) -> dict:
    out: dict = {"runs": []}
    for _ in range(rounds):
        for path in ("driver", "state"):
            run = child_result(["relay.bench.state_latency", "--one", path], MARKER, 600)
            out["runs"].append(run)
            print(json.dumps(run), flush=True)
    for path in ("driver", "state"):
        out[f"{path}_add_batch_ms_p50"] = statistics.median(
            r["add_batch_ms_p50"] for r in out["runs"] if r["path"] == path)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(MARKER + json.dumps(_one(sys.argv[2])), flush=True)
    else:
        print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)))
