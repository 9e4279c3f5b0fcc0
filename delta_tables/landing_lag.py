"""How far the inbox stream is behind the landing tables, from the files alone.

Landing lag = the landing commits that exist but the stream has not committed yet: per table,
its newest version minus the last version the stream committed. That comes from the inbox's
and the rejects' own logs (the stream marks, in the commits of each batch, the newest landing
version it took rows from: right on every host that reads the tables), and where this host
has them, from the stream's Spark checkpoint (the end offsets of its newest committed batch: `offsets/<N>` once
`commits/<N>` exists), or from `<data>/state/landing_consumed.json` if that is further on.
The JSON file alone would overstate the lag: Spark tells a source that batch N is committed
only when it plans batch N+1, so at idle the last batch is never recorded there.

In seconds it is the age of the oldest such commit (its `commitInfo.timestamp`), i.e. how long
the longest-waiting acked envelope has not been in the inbox. Read by the stream's metrics,
`relay status` and the operations notebook; needs no Spark and no open Delta handle.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import object_store
from .layout import Layout


@dataclass
class LandingLag:
    versions: int = 0          # landing commits not yet in the inbox, all tables together
    seconds: float = 0.0       # age of the oldest of them (0 when caught up)
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (latest, consumed)


def commit_version(name: str) -> int | None:
    """The version of a `_delta_log` entry named `<20 digits>.json`; None for any other."""
    if name.endswith(".json") and name[:20].isdigit() and len(name) == 25:
        return int(name[:20])
    return None


def latest_version(table_path: Path) -> int:
    """Newest committed version from the names in `_delta_log`; -1 if the table vanished."""
    try:
        names = object_store.listdir(table_path / "_delta_log")
    except FileNotFoundError:
        return -1
    return max((v for v in map(commit_version, names) if v is not None), default=-1)


class LogFollower:
    """`latest_version` for a follower that has read a table up to some version. On an object
    store it first asks for the next commit (a HEAD while there is none) and LISTs the log only
    when that exists, or once per `list_every` seconds: a caught-up follower polling every
    second then makes ~no LIST, the request S3 bills at 12.5 HEADs (docs/scale-out.md, "Idle").
    The periodic LIST finds a follower stalled past the log's retention, whose next commit is
    gone: its read then fails and it rebuilds, as on a local disk."""

    def __init__(self, table_path, list_every: float = 60.0):
        self.path = table_path
        self.remote = object_store.is_remote(table_path)
        self.list_every = list_every
        self._listed = float("-inf")

    def latest(self, known: int) -> int:
        now = time.monotonic()
        if self.remote and known >= 0 and now - self._listed < self.list_every:
            nxt = self.path / "_delta_log" / f"{known + 1:020d}.json"
            if object_store.read_objects(self.path.location, [(str(nxt), None)])[0] is None:
                return known
        self._listed = now
        return latest_version(self.path)


def commit_time(table_path: Path, version: int) -> float | None:
    """Unix seconds of a commit, from its commitInfo (the file's mtime if it has none)."""
    log_file = table_path / "_delta_log" / f"{version:020d}.json"
    try:
        for line in log_file.read_text().splitlines():
            info = json.loads(line).get("commitInfo")
            if info and "timestamp" in info:
                return info["timestamp"] / 1000.0
        return log_file.stat().st_mtime
    except FileNotFoundError:
        return None   # cleaned up or dropped meanwhile


def has_rows(table_path: Path, version: int) -> bool:
    """Does commit `version` add a file? (Cleaned up or unreadable: assume it does.)"""
    try:
        text = (table_path / "_delta_log" / f"{version:020d}.json").read_text()
    except (FileNotFoundError, OSError):
        return True
    return '"add"' in text


def checkpoint_offsets(checkpoint: Path | str) -> dict[str, int]:
    """End offsets `{"<node>/g<N>": version}` of the newest batch the stream committed, from
    a local checkpoint (one on S3 is not read here: the tables' marks say the same)."""
    if "://" in str(checkpoint):
        return {}
    try:
        done = [int(n) for n in os.listdir(Path(checkpoint) / "commits") if n.isdigit()]
    except FileNotFoundError:
        return {}
    for batch in sorted(done, reverse=True):
        try:
            lines = (Path(checkpoint) / "offsets" / str(batch)).read_text().splitlines()
            return {k: int(v) for k, v in json.loads(lines[-1]).get("v", {}).items()}
        except (FileNotFoundError, ValueError, IndexError, AttributeError):
            continue   # being written or purged: an older batch still tells where we are
    return {}


LANDING_MARK = "relay-landing:"   # + "<node>/g<N>": app transactions the stream commits


def table_marks(layout: Layout) -> dict[str, int]:
    """Per landing table, the newest version whose rows the stream committed, from the app
    transactions of the inbox's and the rejects' logs (jobs/inbox_stream.landing_marks): the
    tables alone say it, on any host that reads them."""
    from deltalake import DeltaTable
    keys = list(layout.landing_tables())
    marks: dict[str, int] = {}
    for path in (layout.inbox, layout.rejects):
        try:
            dt = DeltaTable(str(path))
        except Exception:   # not created yet
            continue
        for key in keys:
            v = dt.transaction_version(LANDING_MARK + key)
            if v is not None:
                marks[key] = max(int(v), marks.get(key, -1))
    return marks


def consumed_versions(layout: Layout, checkpoint: Path | None = None) -> dict[str, int]:
    """Per landing table, the newest version the stream has committed to the inbox: from the
    tables' own logs (`table_marks`), `state/landing_consumed.json` or the stream's
    checkpoint (`checkpoint`, default `<data>/checkpoints/inbox_stream`) where this host has
    them, whichever is further on. The JSON file alone lags a batch behind, and at idle for
    good (module docstring)."""
    consumed = layout.read_landing_consumed()
    ckpt = checkpoint_offsets(checkpoint or layout.root / "checkpoints" / "inbox_stream")
    for source in (ckpt, table_marks(layout)):
        for key, version in source.items():
            consumed[key] = max(version, consumed.get(key, -1))
    return consumed


def landing_lag(layout: Layout, checkpoint: Path | None = None,
                now: float | None = None) -> LandingLag:
    """`checkpoint`: the stream's (default `<data>/checkpoints/inbox_stream`)."""
    now = time.time() if now is None else now
    consumed = consumed_versions(layout, checkpoint)
    lag = LandingLag()
    oldest: float | None = None
    for key, path in layout.landing_tables().items():
        latest = latest_version(path)
        if latest < 0:
            continue
        # version 0 is the table's creation (layout.ensure_table), never data: a generation
        # the stream has not seen yet lags by its commits after that
        done = consumed.get(key, 0)
        while done < latest and not has_rows(path, done + 1):
            done += 1   # a commit without rows (a lease's fencing marker) is nothing to take
        lag.tables[key] = (latest, done)
        if latest > done:
            lag.versions += latest - done
            t = commit_time(path, done + 1)
            if t is not None and (oldest is None or t < oldest):
                oldest = t
    lag.seconds = max(0.0, now - oldest) if oldest is not None else 0.0
    return lag
