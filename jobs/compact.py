"""Compaction: turn acks and expiries into deletes, drop consumed landing generations, and keep
every table small and its log short, so delivered ciphertext leaves the disk.

One run, in order (each step prints one progress line, counts only):

1. purge acked   inbox rows acked at least `ack_grace_seconds` ago lose their envelope (set to
                 NULL: a tombstone). The row itself stays until it expires: the stream
                 deduplicates event_ids against inbox history within the TTL and continues each
                 mailbox's cursor from the inbox.
2. expire        inbox rows with expires_at <= now are deleted, except each (protocol, mailbox)'s
                 highest-cursor row, kept as a tombstone so cursors never restart (which also
                 keeps the relay-wide max seq).
3. acks          acks whose inbox row is gone, or older than the max TTL + grace, are deleted.
   push_log      rows older than `push.log_retention_days` are deleted (jobs/compact_push.py).
   audit         rejects and padding_audit rows older than `audit_retention_days` are deleted.
4. landing       sealed (not the node's newest) and fully consumed landing generations are
                 removed as whole directories; while a node's lease is live (or expired by
                 less than one more lease length), from the generation it writes on none is
                 (delta_tables/node_lease.py).
5. tables        OPTIMIZE (small-file compaction), VACUUM, checkpoint and log cleanup on
                 inbox, acks, rejects and padding_audit (the protocols' tables and push_log
                 in their own steps), all by `vacuum_retention_seconds`.
6. orphans       files no log names, in every table but landing, deleted once older than
                 the bound's slack (`runtime.config.orphan_age_seconds`, 300 s by default;
                 delta_tables/orphan_files.py).

Rows to change are found with DataFusion SQL over a snapshot (delta-rs `QueryBuilder`, no
pyarrow dataset scan) and changed with one MERGE per step, joined on the relay-wide unique seq
and checked on (protocol, mailbox) in the clauses: no mailbox key is ever spelled into a
predicate, so none reaches the Delta log or an error text.

Concurrency: the stream appends to inbox and egress to acks while this runs. In delta-rs 1.6 a
commit that removes files (MERGE, DELETE, UPDATE) and an append racing it cannot both win: the
appender gets `CommitFailedError` ("a concurrent transaction deleted data this operation read")
and must retry on a fresh handle, and so must any appender whose handle predates such a commit.
The MERGE here loses only if a concurrent append matches its recorded pruning predicate (see
`compact_step.merge`); then the step is recomputed on fresh handles a few times, and if it
still loses it is skipped until the next run. Appended rows are never touched: a MERGE only
rewrites files of its own snapshot.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Callable

import pyarrow as pa
from deltalake import DeltaTable

from delta_tables import node_lease, object_store, orphan_files
from delta_tables.landing_lag import consumed_versions
from delta_tables.layout import GENERATION_RE, Layout
from delta_tables.query import sql
from delta_tables.schema import ACKS, INBOX, PADDING_AUDIT, REJECTS, C
from runtime.config import Settings, orphan_age_seconds

from .compact_heya import compact_heya
from .compact_ppp import compact_ppp
from .compact_push import compact_push
from .compact_step import (COMMIT_ATTEMPTS, SAME_MAILBOX, CompactionReport, LostRace,
                           ProtocolStep, S, T, delete_older, human_bytes, maintain, merge,
                           retry)
from .compact_sync import compact_sync

log = logging.getLogger("relay.compaction")

Progress = Callable[[str], None]

# The protocols with tables of their own, each one step after the generic ones (compact_step).
PROTOCOL_STEPS: tuple[tuple[str, ProtocolStep], ...] = (
    ("heya", compact_heya), ("ppp", compact_ppp), ("sync", compact_sync))


def run_compaction(settings: Settings, *, now: datetime | None = None,
                   progress: Progress | None = None) -> CompactionReport:
    """One compaction pass over `settings.data_dir`; see the module docstring."""
    say = progress or (lambda msg: log.info(msg, extra={"event": "compaction_step"}))
    now = now or datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    conf = settings.compaction
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    report = CompactionReport(bytes_before=object_store.disk_usage(layout.tables))
    started = time.monotonic()

    ack_cutoff = now - timedelta(seconds=conf.ack_grace_seconds)
    # No inbox row outlives the max TTL, so no ack is needed for longer.
    stale_ack_cutoff = now - timedelta(seconds=settings.stream.max_ttl_seconds
                                       + conf.ack_grace_seconds)

    def step(name: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            detail = fn()
        except LostRace:
            report.skipped.append(name)
            detail = f"skipped: lost {COMMIT_ATTEMPTS} commit races to concurrent writers"
        say(f"{name}: {detail} ({time.monotonic() - t0:.2f} s)")

    def purge() -> str:
        report.tombstoned_acked = retry(report, lambda: _purge_acked(layout, ack_cutoff, now))
        return f"{report.tombstoned_acked} acked envelopes tombstoned"

    def expire() -> str:
        report.expired_deleted, report.tombstones_kept = retry(
            report, lambda: _expire(layout, now))
        return (f"{report.expired_deleted} expired rows deleted, "
                f"{report.tombstones_kept} max-cursor tombstones kept")

    def acks() -> str:
        report.acks_removed = retry(report, lambda: _clean_acks(layout, stale_ack_cutoff))
        return f"{report.acks_removed} acks removed"

    def audit() -> str:
        # What the tables kept for operators and capacity analysts, once past its retention:
        # without this they grow with traffic for as long as the relay runs.
        cutoff = now - timedelta(days=conf.audit_retention_days)
        report.rejects_removed = delete_older(layout.rejects, C.REJECTED_AT, cutoff, report)
        report.padding_audit_removed = delete_older(layout.padding_audit, C.AUDITED_AT,
                                                    cutoff, report)
        return (f"{report.rejects_removed} rejects and {report.padding_audit_removed} "
                f"padding_audit rows older than {conf.audit_retention_days:g} days deleted")

    def landing() -> str:
        report.landing_dropped = _drop_landing(layout, settings.stream_checkpoint)
        return f"{report.landing_dropped} consumed landing generations dropped"

    step("purge acked", purge)
    step("expire", expire)
    step("acks", acks)
    target = conf.target_file_mb * 1024 * 1024
    for name, protocol_step in PROTOCOL_STEPS:
        step(name, lambda protocol_step=protocol_step: protocol_step(
            layout, report, target, conf.vacuum_retention_seconds))
    step("push_log", lambda: compact_push(layout, report, target,
                                          conf.vacuum_retention_seconds,
                                          settings.push.log_retention_days, now))
    step("audit", audit)
    step("landing", landing)
    for tdef in (INBOX, ACKS, REJECTS, PADDING_AUDIT):
        step(f"tables/{tdef.name}",
             lambda tdef=tdef: maintain(layout.table(tdef), target,
                                        conf.vacuum_retention_seconds, report))

    step("orphans", lambda: _sweep_orphans(layout, report, orphan_age_seconds(conf)))
    report.bytes_after = object_store.disk_usage(layout.tables)
    report.seconds = time.monotonic() - started
    say(f"done: tables {human_bytes(report.bytes_before)} -> "
        f"{human_bytes(report.bytes_after)} in {report.seconds:.2f} s")
    return report


def compaction_loop(settings: Settings, stop_event: threading.Event,
                    progress: Progress | None = None,
                    on_report: Callable[[CompactionReport], None] | None = None,
                    on_failure: Callable[[], None] | None = None,
                    run: Callable[[], CompactionReport] | None = None) -> None:
    """Run `run_compaction` now and then every `interval_seconds` until `stop_event` is set
    (used by `relay up`). A failed run is logged and the next one happens on schedule.
    `on_report` / `on_failure` feed the metrics endpoint. `run` replaces the in-process run:
    `relay compact --loop` runs each in a child process, so what a run's delta-rs and Arrow
    work allocated is given back when it ends instead of held by an idle process."""
    interval = settings.compaction.interval_seconds
    while not stop_event.is_set():
        try:
            report = run() if run else run_compaction(settings, progress=progress)
            log.info("compaction run finished", extra={
                "event": "compaction_run", "tombstoned_acked": report.tombstoned_acked,
                "expired_deleted": report.expired_deleted, "acks_removed": report.acks_removed,
                "landing_dropped": report.landing_dropped,
                "files_compacted": report.files_compacted,
                "files_vacuumed": report.files_vacuumed, "bytes_after": report.bytes_after,
                "skipped": report.skipped, "ms": round(report.seconds * 1000, 1)})
            if on_report:
                on_report(report)
        except Exception as exc:  # keep the relay up; the next run retries
            log.error("compaction run failed", extra={
                "event": "compaction_failed", "error": type(exc).__name__,
                "next_run_s": interval}, exc_info=True)
            if on_failure:
                on_failure()
        stop_event.wait(interval)


# --- steps ---------------------------------------------------------------------------------

def _purge_acked(layout: Layout, cutoff: datetime, now: datetime) -> int:
    inbox = DeltaTable(str(layout.inbox))
    acks = DeltaTable(str(layout.acks))
    # Only rows that still carry an envelope (an empty source means no commit at all) and
    # have not expired: the expire step deletes or nulls those in its own single rewrite.
    source = sql({"inbox": inbox, "acks": acks}, f"""
        SELECT DISTINCT i.{C.SEQ}, i.{C.PROTOCOL}, i.{C.MAILBOX}
        FROM acks a JOIN inbox i
          ON a.{C.PROTOCOL} = i.{C.PROTOCOL} AND a.{C.MAILBOX} = i.{C.MAILBOX}
         AND a.{C.SEQ} = i.{C.SEQ}
        WHERE a.{C.ACKED_AT} <= {_ts(cutoff)} AND i.{C.ENVELOPE} IS NOT NULL
          AND i.{C.EXPIRES_AT} > {_ts(now)}""")
    if source.num_rows == 0:
        return 0
    metrics = (merge(inbox, source)
               .when_matched_update({C.ENVELOPE: "NULL"},
                                    f"{SAME_MAILBOX} AND {T}.{C.ENVELOPE} IS NOT NULL")
               .execute())
    return int(metrics["num_target_rows_updated"])


def _expire(layout: Layout, now: datetime) -> tuple[int, int]:
    """Returns (rows deleted, expired max-cursor rows kept as tombstones)."""
    inbox = DeltaTable(str(layout.inbox))
    expired = sql({"inbox": inbox}, f"""
        WITH top AS (
          SELECT {C.PROTOCOL}, {C.MAILBOX}, max({C.CURSOR}) AS top_cursor
          FROM inbox GROUP BY {C.PROTOCOL}, {C.MAILBOX})
        SELECT i.{C.SEQ}, i.{C.PROTOCOL}, i.{C.MAILBOX},
               i.{C.CURSOR} = top.top_cursor AS keep,
               i.{C.ENVELOPE} IS NULL AS tombstone
        FROM inbox i JOIN top
          ON i.{C.PROTOCOL} = top.{C.PROTOCOL} AND i.{C.MAILBOX} = top.{C.MAILBOX}
        WHERE i.{C.EXPIRES_AT} <= {_ts(now)}""")
    keep = expired.column("keep").to_pylist()
    tombstone = expired.column("tombstone").to_pylist()
    kept = sum(keep)
    # Rows to touch: every expired non-max row, and max rows that still carry an envelope.
    todo = [not k or not t for k, t in zip(keep, tombstone)]
    if not any(todo):
        return 0, kept
    # A row that is not its mailbox's max in this snapshot never becomes the max later
    # (cursors only grow), so deleting it stays right whatever the stream appends meanwhile.
    metrics = (merge(inbox, expired.filter(pa.array(todo)).drop_columns(["tombstone"]))
               .when_matched_delete(f"{SAME_MAILBOX} AND NOT {S}.keep")
               .when_matched_update({C.ENVELOPE: "NULL"},
                                    f"{SAME_MAILBOX} AND {S}.keep "
                                    f"AND {T}.{C.ENVELOPE} IS NOT NULL")
               .execute())
    return int(metrics["num_target_rows_deleted"]), kept


def _clean_acks(layout: Layout, stale_cutoff: datetime) -> int:
    # acks' snapshot first, inbox's after: an ack in this snapshot was written after its row
    # was delivered from the inbox, so a later inbox snapshot lacks that row only if
    # compaction deleted it. The other order would drop acks of rows the stream just added.
    acks = DeltaTable(str(layout.acks))
    inbox = DeltaTable(str(layout.inbox))
    # One source row per (seq, acked_at) to delete, carrying the inbox row of that seq (seq
    # is relay-wide unique there), or NULL if there is none: an ack goes when its (protocol,
    # mailbox, seq) names no inbox row, or when it is older than any TTL. Joining on acked_at
    # too keeps egress's fresh acks (acked_at after every source row's) outside the MERGE's
    # pruning predicate; joined on seq alone, a busy egress made it lose every attempt.
    source = sql({"inbox": inbox, "acks": acks}, f"""
        SELECT DISTINCT a.{C.SEQ}, a.{C.ACKED_AT}, i.{C.PROTOCOL}, i.{C.MAILBOX}
        FROM acks a LEFT JOIN inbox i ON a.{C.SEQ} = i.{C.SEQ}
        WHERE i.{C.SEQ} IS NULL OR a.{C.PROTOCOL} <> i.{C.PROTOCOL}
           OR a.{C.MAILBOX} <> i.{C.MAILBOX} OR a.{C.ACKED_AT} < {_ts(stale_cutoff)}""")
    if source.num_rows == 0:
        return 0
    metrics = (merge(acks, source, (C.SEQ, C.ACKED_AT))
               .when_matched_delete(f"{S}.{C.MAILBOX} IS NULL OR NOT ({SAME_MAILBOX}) "
                                    f"OR {T}.{C.ACKED_AT} < {_ts(stale_cutoff)}")
               .execute())
    return int(metrics["num_target_rows_deleted"])


def _sweep_orphans(layout: Layout, report: CompactionReport, min_age_seconds: int) -> str:
    """Step 6. The age keeps a write in progress safe (orphan_files.py). A file no log names
    that holds an acked envelope was written at the latest by the run that purged the row
    (grace + one interval after the ack), so it goes `min_age_seconds` + one interval after
    that at the latest: inside the bound (runtime.config.orphan_age_seconds)."""
    for d in sorted(layout.tables.iterdir()):
        if d.name != "landing" and (d / "_delta_log").exists():
            report.orphans_deleted += orphan_files.delete(d, min_age_seconds)
    return f"{report.orphans_deleted} files no log names deleted (older than {min_age_seconds} s)"


def drop_consumed_landing(layout: Layout) -> int:
    """Step 4 alone (the load generator seals its synthetic day with it)."""
    return _drop_landing(layout, None)


def _drop_landing(layout: Layout, checkpoint: Path | None) -> int:
    """Remove generations that are sealed (a newer one exists for the node, so ingress no
    longer writes there) and whose every version the stream has committed: by its consumed
    file or its checkpoint (`checkpoint`, the stream's), whichever is further on; the file
    alone left the generation of an idle stream's last batch on disk."""
    consumed = consumed_versions(layout, checkpoint)
    dropped = 0
    now = datetime.now(timezone.utc)
    kept_from: dict[str, int | None] = {}    # node -> its lease's generation (node_lease.py)
    for key, path in layout.landing_tables().items():
        node, gen_name = key.split("/")
        gen = int(GENERATION_RE.match(gen_name).group(1))
        if gen >= max(layout.generations(node), default=gen) or key not in consumed:
            continue
        if node not in kept_from:
            lease = node_lease.read(layout.tables, node)
            kept_from[node] = lease.retired_below(now) if lease else None
        if kept_from[node] is not None and gen >= kept_from[node]:
            continue    # a live node may still write there: its lease says which it writes
        try:
            version = DeltaTable(str(path)).version()
        except Exception:  # vanished or half-created: not ours to judge
            continue
        if version <= consumed[key]:
            object_store.rmtree(path)
            dropped += not path.exists()
    return dropped


# --- helpers ---------------------------------------------------------------------------------

def _ts(moment: datetime) -> str:
    """A SQL literal of the tables' timestamp type (microseconds, UTC)."""
    iso = moment.astimezone(timezone.utc).isoformat()
    return f"arrow_cast('{iso}', 'Timestamp(Microsecond, Some(\"UTC\"))')"
