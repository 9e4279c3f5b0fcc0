"""The cursor-sync control plane as data: the fold of `schema_sync` rows into `SyncState`.

Pure: rows in, state out. The owner (`delta_tables/sync_control.py`) applies each row it writes
with the same methods the loader replays at start, so memory and a rebuild agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from .query import sql
from .schema_sync import (OP_CREATE, OP_JOIN, OP_REGISTER, OP_REVOKE, OP_UNREGISTER,
                          SYNC_DEVICE_ACKS, SYNC_MEMBERS, SYNC_PUSH, SYNC_TABLES, S)


@dataclass
class SyncState:
    members: dict[bytes, set[bytes]] = field(default_factory=dict)   # group -> devices
    revoked: dict[bytes, set[bytes]] = field(default_factory=dict)   # group -> devices
    acked: dict[tuple[bytes, bytes], int] = field(default_factory=dict)  # (group, dev) -> cur
    push: dict[tuple[bytes, bytes], set[tuple[str, bytes]]] = field(default_factory=dict)
    # `at` (unix µs) of the row each entry rests on, when folded from stored rows (`at`
    # given): what `needed_at` names for compaction. The owner's live state passes none.
    rows_at: dict[tuple, int] = field(default_factory=dict, compare=False, repr=False)

    def __repr__(self) -> str:
        return f"SyncState(groups={len(self.members)}, registrations={len(self.push)})"

    def member_row(self, op: str, group: bytes, device: bytes, at: int | None = None) -> None:
        if op in (OP_CREATE, OP_JOIN):
            if device not in self.revoked.get(group, ()):
                mine = self.members.setdefault(group, set())
                if device not in mine and at is not None:
                    self.rows_at[(SYNC_MEMBERS.name, group, device)] = at
                mine.add(device)
        elif op == OP_REVOKE:
            if device not in self.revoked.get(group, ()) and at is not None:
                self.rows_at[(OP_REVOKE, group, device)] = at
            self.revoked.setdefault(group, set()).add(device)
            # setdefault: the same state whether or not compaction kept the admission row
            self.members.setdefault(group, set()).discard(device)
            self.acked.pop((group, device), None)
            self.rows_at.pop((SYNC_MEMBERS.name, group, device), None)
            self.rows_at.pop((SYNC_DEVICE_ACKS.name, group, device), None)

    def ack_row(self, group: bytes, device: bytes, cursor: int, at: int | None = None) -> None:
        key = (group, device)
        if cursor > self.acked.get(key, 0) and device in self.members.get(group, ()):
            self.acked[key] = cursor
            if at is not None:
                self.rows_at[(SYNC_DEVICE_ACKS.name, *key)] = at

    def push_row(self, op: str, group: bytes, device: bytes, platform: str,
                 token: bytes, at: int | None = None) -> None:
        key = (group, device)
        if op == OP_REGISTER:
            self.push.setdefault(key, set()).add((platform, token))
            if at is not None:
                self.rows_at[(SYNC_PUSH.name, group, device, platform, token)] = at
        elif op == OP_UNREGISTER:
            self.rows_at.pop((SYNC_PUSH.name, group, device, platform, token), None)
            mine = self.push.get(key)
            if mine is not None:
                mine.discard((platform, token))
                if not mine:
                    del self.push[key]

    # --- queries ---------------------------------------------------------------------------
    def exists(self, group: bytes) -> bool:
        """Somebody created it (even if every member was revoked since)."""
        return group in self.members or group in self.revoked

    def is_member(self, group: bytes, device: bytes) -> bool:
        return device in self.members.get(group, ())

    def is_revoked(self, group: bytes, device: bytes) -> bool:
        return device in self.revoked.get(group, ())

    def acked_cursor(self, group: bytes, device: bytes) -> int:
        return self.acked.get((group, device), 0)

    def needed_at(self) -> dict[str, set[int]]:
        """Per table, the `at` of every row this fold (of stored rows) rests on; compaction
        deletes the rest: admissions of revoked devices, superseded ack progress, acks of
        revoked devices, unregistered push registrations. Every revoke row stays: while it
        exists the group exists, so the device can neither re-create the group nor rejoin."""
        needed: dict[str, set[int]] = {name: set() for name in SYNC_TABLES}
        for key, at in self.rows_at.items():
            needed[SYNC_MEMBERS.name if key[0] == OP_REVOKE else key[0]].add(at)
        return needed


def _read(path: Path) -> pa.Table:
    return sql({"t": DeltaTable(str(path))}, f"SELECT * FROM t ORDER BY {S.AT}")


def _micros(t: pa.Table) -> list[int]:
    return pc.cast(t.column(S.AT), pa.int64()).to_pylist()


def apply(state: SyncState, found: dict[str, pa.Table]) -> None:
    """Fold rows (table name -> rows in `at` order; a table absent has none) into `state`."""
    if (t := found.get(SYNC_MEMBERS.name)) is not None:
        for row in zip(t.column(S.OP).to_pylist(), t.column(S.GROUP_ID).to_pylist(),
                       t.column(S.DEVICE_ID).to_pylist(), _micros(t)):
            state.member_row(*row)
    if (t := found.get(SYNC_DEVICE_ACKS.name)) is not None:
        for row in zip(t.column(S.GROUP_ID).to_pylist(), t.column(S.DEVICE_ID).to_pylist(),
                       t.column(S.CURSOR).to_pylist(), _micros(t)):
            state.ack_row(*row)
    if (t := found.get(SYNC_PUSH.name)) is not None:
        for row in zip(t.column(S.OP).to_pylist(), t.column(S.GROUP_ID).to_pylist(),
                       t.column(S.DEVICE_ID).to_pylist(), t.column(S.PLATFORM).to_pylist(),
                       t.column(S.TOKEN).to_pylist(), _micros(t)):
            state.push_row(*row)


def load_state(paths: dict[str, Path]) -> SyncState:
    state = SyncState()
    apply(state, {name: _read(paths[name]) for name in
                  (SYNC_MEMBERS.name, SYNC_DEVICE_ACKS.name, SYNC_PUSH.name)})
    return state


def table_paths(layout) -> dict[str, Path]:
    """`layout`: delta_tables.layout.Layout. Table name -> path under <data>/tables/."""
    return layout.table_paths(SYNC_TABLES)


def ensure_tables(layout) -> dict[str, Path]:
    """Create the sync control tables if missing (idempotent); returns their paths."""
    return layout.ensure_tables(SYNC_TABLES)

