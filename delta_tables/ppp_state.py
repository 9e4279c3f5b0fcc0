"""The PPP control plane as data: the fold of `schema_ppp` tables.

Pure: rows in, a `PppState` out. Each host serving PPP (`delta_tables/ppp_control.py`) applies
each row it writes, and those other hosts wrote (`apply`), with the methods the loader replays
at start, so memory and a rebuild after a
restart agree by construction. Backup ciphertext is not held: the state keeps each backup's
version and `at`, and a FETCH_BACKUP reads that one row (`read_backup`). Rooms and their
member tokens are folded by `room_state.RoomState` (`PppState.rooms`), carry groups by
`engine/ppp/carry.CarryGroups` (`PppState.carry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import DeltaTable

from engine.ppp.carry import CarryGroups, Definition
from engine.ppp.rooms import Room

from .discovery_state import DiscoveryState
from .query import sql
from .room_state import RoomState
from .schema_ppp import (OP_DELETE, OP_DEREGISTER, OP_REGISTER, OP_STORE, PPP_BACKUPS,
                         PPP_CARRY_GROUPS, PPP_DELIVERY_TOKENS, PPP_DISCOVERY, PPP_PUSH_TOKENS,
                         PPP_ROOM_TOKENS, PPP_ROOMS, PPP_TABLES, Q)


@dataclass(frozen=True)
class BackupMeta:
    version: int
    at: int          # unix µs; stored_at (seconds) is at // 1e6

    @property
    def stored_at(self) -> int:
        return self.at // 1_000_000


@dataclass
class PppState:
    tokens: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)  # token -> (recipient, at)
    by_recipient: dict[bytes, set[bytes]] = field(default_factory=dict)
    backups: dict[bytes, BackupMeta] = field(default_factory=dict)
    rooms: RoomState = field(default_factory=RoomState)
    discovery: DiscoveryState = field(default_factory=DiscoveryState)
    # pubkey -> {(platform, token): at}: REGISTER_PUSH, keyed (pubkey, token) (spec 004)
    push: dict[bytes, dict[tuple[str, bytes], int]] = field(default_factory=dict)
    carry: CarryGroups = field(default_factory=CarryGroups)
    last_at: int = 0

    def __repr__(self) -> str:
        return (f"PppState(delivery_tokens={len(self.tokens)}, backups={len(self.backups)}, "
                f"rooms={len(self.rooms.rooms)})")

    def _seen(self, at: int) -> None:
        self.last_at = max(self.last_at, at)

    def token_row(self, op: str, token: bytes, recipient: bytes, at: int) -> None:
        self._seen(at)
        if op == OP_REGISTER:
            old = self.tokens.get(token)
            if old is not None and old[0] != recipient:
                return   # the owner never writes this; a token routes to its first recipient
            self.tokens[token] = (recipient, at)
            self.by_recipient.setdefault(recipient, set()).add(token)
        elif op == OP_DEREGISTER:
            old = self.tokens.get(token)
            if old is None or old[0] != recipient:
                return
            del self.tokens[token]
            mine = self.by_recipient[recipient]
            mine.discard(token)
            if not mine:
                del self.by_recipient[recipient]

    def push_row(self, op: str, pubkey: bytes, platform: str, token: bytes, at: int) -> None:
        """A token is keyed by (pubkey, token): registering it again with another platform
        replaces the platform."""
        self._seen(at)
        mine = self.push.setdefault(pubkey, {})
        for key in [k for k in mine if k[1] == token]:
            del mine[key]
        if op == OP_REGISTER:
            mine[(platform, token)] = at
        if not mine:
            del self.push[pubkey]

    def push_tokens(self, pubkey: bytes) -> list[tuple[str, bytes]]:
        return sorted(self.push.get(pubkey, {}))

    def carry_row(self, op: str, group_id: bytes, signer: bytes, members: bytes | None,
                  couriers: bytes | None, at: int) -> None:
        self._seen(at)
        d = None if members is None else Definition.unpack(members, couriers or b"")
        self.carry.apply(op, signer, group_id, d, at)

    def backup_row(self, op: str, pubkey: bytes, version: int, at: int) -> None:
        self._seen(at)
        if op == OP_STORE:
            self.backups[pubkey] = BackupMeta(version, at)
        elif op == OP_DELETE:
            self.backups.pop(pubkey, None)

    # --- queries -------------------------------------------------------------------------------
    def recipient_of(self, token: bytes) -> bytes | None:
        entry = self.tokens.get(token)
        return None if entry is None else entry[0]

    def token_count(self, recipient: bytes) -> int:
        return len(self.by_recipient.get(recipient, ()))

    def room_row(self, op: str, room: Room, at: int) -> None:
        self._seen(at)
        self.rooms.room_row(op, room, at)

    def room_token_row(self, op: str, room_id: bytes, token: bytes | None,
                       grace_until: int | None, at: int) -> None:
        self._seen(at)
        self.rooms.token_row(op, room_id, token, grace_until, at)

    def discovery_row(self, op: str, pubkey: bytes, hash_: bytes | None, pepper_id: int,
                      at: int) -> None:
        self._seen(at)
        self.discovery.row(op, pubkey, hash_, pepper_id, at)

    def needed_at(self, now: float | None = None) -> dict[str, set[int]]:
        """Per table, the `at` of every row the state rests on; a compaction may delete the
        rest (deregistered tokens, superseded and deleted backups, expired rooms, discovery
        sets of past peppers)."""
        import time
        return {PPP_DELIVERY_TOKENS.name: {at for _, at in self.tokens.values()},
                PPP_PUSH_TOKENS.name: {at for mine in self.push.values() for at in mine.values()},
                PPP_BACKUPS.name: {b.at for b in self.backups.values()},
                PPP_CARRY_GROUPS.name: self.carry.needed_at(),
                **self.rooms.needed_at(time.time() if now is None else now),
                **self.discovery.needed_at()}


def micros(col) -> list[int]:
    return pc.cast(col, pa.int64()).to_pylist()


def ts(at: int) -> datetime:
    return datetime.fromtimestamp(at / 1_000_000, timezone.utc)


def _read(tables: dict[str, Path], tdef, query: str) -> pa.Table:
    """`query` over table `t`; a table not created yet (a data directory from before it
    existed, or one no PPP listener has opened) reads as empty."""
    path = tables[tdef.name]
    if not (path / "_delta_log").exists():
        return tdef.arrow_schema().empty_table()
    return sql({"t": DeltaTable(str(path))}, query)


# What the fold reads of each table, in fold order (backup ciphertext stays on disk until a
# FETCH_BACKUP asks for it).
COLUMNS = {
    PPP_DELIVERY_TOKENS.name: f"{Q.OP}, {Q.TOKEN}, {Q.RECIPIENT}, {Q.AT}",
    PPP_BACKUPS.name: f"{Q.OP}, {Q.PUBKEY}, {Q.VERSION}, {Q.AT}",
    PPP_ROOMS.name: "*",
    PPP_ROOM_TOKENS.name: f"{Q.OP}, {Q.ROOM_ID}, {Q.TOKEN}, {Q.GRACE_UNTIL}, {Q.AT}",
    PPP_DISCOVERY.name: f"{Q.OP}, {Q.PUBKEY}, {Q.HASH}, {Q.PEPPER_ID}, {Q.AT}",
    PPP_PUSH_TOKENS.name: f"{Q.OP}, {Q.PUBKEY}, {Q.PLATFORM}, {Q.TOKEN}, {Q.AT}",
    PPP_CARRY_GROUPS.name: f"{Q.OP}, {Q.GROUP_ID}, {Q.PUBKEY}, {Q.MEMBERS}, {Q.COURIERS}, {Q.AT}",
}


def load_state(tables: dict[str, Path]) -> PppState:
    state = PppState()
    apply(state, {name: _read(tables, PPP_TABLES[name],
                              f"SELECT {cols} FROM t ORDER BY {Q.AT}")
                  for name, cols in COLUMNS.items()})
    return state


def apply(state: PppState, found: dict[str, pa.Table]) -> None:
    """Fold rows (table name -> rows in `at` order, `COLUMNS`; a table absent has none)."""
    if (t := found.get(PPP_DELIVERY_TOKENS.name)) is not None:
        for op, token, recipient, at in zip(
                t.column(Q.OP).to_pylist(), t.column(Q.TOKEN).to_pylist(),
                t.column(Q.RECIPIENT).to_pylist(), micros(t.column(Q.AT))):
            state.token_row(op, token, recipient, at)
    if (t := found.get(PPP_BACKUPS.name)) is not None:
        for op, pubkey, version, at in zip(
                t.column(Q.OP).to_pylist(), t.column(Q.PUBKEY).to_pylist(),
                t.column(Q.VERSION).to_pylist(), micros(t.column(Q.AT))):
            state.backup_row(op, pubkey, version, at)
    _apply_rooms(state, found.get(PPP_ROOMS.name), found.get(PPP_ROOM_TOKENS.name))
    if (t := found.get(PPP_DISCOVERY.name)) is not None:
        for op, pk, h, pid, at in zip(t.column(Q.OP).to_pylist(), t.column(Q.PUBKEY).to_pylist(),
                                      t.column(Q.HASH).to_pylist(),
                                      t.column(Q.PEPPER_ID).to_pylist(), micros(t.column(Q.AT))):
            state.discovery_row(op, pk, h, pid, at)
    if (t := found.get(PPP_PUSH_TOKENS.name)) is not None:
        for op, pk, platform, token, at in zip(
                t.column(Q.OP).to_pylist(), t.column(Q.PUBKEY).to_pylist(),
                t.column(Q.PLATFORM).to_pylist(), t.column(Q.TOKEN).to_pylist(),
                micros(t.column(Q.AT))):
            state.push_row(op, pk, platform, token, at)
    if (t := found.get(PPP_CARRY_GROUPS.name)) is not None:
        for row in zip(t.column(Q.OP).to_pylist(), t.column(Q.GROUP_ID).to_pylist(),
                       t.column(Q.PUBKEY).to_pylist(), t.column(Q.MEMBERS).to_pylist(),
                       t.column(Q.COURIERS).to_pylist(), micros(t.column(Q.AT))):
            state.carry_row(*row)


def _secs(col) -> list[int]:
    return [m // 1_000_000 for m in micros(col)]


def _apply_rooms(state: PppState, r: pa.Table | None, t: pa.Table | None) -> None:
    """Room and token rows replayed in one `at` order (a token row is about the room
    incarnation current when it was written)."""
    rows: list[tuple[int, int, tuple]] = []
    if r is not None:
        cols = {c: r.column(c).to_pylist() for c in r.column_names
                if c not in (Q.CREATED_AT, Q.EXPIRES_AT, Q.AT)}
        for i, (created, expires, at) in enumerate(zip(
                _secs(r.column(Q.CREATED_AT)), _secs(r.column(Q.EXPIRES_AT)),
                micros(r.column(Q.AT)))):
            room = Room(cols[Q.ROOM_ID][i], cols[Q.ADMIN][i], cols[Q.ROOM_TYPE][i],
                        cols[Q.S2_CELL][i], cols[Q.S2_COARSE][i], cols[Q.GATED][i],
                        cols[Q.PROXIMITY][i], cols[Q.BLE][i], cols[Q.MAX_MEMBERS][i], created,
                        expires)
            rows.append((at, 0, (cols[Q.OP][i], room)))
    if t is not None:
        for op, room_id, token, g, at in zip(t.column(Q.OP).to_pylist(),
                                             t.column(Q.ROOM_ID).to_pylist(),
                                             t.column(Q.TOKEN).to_pylist(),
                                             micros(t.column(Q.GRACE_UNTIL)),   # nulls: None
                                             micros(t.column(Q.AT))):
            rows.append((at, 1, (op, room_id, token, g)))
    rows.sort(key=lambda x: (x[0], x[1]))
    for at, kind, args in rows:
        if kind == 0:
            state.room_row(*args, at)
        else:
            state.room_token_row(*args, at)


def read_backup(path: Path, pubkey: bytes, at: int) -> bytes | None:
    """The ciphertext of the backup row written at `at` (and owned by `pubkey`)."""
    t = DeltaTable(str(path)).to_pyarrow_dataset().to_table(
        columns=[Q.PUBKEY, Q.CIPHERTEXT],
        filter=ds.field(Q.AT) == pa.scalar(ts(at), pa.timestamp("us", tz="UTC")),
        use_threads=False)
    for pk, ct in zip(t.column(Q.PUBKEY).to_pylist(), t.column(Q.CIPHERTEXT).to_pylist()):
        if pk == pubkey and ct is not None:
            return ct
    return None


def table_paths(layout) -> dict[str, Path]:
    """`layout`: delta_tables.layout.Layout. Table name -> path under <data>/tables/."""
    return layout.table_paths(PPP_TABLES)


def ensure_tables(layout) -> dict[str, Path]:
    """Create the PPP control tables if missing (idempotent); returns their paths."""
    return layout.ensure_tables(PPP_TABLES)
