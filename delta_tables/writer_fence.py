"""One writer per table, enforced through the Delta log itself (no lock service).

A table whose appends must come from one writer at a time (the inbox: its cursors are assigned
from the writer's cache of it) carries a counter, the version of a Delta app transaction
`<prefix>:writer`. A writer reads the counter with the snapshot it builds its cache from and
commits each append with the counter + 1. Two commits of one counter value never both land:

* a writer whose handle already shows a larger counter stops before writing;
* two writers committing concurrently from the same counter: delta-rs fails the later commit
  ("Concurrent transaction failed": a winning commit carries a transaction of the same app id),
  and the writer, reopening, sees the counter moved.

On a local disk a Delta commit is a put-if-absent by `link()` (delta-rs and direct_append.py);
on S3 delta-rs needs conditional put (`object_store.S3Location.storage_options`), so the same
holds there (tests/test_object_store.py races two processes on an S3 server).
"""

from __future__ import annotations

from deltalake import DeltaTable, Transaction


class WriterLost(RuntimeError):
    """Another writer committed to this table since this one read the counter."""


def fence_id(app_id_prefix: str) -> str:
    """The app id of the counter (one per table, whoever writes it)."""
    return f"{app_id_prefix}:writer"


def read(dt: DeltaTable, fence: str) -> int:
    return dt.transaction_version(fence) or 0


def next_transaction(dt: DeltaTable, fence: str, expected: int, table: str) -> Transaction:
    """The transaction the next append must carry, or WriterLost if `dt` already shows another
    writer's commit (a stale `dt` is caught by delta-rs at commit time instead)."""
    seen = read(dt, fence)
    if seen != expected:
        raise WriterLost(f"another writer committed to {table} (writer counter {seen}, this "
                         f"writer's view is as of {expected})")
    return Transaction(fence, expected + 1)
