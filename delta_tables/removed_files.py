"""Files a table's log has removed but that are still on disk: what VACUUM deletes next, and
how long ago each was removed (delivered ciphertext waits there for lagging readers).

delta-rs VACUUM takes its retention in whole hours; the relay's is in seconds
(`compaction.vacuum_retention_seconds`), so removal times are read from the remove actions of
the commit files themselves, newest first. Used by compaction (`jobs/compact_step.py`) and by
`relay status` (the oldest delivered byte still on disk).
"""

from __future__ import annotations

import json
from pathlib import Path

from deltalake import DeltaTable


def on_disk(dt: DeltaTable, path: Path) -> list[str]:
    """Removed files (the log's tombstones) still present, as VACUUM names them."""
    planned = dt.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False,
                        full=False)
    return [p for p in planned if (path / p).exists()]   # p may be absolute


def removal_times(path: Path, latest: int, until: float | None = None,
                  wanted: set[str] | None = None) -> dict[str, float]:
    """File name -> when a commit removed it (unix s), reading commits from `latest` down;
    stops at the first commit at or before `until`, once every name in `wanted` is found, or
    at a commit file cleaned up (names removed before it are then absent)."""
    times: dict[str, float] = {}
    for v in range(latest, -1, -1):
        try:
            text = (path / "_delta_log" / f"{v:020d}.json").read_text()
        except FileNotFoundError:
            break
        actions = [json.loads(line) for line in text.splitlines() if line.strip()]
        stamp = next((a["commitInfo"].get("timestamp") for a in actions
                      if "commitInfo" in a), None)
        for a in actions:
            if "remove" in a:
                r = a["remove"]
                when = r.get("deletionTimestamp") or stamp or 0
                times.setdefault(file_name(r["path"]), when / 1000)
        if until is not None and stamp is not None and stamp / 1000 <= until:
            break
        if wanted is not None and wanted <= times.keys():
            break
    return times


def oldest_removal(path: Path) -> float | None:
    """When the longest-waiting removed file still on disk was removed (unix s), or None.
    A file whose remove commit was already cleaned up from the log counts as removed at the
    oldest commit still there (an under-estimate of its age would hide it)."""
    dt = DeltaTable(str(path))
    present = {file_name(p) for p in on_disk(dt, path)}
    if not present:
        return None
    times = removal_times(path, dt.version(), wanted=present)
    known = [times[n] for n in present if n in times]
    if len(known) < len(present):
        known.append(min(times.values(), default=0.0))
    return min(known)


def file_name(p: str) -> str:
    """Data files sit at the table's root (no partitions): a name identifies one."""
    return str(p).rstrip("/").rsplit("/", 1)[-1]
