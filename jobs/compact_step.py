"""What every compaction step shares, and the one interface a protocol's step implements.

`relay compact` (`jobs/compact.py`) runs the generic steps over the shared tables, then one
`ProtocolStep` per protocol with tables of its own (`jobs/compact_heya.py`, `compact_ppp.py`,
`compact_sync.py`). A step is a function

    step(layout, report, target_size, retention_seconds) -> str   # its progress detail

that adds what it removed to the run's `CompactionReport` and leaves its tables small and
their logs short (`maintain`). The steps build on the helpers here and on nothing of each
other:

* `retry`: a step opens its own fresh handles and is rerun when its commit loses a race to
  a concurrent writer (delta-rs 1.6: a MERGE and an append racing it cannot both win), up to
  `COMMIT_ATTEMPTS` times; then `LostRace`, and the step is skipped until the next run.
* `merge`: the MERGE every step uses, joined on columns that name no mailbox or secret, so
  none reaches the pruning predicate the Delta log records (`SAME_MAILBOX` checks protocol
  and mailbox in the clauses instead).
* `delete_unneeded` / `prune_control_tables`: a control table keeps only the rows its
  protocol's state fold rests on.
* `delete_older`: a table kept for a while (push_log, rejects, padding_audit) loses its rows
  older than its retention.
* `maintain`: OPTIMIZE, VACUUM, checkpoint and log cleanup of one table.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, TypeVar

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from delta_tables import log_retention, removed_files
from delta_tables.layout import Layout
from delta_tables.query import sql
from delta_tables.schema import C

log = logging.getLogger("relay.compaction")

Result = TypeVar("Result")

# A step that loses a commit race is recomputed on fresh handles this many times in total.
COMMIT_ATTEMPTS = 5
RETRY_BACKOFF_SECONDS = 0.05

# A checkpoint is written once the commits after the last one hold this many bytes: it then
# replaces more log than it adds once the retention lets those commits go. A checkpoint of a
# table with a few short commits (~12 KiB of Parquet for a few KiB of JSON) would make a
# table bigger than compaction found it; an idle table keeps its checkpoint.
CHECKPOINT_MIN_LOG_BYTES = 32 * 1024

S, T = "s", "t"  # merge aliases: source, target
SAME_MAILBOX = " AND ".join(f"{T}.{c} = {S}.{c}" for c in (C.PROTOCOL, C.MAILBOX))


@dataclass
class CompactionReport:
    tombstoned_acked: int = 0     # envelopes nulled because they were acked (step 1)
    expired_deleted: int = 0      # inbox rows deleted because they expired (step 2)
    tombstones_kept: int = 0      # expired rows kept as their mailbox's max-cursor tombstone
    acks_removed: int = 0
    landing_dropped: int = 0      # landing generation directories removed
    heya_inbox_deleted: int = 0   # Heya rows of revoked send tokens (DEAU, DALL)
    heya_inbox_trimmed: int = 0   # Heya bodies removed by TRIM
    heya_control_removed: int = 0  # Heya control rows no longer needed
    ppp_control_removed: int = 0   # PPP control rows no longer needed (jobs/compact_ppp.py)
    sync_control_removed: int = 0  # sync control rows no longer needed (jobs/compact_sync.py)
    push_log_removed: int = 0      # push_log rows past push.log_retention_days
    rejects_removed: int = 0       # rejects rows past compaction.audit_retention_days
    padding_audit_removed: int = 0  # padding_audit rows past compaction.audit_retention_days
    files_compacted: int = 0      # small files rewritten by OPTIMIZE
    files_vacuumed: int = 0       # removed files deleted by VACUUM
    orphans_deleted: int = 0      # files no log names (delta_tables/orphan_files.py)
    log_entries_removed: int = 0  # commits and checkpoints before the kept checkpoint
    bytes_before: int = 0         # everything under <data>/tables
    bytes_after: int = 0
    conflicts_retried: int = 0    # commit races lost and recomputed
    skipped: list[str] = field(default_factory=list)  # steps that lost every attempt
    seconds: float = 0.0

    def format(self) -> str:
        lines = [
            f"acked envelopes tombstoned   {self.tombstoned_acked}",
            f"expired rows deleted         {self.expired_deleted}",
            f"max-cursor tombstones kept   {self.tombstones_kept}",
            f"acks removed                 {self.acks_removed}",
            f"landing generations dropped  {self.landing_dropped}",
            f"heya rows deleted / trimmed  {self.heya_inbox_deleted} / "
            f"{self.heya_inbox_trimmed} ({self.heya_control_removed} control rows)",
            f"ppp / sync control removed   {self.ppp_control_removed} / "
            f"{self.sync_control_removed}",
            f"push_log rows removed        {self.push_log_removed}",
            f"rejects / audit rows removed {self.rejects_removed} / "
            f"{self.padding_audit_removed}",
            f"files compacted              {self.files_compacted}",
            f"files vacuumed / orphaned    {self.files_vacuumed} / {self.orphans_deleted}",
            f"log entries removed          {self.log_entries_removed}",
            f"tables on disk               {human_bytes(self.bytes_before)} -> "
            f"{human_bytes(self.bytes_after)}",
            f"commit conflicts retried     {self.conflicts_retried}",
        ]
        if self.skipped:
            lines.append(f"skipped (lost to writers)    {', '.join(self.skipped)}")
        lines.append(f"took                         {self.seconds:.2f} s")
        return "\n".join(lines)


# The interface of a protocol's step: (layout, report, target_size, retention_seconds) -> detail.
ProtocolStep = Callable[[Layout, CompactionReport, int, int], str]


class LostRace(Exception):
    """A step lost its commit to concurrent writers on every attempt."""


def retry(report: CompactionReport, attempt: Callable[[], Result]) -> Result:
    """Run `attempt` (which opens its own fresh handles) until its commit wins."""
    for n in range(COMMIT_ATTEMPTS):
        try:
            return attempt()
        except CommitFailedError:
            report.conflicts_retried += 1
            log.debug("commit conflict, retrying", extra={
                "event": "compaction_conflict", "attempt": n + 1, "of": COMMIT_ATTEMPTS})
            time.sleep(RETRY_BACKOFF_SECONDS * (n + 1))
    raise LostRace()


def merge(target: DeltaTable, source: pa.Table, on: tuple[str, ...] = (C.SEQ,)):
    """MERGE joined on `on` (seq, relay-wide unique, plus acked_at for acks).

    With `streamed_exec=False` delta-rs derives a pruning predicate from the join columns'
    min/max in the source, records it in the commit, and checks concurrent appends against
    it: `seq >= a AND seq <= b` never matches the stream's appends (higher seqs) and names no
    mailbox. Joining on the mailbox too would write two mailbox keys into every commit's
    operationParameters, so the clauses check protocol and mailbox (`SAME_MAILBOX`)."""
    keys = source.select(list(on)).group_by(list(on)).aggregate([])
    if keys.num_rows != source.num_rows:
        # One target row matched by two source rows would be rewritten twice.
        raise RuntimeError(f"merge key {on} is not unique in {target.metadata().name}'s "
                           "compaction source: refusing to merge")
    match = " AND ".join(f"{T}.{c} = {S}.{c}" for c in on)
    return target.merge(source, match, source_alias=S, target_alias=T, streamed_exec=False)


def delete_unneeded(target: DeltaTable, rows: pa.Table, needed, identity: tuple[str, ...],
                    at: str = "at") -> int:
    """Delete the control-table rows among `rows` (their `at` and `identity` columns, read
    from `target`'s snapshot) whose `at` is not in `needed`, the set a protocol's state fold
    still rests on. The MERGE joins on the non-secret `at` only; the identity columns (tokens,
    keys) are compared by name in the clause, never spelled into a predicate the Delta log
    records. No commit when nothing is unneeded. Used by the Heya, PPP and sync steps.

    `at` is unique in a table written through `control.py`'s fence; a table each host
    appends to on its own (sync's ack progress) may hold one `at` twice, from two hosts. Such
    rows are deleted in rounds, each with one source row per `at` (a MERGE whose target row
    two source rows match is refused), and a row shares its fate with every row of its `at`
    only in being kept: a needed `at` keeps them all (never a needed row deleted)."""
    import pyarrow.compute as pc
    keep = pc.is_in(pc.cast(rows.column(at), pa.int64()), pa.array(sorted(needed), pa.int64()))
    source = rows.filter(pc.invert(keep)).select([at, *identity])
    same = " AND ".join(f"{T}.{c} = {S}.{c}" for c in identity)
    deleted = 0
    for part in _rounds(source, at):
        m = merge(target, part, (at,))
        deleted += int(m.when_matched_delete(same).execute()["num_target_rows_deleted"])
    return deleted


def _rounds(source: pa.Table, at: str) -> list[pa.Table]:
    """`source` split so that no part holds one `at` twice (the n-th row of each `at` in
    part n): usually one part."""
    import pyarrow.compute as pc
    ats = pc.cast(source.column(at), pa.int64()).to_pylist()
    seen: dict[int, int] = {}
    rank = []
    for a in ats:
        rank.append(seen.get(a, 0))
        seen[a] = rank[-1] + 1
    ranks = pa.array(rank)
    return [source.filter(pc.equal(ranks, n)) for n in range(max(rank, default=-1) + 1)]


def delete_older(path: Path, column: str, cutoff: datetime,
                 report: CompactionReport) -> int:
    """Delete the rows of the table at `path` whose time `column` is before `cutoff`, with
    one DELETE whose predicate names only a time, never a mailbox or a device. A DELETE that
    loses to a concurrent append (the writer's new rows are younger) is recomputed on a fresh
    handle (`retry`). Returns the rows deleted."""
    at = cutoff.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def delete() -> int:
        metrics = DeltaTable(str(path)).delete(f"{column} < '{at}'")
        return int(metrics.get("num_deleted_rows", 0) or 0)
    return retry(report, delete)


def prune_control_tables(protocol: str, paths: Mapping[str, Path],
                         identity: Mapping[str, tuple[str, ...]], at: str,
                         needed_at: Callable[[], Mapping[str, set[int]]],
                         report: CompactionReport, target_size: int,
                         retention_seconds: int) -> dict[str, int] | None:
    """A protocol's append-only control tables (`paths`: table name -> path) keep only the
    rows its state fold rests on, then are maintained. Tables are judged in `identity`'s
    order (table name -> the columns that name what a row is about); per table the candidate
    rows (`at` + identity, never a payload) are read first and `needed_at()` (the fold) after,
    from snapshots at least as new, so a row appended meanwhile is never touched. A table
    that loses every commit race is skipped (`report.skipped`: "<protocol>/<table>").
    Returns rows removed per table, or None when the tables do not exist (never used here)."""
    if not all((p / "_delta_log").exists() for p in paths.values()):
        return None

    def garbage(name: str) -> int:
        dt = DeltaTable(str(paths[name]))
        t = sql({"t": dt}, f"SELECT {', '.join((at, *identity[name]))} FROM t")
        if t.num_rows == 0:
            return 0
        return delete_unneeded(dt, t, needed_at()[name], identity[name], at)

    removed = {}
    for name in identity:
        try:
            removed[name] = retry(report, lambda name=name: garbage(name))
        except LostRace:
            report.skipped.append(f"{protocol}/{name}")
            removed[name] = 0
    for path in paths.values():
        maintain(path, target_size, retention_seconds, report)
    return removed


def maintain(path: Path, target_size: int, retention_seconds: int,
             report: CompactionReport) -> str:
    """OPTIMIZE (small files into `target_size`), VACUUM (files removed more than
    `retention_seconds` ago leave the disk: `_vacuum_removed`), a checkpoint when the log
    since the last one is long enough to pay for it, and the log's
    entries before the newest checkpoint older than `retention_seconds` deleted
    (delta_tables/log_retention.py). VACUUM goes first, while the commits that removed its
    files are still in the log to tell their removal times. Files no log names are swept
    after every table is maintained (`orphan_files`, jobs/compact.py)."""
    metrics = retry(report, lambda: DeltaTable(str(path)).optimize.compact(
        target_size=target_size))
    compacted = int(metrics.get("numFilesRemoved", 0))
    report.files_compacted += compacted

    dt = DeltaTable(str(path))
    vacuumed = _vacuum_removed(dt, path, retention_seconds)
    report.files_vacuumed += vacuumed
    checkpoint = ""
    if _log_bytes_since_checkpoint(path) >= CHECKPOINT_MIN_LOG_BYTES:
        dt.create_checkpoint()
        checkpoint = f", checkpoint at v{dt.version()}"
    cleaned = log_retention.clean(path, retention_seconds)
    report.log_entries_removed += cleaned
    return (f"{compacted} files compacted{checkpoint}, {vacuumed} vacuumed, "
            f"{cleaned} log entries removed")


def _vacuum_removed(dt: DeltaTable, path: Path, retention_seconds: int) -> int:
    """Lite VACUUM by the second (delta-rs takes whole hours): the files the log says were
    removed, less those removed within `retention_seconds` (delta_tables/removed_files.py),
    are deleted. Only removed files, so never an in-flight write."""
    present = removed_files.on_disk(dt, path)
    if present and retention_seconds > 0:
        recent = removed_files.removal_times(path, dt.version(),
                                             until=time.time() - retention_seconds)
        cutoff = time.time() - retention_seconds
        present = [p for p in present
                   if recent.get(removed_files.file_name(p), cutoff) <= cutoff]
    gone = 0
    for p in present:
        (path / p).unlink(missing_ok=True)
        gone += not (path / p).exists()
    return gone


def _log_bytes_since_checkpoint(path: Path) -> int:
    """Bytes of the commits after the table's newest checkpoint (all of them: none yet)."""
    try:
        since = json.loads((path / "_delta_log" / "_last_checkpoint").read_text())["version"]
    except (FileNotFoundError, ValueError, KeyError):
        since = -1
    total = 0
    for f in (path / "_delta_log").iterdir():
        if f.name.endswith(".json") and f.name[:20].isdigit() and int(f.name[:20]) > since:
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                continue
    return total


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
