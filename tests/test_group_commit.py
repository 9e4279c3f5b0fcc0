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


def test_a_generation_holding_rows_is_sealed_by_age_also_when_idle(layout):
    """Compaction drops only sealed generations: an idle node's last rows (envelope copies)
    must not wait for its next push (ingress.generation_max_age_seconds)."""
    target = LandingTarget(layout, "n4", max_age_seconds=0.4, fsync=False)

    async def main():
        app = GroupCommitAppender(target)
        await app.start()
        await asyncio.sleep(0.5)
        assert target.generation == 1, "an empty generation is not sealed"
        await app.append(landing_row(b"m" * 32, b"first"))
        await asyncio.sleep(1.0)       # idle: sealed by the appender's tick
        sealed_idle = target.generation
        await app.append(landing_row(b"m" * 32, b"second"))
        await app.close()
        return sealed_idle

    assert asyncio.run(main()) == 2
    assert layout.generations("n4") == [1, 2]
    assert target.generation == 2, "the new generation is younger than its age: kept"


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


def test_a_lone_row_commits_on_the_loop_and_a_group_in_a_worker_thread(layout):
    """ingress.inline_commit_rows: a group of one commits on the event loop's thread (no hop);
    the appends that arrive meanwhile form the next group, which commits in a worker thread;
    a commit that opens a new generation never runs on the loop."""
    import threading

    target = LandingTarget(layout, "n4", commits_per_generation=3, fsync=True)
    threads: list[tuple[int, bool]] = []   # (rows, committed on the loop's thread)
    commit = target.commit

    def watched(table):
        threads.append((table.num_rows, threading.get_ident() == loop_thread))
        return commit(table)

    target.commit = watched
    loop_thread = threading.get_ident()     # asyncio.run runs the loop on this thread

    async def main():
        app = GroupCommitAppender(target, inline_rows=1)
        await app.start()
        await app.append(landing_row(b"m" * 32, b"lone"))                  # commit 1
        await asyncio.gather(*(app.append(landing_row(b"m" * 32, bytes([i]) * 8))
                               for i in range(5)))                          # one group: commit 2
        for i in range(3):
            await app.append(landing_row(b"m" * 32, b"again%d" % i))
        await app.close()

    asyncio.run(main())
    assert threads[0] == (1, True)
    assert all(not inline for rows, inline in threads if rows > 1)
    assert any(rows > 1 for rows, _ in threads)
    # the 4th commit opened generation 2: not on the loop, though it was one row
    assert threads[3][0] == 1 and threads[3][1] is False
    assert sum(rows for rows, _ in threads) == 9
    tables = [DeltaTable(str(layout.landing_generation("n4", g))) for g in
              layout.generations("n4")]
    assert sum(t.to_pyarrow_table().num_rows for t in tables) == 9
