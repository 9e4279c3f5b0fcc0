"""Compaction for Heya: what TRIM, DEAU and DALL promised, removed from Delta too.

Run by `jobs/compact.py` as its "heya" step (before the inbox's OPTIMIZE / VACUUM, which then
take the removed files off the disk after `vacuum_retention_seconds`):

1. inbox     Heya rows whose send token is no longer live (DEAU, DALL) are deleted, whole;
             rows of a live token at or below its TRIM point lose their body (a tombstone: the
             row keeps the token's next_seq until `expire` deletes it).
2. control   rows the folded control state no longer rests on (`HeyaState.needed_at`) are
             deleted: revoked send tokens, removed push tokens, superseded EXTD and TRIM rows,
             consumed inbox tokens, deregistered mailboxes. A mailbox's INCO row goes only
             once the inbox token it consumed is gone from `heya_inbox_tokens`, or the token
             would be usable again.
3. tables    OPTIMIZE, checkpoint, log cleanup and VACUUM of the five control tables.

Snapshot order makes step 1 safe against the ingress node writing meanwhile: the inbox is read
first, the control tables after. A send token is durable before any SEND on it is accepted,
so the token of every Heya row in that inbox snapshot is in the control snapshot, and a token
that is not live there has been revoked for good (tokens are never reused).

As everywhere in compaction (`compact_step.merge`), every MERGE joins on a column that is no
secret (the inbox's relay-wide `seq`, the control tables' `at`) and checks the token / owner
in its clauses, so no token or certificate digest is spelled into a predicate the Delta log
records.
"""

from __future__ import annotations

from typing import Callable

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from delta_tables.heya_state import HeyaState, load_state, read_table, table_paths
from delta_tables.layout import Layout
from delta_tables.query import sql
from delta_tables.schema import C
from delta_tables.schema_heya import (HEYA_INBOX_TOKENS, HEYA_MAILBOXES, HEYA_PUSH_TOKENS,
                                      HEYA_SEND_TOKENS, HEYA_TABLES, HEYA_TRIMS, H)
from engine.heya.ids import PROTOCOL

from .compact_step import (SAME_MAILBOX, CompactionReport, LostRace, S, T, delete_unneeded,
                           maintain, merge, retry)

_ACTION = "action"
_DELETE, _TRIM = "delete", "trim"
# Per control table, the columns that name what a row is about (checked in the MERGE clause).
_IDENTITY = {
    HEYA_INBOX_TOKENS.name: (H.TOKEN,),
    HEYA_MAILBOXES.name: (H.OWNER,),
    HEYA_SEND_TOKENS.name: (H.TOKEN,),
    HEYA_PUSH_TOKENS.name: (H.OWNER, H.DEVICE_TOKEN),
    HEYA_TRIMS.name: (H.TOKEN,),
}


def compact_heya(layout: Layout, report: CompactionReport, target_size: int,
                 retention_seconds: int) -> str:
    """One pass (a `compact_step.ProtocolStep`). Returns its progress detail (counts only)."""
    paths = table_paths(layout)
    # No control tables (Heya never ran here): no token is live; nothing else to do.
    have_tables = all((p / "_delta_log").exists() for p in paths.values())

    def guarded(name: str, fn: Callable[[], int]) -> int:
        try:
            return fn()
        except LostRace:
            report.skipped.append(f"heya/{name}")
            return 0

    # 1. inbox (inbox snapshot first, control after: see the module docstring)
    def inbox() -> tuple[int, int]:
        dt = DeltaTable(str(layout.inbox))
        rows = sql({"inbox": dt}, f"""
            SELECT {C.SEQ}, {C.PROTOCOL}, {C.MAILBOX}, {C.CURSOR},
                   {C.ENVELOPE} IS NULL AS tombstone
            FROM inbox WHERE {C.PROTOCOL} = '{PROTOCOL}'""")
        state = load_state(paths) if have_tables else HeyaState()
        actions = []
        for token, cursor, tombstone in zip(rows.column(C.MAILBOX).to_pylist(),
                                            rows.column(C.CURSOR).to_pylist(),
                                            rows.column("tombstone").to_pylist()):
            if token not in state.tokens:
                actions.append(_DELETE)
            elif cursor <= state.trimmed(token) and not tombstone:
                actions.append(_TRIM)
            else:
                actions.append(None)
        mask = pa.array([a is not None for a in actions], pa.bool_())
        source = rows.select([C.SEQ, C.PROTOCOL, C.MAILBOX]).append_column(
            _ACTION, pa.array(actions, pa.string())).filter(mask)
        if source.num_rows == 0:
            return 0, 0
        metrics = (merge(dt, source)
                   .when_matched_delete(f"{SAME_MAILBOX} AND {S}.{_ACTION} = "
                                        f"'{_DELETE}'")
                   .when_matched_update({C.ENVELOPE: "NULL"},
                                        f"{SAME_MAILBOX} AND {S}.{_ACTION} = '{_TRIM}'"
                                        f" AND {T}.{C.ENVELOPE} IS NOT NULL")
                   .execute())
        return int(metrics["num_target_rows_deleted"]), int(metrics["num_target_rows_updated"])

    deleted = trimmed = 0
    try:
        deleted, trimmed = retry(report, inbox)
    except LostRace:
        report.skipped.append("heya/inbox")
    report.heya_inbox_deleted += deleted
    report.heya_inbox_trimmed += trimmed
    if not have_tables:
        return f"{deleted} revoked-token rows deleted (no Heya control tables)"

    # 2. control tables
    def garbage(name: str, exclude: Callable[[pa.Table], pa.Array] | None = None) -> int:
        dt = DeltaTable(str(paths[name]))
        t = read_table(paths[name])
        needed = load_state(paths).needed_at()[name]
        if exclude is not None:
            t = t.filter(pc.invert(exclude(t)))
        return delete_unneeded(dt, t, needed, _IDENTITY[name], H.AT)

    removed = 0
    for name in (HEYA_SEND_TOKENS.name, HEYA_PUSH_TOKENS.name, HEYA_TRIMS.name,
                 HEYA_INBOX_TOKENS.name):
        removed += guarded(name, lambda name=name: retry(
            report, lambda: garbage(name)))

    def still_minted(t: pa.Table) -> pa.Array:
        minted = read_table(paths[HEYA_INBOX_TOKENS.name]).column(H.TOKEN).combine_chunks()
        return pc.fill_null(pc.is_in(t.column(H.INBOX_TOKEN), minted), False)

    removed += guarded(HEYA_MAILBOXES.name, lambda: retry(
        report, lambda: garbage(HEYA_MAILBOXES.name, still_minted)))

    # 3. the control tables' files and logs
    for name in HEYA_TABLES:
        maintain(paths[name], target_size, retention_seconds, report)

    report.heya_control_removed += removed
    return (f"{deleted} revoked-token rows deleted, {trimmed} trimmed bodies removed, "
            f"{removed} control rows removed")
