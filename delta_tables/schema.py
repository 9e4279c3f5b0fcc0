"""Every Delta table of the relay, declared once.

A table is data (`TableDef`): the pyarrow schema the writers use and the Spark StructType the
stream uses are both derived here, so a column cannot drift between the two. Other modules
refer to columns through the `C` constants, never as fresh string literals.

Types are chosen to keep tables at Delta protocol reader 1 / writer 2 (DESIGN.md): timestamps
are UTC-zoned (`timestamp`, never `timestamp_ntz`) and no deletion vectors are enabled, so any
delta-spark cluster can read what delta-rs writes here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa


class C:
    """Column names."""
    EVENT_ID = "event_id"
    PROTOCOL = "protocol"
    MAILBOX = "mailbox"
    ENVELOPE = "envelope"
    META = "meta"
    RECEIVED_AT = "received_at"
    EXPIRES_AT = "expires_at"
    CURSOR = "cursor"
    SEQ = "seq"
    COMMITTED_AT = "committed_at"
    LANDING_TABLE = "landing_table"
    LANDING_VERSION = "landing_version"
    BATCH_ID = "batch_id"
    SIZE = "size"
    REASON = "reason"
    REJECTED_AT = "rejected_at"
    DEVICE = "device"
    ACKED_AT = "acked_at"
    PAYLOAD_SIZE = "payload_size"
    BUCKET = "bucket"
    CONFORMING = "conforming"
    ENVELOPES = "envelopes"
    BYTES = "bytes"
    AUDITED_AT = "audited_at"


@dataclass(frozen=True)
class Column:
    name: str
    kind: str  # one of _ARROW
    nullable: bool = False
    doc: str = ""


_ARROW = {
    "binary": pa.binary(),
    "string": pa.string(),
    "long": pa.int64(),
    "int": pa.int32(),
    "bool": pa.bool_(),
    "timestamp": pa.timestamp("us", tz="UTC"),
}


def _spark_type(kind: str):
    from pyspark.sql import types as T
    return {
        "binary": T.BinaryType(), "string": T.StringType(), "long": T.LongType(),
        "int": T.IntegerType(), "bool": T.BooleanType(), "timestamp": T.TimestampType(),
    }[kind]


@dataclass(frozen=True)
class TableDef:
    name: str
    columns: tuple[Column, ...]
    properties: dict[str, str] = field(default_factory=dict)
    doc: str = ""

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(c.name, _ARROW[c.kind], nullable=c.nullable)
                          for c in self.columns])

    def spark_schema(self):
        from pyspark.sql import types as T
        return T.StructType([T.StructField(c.name, _spark_type(c.kind), c.nullable)
                             for c in self.columns])

    def extended(self, name: str, extra: tuple[Column, ...], doc: str = "") -> "TableDef":
        return TableDef(name, self.columns + extra, dict(self.properties), doc)


# Properties shared by all tables: keep the log short (checkpoints + expired-log cleanup) so
# commit latency and snapshot loads stay flat as a table ages. No deletion vectors: they would
# raise the protocol to 3/7.
_COMMON = {
    "delta.checkpointInterval": "100",
    "delta.enableExpiredLogCleanup": "true",
    "delta.logRetentionDuration": "interval 1 days",
}

_ENVELOPE_COLS = (
    Column(C.EVENT_ID, "binary", doc="dedup key; BLAKE2b-256 unless the protocol defines one"),
    Column(C.PROTOCOL, "string", doc="trueseal | ppp | heya | sync"),
    Column(C.MAILBOX, "binary", doc="where the envelope waits (protocol-specific key)"),
    Column(C.ENVELOPE, "binary", nullable=True, doc="opaque ciphertext; null once purged"),
    Column(C.META, "binary", nullable=True,
           doc="relay-visible protocol fields (msgpack), never envelope content"),
    Column(C.RECEIVED_AT, "timestamp", doc="ingress receipt time"),
    Column(C.EXPIRES_AT, "timestamp", doc="after this the envelope is dropped"),
)

LANDING = TableDef(
    "landing", _ENVELOPE_COLS,
    {**_COMMON, "delta.appendOnly": "true"},
    doc="What one ingress node accepted and acked; one table per node and generation.",
)

# The stream's view of a landing row: where it came from, for ordering and replay.
LANDING_SOURCE = LANDING.extended("landing_source", (
    Column(C.LANDING_TABLE, "string", doc="<node>/<generation>"),
    Column(C.LANDING_VERSION, "long"),
))

INBOX = TableDef(
    "inbox", _ENVELOPE_COLS + (
        Column(C.CURSOR, "long", doc="per-mailbox, gap-free, monotonic; assigned by the stream"),
        Column(C.SEQ, "long", doc="relay-wide unique, monotonic (trueseal blob_id)"),
        Column(C.COMMITTED_AT, "timestamp"),
        Column(C.LANDING_TABLE, "string"),
        Column(C.LANDING_VERSION, "long"),
        Column(C.BATCH_ID, "long"),
    ),
    {**_COMMON, "delta.checkpointInterval": "20",
     # removed files (delivered ciphertext) may be vacuumed soon after
     "delta.deletedFileRetentionDuration": "interval 1 hours"},
    doc="The authoritative inbox. A row whose envelope is null is a tombstone kept until "
        "expiry for dedup and cursor continuity.",
)

ACKS = TableDef(
    "acks", (
        Column(C.PROTOCOL, "string"),
        Column(C.MAILBOX, "binary"),
        Column(C.EVENT_ID, "binary"),
        Column(C.SEQ, "long"),
        Column(C.CURSOR, "long"),
        Column(C.DEVICE, "binary", nullable=True, doc="acking device where a mailbox has several"),
        Column(C.ACKED_AT, "timestamp"),
    ),
    dict(_COMMON),
    doc="Delivery acknowledgements recorded by egress; compaction turns them into deletes.",
)

REJECTS = TableDef(
    "rejects", (
        Column(C.EVENT_ID, "binary"),
        Column(C.PROTOCOL, "string"),
        Column(C.MAILBOX, "binary"),
        Column(C.SIZE, "long", doc="envelope size in bytes; the bytes themselves are not kept"),
        Column(C.REASON, "string", doc="duplicate | expired | oversize"),
        Column(C.RECEIVED_AT, "timestamp"),
        Column(C.REJECTED_AT, "timestamp"),
        Column(C.LANDING_TABLE, "string"),
        Column(C.LANDING_VERSION, "long"),
        Column(C.BATCH_ID, "long"),
    ),
    dict(_COMMON),
    doc="Landing rows the stream did not put in the inbox, with the reason.",
)

PADDING_AUDIT = TableDef(
    "padding_audit", (
        Column(C.BATCH_ID, "long"),
        Column(C.PROTOCOL, "string"),
        Column(C.PAYLOAD_SIZE, "long", doc="envelope size minus the protocol's fixed overhead"),
        Column(C.BUCKET, "int", nullable=True, doc="smallest bucket >= payload; null if none"),
        Column(C.CONFORMING, "bool", doc="payload is exactly a bucket size"),
        Column(C.ENVELOPES, "long"),
        Column(C.BYTES, "long"),
        Column(C.AUDITED_AT, "timestamp"),
    ),
    dict(_COMMON),
    doc="Per micro-batch, protocol and exact payload size: how traffic sits in the buckets.",
)

TABLES = {t.name: t for t in (LANDING, INBOX, ACKS, REJECTS, PADDING_AUDIT)}

# Rejection reasons written by the stream.
REASON_DUPLICATE = "duplicate"
REASON_EXPIRED = "expired"
REASON_OVERSIZE = "oversize"
