"""The stream paces commits already served early (PPP STOREs, trueseal pushes) at the early
gap, and any other commit at the usual one (delta_tables/landing_source.py, early gap): the
protocols a landing commit records in its add's stats, the source's choice over real landing
tables, and the real stream's batch starts under a trickle of each kind."""

from __future__ import annotations

import calendar
import json
import threading
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from delta_tables.landing_source import LandingStreamReader, version_adds
from delta_tables.schema import LANDING
from jobs.inbox_stream import early_protocols, start_inbox_stream
from pyspark.sql.datasource import ReadAllAvailable

from landing_rows import envelope, land, landing_row


def rows(protocol: str, n: int, first: int = 0) -> list[dict]:
    return [landing_row(bytes([7]) * 32, envelope(first + i), protocol=protocol)
            for i in range(n)]


def reader(layout, early_ms=500, protocols="ppp,trueseal") -> LandingStreamReader:
    return LandingStreamReader({**layout.options(), "minBatchGapMs": "100",
                                "earlyGapMs": str(early_ms), "earlyProtocols": protocols,
                                "waitForDataMs": "1000"})


def test_landing_commits_record_their_protocols_as_delta_stats(layout):
    target = land(layout, rows("ppp", 3), node="n1-ppp")
    target.commit(pa.Table.from_pylist(rows("ppp", 1, 10) + rows("ppp_room", 1, 11),
                                       schema=LANDING.arrow_schema()))
    path = layout.landing_generation("n1-ppp", target.generation)
    adds = [version_adds(path, v) for v in (1, 2)]
    assert [a[0].protocols for a in adds] == [("ppp", "ppp"), ("ppp", "ppp_room")]
    # standard Delta stats: delta-rs reads them, and the table reads as before
    actions = [json.loads(line)
               for line in (path / "_delta_log" / f"{1:020d}.json").read_text().splitlines()]
    stats = json.loads(next(a["add"]["stats"] for a in actions if "add" in a))
    # (delta-rs, which commits on S3, records other columns' stats too)
    assert {k: v if k == "numRecords" else {"protocol": v["protocol"]}
            for k, v in stats.items()} == {"numRecords": 3, "minValues": {"protocol": "ppp"},
                                           "maxValues": {"protocol": "ppp"},
                                           "nullCount": {"protocol": 0}}
    dt = DeltaTable(str(path))
    assert dt.to_pyarrow_table().num_rows == 5
    actions = pa.table(dt.get_add_actions(flatten=True))
    assert sorted(actions.column("num_records").to_pylist()) == [2, 3]
    assert sorted(actions.column("min.protocol").to_pylist()) == ["ppp", "ppp"]


def test_the_source_takes_the_early_gap_only_when_every_waiting_commit_was_served(layout):
    ppp = land(layout, rows("ppp", 2), node="n2-ppp")
    src = reader(layout)
    start = {"v": {}}
    end = src._end(start, ReadAllAvailable())
    assert src._gap_s(start, end) == 0.5                 # PPP STOREs only
    # a room message (the stream numbers it) in a later commit of the same table
    ppp.commit(pa.Table.from_pylist(rows("ppp_room", 1, 5), schema=LANDING.arrow_schema()))
    assert src._gap_s(start, src._end(start, ReadAllAvailable())) == 0.1
    # past it, only STOREs again; and a Heya table beside them: the usual gap
    after_room = src._end(start, ReadAllAvailable())
    ppp.commit(pa.Table.from_pylist(rows("ppp", 1, 6), schema=LANDING.arrow_schema()))
    assert src._gap_s(after_room, src._end(after_room, ReadAllAvailable())) == 0.5
    land(layout, rows("heya", 1, 7), node="n2-heya")
    assert src._gap_s(after_room, src._end(after_room, ReadAllAvailable())) == 0.1
    # trueseal counts only when it is early (trueseal.early_delivery), and off is off
    assert reader(layout, protocols="ppp")._gap_s(
        start, reader(layout)._end(start, ReadAllAvailable())) == 0.1
    assert reader(layout, early_ms=0)._gap_s(start, end) == 0.1


def test_a_commit_that_wakes_an_idle_source_is_paced_by_its_own_protocol(layout):
    """A slow trickle: each batch takes everything, so the source waits on the landing signal;
    the commit that wakes it decides the gap (here PPP: the early one, from the last start)."""
    target = land(layout, rows("ppp", 1), node="n4-ppp")
    src = reader(layout)
    limit = ReadAllAvailable()
    first = src.latestOffset({"v": {}, "boot": src._boot}, limit)
    started = src._last_start                  # that batch just started
    try:
        threading.Timer(0.1, lambda: target.commit(pa.Table.from_pylist(
            rows("ppp", 1, 1), schema=LANDING.arrow_schema()))).start()
        end = src.latestOffset(first, limit)
        elapsed = time.monotonic() - started
    finally:
        src.stop()
    assert end["v"][target.current_key] == 2
    assert elapsed >= 0.5, elapsed             # not the usual 0.1 s


def test_early_protocols_follow_the_settings(settings):
    assert early_protocols(settings) == ("ppp", "trueseal")
    settings.trueseal.early_delivery = False
    assert early_protocols(settings) == ("ppp",)


def batch_starts(query, seconds: float, after: int) -> dict[int, float]:
    """When (s) each batch after `after` that ran began its work: Spark's progress
    `timestamp` is the trigger's start, and the source's wait (for data, or out the gap) is
    its `latestOffset`. Empty micro-batches are off, so each had new landing commits (the
    sink reads small ones itself: Spark's numInputRows stays 0)."""
    deadline = time.monotonic() + seconds
    seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        for p in query.recentProgress:
            if p["batchId"] > after and "addBatch" in p["durationMs"]:
                ts = p["timestamp"]
                trigger = calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S")) \
                    + float("0" + ts[19:-1])
                seen[p["batchId"]] = trigger + p["durationMs"]["latestOffset"] / 1000
        time.sleep(0.2)
    return seen


def trickle(layout, node: str, protocol: str, stop: threading.Event, gap=0.05) -> int:
    target = land(layout, rows(protocol, 1), node=node)
    n = 1
    while not stop.wait(gap):
        target.commit(pa.Table.from_pylist(rows(protocol, 1, 1000 * n),
                                           schema=LANDING.arrow_schema()))
        n += 1
    return n


def test_the_real_stream_paces_a_served_trickle_and_not_a_heya_one(spark, settings, layout):
    settings.stream.early_batch_gap_ms = 2000       # far above any batch time on a busy CI
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        gaps = {}
        for protocol in ("ppp", "heya"):
            stop = threading.Event()
            feeder = threading.Thread(target=trickle, args=(
                layout, f"n3-{protocol}", protocol, stop), daemon=True)
            feeder.start()
            after = query.lastProgress["batchId"] if query.lastProgress else -1
            starts = batch_starts(query, 9.0, after)
            stop.set()
            feeder.join()
            time.sleep(2.5)                         # the last early gap ends
            t = [starts[b] for b in sorted(starts)]
            gaps[protocol] = [b - a for a, b in zip(t, t[1:])]
        # PPP STOREs only: the source sleeps out the early gap between starts
        assert gaps["ppp"] and min(gaps["ppp"]) >= 1.9, gaps
        # Heya commits need the stream: batches follow each other at the usual pace
        assert len(gaps["heya"]) >= 4 and sorted(gaps["heya"])[len(gaps["heya"]) // 2] < 1.0, gaps
    finally:
        query.stop()
    inbox = DeltaTable(str(layout.inbox)).to_pyarrow_table()
    assert inbox.num_rows == len(set(inbox.column("event_id").to_pylist()))
