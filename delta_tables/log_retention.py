"""A table's log kept as short as its readers need: the commits and checkpoints older than the
newest checkpoint that has itself aged past the retention are deleted (by the second; delta-rs
`cleanup_metadata` reads `delta.logRetentionDuration`, whose 1 day kept every commit of a busy
day on disk, see docs/operating/retention.md).

What a reader needs of a log: the checkpoint named by `_last_checkpoint` and every commit after
it (a fresh snapshot), or the commits after the version it holds (a follower: egress's inbox
tail rebuilds from a fresh snapshot when one is gone). Nothing at or after the kept checkpoint
is touched, and the kept checkpoint is one at least `retention_seconds` old, so a reader that
read `_last_checkpoint` just before a newer checkpoint was written still finds the one it was
told of, and a follower less than the retention behind still finds its commits. The retention
is compaction's VACUUM retention: a version older than that may name files VACUUM already
deleted, so no reader could read it whole anyway.

Landing tables are never cleaned here: the stream reads their commits one by one
(landing_source.version_adds), and compaction drops their generations whole once consumed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

ENTRY_RE = re.compile(r"^(\d{20})\.")                    # a commit, checkpoint or .crc file
CHECKPOINT_RE = re.compile(r"^(\d{20})\.checkpoint(\.\d+\.\d+)?\.parquet$")


def clean(path: Path, retention_seconds: float, now: float | None = None) -> int:
    """Delete the log entries of `path` older than its newest checkpoint at least
    `retention_seconds` old (file times); returns how many were deleted."""
    log_dir = path / "_delta_log"
    now = time.time() if now is None else now
    entries: list[tuple[int, Path]] = []
    keep_from = -1
    for f in log_dir.iterdir():
        m = ENTRY_RE.match(f.name)
        if not m:
            continue
        version = int(m.group(1))
        entries.append((version, f))
        if CHECKPOINT_RE.match(f.name) and version > keep_from:
            try:
                aged = now - f.stat().st_mtime >= retention_seconds
            except FileNotFoundError:
                continue
            if aged:
                keep_from = version
    deleted = 0
    for version, f in entries:
        if version < keep_from:
            f.unlink(missing_ok=True)
            deleted += 1
    return deleted


def outlived(exc: BaseException) -> bool:
    """A writer's handle outlived the log entries it was loaded from (deleted by `clean`):
    delta-rs finds neither the checkpoint the handle rests on nor the commits after its
    version ("Invalid table version" when updating it). The handle is reopened at the
    newest version and the write retried, as after a lost commit race."""
    text = str(exc)
    return "Invalid table version" in text or (
        "_delta_log" in text and ("not found" in text or "No such file" in text))
