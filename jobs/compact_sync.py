"""Compaction for cursor-sync: the control tables keep only the rows the owner's fold rests on.

Run by `jobs/compact.py` as its "sync" step. Blobs are inbox rows, purged by the generic
steps (a DELETE is an ack); what is sync-only is three append-only control tables
(`schema_sync`). `sync_device_acks` gains a row every time a device's progress moves (each
PULL or Ack), so without this it grows without bound. Here:

1. control   rows the folded state no longer rests on (`SyncState.needed_at`) are deleted:
             every ack row but the one that set each current member's progress, and all ack
             rows of revoked devices; admission rows (create / join) of revoked devices;
             register + unregister rows of unregistered push registrations. Revoke rows are
             kept forever: a group with a revoke row still exists, so the revoked device can
             neither re-create it nor rejoin with an old admission, and the fold still says
             revoked. What stays folds back into the same `SyncState`.
2. tables    OPTIMIZE, checkpoint, log cleanup and VACUUM of the three tables.

Snapshot order makes step 1 safe against the owner writing meanwhile: each table's
candidate rows are read first, the state is folded after, from snapshots at least as new (a
row not needed by a newer state is superseded for good: a device revoked stays revoked,
progress never goes back, a re-registration is a new row). `sync_device_acks` is read before
the members are (inside `load_state`): a device's acks are written only after its admission
is durable, so every device whose acks are judged is a member in the state that judges them.
Rows appended after the first read are never in the MERGE source.

As in `compact_heya.py`, the MERGE joins on `at` (no secret) and checks the group / device
(and push token) in its clause, so no id or token is spelled into a predicate the Delta log
records. A MERGE that loses to an append is recomputed on fresh handles (`compact_step.retry`);
the owner's `DeltaAppendTarget`s (members, push, and the acks' group commit) retry their
append on a fresh handle.
"""

from __future__ import annotations

from delta_tables.layout import Layout
from delta_tables.schema_sync import SYNC_DEVICE_ACKS, SYNC_MEMBERS, SYNC_PUSH, S
from delta_tables.sync_state import load_state, table_paths

from .compact_step import CompactionReport, prune_control_tables

# Per control table, in the order judged, the columns that name what a row is about (checked
# in the MERGE clause).
_IDENTITY = {
    SYNC_DEVICE_ACKS.name: (S.GROUP_ID, S.DEVICE_ID),
    SYNC_MEMBERS.name: (S.GROUP_ID, S.DEVICE_ID),
    SYNC_PUSH.name: (S.GROUP_ID, S.DEVICE_ID, S.TOKEN),
}


def compact_sync(layout: Layout, report: CompactionReport, target_size: int,
                 retention_seconds: int) -> str:
    """One pass (a `compact_step.ProtocolStep`). Returns its progress detail (counts only)."""
    paths = table_paths(layout)
    counts = prune_control_tables("sync", paths, _IDENTITY, S.AT,
                                  lambda: load_state(paths).needed_at(), report,
                                  target_size, retention_seconds)
    if counts is None:
        return "no sync control tables"
    report.sync_control_removed += sum(counts.values())
    return (f"{counts[SYNC_DEVICE_ACKS.name]} ack-progress rows, "
            f"{counts[SYNC_MEMBERS.name]} membership rows and "
            f"{counts[SYNC_PUSH.name]} push rows removed")
