"""Incident replay: landing after a version, through the same stream, into a fresh inbox."""

from __future__ import annotations

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from jobs.inbox_stream import start_inbox_stream
from jobs.replay import start_replay, start_versions_from

from landing_rows import envelope, land, landing_row

MB = [bytes([i]) * 32 for i in range(1, 4)]


def read(path):
    return DeltaTable(str(path)).to_pyarrow_table()


def test_replay_reads_only_after_the_version_and_leaves_the_relay_alone(spark, settings, layout,
                                                                        tmp_path):
    rows = [landing_row(MB[i % 3], envelope(i)) for i in range(60)]
    a = land(layout, rows, node="node-a", per_commit=10)          # versions 1..6
    land(layout, [landing_row(MB[0], envelope(100 + i)) for i in range(7)], node="node-b")
    query, _ = start_inbox_stream(spark, settings, available_now=True, fsync=False)
    query.awaitTermination(120)
    assert query.exception() is None
    live_before = read(layout.inbox).num_rows
    consumed_before = layout.read_landing_consumed()

    offsets = start_versions_from(layout, a.current_key, 3)
    replay, sink = start_replay(spark, settings, tmp_path / "replay", offsets)
    replay.awaitTermination(120)
    assert replay.exception() is None
    got = read(Layout(tmp_path / "replay").inbox)
    # versions 4..6 of node-a only: node-b starts at its newest version
    assert got.num_rows == 30
    assert set(got.column(C.LANDING_VERSION).to_pylist()) == {4, 5, 6}
    assert set(got.column(C.LANDING_TABLE).to_pylist()) == {a.current_key}
    per: dict[bytes, list[int]] = {}
    for m, c in zip(got.column(C.MAILBOX).to_pylist(), got.column(C.CURSOR).to_pylist()):
        per.setdefault(m, []).append(c)
    assert all(sorted(c) == list(range(1, len(c) + 1)) for c in per.values())  # fresh cursors
    # the relay's inbox and its record of consumed landing are untouched
    assert read(layout.inbox).num_rows == live_before == 67
    assert layout.read_landing_consumed() == consumed_before
    assert sum(s.rows_in for s in sink.history) == 30
