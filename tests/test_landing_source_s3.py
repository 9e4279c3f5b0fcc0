"""The stream's landing source with the tables on a real S3-compatible server (moto's server
mode on loopback): its concurrent reads keep commits whole and in order, a removing commit is
still refused at its version, and finding what is new costs no LIST while nothing changes
(each request counted in the server's own log)."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pyarrow as pa
import pytest
from deltalake import write_deltalake
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxFiles

from delta_tables.group_commit import LandingTarget
from delta_tables.landing_lag import LogFollower, latest_version
from delta_tables.landing_source import (
    LandingLogError, LandingStreamReader, batch_files, planned_files, read_files,
)
from delta_tables.layout import Layout
from delta_tables.schema import C
from relay.bench.s3_server import BUCKET, RequestLog, s3_server
from relay.bench.tables import _mailboxes, landing_table


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = RequestLog(tmp_path_factory.mktemp("s3") / "requests.log")
    with s3_server(request_log=log.path) as endpoint:
        yield endpoint, log


@pytest.fixture
def layout(server, tmp_path):
    return Layout.at(str(tmp_path / "data"), f"s3://{BUCKET}/{tmp_path.name}", server[0])


@pytest.fixture
def requests(server):
    return server[1]


def reader(layout, **options) -> LandingStreamReader:
    return LandingStreamReader({**layout.options(), "listIntervalMs": "600000", **options})


def land(layout, node: str, commits: int, rows: int = 3, seed: int = 0) -> list[bytes]:
    """`commits` landing commits on `node`; the event ids in commit order."""
    rng = np.random.default_rng(seed)
    mailboxes = _mailboxes(rng, 10)
    target = LandingTarget(layout, node, fsync=False)
    ids = []
    for _ in range(commits):
        table = landing_table(rows, mailboxes, rng, size=64)
        target.commit(table)
        ids.extend(table.column(C.EVENT_ID).to_pylist())
    return ids


def test_concurrent_reads_keep_every_commit_whole_and_in_order(layout, requests):
    ids = {node: land(layout, node, 20, seed=i) for i, node in enumerate(("n0", "n1"))}
    src = reader(layout)
    start = src.initialOffset()
    tables = layout.landing_tables()
    latest = {key: latest_version(path) for key, path in tables.items()}
    # a bounded batch takes whole commits of the first table, in version order
    first = src.latestOffset(start, ReadMaxFiles(5))
    assert first["v"] == {"n0/g000001": 5}
    # the rest, all of it: what the source planned and what the driver reads alone agree.
    # n0's commits were fetched ahead with the first batch; n1's (from its version 0) are one
    # GET each (sizes from the log's listing); the HEADs are the look's 4 misses (each
    # table's next commit, each node's next generation)
    requests.mark()
    end = src.latestOffset(start, ReadAllAvailable())
    assert requests.counts() == {"GET": latest["n1/g000001"] + 1, "HEAD": 4}
    assert end["v"] == latest
    planned = batch_files(layout, start, end, src._adds)
    alone = batch_files(layout, start, end)
    assert planned == alone
    # the driver takes the source's plan of this very batch, and reads another one itself
    assert planned_files(layout, start, end) == alone
    assert planned_files(layout, first, end) == batch_files(layout, first, end) != alone
    assert [(f.table, f.version) for f in alone] == [
        (key, v) for key in sorted(latest) for v in range(1, latest[key] + 1)]
    requests.mark()
    rows = pa.Table.from_batches(list(read_files(alone, s3=layout.s3)))
    assert requests.counts() == {"GET": len(alone)}      # sizes known: no HEAD first
    assert rows.column(C.EVENT_ID).to_pylist() == ids["n0"] + ids["n1"]
    assert rows.column(C.LANDING_VERSION).to_pylist() == [
        v for key in sorted(latest) for v in range(1, latest[key] + 1) for _ in range(3)]
    # the executors' path: each partition in order, the partitions in order
    parts = src.partitions(start, end)
    assert len(parts) > 1
    read = [b for p in parts for b in src.read(p)]
    assert pa.Table.from_batches(read).column(C.EVENT_ID).to_pylist() == ids["n0"] + ids["n1"]


def test_a_removing_commit_fetched_ahead_is_refused_only_where_it_is(layout):
    land(layout, "n0", 6)
    path = layout.landing_tables()["n0/g000001"]
    # the table is append-only (delta-rs refuses to write this): a commit as another writer
    # could leave it, removing the first commit's file
    first_file = next(json.loads(line)["add"]["path"] for line in
                      (path / "_delta_log" / f"{1:020d}.json").read_text().splitlines()
                      if "add" in json.loads(line))
    removing = latest_version(path) + 1
    assert removing == 7
    (path / "_delta_log" / f"{removing:020d}.json").write_text(json.dumps({"remove": {
        "path": first_file, "deletionTimestamp": int(time.time() * 1000),
        "dataChange": True}}) + "\n")
    src = reader(layout)
    start = src.initialOffset()
    # a batch before it is taken whole, though its commit was fetched with the batch's
    first = src.latestOffset(start, ReadMaxFiles(3))
    assert first["v"] == {"n0/g000001": 3}
    assert ("n0/g000001", removing) in src._adds_cache
    assert [f.version for f in batch_files(layout, start, {"v": {"n0/g000001": 6}})] == [
        1, 2, 3, 4, 5, 6]
    # the batch that reaches it is refused, by the source and by the driver's own read
    with pytest.raises(LandingLogError, match="removes data"):
        src.latestOffset(first, ReadAllAvailable())
    with pytest.raises(LandingLogError, match="removes data"):
        batch_files(layout, first, {"v": {"n0/g000001": removing}})


def test_an_idle_look_lists_nothing_and_a_new_generation_is_found_without_a_listing(
        layout, requests):
    land(layout, "n0", 2)
    land(layout, "n1", 2, seed=1)
    src = reader(layout)
    start = src.initialOffset()
    end = src.latestOffset(start, ReadAllAvailable())          # the first look lists
    assert end["v"] == {"n0/g000001": 2, "n1/g000001": 2}
    requests.mark()
    for _ in range(3):
        assert src.latestOffset(end, ReadAllAvailable())["v"] == end["v"]
        assert src.reportLatestOffset()["v"] == end["v"]      # asks nothing
    # each look: a HEAD for each table's next commit and each node's next generation
    assert requests.counts() == {"HEAD": 3 * 4}

    land(layout, "n1", 1, seed=2)      # a restarted node: a new generation, one commit
    requests.mark()
    now = src.latestOffset(end, ReadAllAvailable())
    assert now["v"] == {"n0/g000001": 2, "n1/g000001": 2, "n1/g000002": 1}
    root = str(layout.landing_root).removeprefix(f"s3://{BUCKET}/")
    lists = [target for kind, target in requests.requests() if kind == "LIST"]
    # only the logs of the new generation and of the one it sealed; no prefix listed
    assert len(lists) == 2 and all("_delta_log" in t for t in lists), lists
    assert not any(f"prefix={root}/&" in t or f"prefix={root}/n1/&" in t for t in lists)
    requests.mark()
    src.latestOffset(now, ReadAllAvailable())
    # the sealed generation is not looked at again
    assert requests.counts() == {"HEAD": 4}


def test_a_caught_up_inbox_follower_lists_nothing_until_a_commit_or_its_interval(
        layout, requests):
    """Egress and the push job poll the inbox's log every second: on S3 a poll is a HEAD of
    the next commit while there is none, and a LIST only once it exists (or per interval)."""
    path = layout.landing_root / "any-table"
    options = layout.s3.storage_options()

    def commit():
        write_deltalake(str(path), pa.table({"n": [1]}), mode="append",
                        storage_options=options)
    commit()
    commit()
    follow = LogFollower(path, list_every=3600)
    known = follow.latest(-1)                               # a first look lists
    assert known == latest_version(path) >= 0
    requests.mark()
    for _ in range(5):
        assert follow.latest(known) == known
    assert requests.counts() == {"HEAD": 5}
    commit()
    commit()
    requests.mark()
    assert follow.latest(known) == known + 2
    assert requests.counts() == {"HEAD": 1, "GET": 1, "LIST": 1}
    follow.list_every = 0                                   # the interval's LIST
    requests.mark()
    assert follow.latest(known + 2) == known + 2
    assert requests.counts() == {"LIST": 1}


def test_a_new_node_signalled_on_this_host_is_found_at_once(layout):
    land(layout, "n0", 1)
    src = reader(layout, waitForDataMs="20000")
    start = src.initialOffset()
    end = src.latestOffset(start, ReadAllAvailable())
    assert list(end["v"]) == ["n0/g000001"]
    end["boot"] = src._boot                 # caught up after its first batch: it waits
    done = threading.Event()

    def new_node():                         # a node that starts after the stream, on this host
        rng = np.random.default_rng(3)
        target = LandingTarget(layout, "n9", fsync=False)
        while not done.wait(0.3):
            target.commit(landing_table(1, _mailboxes(rng, 1), rng, size=64))
    late = threading.Thread(target=new_node)
    late.start()
    try:
        for _ in range(5):      # each look ends at a signal (or after 20 s without one)
            woke = src.latestOffset(end, ReadAllAvailable())
            if "n9/g000001" in woke["v"]:
                break
    finally:
        done.set()
        late.join()
        src.stop()
    # found on the writers' signals, long before listIntervalMs (10 minutes here)
    assert woke["v"]["n0/g000001"] == 1 and woke["v"]["n9/g000001"] >= 1, woke
