"""PPP control tables after compaction: only what the fold rests on stays, on disk too.

The control plane is driven through `PppControl` (what the listener calls) on real Delta
tables; after `relay compact` (vacuum retention 0) the bytes of every superseded or deleted
backup and every deregistered token are searched for in every file under <data>/tables, and
a fresh fold (a restart of the listener) must equal the fold before compaction.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.ppp_state import load_state, table_paths
from delta_tables.schema_ppp import PPP_BACKUPS, PPP_DELIVERY_TOKENS
from delta_tables.ppp_control import PppControl
from engine.ppp.carry import OP_LEAVE, OP_REGISTER, Definition
from jobs.compact import run_compaction

R1, R2 = b"\x01" * 32, b"\x02" * 32                 # recipients
G_LIVE, G_GONE = b"\x21" * 16, b"\x22" * 16          # carry groups
P1, P2, P3 = b"\x11" * 32, b"\x12" * 32, b"\x13" * 32  # backup owners


def blob(tag: str) -> bytes:
    return tag.encode() + b"|" + os.urandom(64)   # random: stored as is by parquet


def on_disk(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def _carry_disk(layout: Layout) -> bytes:
    path = table_paths(layout)["ppp_carry_groups"]
    assert (path / "_delta_log").is_dir()
    return on_disk(path)


def fold(layout: Layout):
    st = load_state(table_paths(layout))
    return (st.tokens, st.by_recipient, st.backups, st.push,
            {g: (c.owner, c.definition, c.consented) for g, c in st.carry.groups.items()})


def test_superseded_backups_and_deregistered_tokens_leave_delta(settings):
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    t1, t2, t3 = os.urandom(12), os.urandom(12), os.urandom(12)
    dead_push, live_push = os.urandom(32).hex().encode(), os.urandom(20).hex().encode()
    b = {k: blob(k) for k in ("p1v1", "p1v2", "p1v3", "p2", "p3old", "p3new")}

    async def control_plane():
        c = PppControl(layout, fsync=False)
        await c.load()
        assert await c.register_token(R1, t1) is None
        assert await c.register_token(R1, t2) is None
        assert await c.deregister_token(R1, t2)
        assert await c.register_token(R2, t2) is None       # freed, now R2's
        assert await c.register_token(R1, t3) is None
        assert await c.deregister_token(R1, t3)
        for k in ("p1v1", "p1v2", "p1v3"):
            await c.store_backup(P1, b[k])
        await c.store_backup(P2, b["p2"])
        assert await c.delete_backup(P2)
        await c.store_backup(P3, b["p3old"])
        assert await c.delete_backup(P3)
        assert (await c.store_backup(P3, b["p3new"])).version == 1
        # push tokens: a dead one the push job deregistered leaves with its register row
        assert await c.register_push(R1, "apns", dead_push) is None
        assert await c.register_push(R1, "fcm", live_push) is None
        assert await c.deregister_push(R1, "apns", dead_push)
        # carry groups: a live one keeps its rows (they rebuild the consents); a dissolved
        # one's leave with them
        live = Definition.of([R1, R2], [P1])
        assert await c.carry_change(OP_REGISTER, R1, G_LIVE, live) is None
        assert await c.carry_change(OP_REGISTER, R2, G_LIVE, live) is None
        assert await c.carry_change(OP_REGISTER, R2, G_GONE, Definition.of([R2], [P3])) is None
        assert await c.carry_change(OP_LEAVE, R2, G_GONE, None) is None
    asyncio.run(control_plane())
    before = fold(layout)
    assert before[2][P1].version == 3 and P2 not in before[2]

    lines: list[str] = []
    report = run_compaction(settings, progress=lines.append)
    assert report.ppp_control_removed == 14 and not report.skipped
    assert any(line.startswith("ppp: 4 delivery-token rows, 6 backup rows, 0 room and "
                               "discovery rows, 2 push-token rows, 2 carry-group rows and "
                               "0 quota hits removed") for line in lines)
    assert "ppp / sync control removed   14 / 0" in report.format()

    assert fold(layout) == before
    paths = table_paths(layout)
    assert DeltaTable(str(paths[PPP_DELIVERY_TOKENS.name])).to_pyarrow_table().num_rows == 2
    assert DeltaTable(str(paths[PPP_BACKUPS.name])).to_pyarrow_table().num_rows == 2
    disk = on_disk(layout.tables)
    for gone in ("p1v1", "p1v2", "p2", "p3old"):
        assert b[gone] not in disk, f"backup {gone} is still on disk"
    for kept in ("p1v3", "p3new"):
        assert b[kept] in disk
    assert t3 not in disk and P2 not in disk and dead_push not in disk
    assert G_GONE not in disk and P3 not in _carry_disk(layout) and G_LIVE in disk
    assert t1 in disk and t2 in disk and live_push in disk
    for log_file in layout.tables.rglob("_delta_log/*.json"):
        text = log_file.read_text()
        for secret in (t1, t2, t3, R1, R2, P1, P2, P3):
            assert secret.hex() not in text

    # Nothing left to do: no commit to either table.
    versions = [DeltaTable(str(p)).version() for p in paths.values()]
    again = run_compaction(settings, progress=lambda _: None)
    assert again.ppp_control_removed == 0 and not again.skipped
    assert [DeltaTable(str(p)).version() for p in paths.values()] == versions

    # A restart: same routing, same backups, version counters continue as before.
    async def restart():
        c = PppControl(layout, fsync=False)
        await c.load()
        assert c.recipient_of(t1) == R1 and c.recipient_of(t2) == R2
        assert c.recipient_of(t3) is None
        ct, meta = await c.fetch_backup(P1)
        assert ct == b["p1v3"] and meta.version == 3
        assert (await c.fetch_backup(P3))[0] == b["p3new"]
        assert await c.fetch_backup(P2) is None
        assert (await c.store_backup(P1, b"x")).version == 4
        assert (await c.store_backup(P2, b"y")).version == 1
        assert (await c.store_backup(P3, b"z")).version == 2
    asyncio.run(restart())


def test_owner_writes_during_compaction_are_not_lost(settings):
    """The owner stores backups and (de)registers tokens while compaction deletes, rewrites
    and vacuums under it: every write it acknowledged is in the fresh fold."""
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()

    async def main():
        c = PppControl(layout, fsync=False)
        await c.load()
        for i in range(5):
            await c.store_backup(P1, blob(f"seed{i}"))
        writes, last = 0, b""
        for _ in range(2):
            job = asyncio.create_task(asyncio.to_thread(
                run_compaction, settings, progress=lambda _: None))
            while not job.done() or writes < 6:
                last = blob(f"w{writes}")
                await c.store_backup(P1, last)
                tok = os.urandom(12)
                assert await c.register_token(R1, tok) is None
                if writes % 2:
                    assert await c.deregister_token(R1, tok)
                writes += 1
            await job
        return c.state, last

    state, last = asyncio.run(main())
    fresh = load_state(table_paths(layout))
    assert fresh.tokens == state.tokens and fresh.backups == state.backups
    assert fresh.backups[P1].version == state.backups[P1].version
    run_compaction(settings, progress=lambda _: None)
    assert load_state(table_paths(layout)).backups == state.backups
    disk = on_disk(layout.tables)
    assert last in disk and disk.count(b"seed") == 0
