"""The push job's bookkeeping, on real Delta tables and a real push desk socket (no Spark):
rows wait for a listener that is down and are never dropped; the marker never passes them;
a restart within the window does not wake a device again; a push_log that cannot be written
sends nothing and loses nothing.

The desk's backend here stands in for a listener (the listeners' own answers are tested end
to end in tests/test_push.py): it says who is registered and offline.
"""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timedelta, timezone

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from delta_tables.layout import Layout
from delta_tables.schema import INBOX, C
from delta_tables.schema_push import PUSH_LOG
from egress.push.job import APP_ID, PushJob
from egress.push.providers import providers
from runtime.push_desk import Device, PushDesk, desk_dir


class Listener:
    """A desk backend: every mailbox has one APNs device, offline."""

    def __init__(self):
        self.asked = 0

    def wake(self, mailbox, cursor, meta):
        self.asked += 1
        return [Device(mailbox, "apns", mailbox.hex().encode(), None)]

    def owner(self, owner):
        return False, [Device(owner, "apns", owner.hex().encode(), None)]

    async def drop(self, owner, platform, token):
        return True

    def pending(self):
        return []


def commit_rows(layout: Layout, mailboxes: list[bytes]) -> int:
    now = datetime.now(timezone.utc)
    rows = [{C.EVENT_ID: os.urandom(32), C.PROTOCOL: "ppp", C.MAILBOX: m, C.ENVELOPE: b"x",
             C.META: None, C.RECEIVED_AT: now, C.EXPIRES_AT: now + timedelta(days=1),
             C.CURSOR: 1, C.SEQ: i, C.COMMITTED_AT: now, C.LANDING_TABLE: "t",
             C.LANDING_VERSION: 0, C.BATCH_ID: 0} for i, m in enumerate(mailboxes)]
    write_deltalake(str(layout.inbox), pa.Table.from_pylist(rows, schema=INBOX.arrow_schema()),
                    mode="append")
    return DeltaTable(str(layout.inbox)).version()


def outcomes(layout: Layout) -> list[dict]:
    t = DeltaTable(str(layout.table(PUSH_LOG))).to_pyarrow_table()
    return [r for r in t.to_pylist() if r["outcome"] != "intent"]


def marker(layout: Layout) -> int | None:
    return DeltaTable(str(layout.table(PUSH_LOG))).transaction_version(APP_ID)


def test_rows_wait_for_a_listener_and_a_restart_keeps_the_window(settings):
    settings.push.window_seconds = 60
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    a, b = b"\xaa" * 32, b"\xbb" * 32

    async def main():
        job = PushJob(settings, providers(settings.push, settings.data_dir))
        await job.start()
        v = commit_rows(layout, [a, b])
        await job.step()                  # no listener: both rows held, nothing decided
        assert [r.mailbox for r in job.held] == [a, b] and job.safe_version() < v
        desk = await PushDesk.open(desk_dir(settings.data_dir), "ppp", Listener())
        try:
            await job.step()              # the listener is back: both woken (dry run)
            assert not job.held and job.safe_version() == v
            await job._commit_outcomes(force=True)
            assert sorted(r["outcome"] for r in outcomes(layout)) == ["dry_run", "dry_run"]
            assert marker(layout) == v
            await job.close()

            # A restart, within the window: a new message for a is covered, not woken again.
            job = PushJob(settings, providers(settings.push, settings.data_dir))
            await job.start()
            assert job.marker == v and job.version == v
            v2 = commit_rows(layout, [a])
            await job.step()
            assert job.stats.decided["covered"] == 1 and job.safe_version() == v2
            await job.close()
            assert len(outcomes(layout)) == 2

            # push_log cannot be written: nothing is sent, the row is kept and retried.
            job = PushJob(settings, providers(settings.push, settings.data_dir))
            job.conf.window_seconds = 0
            job.planner.window = 0
            await job.start()
            c = b"\xcc" * 32
            commit_rows(layout, [c])
            broken = job._append

            def fail(*a, **k):
                raise OSError("disk full")
            job._append = fail
            try:
                await job.step()
            except OSError:
                pass
            assert [r.mailbox for r in job.held] == [c] or job.done_rows
            job._append = broken
            t0 = time.monotonic()
            while not any(r["platform"] == "apns" and r["outcome"] == "dry_run"
                          for r in outcomes(layout)[2:]):
                await job.step()
                await job._commit_outcomes(force=True)
                assert time.monotonic() - t0 < 30
            await job.close()
        finally:
            desk.close()

    asyncio.run(main())
