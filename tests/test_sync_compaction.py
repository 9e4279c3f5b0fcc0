"""cursor-sync control tables after compaction: only what the fold rests on stays.

Driven through `SyncControl` (what the QUIC shell calls) on real Delta tables; after
`relay compact` (vacuum retention 0) the tables hold one ack row per live device, no
admission of a revoked device, no unregistered push registration (searched for on disk), a
fresh fold (a restart of the listener) equals the fold before, and a revoked device still
cannot rejoin.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema_sync import SYNC_DEVICE_ACKS, SYNC_MEMBERS, SYNC_PUSH
from delta_tables.sync_state import load_state, table_paths
from delta_tables.sync_control import SyncControl
from jobs.compact import run_compaction

G1, G2 = b"\x61" * 32, b"\x62" * 32
A, B, C, E, F = (bytes([n]) * 32 for n in (0xA1, 0xB1, 0xC1, 0xE1, 0xF1))


def on_disk(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def rows(layout: Layout, name: str) -> int:
    return DeltaTable(str(table_paths(layout)[name])).to_pyarrow_table().num_rows


def test_superseded_sync_control_rows_leave_delta(settings):
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    tok = {k: k.encode() + b"|" + os.urandom(24) for k in ("a1", "a2", "b", "c")}

    async def control_plane():
        c = SyncControl(layout, fsync=False)
        await c.load()
        assert await c.admit(G1, A, None) == "created"
        assert await c.admit(G1, B, A) == "joined"
        assert await c.admit(G1, C, A) == "joined"
        for dev, cursor in ((A, 1), (A, 2), (A, 3), (B, 1), (B, 5), (C, 2)):
            assert c.record_ack(G1, dev, cursor)
        await c.flush_acks()
        await c.push_registration(G1, A, "apns", tok["a1"], True)
        await c.push_registration(G1, A, "fcm", tok["a2"], True)
        await c.push_registration(G1, A, "apns", tok["a1"], False)
        await c.push_registration(G1, B, "fcm", tok["b"], True)
        await c.push_registration(G1, B, "fcm", tok["b"], False)
        await c.push_registration(G1, B, "fcm", tok["b"], True)
        await c.push_registration(G1, C, "apns", tok["c"], True)
        assert await c.revoke(G1, C, A)
        assert await c.admit(G2, E, None) == "created"
        assert await c.revoke(G2, E, E)               # the group's only member
        await c.close()
    asyncio.run(control_plane())
    before = load_state(table_paths(layout))
    assert before.acked == {(G1, A): 3, (G1, B): 5}

    lines: list[str] = []
    report = run_compaction(settings, progress=lines.append)
    assert report.sync_control_removed == 10 and not report.skipped
    assert any(line.startswith("sync: 4 ack-progress rows, 2 membership rows and 4 push rows "
                               "removed") for line in lines)

    after = load_state(table_paths(layout))
    assert after == before      # members, revoked, acked, push
    assert after.exists(G2) and after.is_revoked(G2, E) and after.is_revoked(G1, C)
    assert (rows(layout, SYNC_MEMBERS.name), rows(layout, SYNC_DEVICE_ACKS.name),
            rows(layout, SYNC_PUSH.name)) == (4, 2, 3)   # A, B, 2 revokes; A, B; a2, b, c
    disk = on_disk(layout.tables)
    assert tok["a1"] not in disk, "an unregistered push token is still on disk"
    assert tok["a2"] in disk and tok["b"] in disk
    for log_file in layout.tables.rglob("_delta_log/*.json"):
        text = log_file.read_text()
        for secret in (G1, G2, A, B, C, E):
            assert secret.hex() not in text
        assert tok["a1"].hex() not in text

    paths = table_paths(layout).values()
    versions = [DeltaTable(str(p)).version() for p in paths]
    again = run_compaction(settings, progress=lambda _: None)
    assert again.sync_control_removed == 0 and not again.skipped
    assert [DeltaTable(str(p)).version() for p in paths] == versions

    # A restart: revoked devices stay out (even of a group with no member left), progress
    # and registrations are as before.
    async def restart():
        c = SyncControl(layout, fsync=False)
        await c.load()
        try:
            assert await c.admit(G1, C, A) == "refused"
            assert await c.admit(G1, C, None, open_group=True) == "refused"
            assert await c.admit(G2, E, None) == "refused"
            assert await c.admit(G2, F, None) == "refused"   # exists, no live admitter
            assert c.state.acked_cursor(G1, A) == 3 and c.state.acked_cursor(G1, C) == 0
            assert not c.record_ack(G1, B, 5) and c.record_ack(G1, B, 6)
            assert c.state.push[(G1, B)] == {("fcm", tok["b"])}
        finally:
            await c.close()
    asyncio.run(restart())


def test_owner_writes_during_compaction_are_not_lost(settings):
    """Devices ack, join and register push while compaction rewrites and vacuums the tables
    (the ack appender's and the membership writer's handles go stale and must retry): the
    fresh fold equals the owner's memory."""
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()

    async def main():
        c = SyncControl(layout, fsync=False)
        await c.load()
        try:
            assert await c.admit(G1, A, None) == "created"
            for cursor in range(1, 6):
                c.record_ack(G1, A, cursor)
            await c.flush_acks()
            n = 0
            for _ in range(2):
                job = asyncio.create_task(asyncio.to_thread(
                    run_compaction, settings, progress=lambda _: None))
                while not job.done() or n < 6:
                    n += 1
                    c.record_ack(G1, A, 5 + n)
                    dev = os.urandom(32)
                    assert await c.admit(G1, dev, A) == "joined"
                    c.record_ack(G1, dev, n)
                    await c.push_registration(G1, dev, "fcm", b"t%d" % n, True)
                    if n % 2:
                        assert await c.revoke(G1, dev, A)
                    await c.flush_acks()
                await job
            return c.state
        finally:
            await c.close()

    state = asyncio.run(main())
    fresh = load_state(table_paths(layout))
    assert fresh == state
    run_compaction(settings, progress=lambda _: None)
    assert load_state(table_paths(layout)) == state
    assert rows(layout, SYNC_DEVICE_ACKS.name) == len(state.acked)
