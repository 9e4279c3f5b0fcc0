"""Compaction for PPP: the control tables keep only the rows the owner's fold rests on.

Run by `jobs/compact.py` as its "ppp" step. PPP events are inbox rows, purged by the generic
steps; what is PPP-only is two append-only control tables (`schema_ppp`), which grow with
every change: each STORE_BACKUP adds a row of up to 5 MiB; rooms and their member tokens
add two more (`room_state.py`: an expired room's rows are not needed, so they are purged
here, §7.1). Here:

1. control   rows the folded state no longer rests on (`PppState.needed_at`) are deleted:
             register + deregister rows of deregistered delivery tokens, superseded backups,
             every backup row of a pubkey whose last change was a DELETE_BACKUP, and the
             delete rows. What stays folds back into the same state: each live token's
             register row, each pubkey's newest store after its last delete, whose `version`
             column is what the loader reads back (the next store is that + 1; no backup
             left means the next store is version 1, as without compaction), and the quota
             hits older than the longest quota window (`limits.LONGEST_QUOTA_SECS`, an
             hour): no count reads them any more.
2. tables    OPTIMIZE, checkpoint, log cleanup and VACUUM of the tables, so a superseded
             backup's ciphertext leaves the disk after `vacuum_retention_seconds`.
3. groups    the inbox rows of deleted groups (DELETE_GROUP) lose their envelope (the
             stream's tombstones, purged by the expire step when they expire): the
             group's delete row already made them unreachable, this frees their bytes.

Snapshot order makes step 1 safe against the owner writing meanwhile (a register,
deregister, store or delete is one append): the rows to judge are read first, the state is
folded after, from a snapshot at least as new. A row not needed by the newer state was
superseded for good (a later row re-registering a token or storing a backup is a new row with
a new `at`); a row the newer state needs is kept. Rows appended after the first read are
never in the MERGE source, so they are never touched.

As in `compact_heya.py`, the MERGE joins on `at` (no secret; strictly increasing per writer)
and checks the token / pubkey in its clause, so none is spelled into a predicate the Delta log
records. A MERGE that loses to the owner's append is recomputed on fresh handles
(`compact_step.retry`); the owner's `DeltaAppendTarget` retries its append on a fresh handle.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from delta_tables.layout import Layout, equals
from delta_tables.schema import C
from engine.ppp.rooms import ROOM_PROTOCOL
from delta_tables.ppp_state import load_state, table_paths
from delta_tables.schema_ppp import (PPP_BACKUPS, PPP_BUDGET_HITS, PPP_CARRY_GROUPS,
                                    PPP_DELIVERY_TOKENS, PPP_DISCOVERY, PPP_PUSH_TOKENS,
                                    PPP_ROOM_TOKENS, PPP_ROOMS, Q)

from .compact_step import SAME_MAILBOX, T, CompactionReport, merge, prune_control_tables, retry

# Per table, in the order judged, the columns that name what a row is about (checked in the
# MERGE clause).
_IDENTITY = {
    PPP_DELIVERY_TOKENS.name: (Q.TOKEN, Q.RECIPIENT),
    PPP_BACKUPS.name: (Q.PUBKEY,),
    PPP_ROOMS.name: (Q.ROOM_ID,),
    PPP_ROOM_TOKENS.name: (Q.ROOM_ID,),
    PPP_DISCOVERY.name: (Q.PUBKEY,),
    PPP_PUSH_TOKENS.name: (Q.PUBKEY, Q.TOKEN),
    PPP_CARRY_GROUPS.name: (Q.GROUP_ID, Q.PUBKEY),
    PPP_BUDGET_HITS.name: (Q.PUBKEY_HASH, Q.CMD),
}


def compact_ppp(layout: Layout, report: CompactionReport, target_size: int,
                retention_seconds: int) -> str:
    """One pass (a `compact_step.ProtocolStep`). Returns its progress detail (counts only)."""
    paths = table_paths(layout)
    removed = prune_control_tables("ppp", paths, _IDENTITY, Q.AT,
                                   lambda: load_state(paths).needed_at(), report,
                                   target_size, retention_seconds)
    if removed is None:
        return "no PPP control tables"
    tokens, backups = removed[PPP_DELIVERY_TOKENS.name], removed[PPP_BACKUPS.name]
    rooms = removed[PPP_ROOMS.name] + removed[PPP_ROOM_TOKENS.name] \
        + removed[PPP_DISCOVERY.name]
    push = removed[PPP_PUSH_TOKENS.name]
    carry = removed[PPP_CARRY_GROUPS.name]
    hits = removed[PPP_BUDGET_HITS.name]
    report.ppp_control_removed += tokens + backups + rooms + push + carry + hits
    deleted = set(load_state(paths).rooms.deleted)
    emptied = retry(report, lambda: _empty_deleted_groups(layout, deleted)) if deleted else 0
    return (f"{tokens} delivery-token rows, {backups} backup rows, {rooms} room and "
            f"discovery rows, {push} push-token rows, {carry} carry-group rows and {hits} "
            f"quota hits removed, "
            f"{emptied} messages of deleted groups emptied")


def _empty_deleted_groups(layout: Layout, deleted: set[bytes]) -> int:
    inbox = DeltaTable(str(layout.inbox))
    t = inbox.to_pyarrow_dataset().to_table(
        columns=[C.SEQ, C.PROTOCOL, C.MAILBOX],
        filter=equals(C.PROTOCOL, ROOM_PROTOCOL) & ds.field(C.ENVELOPE).is_valid())
    # plain types: files delta-rs rewrote hold *_view columns (`layout.equals`)
    t = t.cast(pa.schema([(C.SEQ, pa.int64()), (C.PROTOCOL, pa.string()),
                          (C.MAILBOX, pa.binary())]))
    t = t.filter(pc.is_in(t.column(C.MAILBOX), pa.array(sorted(deleted), pa.binary())))
    if t.num_rows == 0:
        return 0
    metrics = (merge(inbox, t)
               .when_matched_update({C.ENVELOPE: "NULL"},
                                    f"{SAME_MAILBOX} AND {T}.{C.ENVELOPE} IS NOT NULL")
               .execute())
    return int(metrics["num_target_rows_updated"])
