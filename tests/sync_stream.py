"""The inbox stream's own foreachBatch sink (`jobs.inbox_stream.InboxSink`: dedup, gap-free
cursors, rejects, TTL clamp, the inbox commit) driven by a small asyncio poller instead of
Spark's scheduler, as `jobs/loadgen.py` drives it: each new landing commit becomes one
micro-batch. For shell tests that need cursors but not Spark's start-up; the end-to-end test
(tests/test_sync_end_to_end.py) runs the real Spark stream.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from delta_tables.landing_lag import latest_version
from delta_tables.layout import Layout
from delta_tables.schema import C, LANDING, LANDING_SOURCE
from jobs.inbox_stream import BATCH_TS, InboxSink
from jobs.inbox_transform import StreamRules
from runtime.inbox_signal import InboxSignalSender, signal_dir


class _Batch:
    def __init__(self, table: pa.Table):
        self._table = table

    def toArrow(self) -> pa.Table:
        return self._table


class SinkDriver:
    def __init__(self, settings):
        self.layout = Layout.of(settings)
        self.layout.ensure_shared_tables()
        checkpoint = self.layout.root / "checkpoints" / "sync-test"
        checkpoint.mkdir(parents=True, exist_ok=True)
        (checkpoint / "metadata").write_text(json.dumps({"id": "sync-test"}))
        self.sink = InboxSink(self.layout, StreamRules.from_conf(settings.stream), checkpoint,
                              settings.stream.app_id, fsync=False)
        # as the relay's stream does: the listeners' tails are woken after each inbox commit
        self.sink.on_inbox_commit = InboxSignalSender(signal_dir(settings.data_dir)).notify
        self.seen: dict[str, int] = {}
        self.batch = 0
        self.paused = False
        self._task: asyncio.Task | None = None

    def _once(self) -> int:
        rows = 0
        for key, path in self.layout.landing_tables().items():
            latest = latest_version(path)
            for v in range(self.seen.get(key, 0) + 1, latest + 1):
                log = path / "_delta_log" / f"{v:020d}.json"
                adds = [json.loads(line)["add"]["path"] for line in log.read_text().splitlines()
                        if '"add"' in line and "add" in json.loads(line)]
                tables = [pq.read_table(path / a, schema=LANDING.arrow_schema()) for a in adds]
                if not tables:
                    continue
                t = pa.concat_tables(tables)
                k = t.num_rows
                src = LANDING_SOURCE.arrow_schema()
                t = (t.append_column(src.field(C.LANDING_TABLE), pa.array([key] * k, pa.string()))
                     .append_column(src.field(C.LANDING_VERSION), pa.array([v] * k, pa.int64()))
                     .append_column(BATCH_TS, pa.array([datetime.now(timezone.utc)] * k,
                                                       pa.timestamp("us", tz="UTC"))))
                self.sink(_Batch(t), self.batch)
                self.batch += 1
                rows += k
            self.seen[key] = latest
        return rows

    async def run(self) -> None:
        while True:
            if not self.paused:
                await asyncio.to_thread(self._once)
            await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
