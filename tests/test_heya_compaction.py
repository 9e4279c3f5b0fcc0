"""TRIM, DEAU and DALL leave the disk: compaction over real Delta tables (no Spark, no TLS).

The control plane is driven through `HeyaControl` (what the listener calls), the inbox rows are
appended as the stream writes them, and after `relay compact` (vacuum retention 0) the bytes of
every trimmed or revoked message, revoked token, removed push token and deregistered
certificate digest are searched for in every file under <data>/tables.
"""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX
from delta_tables.heya_control import HeyaControl, mint_inbox_tokens
from jobs.compact import run_compaction
from runtime.config import Settings

ALICE, BOB = b"\xa1" * 32, b"\xb0" * 32     # certificate digests


def body(tag: str) -> bytes:
    return tag.encode() + b"|" + os.urandom(48)   # random: stored as is by parquet


def inbox_rows(specs, seq0: int) -> pa.Table:
    now = datetime.now(timezone.utc)
    rows = [{
        C.EVENT_ID: os.urandom(32), C.PROTOCOL: "heya", C.MAILBOX: token, C.ENVELOPE: b,
        C.META: None, C.RECEIVED_AT: now, C.EXPIRES_AT: now + timedelta(days=1),
        C.CURSOR: cursor, C.SEQ: seq0 + i, C.COMMITTED_AT: now,
        C.LANDING_TABLE: "node-0/g000001", C.LANDING_VERSION: 1, C.BATCH_ID: 0}
        for i, (token, cursor, b) in enumerate(specs)]
    return pa.Table.from_pylist(rows, schema=INBOX.arrow_schema())


def on_disk(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_trim_deau_dall_are_removed_from_delta(tmp_path):
    settings = Settings(data_dir=str(tmp_path))
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout(tmp_path)
    layout.ensure_shared_tables()
    inbox_a, inbox_b = mint_inbox_tokens(layout, 2, fsync=False)
    kept_device, gone_device = "y" * 64, "x" * 64

    async def control_plane():
        c = HeyaControl(layout, fsync=False)
        await c.load()
        assert await c.inco(ALICE, inbox_a) and await c.inco(BOB, inbox_b)
        a = (await c.auth(ALICE, 0, 2220385707)).token
        revoked = (await c.auth(ALICE, 0, 2220385707)).token
        bob_token = (await c.auth(BOB, 0, 2220385707)).token
        assert await c.extd(ALICE, a, 10, 9_999_999_999) == 2220385717
        assert await c.trim(ALICE, a, 0) and await c.trim(ALICE, a, 1)
        await c.iosa(ALICE, gone_device)
        await c.iosa(ALICE, kept_device)
        assert await c.iosd(ALICE, gone_device)
        await c.iosa(BOB, "z" * 64)
        assert await c.deau(ALICE, revoked)
        assert await c.dall(BOB) == [bob_token]
        return a, revoked, bob_token

    a, revoked, bob_token = asyncio.run(control_plane())
    stray = os.urandom(32)                       # a token no control row ever named
    bodies = {k: body(k) for k in ("a0", "a1", "a2", "a3", "r0", "r1", "b0", "s0")}
    write_deltalake(str(layout.inbox), inbox_rows([
        (a, 0, bodies["a0"]), (a, 1, bodies["a1"]), (a, 2, bodies["a2"]), (a, 3, bodies["a3"]),
        (revoked, 0, bodies["r0"]), (revoked, 1, bodies["r1"]), (bob_token, 0, bodies["b0"]),
        (stray, 0, bodies["s0"])], 1), mode="append")

    lines: list[str] = []
    report = run_compaction(settings, progress=lines.append)

    inbox = DeltaTable(str(layout.inbox)).to_pyarrow_table().to_pylist()
    assert sorted((r[C.MAILBOX] == a, r[C.CURSOR], r[C.ENVELOPE]) for r in inbox) == [
        (True, 0, None), (True, 1, None), (True, 2, bodies["a2"]), (True, 3, bodies["a3"])]
    assert (report.heya_inbox_deleted, report.heya_inbox_trimmed) == (4, 2)
    assert report.heya_control_removed > 0 and not report.skipped
    assert any(line.startswith("heya: 4 revoked-token rows deleted") for line in lines)

    disk = on_disk(layout.tables)
    for gone in ("a0", "a1", "r0", "r1", "b0", "s0"):
        assert bodies[gone] not in disk, f"message {gone} is still on disk"
    for kept in ("a2", "a3"):
        assert bodies[kept] in disk
    for secret in (revoked, bob_token, BOB, gone_device.encode(), inbox_b):
        assert secret not in disk, "a revoked token / digest / push token is still on disk"
    # Alice's INCO row names the (consumed, single-use) inbox token it took; it stays with it.
    assert a in disk and ALICE in disk and kept_device.encode() in disk and inbox_a in disk
    for log_file in layout.tables.rglob("_delta_log/*.json"):
        text = log_file.read_text()
        for secret in (a, revoked, ALICE, BOB):
            assert secret.hex() not in text

    # What is left folds back into the same state (a restart of the listener).
    async def reload():
        c = HeyaControl(layout, fsync=False)
        await c.load()
        return c
    c = asyncio.run(reload())
    assert set(c.state.tokens) == {a} and c.state.tokens[a].end == 2220385717
    assert c.is_mailbox(ALICE) and not c.is_mailbox(BOB)
    assert c.trimmed(a) == 1 and [d for d, _ in c.push_tokens(ALICE)] == [kept_device]
    assert c.state.minted == {} and c.push_tokens(BOB) == []

    again = run_compaction(settings, progress=lambda _: None)
    assert (again.heya_inbox_deleted, again.heya_inbox_trimmed, again.heya_control_removed) == (
        0, 0, 0)
