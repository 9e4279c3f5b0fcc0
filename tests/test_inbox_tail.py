"""The inbox tail never leaves a view behind the inbox: a version it cannot read (here a
file that a later DELETE removed from the table and that is unreadable on disk) made every
poll fail, for ever, and the view was stale until a restart. Now the tail rebuilds from the
current snapshot after a few failed polls and goes on following the log. Real Delta tables on
disk, the real egress hub."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX
from egress.inbox_tail import InboxTail
from egress.pending import MailboxHub


def _rows(mailbox: bytes, cursors: range, seq0: int) -> pa.Table:
    now = datetime.now(timezone.utc)
    n = len(cursors)
    return pa.Table.from_pylist([{
        C.EVENT_ID: b"e%d" % (seq0 + i), C.PROTOCOL: "trueseal", C.MAILBOX: mailbox,
        C.ENVELOPE: b"ciphertext %d" % c, C.META: None, C.RECEIVED_AT: now,
        C.EXPIRES_AT: now + timedelta(days=1), C.CURSOR: c, C.SEQ: seq0 + i,
        C.COMMITTED_AT: now, C.LANDING_TABLE: "node-0/g000001", C.LANDING_VERSION: 1,
        C.BATCH_ID: seq0} for i, c in enumerate(cursors)], schema=INBOX.arrow_schema())


def test_a_tail_that_cannot_read_a_version_rebuilds_and_follows_on(tmp_path):
    layout = Layout(tmp_path / "data")
    layout.ensure_shared_tables()
    inbox = str(layout.inbox)
    write_deltalake(inbox, _rows(b"a" * 32, range(1, 3), 1), mode="append")
    hub = MailboxHub(ack_sink=None)
    tail = InboxTail(layout.inbox, layout.acks, hub)

    async def scenario():
        await tail.bootstrap()
        assert hub.pending_count() == 2
        # Version 2 adds b's rows; a DELETE (version 3) removes that file again, and the file
        # left on disk is unreadable: version 2 can never be read, the snapshot is fine.
        before = set(DeltaTable(inbox).file_uris())
        write_deltalake(inbox, _rows(b"b" * 32, range(1, 3), 3), mode="append")
        (added,) = set(DeltaTable(inbox).file_uris()) - before
        DeltaTable(inbox).delete(f"{C.SEQ} >= 3")
        assert added not in DeltaTable(inbox).file_uris()
        with open(added.removeprefix("file://"), "wb") as fh:
            fh.write(b"not parquet")
        write_deltalake(inbox, _rows(b"c" * 32, range(1, 4), 5), mode="append")   # version 4
        stop = asyncio.Event()
        run = asyncio.create_task(tail.run(0.01, stop))
        for _ in range(500):
            if hub.pending_count() == 5:
                break
            await asyncio.sleep(0.01)
        stop.set()
        await run

    asyncio.run(scenario())
    assert hub.pending_count() == 5          # a's two and c's three; b's were deleted
    assert tail.version == DeltaTable(inbox).version()



def test_versions_written_with_other_arrow_encodings_are_read_in_one_poll(tmp_path):
    """Spark's Arrow path writes large_binary / large_string, delta-rs rewrites *_view: files
    of one poll were concatenated as they came, and one such mix failed every poll."""
    layout = Layout(tmp_path / "data")
    layout.ensure_shared_tables()
    inbox = str(layout.inbox)
    hub = MailboxHub(ack_sink=None)
    tail = InboxTail(layout.inbox, layout.acks, hub)

    async def scenario():
        await tail.bootstrap()
        large = _rows(b"a" * 32, range(1, 3), 1)
        large = large.cast(pa.schema([
            pa.field(f.name, pa.large_binary() if f.type == pa.binary() else
                     pa.large_string() if f.type == pa.string() else f.type, f.nullable)
            for f in large.schema]))
        write_deltalake(inbox, large, mode="append")
        write_deltalake(inbox, _rows(b"b" * 32, range(1, 2), 3), mode="append")
        assert await tail.poll_once() == 3

    asyncio.run(scenario())
    assert hub.pending_count() == 3
