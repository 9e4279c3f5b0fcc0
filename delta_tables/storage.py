"""What the tables hold against what is still to deliver (docs/operating/retention.md):
bytes on disk per table, the live ciphertext, and the oldest delivered byte still on disk.
Read by `relay status`, the operations notebook and `relay loadgen --retain`."""

from __future__ import annotations

from datetime import datetime

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from . import removed_files
from .layout import Layout
from .object_store import disk_usage
from .schema import C


def _sql(tables: dict[str, DeltaTable], sql: str) -> list[dict]:
    qb = QueryBuilder()
    for name, dt in tables.items():
        qb.register(name, dt)
    return pa.table(qb.execute(sql).read_all()).to_pylist()


def ts_literal(now: datetime) -> str:
    return f"arrow_cast('{now.isoformat()}', 'Timestamp(Microsecond, Some(\"UTC\"))')"


def byte_length(column: str) -> str:
    """SQL for a binary column's length in bytes: DataFusion's length() and octet_length()
    read binary as UTF-8 (and fail on ciphertext), hex does not."""
    return f"length(encode({column}, 'hex')) / 2"


def table_bytes(layout: Layout) -> dict[str, int]:
    """Bytes under each directory of the tables (`landing`: every node's generations)."""
    if not layout.tables.exists():
        return {}
    return {d.name: disk_usage(d) for d in sorted(layout.tables.iterdir()) if d.is_dir()}


def live_bytes(layout: Layout, now: datetime) -> int:
    """Ciphertext still to deliver: envelopes not purged, not expired and not acked."""
    inbox, acks = DeltaTable(str(layout.inbox)), DeltaTable(str(layout.acks))
    (row,) = _sql({"inbox": inbox, "acks": acks}, f"""
        SELECT sum({byte_length('i.' + C.ENVELOPE)}) AS b FROM inbox i LEFT JOIN acks a
          ON a.{C.SEQ} = i.{C.SEQ} AND a.{C.PROTOCOL} = i.{C.PROTOCOL}
         AND a.{C.MAILBOX} = i.{C.MAILBOX}
        WHERE i.{C.ENVELOPE} IS NOT NULL AND i.{C.EXPIRES_AT} > {ts_literal(now)}
          AND a.{C.SEQ} IS NULL""")
    return int(row["b"] or 0)


def oldest_delivered_s(layout: Layout, now: datetime) -> float | None:
    """Age of the oldest delivered byte still on disk: the longest an acked envelope has
    kept its bytes in the inbox, or a file the log removed has waited for VACUUM (in any
    table but landing, whose generations go whole), whichever is older; None: none."""
    inbox, acks = DeltaTable(str(layout.inbox)), DeltaTable(str(layout.acks))
    (row,) = _sql({"inbox": inbox, "acks": acks}, f"""
        SELECT min(a.{C.ACKED_AT}) AS oldest FROM acks a JOIN inbox i
          ON a.{C.SEQ} = i.{C.SEQ} AND a.{C.PROTOCOL} = i.{C.PROTOCOL}
         AND a.{C.MAILBOX} = i.{C.MAILBOX}
        WHERE i.{C.ENVELOPE} IS NOT NULL""")
    ages = [(now - row["oldest"]).total_seconds()] if row["oldest"] else []
    for d in (layout.tables.iterdir() if layout.tables.exists() else ()):
        if d.name != "landing" and (d / "_delta_log").exists():
            removed = removed_files.oldest_removal(d)
            if removed is not None:
                ages.append(now.timestamp() - removed)
    return max(ages, default=None)
