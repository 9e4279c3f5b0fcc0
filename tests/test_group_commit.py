"""The group-commit appender: shared commits, release only after commit, rotation, and
appends that survive compaction removing files under an older handle."""

from __future__ import annotations

import asyncio
import os
from datetime import datetime, timezone

import pyarrow as pa
from deltalake import DeltaTable

from delta_tables.group_commit import DeltaAppendTarget, GroupCommitAppender, LandingTarget
from delta_tables.schema import ACKS, C

from landing_rows import landing_row


def test_concurrent_appends_share_commits_and_are_visible_when_released(layout):
    target = LandingTarget(layout, "n1", fsync=True)

    async def main():
        app = GroupCommitAppender(target)
        await app.start()

        async def one(i):
            await app.append(landing_row(b"m" * 32, os.urandom(64)))
            # released => committed: the row is in the table's current version
            return DeltaTable(str(target._target.path)).version()

        versions = await asyncio.gather(*(one(i) for i in range(500)))
        await app.close()
        return app, versions

    app, versions = asyncio.run(main())
    assert app.rows_committed == 500
    assert app.commits < 50, "concurrent appends must share commits"
    assert min(versions) >= 1
    assert DeltaTable(str(target._target.path)).to_pyarrow_table().num_rows == 500


def test_landing_rotates_generations(layout):
    target = LandingTarget(layout, "n2", commits_per_generation=3, fsync=False)
    for i in range(7):
        target.commit(pa.Table.from_pylist([landing_row(b"m" * 32, bytes([i]) * 10)],
                                           schema=target.schema))
    assert layout.generations("n2") == [1, 2, 3]
    # a restarted node never appends to a generation a dead process may have been writing
    assert LandingTarget(layout, "n2", fsync=False).generation == 4


def test_failed_commit_reaches_every_caller_and_acks_nothing(layout):
    target = LandingTarget(layout, "n3", fsync=False)

    async def main():
        app = GroupCommitAppender(target)
        await app.start()
        bad = landing_row(b"m" * 32, b"x")
        bad[C.RECEIVED_AT] = "not a timestamp"
        results = await asyncio.gather(app.append(landing_row(b"m" * 32, b"ok")),
                                       app.append(bad), return_exceptions=True)
        await app.close()
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, Exception) for r in results)


def test_append_after_compaction_removed_files(layout):
    target = DeltaAppendTarget(layout.acks, ACKS, fsync=False)

    def row(seq):
        return pa.Table.from_pylist([{
            C.PROTOCOL: "trueseal", C.MAILBOX: b"m" * 32, C.EVENT_ID: bytes([seq]) * 32,
            C.SEQ: seq, C.CURSOR: seq, C.DEVICE: None,
            C.ACKED_AT: datetime.now(timezone.utc)}], schema=ACKS.arrow_schema())

    target.commit(row(1))
    DeltaTable(str(layout.acks)).delete(f"{C.SEQ} = 1")   # another writer removes files
    target.commit(row(2))                                 # through the older handle
    assert DeltaTable(str(layout.acks)).to_pyarrow_table().column(C.SEQ).to_pylist() == [2]
