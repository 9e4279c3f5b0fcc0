"""The relay's Delta tables as Spark temp views for analysis, with mailbox keys hashed.

Spark reaches Delta through delta-rs here (DESIGN.md): each table is read with
`DeltaTable(path).to_pyarrow_table()` and handed to Spark as Arrow. On the way in, the columns
that identify a person's device or carry ciphertext are replaced, so no view, and nothing a
notebook prints or plots from one, can show a key or an envelope:

    mailbox   -> mailbox_hash   first 12 hex digits of SHA-256(mailbox): stable for joins and
                                top-N lists, not the key
    envelope  -> envelope_size  bytes (null once compaction made the row a tombstone)
    meta      -> meta_size      bytes of the relay-visible protocol fields (they may hold tokens)
    event_id  -> event_hash     first 12 hex digits of SHA-256(event_id)
    device    -> device_hash

Views: inbox, acks, rejects, padding_audit, and landing (every generation still on disk, with
its `landing_table` key and `landing_version`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from delta_tables.landing_lag import latest_version
from delta_tables.layout import Layout
from delta_tables.schema import ACKS, INBOX, LANDING, PADDING_AUDIT, REJECTS, C, TableDef

HASH_HEX = 12
_HASHED = {C.MAILBOX: "mailbox_hash", C.EVENT_ID: "event_hash", C.DEVICE: "device_hash"}
_SIZED = {C.ENVELOPE: "envelope_size", C.META: "meta_size"}


def short_hash(value: bytes | None) -> str | None:
    return None if value is None else hashlib.sha256(value).hexdigest()[:HASH_HEX]


def _hash_column(col: pa.ChunkedArray) -> pa.Array:
    # hash each distinct value once: mailboxes repeat a lot
    uniq = pc.unique(col)
    hashed = pa.array([short_hash(v) for v in uniq.to_pylist()], pa.string())
    return pc.take(hashed, pc.index_in(col, value_set=uniq))


def private_view(table: pa.Table) -> pa.Table:
    """`table` with keys hashed and envelopes reduced to their size (module docstring)."""
    out = table
    for name, new in _HASHED.items():
        if name in out.column_names:
            i = out.column_names.index(name)
            out = out.set_column(i, new, _hash_column(out.column(name)))
    for name, new in _SIZED.items():
        if name in out.column_names:
            i = out.column_names.index(name)
            out = out.set_column(i, new, pc.cast(pc.binary_length(out.column(name)), pa.int64()))
    return out


def read_table(layout: Layout, tdef: TableDef) -> pa.Table:
    path = layout.table(tdef)
    if not (path / "_delta_log").exists():
        return private_view(tdef.arrow_schema().empty_table())
    return private_view(DeltaTable(str(path)).to_pyarrow_table())


def read_landing(layout: Layout) -> pa.Table:
    """Every landing table still on disk, tagged with its key and each row's version."""
    parts = []
    for key, path in layout.landing_tables().items():
        if latest_version(path) < 0:
            continue
        dt = DeltaTable(str(path))
        for version in range(dt.version() + 1):
            # one version at a time: the version of a row is what a replay starts from
            t = _version_rows(path, version)
            if t is not None and t.num_rows:
                parts.append(t.append_column(C.LANDING_TABLE, pa.array([key] * t.num_rows))
                             .append_column(C.LANDING_VERSION,
                                            pa.array([version] * t.num_rows, pa.int64())))
    schema = private_view(LANDING.arrow_schema().empty_table()).schema \
        .append(pa.field(C.LANDING_TABLE, pa.string())) \
        .append(pa.field(C.LANDING_VERSION, pa.int64()))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables([private_view(p) for p in parts]).cast(schema)


def _version_rows(path: Path, version: int) -> pa.Table | None:
    from delta_tables.landing_source import version_adds   # imports pyspark: only here
    import pyarrow.parquet as pq
    files = version_adds(path, version)
    if not files:
        return None
    return pa.concat_tables([pq.read_table(f, columns=LANDING.names) for f in files])


def register_views(spark, data_dir: str | Path, landing: bool = True) -> dict[str, int]:
    """Create (or replace) the temp views; returns rows per view."""
    layout = Layout(data_dir)
    tables = {t.name: read_table(layout, t) for t in (INBOX, ACKS, REJECTS, PADDING_AUDIT)}
    if landing:
        tables["landing"] = read_landing(layout)
    for name, table in tables.items():
        spark.createDataFrame(table).createOrReplaceTempView(name)
    return {name: t.num_rows for name, t in tables.items()}
