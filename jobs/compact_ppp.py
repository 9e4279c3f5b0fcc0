"""Compaction for PPP: the control tables keep only the rows the owner's fold rests on.

Run by `jobs/compact.py` as its "ppp" step. PPP events are inbox rows, purged by the generic
steps; what is PPP-only is two append-only control tables (`schema_ppp`), which grow with
every change: each STORE_BACKUP adds a row of up to 5 MiB. Here:

1. control   rows the folded state no longer rests on (`PppState.needed_at`) are deleted:
             register + deregister rows of deregistered delivery tokens, superseded backups,
             every backup row of a pubkey whose last change was a DELETE_BACKUP, and the
             delete rows. What stays folds back into the same state: each live token's
             register row, each pubkey's newest store after its last delete, whose `version`
             column is what the loader reads back (the next store is that + 1; no backup
             left means the next store is version 1, as without compaction).
2. tables    OPTIMIZE, checkpoint, log cleanup and VACUUM of both tables, so a superseded
             backup's ciphertext leaves the disk after `vacuum_retention_hours`.

Snapshot order makes step 1 safe against the owner writing meanwhile (a register,
deregister, store or delete is one append): the rows to judge are read first, the state is
folded after, from a snapshot at least as new. A row not needed by the newer state was
superseded for good (a later row re-registering a token or storing a backup is a new row with
a new `at`); a row the newer state needs is kept. Rows appended after the first read are
never in the MERGE source, so they are never touched.

As in `compact_heya.py`, the MERGE joins on `at` (no secret; strictly increasing per writer)
and checks the token / pubkey in its clause, so none is spelled into a predicate the Delta log
records. A MERGE that loses to the owner's append is recomputed on fresh handles
(`compact._retry`); the owner's `DeltaAppendTarget` retries its append on a fresh handle.
"""

from __future__ import annotations

from typing import Callable

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.ppp_state import load_state, table_paths
from delta_tables.query import sql
from delta_tables.schema_ppp import PPP_BACKUPS, PPP_DELIVERY_TOKENS, PPP_TABLES, Q

from . import compact

# Per table, the columns that name what a row is about (checked in the MERGE clause).
_IDENTITY = {
    PPP_DELIVERY_TOKENS.name: (Q.TOKEN, Q.RECIPIENT),
    PPP_BACKUPS.name: (Q.PUBKEY,),
}


def compact_ppp(layout: Layout, report, target_size: int, retention_hours: int) -> str:
    """One pass; `report` is the run's `compact.CompactionReport`. Returns its progress
    detail (counts only)."""
    paths = table_paths(layout)
    if not all((p / "_delta_log").exists() for p in paths.values()):
        return "no PPP control tables"

    def garbage(name: str) -> int:
        dt = DeltaTable(str(paths[name]))
        # The candidates, from dt's own snapshot (never the ciphertext: at + identity only),
        # then the state from a snapshot at least as new.
        t = sql({"t": dt}, f"SELECT {', '.join((Q.AT, *_IDENTITY[name]))} FROM t")
        if t.num_rows == 0:
            return 0
        return compact.delete_unneeded(dt, t, load_state(paths).needed_at()[name],
                                       _IDENTITY[name], Q.AT)

    def guarded(name: str, fn: Callable[[], int]) -> int:
        try:
            return compact._retry(report, fn)
        except compact._LostRace:
            report.skipped.append(f"ppp/{name}")
            return 0

    tokens = guarded(PPP_DELIVERY_TOKENS.name, lambda: garbage(PPP_DELIVERY_TOKENS.name))
    backups = guarded(PPP_BACKUPS.name, lambda: garbage(PPP_BACKUPS.name))

    for name in PPP_TABLES:
        compact._maintain(paths[name], target_size, retention_hours, report)

    report.ppp_control_removed += tokens + backups
    return f"{tokens} delivery-token rows and {backups} backup rows removed"
