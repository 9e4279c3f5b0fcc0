"""push_log on disk: `relay compact` keeps `push.log_retention_days` of it, and never the
marker the push job restarts from."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake import CommitProperties, Transaction

from delta_tables.layout import Layout
from delta_tables.schema_push import PL, PUSH_LOG
from egress.push.job import APP_ID
from jobs.compact import run_compaction


def _row(at: datetime, outcome: str) -> dict:
    return {PL.AT: at, PL.PROTOCOL: "ppp", PL.PLATFORM: "apns", PL.DEVICE: b"d" * 16,
            PL.TRIGGER: "message", PL.OUTCOME: outcome, PL.REASON: None, PL.ATTEMPTS: 1,
            PL.WAKE_AT: at, PL.LATENCY_MS: 5, PL.INBOX_TO_PUSH_MS: 9}


def test_old_push_log_rows_leave_and_the_marker_stays(settings):
    settings.push.log_retention_days = 7
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    path = layout.ensure_tables({PUSH_LOG.name: PUSH_LOG})[PUSH_LOG.name]
    now = datetime.now(timezone.utc)
    old = [_row(now - timedelta(days=d), o) for d in (8, 9) for o in ("intent", "sent")]
    new = [_row(now - timedelta(days=d), o) for d in (1, 6) for o in ("intent", "sent")]
    write_deltalake(str(path), pa.Table.from_pylist(old + new, schema=PUSH_LOG.arrow_schema()),
                    mode="append", commit_properties=CommitProperties(
                        app_transactions=[Transaction(APP_ID, 41)]))
    lines: list[str] = []
    report = run_compaction(settings, now=now, progress=lines.append)
    assert report.push_log_removed == 4 and not report.skipped
    assert any("4 push_log rows older than 7 days deleted" in line for line in lines)
    dt = DeltaTable(str(path))
    assert dt.to_pyarrow_table().num_rows == 4
    assert dt.transaction_version(APP_ID) == 41
    assert run_compaction(settings, now=now, progress=lambda _: None).push_log_removed == 0
