"""Delivered ciphertext leaves the disk within `compaction.delivered_bound_seconds`.

All real: trueseal (Noise NK push, XX receive with DeliverAck) and Heya (TLS, SEND, TRIM)
through the ingress node, the Spark stream and egress, with the relay's own compaction loop
running beside them on a shortened clock. Each envelope carries a random 64-byte marker; after
the bound no file under the data directory (tables, landing generations, the stream's
checkpoint and state) nor under Spark's local directories holds the marker of a delivered
envelope, while the marker of an envelope still waiting for its receiver is found (the scan
sees what it looks for). A push after compaction still reaches its receiver (the readers
survived the vacuums under them)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from delta_tables import object_store
from delta_tables.heya_control import mint_inbox_tokens
from delta_tables.layout import Layout
from jobs.compact import compaction_loop
from jobs.inbox_stream import start_inbox_stream

from heya_client import Cert, HeyaClient, recv_line, register_and_mint, send_line
from test_end_to_end import push_all, receive, relay_nodes
from trueseal_client import keypair

END = 2220385707
# The shortened clock: 1 + 2 x 2 + 3 = 8 s of schedule inside a 30 s bound (runs take the rest).
BOUND_S = 30


def marker() -> bytes:
    return os.urandom(64)


def spark_local_dirs(spark) -> list[Path]:
    """Where this Spark application's block manager spills and shuffles (`spark.local.dir`)."""
    dbm = spark._jvm.org.apache.spark.SparkEnv.get().blockManager().diskBlockManager()
    return [Path(str(d.getPath())) for d in dbm.localDirs()]


def _parquet_values(p: Path) -> bytes:
    """A Parquet file's binary and string values, decoded: zstd may Huffman-code a page's
    literals, so a marker need not appear verbatim in the file's bytes."""
    try:
        t = pq.read_table(p)
    except Exception:   # not Parquet after all, or vacuumed while we read
        return b""
    out = []
    for col in t.columns:
        if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or \
                pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            out += [v if isinstance(v, bytes) else v.encode() for v in col.to_pylist()
                    if v is not None]
    return b"\0".join(out)


def found(markers: dict[str, bytes], roots: list[Path]) -> dict[str, list[str]]:
    """Marker name -> the files under `roots` that hold it, verbatim or (Parquet) decoded."""
    hits: dict[str, list[str]] = {}
    for root in roots:
        for p in root.rglob("*"):
            try:
                data = p.read_bytes() if p.is_file() else b""
            except (FileNotFoundError, PermissionError):   # vacuumed while we walked
                continue
            if p.suffix == ".parquet":
                data += b"\0" + _parquet_values(p)
            for name, m in markers.items():
                if m in data:
                    hits.setdefault(name, []).append(str(p))
    return hits


def test_delivered_markers_leave_every_file_within_the_bound(spark, settings, tmp_path):
    if settings.tables_dir:
        pytest.skip("scans a local data directory")
    runs: list = []
    with shortened_clock(spark, settings, runs):
        asyncio.run(_scenario(settings, tmp_path, spark, runs))


@contextlib.contextmanager
def shortened_clock(spark, settings, runs: list):
    """The relay's stream and compaction loop (its reports into `runs`) on the shortened
    clock: 1 + 2 x 2 + 3 = 8 s of schedule inside BOUND_S."""
    settings.stream.trigger_interval_ms = 100
    settings.ingress.generation_max_age_seconds = 1
    c = settings.compaction
    c.ack_grace_seconds, c.interval_seconds, c.vacuum_retention_seconds = 1, 2, 3
    c.delivered_bound_seconds = BOUND_S
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    stop = threading.Event()
    loop = threading.Thread(target=compaction_loop, args=(settings, stop),
                            kwargs={"progress": lambda _: None, "on_report": runs.append},
                            daemon=True)
    try:
        loop.start()
        yield
    finally:
        stop.set()
        loop.join(timeout=120)
        query.stop()


async def _scenario(settings, tmp_path, spark, runs):
    (inbox_token,) = mint_inbox_tokens(Layout.of(settings), fsync=False)
    delivered: dict[str, bytes] = {}
    waiting: dict[str, bytes] = {}
    async with relay_nodes(settings) as (ingress, egress):
        relay_pub = ingress.key.public
        push_port, recv_port = ingress.trueseal.bound_port, egress.trueseal.bound_port
        (a_priv, a_pub), (_b_priv, b_pub) = keypair(), keypair()
        # trueseal: two envelopes for A (delivered, DeliverAck'd), one for B (never online).
        for i in range(2):
            delivered[f"trueseal-{i}"] = marker()
        waiting["trueseal-waiting"] = marker()
        await push_all(push_port, relay_pub,
                       [(a_pub, b"env|" + delivered[f"trueseal-{i}"]) for i in range(2)]
                       + [(b_pub, b"env|" + waiting["trueseal-waiting"])])
        a_conn, got = await receive(recv_port, relay_pub, a_priv, 2)
        assert sorted(e for _, e in got) == sorted(b"env|" + delivered[f"trueseal-{i}"]
                                                   for i in range(2))

        # Heya: two SENDs on one send token; the receiver takes seq 0 and TRIMs it.
        delivered["heya-0"] = marker().hex().encode()
        waiting["heya-waiting"] = marker().hex().encode()
        alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
        i_hex = inbox_token.hex().encode()
        port = ingress.heya.bound_port
        a, t_hex = await register_and_mint(port, alice, i_hex, END)
        b = await HeyaClient.connect(port, bob)
        for body in (delivered["heya-0"], waiting["heya-waiting"]):
            b.send(send_line(t_hex, body))
            await b.expect(recv_line(body))
        await a.expect(b"HAVE " + t_hex + b" 1\nHAVE " + t_hex + b" 2\n", timeout=60)
        a.send(b"WANT " + t_hex + b" 0\n")
        await a.expect(b"GIVE " + t_hex + b" 0 128\n" + delivered["heya-0"] + b"\n")
        a.send(b"TRIM " + t_hex + b" 0\n")
        await a.expect(b"TRIM " + t_hex + b" 0 ")
        await a.read_line()
        acked_at = time.monotonic()

        # The relay's compaction loop runs meanwhile; wait for the bound, looking each second.
        roots = [Path(settings.data_dir), *spark_local_dirs(spark)]
        markers = {**delivered, **waiting}
        hits = await asyncio.to_thread(found, markers, roots)
        assert set(delivered) <= hits.keys(), "the scan must first see the delivered markers"
        while hits.keys() & set(delivered) and time.monotonic() - acked_at < BOUND_S:
            await asyncio.sleep(1)
            hits = await asyncio.to_thread(found, markers, roots)
        gone_after = time.monotonic() - acked_at
        assert not hits.keys() & set(delivered), (
            f"delivered markers still on disk {BOUND_S} s after their ack: "
            f"{ {k: v for k, v in hits.items() if k in delivered} }; compaction runs took "
            f"{[round(r.seconds, 1) for r in runs]} s, skipped {[r.skipped for r in runs]}")
        assert set(waiting) <= hits.keys(), "an undelivered envelope's marker must still be found"
        print(f"delivered markers gone {gone_after:.1f} s after the last ack; compaction runs "
              f"took {[round(r.seconds, 1) for r in runs]} s")

        # Readers kept their place through the vacuums: a new push reaches A, Heya still GIVEs.
        a_conn.close()
        late = marker()
        await push_all(push_port, relay_pub, [(a_pub, b"env|" + late)])
        a_conn, got = await receive(recv_port, relay_pub, a_priv, 1, timeout=60)
        assert [e for _, e in got] == [b"env|" + late]
        a.send(b"WANT " + t_hex + b" 1\n")
        await a.expect(b"GIVE " + t_hex + b" 1 128\n" + waiting["heya-waiting"] + b"\n")
        a_conn.close()
        a.close()
        b.close()


def test_a_schedule_that_cannot_keep_the_bound_is_refused():
    from runtime import config
    with pytest.raises(config.ConfigError, match="delivered_bound_seconds"):
        config.load(None, env={"RELAY_COMPACTION__INTERVAL_SECONDS": "300"})
    s = config.load(None, env={})
    c = s.compaction
    assert (c.ack_grace_seconds + 2 * c.interval_seconds + c.vacuum_retention_seconds
            <= c.delivered_bound_seconds <= 600)


def test_vacuum_keeps_a_removed_file_for_its_retention_then_deletes_it(tmp_path):
    """VACUUM by the second, judged from the remove action's time: a file stays while a
    reader may still hold a snapshot naming it, and goes once the retention passed, also
    when the commit that removed it is the table's last (no newer commit marks the time)."""
    from deltalake import DeltaTable, write_deltalake

    from jobs.compact_step import CompactionReport, maintain
    path = tmp_path / "t"
    write_deltalake(str(path), pa.table({"x": [b"first-file-marker"]}))
    (old,) = DeltaTable(str(path)).file_uris()
    write_deltalake(str(path), pa.table({"x": [b"second"]}), mode="overwrite")
    report = CompactionReport()
    maintain(path, 1 << 20, 2, report)
    old = Path(old.removeprefix("file://"))
    assert old.exists(), "removed under 2 s ago: a reader may still need it"
    time.sleep(2.2)
    maintain(path, 1 << 20, 2, report)
    assert not old.exists()
    assert report.files_vacuumed == 1
    assert DeltaTable(str(path)).to_pyarrow_table().column("x").to_pylist() == [b"second"]


def test_expired_envelopes_leave_every_file_too(tmp_path):
    """Expiry, like an ack: the expired row's bytes leave the inbox's files once compaction
    rewrote them and its retention passed; a live row's bytes stay (the scan sees them)."""
    from datetime import datetime, timedelta, timezone

    from deltalake import write_deltalake

    from jobs.compact import run_compaction
    from runtime.config import Settings
    from test_compaction import MB_A, MB_B, envelope, inbox_rows
    settings = Settings(data_dir=str(tmp_path))
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout(tmp_path)
    layout.ensure_shared_tables()
    now = datetime.now(timezone.utc)
    write_deltalake(str(layout.inbox), inbox_rows([
        (MB_A, 1, 1, now - timedelta(seconds=1), True),    # expired, not its mailbox's max
        (MB_A, 2, 2, now - timedelta(seconds=1), True),    # expired, kept as the max tombstone
        (MB_B, 1, 3, now + timedelta(days=1), True)]), mode="append")
    markers = {"expired-1": envelope(MB_A, 1), "expired-2": envelope(MB_A, 2),
               "live": envelope(MB_B, 1)}
    assert set(found(markers, [tmp_path])) == set(markers)
    report = run_compaction(settings, now=now, progress=lambda _: None)
    assert (report.expired_deleted, report.tombstones_kept) == (1, 1)
    assert set(found(markers, [tmp_path])) == {"live"}


# The storage ratio's run: a few large envelopes wait (the live ciphertext outweighs the
# tables' fixed footprint, a log entry or two each), many small ones are delivered, each in
# a commit of its own, as a day's traffic is: kept for the log's default day, their commits
# alone would take the ratio past 2x.
RATIO_ENVELOPES = 20
RATIO_ENVELOPE_BYTES = 16 * 1024
DELIVERED_COMMITS = 150


def test_after_the_bound_the_tables_hold_at_most_twice_what_is_undelivered(spark, settings):
    """A real relay run on the shortened clock: many small envelopes delivered and acked, each
    in commits of its own, a few large ones waiting. Once the bound has passed, every table's
    bytes on disk (data, logs, checkpoints) are at most RATIO_BOUND x the live ciphertext plus the inbox rows' metadata, as
    delta_tables/storage.py measures it for `relay status`; the day's many small commits left
    no log behind them."""
    from delta_tables import storage
    with shortened_clock(spark, settings, []):
        measured = asyncio.run(_ratio_scenario(settings))
    layout = Layout.of(settings)
    print(f"after the bound: live {measured.live_bytes}, row metadata "
          f"{measured.row_metadata_bytes}, on disk {measured.on_disk}, ratio "
          f"{measured.ratio:.2f}x; per table {measured.table_bytes}")
    assert measured.live_bytes == RATIO_ENVELOPES * (RATIO_ENVELOPE_BYTES + 4)  # b"env|"
    assert measured.oldest_delivered_s is None, "a delivered byte is still on disk"
    assert measured.ratio <= storage.RATIO_BOUND, measured
    inbox_log = [n for n in object_store.listdir(layout.inbox / "_delta_log")
                 if n.endswith(".json")]
    assert len(inbox_log) < 20, "the inbox's commits stayed in its log past the retention"


async def _ratio_scenario(settings):
    from datetime import datetime, timezone

    from delta_tables import storage
    async with relay_nodes(settings) as (ingress, egress):
        relay_pub = ingress.key.public
        push_port, recv_port = ingress.trueseal.bound_port, egress.trueseal.bound_port
        (a_priv, a_pub), (_b_priv, b_pub) = keypair(), keypair()
        await push_all(push_port, relay_pub, [(b_pub, b"env|" + os.urandom(RATIO_ENVELOPE_BYTES))
                                              for _ in range(RATIO_ENVELOPES)])
        for _ in range(DELIVERED_COMMITS):     # one push session, one landing commit each
            await push_all(push_port, relay_pub, [(a_pub, b"env|" + os.urandom(1024))])
        a_conn, got = await receive(recv_port, relay_pub, a_priv, DELIVERED_COMMITS,
                                    timeout=120)
        acked_at = time.monotonic()
        a_conn.close()
        # Acked at the latest when the device session ends; then the bound passes.
        await asyncio.sleep(max(0.0, BOUND_S - (time.monotonic() - acked_at)))
        return await asyncio.to_thread(storage.measure, Layout.of(settings),
                                       datetime.now(timezone.utc))


def test_a_compaction_run_never_leaves_the_tables_bigger_once_its_retention_passed(tmp_path):
    """The case where compaction can only add: every row live (nothing to purge or expire),
    in many small commits, and a small table of two commits. OPTIMIZE rewrites, checkpoints
    are written; once the retention passed and the next run vacuumed and cleaned the logs,
    no table is bigger than the first run found it."""
    from datetime import datetime, timedelta, timezone

    from deltalake import write_deltalake

    from delta_tables.object_store import disk_usage
    from delta_tables.storage import table_bytes
    from jobs.compact import run_compaction
    from runtime.config import Settings
    from test_compaction import MB_A, inbox_rows
    settings = Settings(data_dir=str(tmp_path))
    settings.compaction.vacuum_retention_seconds = 1
    layout = Layout(tmp_path)
    layout.ensure_shared_tables()
    later = datetime.now(timezone.utc) + timedelta(days=1)
    for n in range(60):
        write_deltalake(str(layout.inbox), inbox_rows([(MB_A, n + 1, n + 1, later, True)]),
                        mode="append")
    write_deltalake(str(layout.rejects), _reject_rows(), mode="append")
    before = table_bytes(layout)
    first = run_compaction(settings, progress=lambda _: None)
    assert first.files_compacted >= 60
    time.sleep(1.2)
    second = run_compaction(settings, progress=lambda _: None)
    after = table_bytes(layout)
    print(f"tables before {before}, after {after}")
    for name, n in after.items():
        assert n <= before.get(name, 0), (name, before.get(name), n)
    assert second.bytes_after == disk_usage(layout.tables) <= first.bytes_before
    assert len(list((layout.inbox / "_delta_log").glob("*.json"))) < 5   # of 61 commits


def _reject_rows(*ages: timedelta) -> pa.Table:
    """One rejects row per age (rejected that long ago; default one, now), each with an
    event id of its own: the age in seconds."""
    from delta_tables.schema import REJECTS, C
    now = datetime.now(timezone.utc)
    rows = [{C.EVENT_ID: int(age.total_seconds()).to_bytes(32, "big"), C.PROTOCOL: "trueseal",
             C.MAILBOX: b"\x02" * 32, C.SIZE: 100, C.REASON: "duplicate",
             C.RECEIVED_AT: now - age, C.REJECTED_AT: now - age,
             C.LANDING_TABLE: "node-0/g000001", C.LANDING_VERSION: 1, C.BATCH_ID: 0}
            for age in ages or (timedelta(0),)]
    return pa.Table.from_pylist(rows, schema=REJECTS.arrow_schema())


def _audit_rows(*ages: timedelta) -> pa.Table:
    """One padding_audit row per age (audited that long ago), its payload size the age in
    seconds."""
    from delta_tables.schema import PADDING_AUDIT, C
    now = datetime.now(timezone.utc)
    rows = [{C.BATCH_ID: 0, C.PROTOCOL: "ppp", C.PAYLOAD_SIZE: int(age.total_seconds()),
             C.BUCKET: None, C.CONFORMING: False, C.ENVELOPES: 1, C.BYTES: 600,
             C.AUDITED_AT: now - age} for age in ages]
    return pa.Table.from_pylist(rows, schema=PADDING_AUDIT.arrow_schema())


def test_rejects_and_the_padding_audit_keep_only_their_retention(tmp_path):
    """Rows older than `compaction.audit_retention_days` leave both tables (and, once the
    vacuum retention has passed, every file of them), recent rows stay, and so do the app
    transactions the stream's commits carried (its replay check and the landing lag read
    them)."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    from delta_tables.schema import C
    from jobs.compact import run_compaction
    from runtime.config import Settings
    settings = Settings(data_dir=str(tmp_path))
    settings.compaction.audit_retention_days = 7
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout(tmp_path)
    layout.ensure_shared_tables()
    old = [timedelta(days=7, seconds=60), timedelta(days=30)]
    recent = [timedelta(hours=1), timedelta(days=6, hours=23)]
    marks = CommitProperties(app_transactions=[Transaction("stream-app", 41)])
    for path, rows in ((layout.rejects, _reject_rows), (layout.padding_audit, _audit_rows)):
        # old and recent rows in one file, so the delete must rewrite it; then a recent one
        write_deltalake(str(path), rows(*old, recent[0]), mode="append", commit_properties=marks)
        write_deltalake(str(path), rows(recent[1]), mode="append")

    lines: list[str] = []
    report = run_compaction(settings, progress=lines.append)
    assert (report.rejects_removed, report.padding_audit_removed) == (2, 2)
    assert not report.skipped
    assert any(line.startswith("audit: 2 rejects and 2 padding_audit rows older than 7 days "
                               "deleted") for line in lines)
    secs = sorted(int(a.total_seconds()) for a in recent)
    rejects, audit = DeltaTable(str(layout.rejects)), DeltaTable(str(layout.padding_audit))
    assert sorted(int.from_bytes(e, "big") for e in
                  rejects.to_pyarrow_table().column(C.EVENT_ID).to_pylist()) == secs
    assert sorted(audit.to_pyarrow_table().column(C.PAYLOAD_SIZE).to_pylist()) == secs
    assert rejects.transaction_version("stream-app") == 41
    assert audit.transaction_version("stream-app") == 41
    # The vacuum (retention 0) deleted the file that held the old rows with the recent one.
    on_disk = [pq.read_table(p) for path in (layout.rejects, layout.padding_audit)
               for p in path.rglob("*.parquet") if "_delta_log" not in p.parts]
    assert sum(t.num_rows for t in on_disk) == 4
    again = run_compaction(settings, progress=lambda _: None)
    assert (again.rejects_removed, again.padding_audit_removed) == (0, 0)


def test_files_no_log_names_go_once_older_than_the_slack_and_no_sooner(tmp_path):
    """A write that failed between its Parquet file and its commit leaves a file no log
    names. Compaction deletes it once it is older than the bound's slack (by its age: a write
    in progress commits within seconds); a younger one stays, and so does an old file the log
    removed a moment ago (it waits for VACUUM's retention: a reader may hold a snapshot
    naming it), and every file the snapshot names."""
    from deltalake import DeltaTable, write_deltalake

    from jobs.compact import run_compaction
    from runtime.config import Settings, orphan_age_seconds
    settings = Settings(data_dir=str(tmp_path))
    c = settings.compaction
    c.ack_grace_seconds, c.interval_seconds, c.vacuum_retention_seconds = 1, 2, 30
    c.delivered_bound_seconds = 60
    slack = orphan_age_seconds(c)
    layout = Layout(tmp_path)
    layout.ensure_shared_tables()
    path = layout.rejects
    write_deltalake(str(path), _reject_rows(), mode="append")
    (removed,) = [Path(u.removeprefix("file://")) for u in DeltaTable(str(path)).file_uris()]
    write_deltalake(str(path), _reject_rows(), mode="overwrite")    # removes the first file
    old = time.time() - slack - 5
    os.utime(removed, (old, old))
    failed_write = path / "part-00001-0badc0de-failed-write-c000.zstd.parquet"
    failed_write.write_bytes(b"PAR1 half a file")
    os.utime(failed_write, (old, old))
    in_flight = path / "part-00002-0badc0de-in-flight-c000.zstd.parquet"
    in_flight.write_bytes(b"PAR1 being written")
    report = run_compaction(settings, progress=lambda _: None)
    assert report.orphans_deleted == 1
    assert not failed_write.exists()
    assert in_flight.exists(), "younger than the slack: maybe a write in progress"
    assert removed.exists(), "removed under vacuum_retention_seconds ago: VACUUM decides"
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 1


def test_a_writer_whose_handle_outlived_the_log_reopens_it(tmp_path):
    """A long-lived appender (egress's acks, a protocol's control tables, the stream's
    direct appender) holds a handle loaded from a checkpoint; compaction then writes a newer one and deletes the older with
    the commits before it. The next append finds its handle's log gone, reopens the table
    and commits: no append is lost."""
    from deltalake import DeltaTable, write_deltalake

    from delta_tables.group_commit import DeltaAppendTarget
    from delta_tables.schema import REJECTS
    from delta_tables.txn_append import TxnAppender
    from jobs.compact_step import CompactionReport, maintain
    path = tmp_path / "rejects"
    report = CompactionReport()

    def many_commits():
        for _ in range(40):          # past CHECKPOINT_MIN_LOG_BYTES of commits
            write_deltalake(str(path), _reject_rows(), mode="append")

    many_commits()
    maintain(path, 1 << 20, 0, report)
    target = DeltaAppendTarget(path, REJECTS, fsync=False)
    target.commit(_reject_rows())   # the handle now rests on that checkpoint
    stream = TxnAppender(path, REJECTS, fsync=False)   # the stream's direct appender too
    first_checkpoint = sorted((path / "_delta_log").glob("*.checkpoint.parquet"))
    many_commits()
    maintain(path, 1 << 20, 0, report)
    assert not any(p.exists() for p in first_checkpoint), "the handle's checkpoint is gone"
    target.commit(_reject_rows())
    assert stream.txn_version("stream-app") is None     # looked up in its log: reopened
    stream.append(_reject_rows(), {"stream-app": 1})
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 83
    assert DeltaTable(str(path)).transaction_version("stream-app") == 1


def test_with_the_state_in_spark_delivered_markers_leave_every_file_too(spark, settings,
                                                                        tmp_path):
    """The same with the dedup index and cursors in Spark's state store: the envelopes then
    travel through Spark's shuffle, whose files are encrypted with a key held only in the
    process's memory (spark.io.encryption.enabled) and cleaned up minutes later."""
    if settings.tables_dir:
        pytest.skip("scans a local data directory")
    settings.stream.state_store = True
    runs: list = []
    with shortened_clock(spark, settings, runs):
        asyncio.run(_scenario(settings, tmp_path, spark, runs))
