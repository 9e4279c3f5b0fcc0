"""Small commit files: written without Parquet statistics on the opaque columns, and read
(by the stream's driver and executors, `landing_source.read_files`) in table and version
order with their tags, cast when written otherwise, refused when a required value is null."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from delta_tables.direct_append import DirectAppender
from delta_tables.landing_source import FileRef, read_files, version_adds
from delta_tables.layout import ensure_table
from delta_tables.schema import C, LANDING, LANDING_SOURCE

from landing_rows import landing_row

SCHEMA = LANDING.arrow_schema()


def rows(*envelopes: bytes, mailbox=b"m" * 32) -> pa.Table:
    return pa.Table.from_pylist([landing_row(mailbox, e) for e in envelopes], schema=SCHEMA)


def refs(path, key: str, versions) -> list[FileRef]:
    return [FileRef(key, v, f.path, f.size) for v in versions for f in version_adds(path, v)]


def test_commit_files_keep_statistics_only_where_a_reader_can_use_them(tmp_path):
    path = tmp_path / "t"
    ensure_table(path, LANDING)
    envelope = b"\xee" * 1100
    DirectAppender(path, SCHEMA, fsync=False).append(rows(envelope))
    [ref] = refs(path, "t", [1])
    md = pq.ParquetFile(ref.path).metadata
    stats = {md.schema.column(i).name: md.row_group(0).column(i).statistics
             for i in range(md.num_columns)}
    assert stats[C.ENVELOPE] is None or not stats[C.ENVELOPE].has_min_max
    assert stats[C.MAILBOX].has_min_max and stats[C.MAILBOX].min == b"m" * 32
    assert ref.size < 2 * len(envelope) + 2048     # the envelope is in the file once, not 3x
    assert DeltaTable(str(path)).to_pyarrow_table()[C.ENVELOPE].to_pylist() == [envelope]


def test_read_files_tags_rows_in_order_across_chunks_and_casts_other_writers(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for p in (a, b):
        ensure_table(p, LANDING)
    app_a, app_b = DirectAppender(a, SCHEMA, fsync=False), DirectAppender(b, SCHEMA, fsync=False)
    app_a.append(rows(b"a1"))
    app_a.append(rows(b"a2", b"a3", b"a4"))
    app_b.append(rows(b"b1"))
    # a file as another writer may have written it: nanosecond times, large binary envelopes
    other = rows(b"b2", b"b3")
    other = other.cast(pa.schema([f.with_type(pa.timestamp("ns", tz="UTC"))
                                  if pa.types.is_timestamp(f.type) else
                                  f.with_type(pa.large_binary()) if f.name == C.ENVELOPE
                                  else f for f in SCHEMA]))
    pq.write_table(other, b / "other.parquet")
    files = (refs(a, "a", [1, 2]) + refs(b, "b", [1])
             + [FileRef("b", 2, str(b / "other.parquet"), 1)] + refs(a, "a", []))
    expected = [(b"a1", "a", 1), (b"a2", "a", 2), (b"a3", "a", 2), (b"a4", "a", 2),
                (b"b1", "b", 1), (b"b2", "b", 2), (b"b3", "b", 2)]
    for chunk_rows in (1, 2, 65536):
        batches = list(read_files(files, chunk_rows=chunk_rows))
        assert all(batch.schema == LANDING_SOURCE.arrow_schema() for batch in batches)
        t = pa.Table.from_batches(batches)
        assert list(zip(t[C.ENVELOPE].to_pylist(), t[C.LANDING_TABLE].to_pylist(),
                        t[C.LANDING_VERSION].to_pylist())) == expected
    assert sum(1 for _ in read_files(files, chunk_rows=65536)) <= 2   # files tagged together


def test_read_files_refuses_a_null_where_the_schema_has_none(tmp_path):
    loose = pa.schema([f.with_nullable(True) for f in SCHEMA])
    good = rows(b"ok").cast(loose)
    bad = pa.Table.from_pylist([{**landing_row(b"m" * 32, b"x"), C.MAILBOX: None}],
                               schema=loose)
    pq.write_table(good, tmp_path / "good.parquet")
    pq.write_table(bad, tmp_path / "bad.parquet")
    files = [FileRef("t", 1, str(tmp_path / "good.parquet"), 1),
             FileRef("t", 2, str(tmp_path / "bad.parquet"), 1)]
    with pytest.raises((pa.ArrowInvalid, ValueError)):
        list(read_files(files))
    # without the bad file, the good one (written with a looser schema) is read and cast
    [batch] = list(read_files(files[:1]))
    assert batch.schema == LANDING_SOURCE.arrow_schema() and batch.num_rows == 1
