"""Compaction on real Delta tables in tmp_path (no Spark)."""

from __future__ import annotations

import os
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake
from deltalake.exceptions import CommitFailedError

from delta_tables.layout import Layout
from delta_tables.schema import ACKS, INBOX, LANDING, C
from jobs.compact import compaction_loop, run_compaction
from runtime.config import Settings

NOW = datetime.now(timezone.utc).replace(microsecond=0)
PROTO = "trueseal"
MB_A, MB_B, MB_C = (bytes([i]) * 32 for i in (0xA1, 0xB2, 0xC3))


def settings(tmp_path: Path, **compaction) -> Settings:
    s = Settings(data_dir=str(tmp_path))
    s.compaction.ack_grace_seconds = 60
    s.compaction.vacuum_retention_seconds = 0
    for k, v in compaction.items():
        setattr(s.compaction, k, v)
    return s


def envelope(mailbox: bytes, cursor: int) -> bytes:
    return b"CIPHERTEXT|" + mailbox[:1].hex().encode() + b"|%08d|" % cursor + b"\x00" * 16


def inbox_rows(specs) -> pa.Table:
    """specs: (mailbox, cursor, seq, expires_at, has_envelope)."""
    cols = {name: [] for name in INBOX.names}
    for mailbox, cursor, seq, expires_at, has_envelope in specs:
        row = {
            C.EVENT_ID: seq.to_bytes(32, "big"), C.PROTOCOL: PROTO, C.MAILBOX: mailbox,
            C.ENVELOPE: envelope(mailbox, cursor) if has_envelope else None, C.META: None,
            C.RECEIVED_AT: NOW - timedelta(hours=1), C.EXPIRES_AT: expires_at,
            C.CURSOR: cursor, C.SEQ: seq, C.COMMITTED_AT: NOW - timedelta(hours=1),
            C.LANDING_TABLE: "node-0/g000001", C.LANDING_VERSION: 1, C.BATCH_ID: 0,
        }
        for name in INBOX.names:
            cols[name].append(row[name])
    return pa.table(cols, schema=INBOX.arrow_schema())


def ack_rows(specs) -> pa.Table:
    """specs: (mailbox, seq, acked_at)."""
    cols = {name: [] for name in ACKS.names}
    for mailbox, seq, acked_at in specs:
        row = {C.PROTOCOL: PROTO, C.MAILBOX: mailbox, C.EVENT_ID: seq.to_bytes(32, "big"),
               C.SEQ: seq, C.CURSOR: seq, C.DEVICE: None, C.ACKED_AT: acked_at}
        for name in ACKS.names:
            cols[name].append(row[name])
    return pa.table(cols, schema=ACKS.arrow_schema())


def read(path: Path) -> list[dict]:
    # DataFusion rather than a pyarrow dataset scan: Arrow's scanner threads can abort the
    # interpreter at exit ("terminate called without an active exception").
    out = QueryBuilder().register("t", DeltaTable(str(path))).execute("SELECT * FROM t")
    return pa.table(out.read_all()).to_pylist()


def inbox_by_key(layout: Layout) -> dict[tuple[bytes, int], dict]:
    return {(r[C.MAILBOX], r[C.CURSOR]): r for r in read(layout.inbox)}


@pytest.fixture
def layout(tmp_path) -> Layout:
    lay = Layout(tmp_path)
    lay.ensure_shared_tables()
    return lay


def test_acked_rows_tombstoned_only_after_grace(tmp_path, layout):
    future = NOW + timedelta(days=1)
    write_deltalake(str(layout.inbox), inbox_rows(
        [(MB_A, c, c, future, True) for c in (1, 2, 3, 4)] + [(MB_B, 1, 5, future, True)]),
        mode="append")
    write_deltalake(str(layout.acks), ack_rows([
        (MB_A, 1, NOW - timedelta(seconds=120)),   # past grace
        (MB_A, 2, NOW - timedelta(seconds=10)),    # within grace
        (MB_A, 4, NOW - timedelta(seconds=60)),    # exactly at grace: acked_at <= now - grace
        (MB_B, 3, NOW - timedelta(hours=1)),       # seq 3 lives in MB_A: the binary key decides
    ]), mode="append")

    lines: list[str] = []
    report = run_compaction(settings(tmp_path), now=NOW, progress=lines.append)

    rows = inbox_by_key(layout)
    assert len(rows) == 5, "tombstones stay until they expire"
    assert rows[(MB_A, 1)][C.ENVELOPE] is None and rows[(MB_A, 4)][C.ENVELOPE] is None
    assert rows[(MB_A, 2)][C.ENVELOPE] == envelope(MB_A, 2)
    assert rows[(MB_A, 3)][C.ENVELOPE] == envelope(MB_A, 3)   # unacked (the MB_B ack misses)
    assert rows[(MB_B, 1)][C.ENVELOPE] == envelope(MB_B, 1)
    assert report.tombstoned_acked == 2
    assert report.acks_removed == 1  # the MB_B ack has no inbox row
    assert report.expired_deleted == report.tombstones_kept == 0
    acks = {(r[C.MAILBOX], r[C.SEQ]) for r in read(layout.acks)}
    assert acks == {(MB_A, 1), (MB_A, 2), (MB_A, 4)}

    # One progress line per step, counts only: no envelope or mailbox bytes.
    assert [line.split(":")[0] for line in lines] == [
        "purge acked", "expire", "acks", "heya", "ppp", "sync", "push_log", "audit", "landing",
        "tables/inbox", "tables/acks", "tables/rejects", "tables/padding_audit", "orphans", "done"]
    text = "\n".join(lines) + report.format()
    for secret in (MB_A.hex(), MB_B.hex(), "CIPHERTEXT", repr(MB_A)):
        assert secret not in text
    # Nor in the commits compaction wrote (delta-rs records a MERGE's pruning predicate).
    for log_file in [*layout.inbox.glob("_delta_log/*.json"),
                     *layout.acks.glob("_delta_log/*.json")]:
        assert MB_A.hex() not in log_file.read_text() and MB_B.hex() not in log_file.read_text()

    later = run_compaction(settings(tmp_path), now=NOW + timedelta(seconds=60),
                           progress=lambda _: None)
    assert later.tombstoned_acked == 1
    assert inbox_by_key(layout)[(MB_A, 2)][C.ENVELOPE] is None
    again = run_compaction(settings(tmp_path), now=NOW + timedelta(seconds=60),
                           progress=lambda _: None)
    assert again.tombstoned_acked == 0


def test_expiry_deletes_rows_but_keeps_each_mailbox_max_cursor(tmp_path, layout):
    past, future = NOW - timedelta(seconds=1), NOW + timedelta(days=1)
    write_deltalake(str(layout.inbox), inbox_rows([
        (MB_A, 1, 1, past, True), (MB_A, 2, 2, past, False),   # expired; one a tombstone
        (MB_A, 3, 4, past, True),                               # expired max: kept, nulled
        (MB_B, 1, 3, past, True), (MB_B, 2, 5, future, True),   # max is alive
        (MB_C, 7, 6, NOW, False),                               # expired max, already a tombstone
    ]), mode="append")

    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)

    rows = inbox_by_key(layout)
    assert set(rows) == {(MB_A, 3), (MB_B, 2), (MB_C, 7)}
    assert rows[(MB_A, 3)][C.ENVELOPE] is None
    assert rows[(MB_B, 2)][C.ENVELOPE] == envelope(MB_B, 2)
    assert rows[(MB_C, 7)][C.ENVELOPE] is None
    assert (report.expired_deleted, report.tombstones_kept) == (3, 2)

    # Cursors continue from here: each mailbox's max cursor and the relay-wide max seq survive.
    top = pa.table(QueryBuilder().register("inbox", DeltaTable(str(layout.inbox))).execute(
        f"SELECT {C.MAILBOX}, max({C.CURSOR}) AS c, max({C.SEQ}) AS s FROM inbox "
        f"GROUP BY {C.MAILBOX}").read_all()).to_pylist()
    assert {r[C.MAILBOX]: r["c"] for r in top} == {MB_A: 3, MB_B: 2, MB_C: 7}
    assert max(r["s"] for r in top) == 6

    # A newer row makes the kept tombstone an ordinary expired row: then it goes.
    write_deltalake(str(layout.inbox), inbox_rows([(MB_A, 4, 7, future, True)]), mode="append")
    version = DeltaTable(str(layout.inbox)).version()
    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)
    assert (report.expired_deleted, report.tombstones_kept) == (1, 1)
    assert set(inbox_by_key(layout)) == {(MB_A, 4), (MB_B, 2), (MB_C, 7)}
    ops = [h["operation"] for h in DeltaTable(str(layout.inbox)).history()
           if h["version"] > version]
    assert ops.count("MERGE") == 1

    # Nothing left to do: no MERGE commit at all.
    version = DeltaTable(str(layout.inbox)).version()
    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)
    assert (report.expired_deleted, report.tombstones_kept) == (0, 1)
    assert "MERGE" not in [h["operation"] for h in DeltaTable(str(layout.inbox)).history()
                           if h["version"] > version]


def test_vacuum_removes_delivered_ciphertext_from_disk(tmp_path, layout):
    future = NOW + timedelta(days=1)
    secret = b"KNOWN-SECRET-" + os.urandom(24).hex().encode()
    kept = b"STILL-PENDING-" + os.urandom(24).hex().encode()
    delivered = inbox_rows([(MB_A, 1, 1, future, True), (MB_A, 2, 2, future, True)])
    delivered = delivered.set_column(
        INBOX.names.index(C.ENVELOPE), C.ENVELOPE, pa.array([secret, kept], pa.binary()))
    write_deltalake(str(layout.inbox), delivered, mode="append")
    write_deltalake(str(layout.acks), ack_rows([(MB_A, 1, NOW - timedelta(hours=1))]),
                    mode="append")

    def files_containing(needle: bytes) -> list[Path]:
        return [p for p in layout.inbox.rglob("*") if p.is_file() and needle in p.read_bytes()]

    assert files_containing(secret)
    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)

    assert report.tombstoned_acked == 1 and report.files_vacuumed >= 1
    assert files_containing(secret) == []
    assert files_containing(kept), "the unacked envelope is still stored"
    assert report.bytes_before > 0 and report.bytes_after > 0

    # delta-rs 1.6 lite VACUUM re-reports files it already deleted (and commits VACUUM
    # START/END for them) while their tombstones last: an idle run must count and commit nothing.
    version = DeltaTable(str(layout.inbox)).version()
    idle = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)
    assert idle.files_vacuumed == 0 and idle.files_compacted == 0
    assert DeltaTable(str(layout.inbox)).version() == version


def test_landing_dropped_only_when_sealed_and_consumed(tmp_path, layout):
    def landing(node: str, gen: int, appends: int) -> str:
        path = layout.ensure_landing(node, gen)
        for _ in range(appends):
            rows = inbox_rows([(MB_A, 1, 1, NOW, True)]).select(LANDING.names)
            write_deltalake(str(path), rows.cast(LANDING.arrow_schema()), mode="append")
        return f"{node}/g{gen:06d}"

    sealed_consumed = landing("node-0", 1, 2)        # version 2, consumed 2 -> dropped
    sealed_lagging = landing("node-0", 2, 2)         # version 2, consumed 1 -> kept
    sealed_unknown = landing("node-0", 3, 1)         # never consumed        -> kept
    newest = landing("node-0", 4, 1)                 # consumed but current  -> kept
    other_newest = landing("node-1", 1, 1)           # node-1's only one     -> kept
    layout.write_landing_consumed({sealed_consumed: 2, sealed_lagging: 1, newest: 1,
                                   other_newest: 1})

    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)

    assert report.landing_dropped == 1
    assert set(layout.landing_tables()) == {sealed_lagging, sealed_unknown, newest,
                                             other_newest}
    assert not layout.landing_generation("node-0", 1).exists()


def test_files_compacted_and_report(tmp_path, layout):
    future = NOW + timedelta(days=1)
    for c in range(1, 6):
        write_deltalake(str(layout.inbox), inbox_rows([(MB_A, c, c, future, True)]),
                        mode="append")
    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)
    assert report.files_compacted == 5
    assert len(DeltaTable(str(layout.inbox)).file_uris()) == 1
    assert report.skipped == [] and report.conflicts_retried == 0
    text = report.format()
    assert "files compacted              5" in text


def test_concurrent_appends_are_not_lost(tmp_path, layout):
    """The stream appends to inbox and egress to acks while compaction rewrites both tables.
    Writers retry their commit on CommitFailedError, as the real ones must: every append that
    reported success must survive, untouched."""
    past, future = NOW - timedelta(seconds=1), NOW + timedelta(days=1)
    # Work for every step, spread over many small files.
    for k in range(20):
        write_deltalake(str(layout.inbox), inbox_rows(
            [(MB_A, k * 3 + j, k * 3 + j, past if k % 2 else future, True) for j in (1, 2, 3)]),
            mode="append")
    write_deltalake(str(layout.acks), ack_rows(
        [(MB_A, s, NOW - timedelta(hours=1)) for s in range(1, 61, 2)]), mode="append")

    stop = threading.Event()
    committed_inbox: list[int] = []
    committed_acks: list[int] = []
    lost_races = {"inbox": 0, "acks": 0}

    def appender(table: str, path: Path, make, committed: list[int]) -> None:
        # As the real writers must: one long-lived handle, reloaded when a commit loses. A
        # handle older than a compaction commit that removed files always loses (delta-rs 1.6).
        dt = DeltaTable(str(path))
        n = 0
        while not stop.is_set():
            rows = make(n)
            while True:
                try:
                    write_deltalake(dt, rows, mode="append")
                    break
                except CommitFailedError:
                    lost_races[table] += 1
                    dt = DeltaTable(str(path))
            committed.append(n)
            n += 1
            time.sleep(0.005)  # the real writers commit every 50-250 ms; leave compaction a core

    live_seq = 1_000_000
    threads = [
        threading.Thread(target=appender, args=(
            "inbox", layout.inbox,
            lambda n: inbox_rows([(MB_B, n + 1, live_seq + n, future, True)]),
            committed_inbox)),
        # Acks of a live row (seq 31, inside the seq range the acks cleanup rewrites, so its
        # MERGE may lose and be retried), within grace: nothing may remove them.
        threading.Thread(target=appender, args=(
            "acks", layout.acks,
            lambda n: ack_rows([(MB_A, 31, NOW + timedelta(seconds=n))]), committed_acks)),
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(0.1)
        reports = [run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)
                   for _ in range(3)]
    finally:
        stop.set()
        for t in threads:
            t.join()

    rows = inbox_by_key(layout)
    live = {c: r for (mb, c), r in rows.items() if mb == MB_B}
    assert len(committed_inbox) > 10 and len(committed_acks) > 10
    assert sorted(live) == [n + 1 for n in committed_inbox]
    assert all(r[C.ENVELOPE] == envelope(MB_B, c) for c, r in live.items())
    acks_now = [r for r in read(layout.acks) if r[C.ACKED_AT] >= NOW]
    assert len(acks_now) == len(committed_acks)

    # Compaction itself did its work (a step that lost every race is done by the next run).
    reports.append(run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None))
    assert sum(r.expired_deleted for r in reports) == 29  # 30 expired MB_A rows, max kept
    assert sum(r.tombstoned_acked for r in reports) == 20  # acked (odd) seqs still alive
    assert sum(r.acks_removed for r in reports) == 10     # acked seqs among the deleted
    print(f"\nappends: {len(committed_inbox)} inbox, {len(committed_acks)} acks; "
          f"lost/retried: {lost_races}; compaction: "
          f"{[round(r.seconds, 2) for r in reports]} s, retries: "
          f"{sum(r.conflicts_retried for r in reports)}; skipped: "
          f"{[r.skipped for r in reports]}")


def test_compaction_loop_runs_until_stopped(tmp_path, layout):
    stop = threading.Event()
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        if line.startswith("done"):
            stop.set()

    s = settings(tmp_path, interval_seconds=3600)
    t = threading.Thread(target=compaction_loop, args=(s, stop, progress))
    t.start()
    t.join(timeout=20)
    assert not t.is_alive()
    assert sum(line.startswith("done") for line in lines) == 1


def test_lost_commit_race_is_recomputed_on_fresh_handles(tmp_path, layout, monkeypatch):
    import jobs.compact as compact
    future = NOW + timedelta(days=1)
    write_deltalake(str(layout.inbox), inbox_rows([(MB_A, c, c, future, True) for c in (1, 2)]),
                    mode="append")
    write_deltalake(str(layout.acks), ack_rows([(MB_A, 1, NOW - timedelta(hours=1))]),
                    mode="append")
    real_merge, calls = compact.merge, []

    def merge_after_a_rival_commit(target, source):
        calls.append(target.version())
        if len(calls) == 1:
            # A rival rewrites the file this merge read, between its snapshot and its commit.
            DeltaTable(str(layout.inbox)).update({C.META: "NULL"}, predicate=f"{C.SEQ} = 2")
        return real_merge(target, source)

    monkeypatch.setattr(compact, "merge", merge_after_a_rival_commit)
    report = run_compaction(settings(tmp_path), now=NOW, progress=lambda _: None)

    assert report.conflicts_retried == 1 and report.skipped == []
    assert calls[1] == calls[0] + 1, "the retry saw the rival's commit"
    rows = inbox_by_key(layout)
    assert rows[(MB_A, 1)][C.ENVELOPE] is None
    assert rows[(MB_A, 2)][C.ENVELOPE] == envelope(MB_A, 2)
    assert report.tombstoned_acked == 1


def test_step_that_always_loses_is_skipped_not_fatal(tmp_path, layout, monkeypatch):
    import jobs.compact as compact
    import jobs.compact_step as compact_step
    write_deltalake(str(layout.inbox), inbox_rows([(MB_A, 1, 1, NOW, True),
                                                   (MB_A, 2, 2, NOW, True)]), mode="append")

    def always_loses(*_):
        raise CommitFailedError("Commit failed: a concurrent transactions added new data.")

    monkeypatch.setattr(compact, "_purge_acked", always_loses)
    monkeypatch.setattr(compact_step, "RETRY_BACKOFF_SECONDS", 0)
    lines: list[str] = []
    report = run_compaction(settings(tmp_path), now=NOW, progress=lines.append)

    assert report.skipped == ["purge acked"]
    assert report.conflicts_retried == compact_step.COMMIT_ATTEMPTS
    assert "skipped" in lines[0] and "skipped (lost to writers)    purge acked" in report.format()
    assert report.expired_deleted == 1, "the other steps still ran"


def test_the_loop_runs_each_pass_in_a_child_and_reads_its_report_back(tmp_path, layout):
    """`relay compact --loop` runs every pass as `relay compact --json` in a child process
    (memory given back between runs): the child's work is real, its report is the loop's."""
    import argparse

    from relay import cli
    long_ago = NOW - timedelta(days=2)
    write_deltalake(str(layout.inbox), inbox_rows(
        [(MB_A, 1, 1, NOW + timedelta(days=1), True), (MB_A, 2, 2, NOW + timedelta(days=1),
                                                      True)]), mode="append")
    write_deltalake(str(layout.acks), ack_rows([(MB_A, 1, long_ago)]), mode="append")
    args = argparse.Namespace(conf=None, data_dir=str(tmp_path))
    # The pass runs in a process group of its own: a Ctrl-C or SIGTERM to the relay's group
    # is the loop's to handle, not the pass's (it killed the pass, -15).
    groups: list[tuple[int, int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set() and not groups:
            for d in Path("/proc").iterdir():
                try:
                    if b"compact\0--json" in (d / "cmdline").read_bytes():
                        groups.append((int(d.name), os.getpgid(int(d.name))))
                except (OSError, ValueError):
                    pass
            time.sleep(0.01)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        report = cli._compact_in_child(args, threading.Event())
    finally:
        done.set()
        watcher.join()
    assert groups and groups[0][0] == groups[0][1] != os.getpgid(0), groups
    assert report.tombstoned_acked == 1 and report.bytes_after > 0 and report.seconds > 0
    rows = inbox_by_key(layout)
    assert rows[(MB_A, 1)][C.ENVELOPE] is None
    assert rows[(MB_A, 2)][C.ENVELOPE] == envelope(MB_A, 2)
    # a child that fails is a failed run for the loop (logged, retried on schedule)
    bad = argparse.Namespace(conf=str(tmp_path / "missing.toml"), data_dir=str(tmp_path))
    with pytest.raises(RuntimeError, match="exited with"):
        cli._compact_in_child(bad, threading.Event())
