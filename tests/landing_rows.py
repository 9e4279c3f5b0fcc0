"""Landing rows for the stream and group-commit tests: one row as ingress writes it, committed
to a fresh landing generation, and recognisable envelopes."""

from __future__ import annotations

import hashlib
import os
from datetime import datetime, timedelta, timezone

import pyarrow as pa

from delta_tables.group_commit import LandingTarget
from delta_tables.layout import Layout
from delta_tables.schema import C, LANDING


def landing_row(mailbox: bytes, envelope: bytes, *, protocol="trueseal", event_id=None,
                received_at=None, ttl=timedelta(days=1), expires_at=None):
    received_at = received_at or datetime.now(timezone.utc)
    return {
        C.EVENT_ID: event_id or hashlib.blake2b(mailbox + envelope, digest_size=32).digest(),
        C.PROTOCOL: protocol, C.MAILBOX: mailbox, C.ENVELOPE: envelope, C.META: None,
        C.RECEIVED_AT: received_at, C.EXPIRES_AT: expires_at or received_at + ttl,
    }


def land(layout: Layout, rows: list[dict], node="node-t", per_commit=None):
    """Commit rows to a fresh landing generation of `node`, `per_commit` rows a commit."""
    target = LandingTarget(layout, node, fsync=False)
    per_commit = per_commit or max(1, len(rows))
    for i in range(0, len(rows), per_commit):
        chunk = rows[i:i + per_commit]
        target.commit(pa.Table.from_pylist(chunk, schema=LANDING.arrow_schema()))
    return target


def envelope(n: int, size: int = 200) -> bytes:
    return n.to_bytes(8, "big") + os.urandom(size - 8)
