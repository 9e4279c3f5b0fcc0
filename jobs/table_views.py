"""The relay's Delta tables as Spark temp views for analysis, with mailbox keys hashed.

The Delta tables (inbox, acks, rejects, padding_audit, push_log) are read by delta-spark
(`spark.read.format("delta")`, delta_tables/spark_delta.py), so a view is a lazy scan of the
table, not a copy in driver memory, and the same session can run `DESCRIBE HISTORY` or a time
travel query on them. The landing generations (read version by version, to tag each row with
its version) and the PPP rooms (folded from the control log) are built in Arrow. On the way in,
the columns that identify a person's device or carry ciphertext are replaced, so no view, and
nothing a notebook prints or plots from one, can show a key or an envelope:

    mailbox   -> mailbox_hash   first 12 hex digits of SHA-256(mailbox): stable for joins and
                                top-N lists, not the key
    envelope  -> envelope_size  bytes (null once compaction made the row a tombstone)
    meta      -> meta_size      bytes of the relay-visible protocol fields (they may hold tokens)
    event_id  -> event_hash     first 12 hex digits of SHA-256(event_id)
    device    -> device_hash

Views: inbox, acks, rejects, padding_audit, and landing (every generation still on disk, with
its `landing_table` key and `landing_version`); and for PPP rooms (spec 004 §7):

    rooms         one row per room or group the PPP control plane holds (expired rooms too,
                  until compaction purges them): room_hash (as mailbox_hash of its messages),
                  room_type, s2_cell_id, s2_coarse_id (S2 tokens: what discovery shows
                  anyway; null for groups), gated, ble_enabled, max_members, member_count,
                  created_at, expires_at. Never the admin's key.
    room_traffic  the rooms' messages in the inbox by coarse cell and hour: messages, bytes,
                  rooms with traffic.

and for push wake-ups, `push_log` (delta_tables/schema_push.py) with its device hashed again
(device_hash): time, protocol, platform, trigger, outcome, attempts, latencies.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from delta_tables import query, spark_delta
from delta_tables.landing_lag import latest_version
from delta_tables.layout import Layout
from delta_tables.schema import ACKS, INBOX, LANDING, PADDING_AUDIT, REJECTS, C, TableDef
from delta_tables.schema_push import PUSH_LOG
from delta_tables.spark_delta import HASH_HEX, HASHED, SIZED   # one definition, both paths


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
    for name, new in HASHED.items():
        if name in out.column_names:
            i = out.column_names.index(name)
            out = out.set_column(i, new, _hash_column(out.column(name)))
    for name, new in SIZED.items():
        if name in out.column_names:
            i = out.column_names.index(name)
            out = out.set_column(i, new, pc.cast(pc.binary_length(out.column(name)), pa.int64()))
    return out


def read_table(layout: Layout, tdef: TableDef) -> pa.Table:
    path = layout.table(tdef)
    if not (path / "_delta_log").exists():
        return private_view(tdef.arrow_schema().empty_table())
    return private_view(query.read(DeltaTable(str(path))))


def delta_frame(spark, layout: Layout, tdef: TableDef):
    """`tdef` read by delta-spark with keys hashed and envelopes sized (an empty frame of the
    same columns before the table's first commit)."""
    if spark_delta.exists(layout, tdef):
        return spark_delta.private(spark_delta.read(spark, layout, tdef))
    return spark.createDataFrame(private_view(tdef.arrow_schema().empty_table()))


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
    return pa.concat_tables([pq.read_table(f.path, columns=LANDING.names) for f in files])


ROOMS_SCHEMA = pa.schema([
    ("room_hash", pa.string()), ("room_type", pa.string()), ("s2_cell_id", pa.string()),
    ("s2_coarse_id", pa.string()), ("gated", pa.bool_()), ("ble_enabled", pa.bool_()),
    ("max_members", pa.int32()), ("member_count", pa.int32()),
    ("created_at", pa.timestamp("us", tz="UTC")), ("expires_at", pa.timestamp("us", tz="UTC"))])


def read_rooms(layout: Layout) -> pa.Table:
    """The PPP control plane's rooms, folded as the listener folds them (`ppp_state`)."""
    from datetime import datetime, timezone

    from delta_tables.ppp_state import load_state, table_paths
    rooms = load_state(table_paths(layout)).rooms
    ts = lambda s: datetime.fromtimestamp(s, timezone.utc)   # noqa: E731
    return pa.Table.from_pylist([{
        "room_hash": short_hash(r.room_id), "room_type": r.room_type, "s2_cell_id": r.fine,
        "s2_coarse_id": r.coarse, "gated": r.gated, "ble_enabled": r.ble_enabled,
        "max_members": r.max_members, "member_count": rooms.members(r.room_id),
        "created_at": ts(r.created_at), "expires_at": ts(r.expires_at)}
        for r in rooms.rooms.values()], schema=ROOMS_SCHEMA)


ROOM_TRAFFIC = """
    SELECT r.s2_coarse_id, date_trunc('HOUR', i.received_at) AS hour,
           count(*) AS messages, sum(i.envelope_size) AS bytes,
           count(DISTINCT r.room_hash) AS rooms
    FROM inbox i JOIN rooms r ON i.mailbox_hash = r.room_hash
    WHERE i.protocol = 'ppp_room'
    GROUP BY r.s2_coarse_id, date_trunc('HOUR', i.received_at)"""


def register_views(spark, data_dir: str | Path, landing: bool = True) -> dict[str, int]:
    """Create (or replace) the temp views; returns rows per view."""
    layout = Layout(data_dir)
    frames = {t.name: delta_frame(spark, layout, t)
              for t in (INBOX, ACKS, REJECTS, PADDING_AUDIT, PUSH_LOG)}
    tables = {"rooms": read_rooms(layout)}
    if landing:
        tables["landing"] = read_landing(layout)
    frames.update({name: spark.createDataFrame(t) for name, t in tables.items()})
    counts = {}
    for name, frame in frames.items():
        frame.createOrReplaceTempView(name)
        counts[name] = tables[name].num_rows if name in tables else frame.count()
    spark.sql(f"CREATE OR REPLACE TEMP VIEW room_traffic AS {ROOM_TRAFFIC}")
    counts["room_traffic"] = spark.table("room_traffic").count()
    return counts

