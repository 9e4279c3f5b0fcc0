"""What the tables hold against what is still to deliver (docs/operating/retention.md):
bytes on disk per table, the live ciphertext, the inbox rows' metadata, the storage ratio and
the oldest delivered byte still on disk. `measure` is the one definition, used by
`relay status`, `relay loadgen --retain` and the notebooks.

The storage ratio is every byte under the tables directory (every table, with its logs and
checkpoints, also the tables that hold no ciphertext) over what the relay must keep for the
envelopes still waiting: their ciphertext, plus the fixed per-row metadata of the inbox's
rows (every column but `envelope`, at its raw size: 8 bytes a number or time, a key's or
string's own length), which tombstones keep until they expire. Once
`compaction.delivered_bound_seconds` has passed it is at most RATIO_BOUND."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from deltalake import DeltaTable

from . import query, removed_files
from .layout import Layout
from .object_store import disk_usage
from .schema import INBOX, C

# Once the bound has passed, the tables hold at most this many bytes per byte the relay must
# keep (the live ciphertext plus the inbox rows' metadata).
RATIO_BOUND = 2.0
# The raw size of a fixed-width value (schema kinds); binary and string values count their
# own length.
_WIDTH = {"long": 8, "timestamp": 8, "int": 4, "bool": 1}


@dataclass
class Storage:
    live_bytes: int                   # ciphertext of envelopes not acked, expired or purged
    row_metadata_bytes: int           # the inbox rows' other columns, at their raw size
    table_bytes: dict[str, int] = field(default_factory=dict)  # directory -> bytes
    oldest_delivered_s: float | None = None   # age of the oldest delivered byte on disk
    on_disk: int = 0                  # sum of table_bytes
    ratio: float | None = None        # on_disk / (live + metadata); None: nothing to keep


def measure(layout: Layout, now: datetime, *, live: int | None = None) -> Storage:
    """The storage figures of the tables as they are now (`live`: the live ciphertext when
    the caller already summed it)."""
    table = table_bytes(layout)
    on_disk = sum(table.values())
    live = live_bytes(layout, now) if live is None else live
    meta = row_metadata_bytes(layout)
    keep = live + meta
    return Storage(live, meta, table, oldest_delivered_s(layout, now), on_disk,
                   on_disk / keep if keep else None)


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
    (row,) = query.rows({"inbox": inbox, "acks": acks}, f"""
        SELECT sum({byte_length('i.' + C.ENVELOPE)}) AS b FROM inbox i LEFT JOIN acks a
          ON a.{C.SEQ} = i.{C.SEQ} AND a.{C.PROTOCOL} = i.{C.PROTOCOL}
         AND a.{C.MAILBOX} = i.{C.MAILBOX}
        WHERE i.{C.ENVELOPE} IS NOT NULL AND i.{C.EXPIRES_AT} > {ts_literal(now)}
          AND a.{C.SEQ} IS NULL""")
    return int(row["b"] or 0)


def row_metadata_bytes(layout: Layout) -> int:
    """The inbox rows' values other than the envelope, at their raw size (the fixed per-row
    metadata a tombstone keeps too): fixed-width columns at their width, keys and strings
    at their length."""
    terms = []
    for col in INBOX.columns:
        if col.name == C.ENVELOPE:
            continue
        if col.kind in _WIDTH:
            terms.append(f"{_WIDTH[col.kind]} * count(*)")
        elif col.kind == "binary":
            terms.append(f"coalesce(sum({byte_length(col.name)}), 0)")
        else:
            terms.append(f"coalesce(sum(octet_length({col.name})), 0)")
    (row,) = query.rows({"inbox": DeltaTable(str(layout.inbox))},
                        f"SELECT {' + '.join(terms)} AS b FROM inbox")
    return int(row["b"] or 0)


def oldest_delivered_s(layout: Layout, now: datetime) -> float | None:
    """Age of the oldest delivered byte still on disk: the longest an acked envelope has
    kept its bytes in the inbox, or a file the log removed has waited for VACUUM (in any
    table but landing, whose generations go whole), whichever is older; None: none."""
    inbox, acks = DeltaTable(str(layout.inbox)), DeltaTable(str(layout.acks))
    (row,) = query.rows({"inbox": inbox, "acks": acks}, f"""
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
