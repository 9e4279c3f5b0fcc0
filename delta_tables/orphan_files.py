"""Files in a table's directory that no version of its log names: a write that failed between
its Parquet file and its commit, or a removed file whose tombstone aged out of the log. Delta's
full VACUUM judges these by file age alone, in whole hours (delta-rs); compaction judges them
by the second, so they too leave the disk within `compaction.delivered_bound_seconds`.

Safe because of the age: a file is deleted only when it is at least `min_age_seconds` old
(compaction passes the bound's slack, `runtime.config.orphan_age_seconds`: 300 s by
default, at least 10 s). A write in progress names its files in a commit within seconds of writing them: the stream's, egress's
and ingress's appends commit within a second, compaction's own rewrites are committed or
abandoned before its sweep (one run at a time), and a commit that loses a race is retried at
once with the same files. The snapshot is read before the directory is listed, so a file
committed meanwhile is young and skipped. A file the log removed (a tombstone) is never an
orphan here: it waits for the VACUUM by removal time (removed_files.py), which protects the
readers of older snapshots.
"""

from __future__ import annotations

import time
from pathlib import Path

from deltalake import DeltaTable

from .removed_files import file_name


def find(path: Path, min_age_seconds: float, now: float | None = None) -> list[Path]:
    """The data files under `path` (its root: the tables are not partitioned) that neither the
    current snapshot nor a tombstone names and that are at least `min_age_seconds` old."""
    dt = DeltaTable(str(path))
    named = {file_name(u) for u in dt.file_uris()}
    named |= {file_name(p) for p in dt.vacuum(retention_hours=0, dry_run=True,
                                              enforce_retention_duration=False, full=False)}
    now = time.time() if now is None else now
    out = []
    for f in path.iterdir():
        if f.name.startswith(("_", ".")) or f.name in named:   # the log, hidden files
            continue
        try:
            if f.is_file() and now - f.stat().st_mtime >= min_age_seconds:
                out.append(f)
        except FileNotFoundError:
            continue
    return out


def delete(path: Path, min_age_seconds: float) -> int:
    """Delete what `find` returns; how many are gone."""
    gone = 0
    for f in find(path, min_age_seconds):
        f.unlink(missing_ok=True)
        gone += not f.exists()
    return gone
