"""Direct appends (pyarrow file + our commit file) are ordinary Delta versions: delta-rs reads
them, appends and compacts on top of them, and two writers never take the same version."""

from __future__ import annotations

import os
import threading
import time

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from delta_tables.direct_append import DirectAppender
from delta_tables.landing_source import version_adds
from delta_tables.layout import ensure_table
from delta_tables.schema import C, LANDING

from landing_rows import landing_row

SCHEMA = LANDING.arrow_schema()


def rows(*envelopes: bytes) -> pa.Table:
    return pa.Table.from_pylist([landing_row(b"m" * 32, e) for e in envelopes], schema=SCHEMA)


def test_delta_rs_reads_appends_and_compacts_what_direct_appends_wrote(tmp_path):
    path = tmp_path / "t"
    ensure_table(path, LANDING)
    app = DirectAppender(path, SCHEMA, fsync=True)
    assert [app.append(rows(b"a")), app.append(rows(b"b", b"c"))] == [1, 2]

    dt = DeltaTable(str(path))
    assert dt.version() == 2
    assert sorted(dt.to_pyarrow_table()[C.ENVELOPE].to_pylist()) == [b"a", b"b", b"c"]
    assert dt.schema().to_arrow() == DeltaTable(str(path), version=0).schema().to_arrow()
    info = dt.history(1)[0]
    assert info["operation"] == "WRITE" and info["isBlindAppend"] is True
    # the stream's reader of commit files finds the one file of each version
    assert len(version_adds(path, 1)) == 1 and len(version_adds(path, 2)) == 1
    assert sorted(dt.get_add_actions(flatten=True).column("num_records").to_pylist()) == [1, 2]

    # delta-rs writes on top (version 3), then compaction's OPTIMIZE and VACUUM run as usual
    write_deltalake(dt, rows(b"d"), mode="append")
    dt.optimize.compact()
    dt.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    dt = DeltaTable(str(path))
    assert sorted(dt.to_pyarrow_table()[C.ENVELOPE].to_pylist()) == [b"a", b"b", b"c", b"d"]
    # and a direct append after them takes the next version
    assert DirectAppender(path, SCHEMA).append(rows(b"e")) == dt.version() + 1
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 5
    assert not [n for n in os.listdir(path / "_delta_log") if n.endswith(".tmp")]


def test_two_writers_never_take_the_same_version(tmp_path):
    path = tmp_path / "t"
    ensure_table(path, LANDING)
    writers = [DirectAppender(path, SCHEMA, fsync=False) for _ in range(2)]
    # Each writer's idea of the newest version goes stale as soon as the other commits: every
    # append after the first must find the taken name (EEXIST) and move on.
    for i in range(3):
        for w, tag in zip(writers, b"xy"):
            w.append(rows(bytes([tag, i])))
    got: dict[str, list[int]] = {"x": [], "y": []}

    def run(w: DirectAppender, tag: str):
        for i in range(40):
            got[tag].append(w.append(rows(f"{tag}{i}".encode())))

    threads = [threading.Thread(target=run, args=(w, t)) for w, t in zip(writers, "xy")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    versions = got["x"] + got["y"]
    assert sorted(versions) == list(range(7, 87))      # every version once, no gap
    dt = DeltaTable(str(path))
    assert dt.version() == 86 and dt.to_pyarrow_table().num_rows == 86


def test_rows_are_cast_to_the_table_schema_or_refused(tmp_path):
    path = tmp_path / "t"
    ensure_table(path, LANDING)
    app = DirectAppender(path, SCHEMA, fsync=False)
    loose = pa.Table.from_pylist([landing_row(b"m" * 32, b"z")])    # inferred, nullable types
    assert app.append(loose) == 1
    bad = pa.table({"event_id": [b"x"]})
    try:
        app.append(bad)
    except (ValueError, pa.ArrowInvalid, KeyError):
        pass
    else:
        raise AssertionError("a table without the schema's columns must be refused")
    assert DeltaTable(str(path)).version() == 1


def test_a_commit_is_linked_only_after_its_data_name_and_content_are_durable(tmp_path,
                                                                            monkeypatch):
    """Crash safety is an order of system calls (a kill -9 cannot show it: the page cache
    survives a process): the data file, the table directory holding its name and the commit's
    content are fsync'ed, concurrently, before the link that publishes the version; the log
    directory after it, before append returns. The calls are the real ones, recorded."""
    path = tmp_path / "t"
    ensure_table(path, LANDING)
    app = DirectAppender(path, SCHEMA, fsync=True)
    events: list[tuple] = []
    lock = threading.Lock()
    real_fsync, real_link = os.fsync, os.link

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        t0 = time.monotonic()
        time.sleep(0.05)               # long enough to see whether the three overlap
        real_fsync(fd)
        with lock:
            events.append(("fsync", target, t0, time.monotonic()))

    def link(src, dst):
        real_link(src, dst)
        with lock:
            events.append(("link", str(dst), time.monotonic(), time.monotonic()))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    version = app.append(rows(b"a"))
    monkeypatch.undo()

    kinds = [(e[0], e[1]) for e in events]
    linked = kinds.index(("link", str(path / "_delta_log" / f"{version:020d}.json")))
    before = {t for k, t in kinds[:linked]}
    data = version_adds(path, version)[0].path
    assert data in before and str(path) in before
    assert any(t.startswith(str(path / "_delta_log" / "_commit_")) for t in before)
    assert kinds[linked + 1:] == [("fsync", str(path / "_delta_log"))]
    pre = events[:linked]
    assert len(pre) == 3
    assert max(e[2] for e in pre) < min(e[3] for e in pre)   # all three were in flight at once
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 1
