"""Compaction of `push_log`: rows older than `push.log_retention_days` are deleted.

The push job appends two rows per wake-up (its intent and its outcome), so without this the
log grows with traffic for ever. The job itself reads back only its last window (its restart,
egress/push/job.py) and the app-transaction marker, which lives in the Delta log and its
checkpoints, not in rows; the capacity notebook reads what is kept. The predicate names only
a time, never a device. A DELETE that loses to the job's append is recomputed
(`compact_step.delete_older`); the job's own append retries on the next step.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from delta_tables.layout import Layout
from delta_tables.schema_push import PL, PUSH_LOG

from .compact_step import CompactionReport, delete_older, maintain


def compact_push(layout: Layout, report: CompactionReport, target_size: int,
                 retention_seconds: int, keep_days: float, now: datetime | None = None) -> str:
    path = layout.table(PUSH_LOG)
    if not (path / "_delta_log").exists():
        return "no push_log"
    cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=keep_days)
    removed = delete_older(path, PL.AT, cutoff, report)
    report.push_log_removed += removed
    maintain(path, target_size, retention_seconds, report)
    return f"{removed} push_log rows older than {keep_days:g} days deleted"
