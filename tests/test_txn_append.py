"""Exactly-once direct appends (delta_tables/txn_append.py), read back by delta-rs."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from delta_tables import writer_fence
from delta_tables.layout import ensure_table
from delta_tables.schema import C, PADDING_AUDIT
from delta_tables.txn_append import AlreadyCommitted, TxnAppender, UnsupportedTable

APP, FENCE = "stream:q1", "stream:writer"
T0 = datetime(2026, 11, 28, 1, 2, 3, 456789, tzinfo=timezone.utc)


def audit_rows(batch_id: int, n: int = 3) -> pa.Table:
    return pa.Table.from_pylist([
        {C.BATCH_ID: batch_id, C.PROTOCOL: "heya", C.PAYLOAD_SIZE: 100 * i,
         C.BUCKET: None if i == 0 else 256, C.CONFORMING: i % 2 == 0, C.ENVELOPES: i + 1,
         C.BYTES: 600, C.AUDITED_AT: T0 + timedelta(microseconds=i)}
        for i in range(n)], schema=PADDING_AUDIT.arrow_schema())


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "padding_audit"
    ensure_table(path, PADDING_AUDIT)
    return path


def data_files(path) -> set[str]:
    return {n for n in os.listdir(path) if n.endswith(".parquet")}


def test_commits_rows_markers_and_stats_that_delta_rs_reads(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=True)
    v1 = app.append(audit_rows(1), {APP: 1, FENCE: 1}, fence=FENCE)
    v2 = app.append(audit_rows(2), {APP: 2, FENCE: 2}, fence=FENCE)
    assert v2 == v1 + 1

    dt = DeltaTable(str(table))
    assert dt.version() == v2
    assert dt.transaction_version(APP) == 2 and dt.transaction_version(FENCE) == 2
    assert sorted(dt.to_pyarrow_table().column(C.BATCH_ID).to_pylist()) == [1, 1, 1, 2, 2, 2]
    add = [json.loads(line)["add"] for line in
           (table / "_delta_log" / f"{v2:020d}.json").read_text().splitlines()
           if "add" in json.loads(line)][0]
    stats = json.loads(add["stats"])
    assert stats["numRecords"] == 3
    assert stats["minValues"][C.PAYLOAD_SIZE] == 0 and stats["maxValues"][C.PAYLOAD_SIZE] == 200
    # timestamps to the millisecond, the max rounded up so it bounds the rows
    assert stats["minValues"][C.AUDITED_AT] == "2026-11-28T01:02:03.456Z"
    assert stats["maxValues"][C.AUDITED_AT] == "2026-11-28T01:02:03.457Z"
    assert stats["nullCount"][C.BUCKET] == 1
    # delta-rs prunes files by these stats
    assert dt.to_pyarrow_table(filters=[(C.PAYLOAD_SIZE, ">", 500)]).num_rows == 0


def test_a_replayed_transaction_commits_nothing(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=False)
    app.append(audit_rows(5), {APP: 5})
    files, version = data_files(table), app.version
    with pytest.raises(AlreadyCommitted):
        app.append(audit_rows(5), {APP: 5})
    restarted = TxnAppender(table, PADDING_AUDIT, fsync=False)   # state read from the table
    assert restarted.txn_version(APP) == 5
    with pytest.raises(AlreadyCommitted):
        restarted.append(audit_rows(4), {APP: 4})
    assert data_files(table) == files and DeltaTable(str(table)).version() == version


def test_another_writers_commit_moves_the_append_to_the_next_version(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=False)
    app.append(audit_rows(1), {APP: 1})
    # compaction (or any writer without this app's marker) commits meanwhile
    write_deltalake(str(table), audit_rows(99, 1), mode="append")
    DeltaTable(str(table)).delete(f"{C.BATCH_ID} = 99")
    version = app.append(audit_rows(2), {APP: 2})
    dt = DeltaTable(str(table))
    assert version == dt.version() == 4
    assert dt.transaction_version(APP) == 2
    assert sorted(set(dt.to_pyarrow_table().column(C.BATCH_ID).to_pylist())) == [1, 2]


def test_a_concurrent_commit_of_the_same_transaction_wins_and_no_file_is_left(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=False)
    app.append(audit_rows(1), {APP: 1})
    files = data_files(table)
    # the same batch committed by another process of the same stream (a replay racing)
    write_deltalake(str(table), audit_rows(2), mode="append",
                    commit_properties=CommitProperties(app_transactions=[Transaction(APP, 2)]))
    raced = data_files(table)
    with pytest.raises(AlreadyCommitted):
        app.append(audit_rows(2), {APP: 2})
    assert data_files(table) == raced and len(raced) == len(files) + 1
    assert DeltaTable(str(table)).to_pyarrow_table().num_rows == 6


def test_a_moved_writer_counter_stops_the_writer(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=False)
    app.append(audit_rows(1), {APP: 1, FENCE: 1}, fence=FENCE)
    rival = TxnAppender(table, PADDING_AUDIT, fsync=False)
    rival.append(audit_rows(1), {"other:q2": 1, FENCE: 2}, fence=FENCE)
    with pytest.raises(writer_fence.WriterLost):        # found when its version is taken
        app.append(audit_rows(2), {APP: 2, FENCE: 2}, fence=FENCE)
    with pytest.raises(writer_fence.WriterLost):        # and before writing, from then on
        app.append(audit_rows(2), {APP: 2, FENCE: 2}, fence=FENCE)
    dt = DeltaTable(str(table))
    assert writer_fence.read(dt, FENCE) == 2 and dt.transaction_version(APP) == 1


def test_checkpoints_follow_the_tables_interval_and_keep_the_markers(table):
    app = TxnAppender(table, PADDING_AUDIT, fsync=False)   # checkpointInterval 100
    assert app.checkpoint_interval == 100
    for batch in range(1, 101):
        app.append(audit_rows(batch, 1), {APP: batch})
        if app.checkpoint_due():
            app.checkpoint()
    last = json.loads((table / "_delta_log" / "_last_checkpoint").read_text())
    assert last["version"] == 100
    for n in range(1, 101):   # the commits could be gone: the checkpoint holds the state
        (table / "_delta_log" / f"{n:020d}.json").rename(table / f"moved-{n}.json")
    dt = DeltaTable(str(table))
    assert dt.transaction_version(APP) == 100 and dt.to_pyarrow_table().num_rows == 100
    assert not app.checkpoint_due()


def test_a_table_asking_more_of_writers_is_refused(tmp_path):
    path = tmp_path / "t"
    write_deltalake(str(path), audit_rows(1), configuration={"delta.enableChangeDataFeed": "true"})
    assert DeltaTable(str(path)).protocol().min_writer_version > 2
    with pytest.raises(UnsupportedTable):
        TxnAppender(path, PADDING_AUDIT)
