"""The Heya control plane as data: the fold of the control tables (`schema_heya.py`).

Pure: rows in, a `HeyaState` out. The owner (`heya_control.py`, in the ingress process) applies
each row it writes with the same methods the loader replays at start, so its memory and a
rebuild after a restart agree by construction. Compaction (`jobs/compact_heya.py`) folds the
same way and deletes every row the current state no longer needs (`needed_at`).

Rows of one table are applied in `at` order (strictly increasing in commit order, across
hosts: `control.py`).
Tables are applied in this order: mailboxes (which inbox tokens are consumed), inbox tokens,
send tokens, push tokens, trims (a trim of a revoked token is ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from .query import sql
from .schema_heya import (HEYA_INBOX_TOKENS, HEYA_MAILBOXES, HEYA_PUSH_TOKENS, HEYA_SEND_TOKENS,
                          HEYA_TABLES,
                          HEYA_TRIMS, OP_AUTH, OP_DALL, OP_DEAU, OP_EXTD, OP_INCO, OP_IOSA,
                          OP_IOSD, OP_DALL_MARK, H)


@dataclass
class SendToken:
    token: bytes
    owner: bytes
    start: int          # unix seconds
    end: int
    auth_at: int        # µs: `at` of its AUTH row
    extd_at: int | None = None   # µs: `at` of its latest EXTD row

    def valid_at(self, unix: float) -> bool:
        return self.start <= unix <= self.end

    def __repr__(self) -> str:   # a send token is a bearer credential: never shown
        return f"SendToken(start={self.start}, end={self.end})"


@dataclass
class HeyaState:
    minted: dict[bytes, int] = field(default_factory=dict)       # unused inbox token -> at
    used: set[bytes] = field(default_factory=set)                # consumed inbox tokens
    mailboxes: dict[bytes, int] = field(default_factory=dict)    # owner -> at of its INCO
    tokens: dict[bytes, SendToken] = field(default_factory=dict)
    owned: dict[bytes, set[bytes]] = field(default_factory=dict)  # owner -> send tokens
    push: dict[bytes, dict[str, int]] = field(default_factory=dict)  # owner -> device -> at
    trims: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # token -> (up_to, at)
    dalls: dict[bytes, int] = field(default_factory=dict)   # owner -> at of its last DALL mark
    last_at: int = 0

    def __repr__(self) -> str:
        return (f"HeyaState(mailboxes={len(self.mailboxes)}, tokens={len(self.tokens)}, "
                f"unused_inbox_tokens={len(self.minted)})")

    # --- one row each ----------------------------------------------------------------------
    def _seen(self, at: int) -> None:
        self.last_at = max(self.last_at, at)

    def mint(self, token: bytes, at: int) -> None:
        self._seen(at)
        if token not in self.used:
            self.minted[token] = at

    def mailbox_row(self, op: str, owner: bytes, inbox_token: bytes | None, at: int) -> None:
        self._seen(at)
        if op == OP_INCO:
            self.mailboxes[owner] = at
            if inbox_token is not None:
                self.used.add(inbox_token)
                self.minted.pop(inbox_token, None)
        elif op == OP_DALL:
            self.mailboxes.pop(owner, None)

    def send_token_row(self, op: str, token: bytes, owner: bytes, start: int, end: int,
                       at: int) -> None:
        self._seen(at)
        if op == OP_DALL_MARK:
            self.dalls[owner] = max(at, self.dalls.get(owner, 0))
            return
        if op == OP_AUTH:
            self.tokens[token] = SendToken(token, owner, start, end, at)
            self.owned.setdefault(owner, set()).add(token)
            return
        tok = self.tokens.get(token)
        if tok is None:
            return
        if op == OP_EXTD:
            tok.end, tok.extd_at = end, at
        elif op == OP_DEAU:
            del self.tokens[token]
            self.trims.pop(token, None)
            mine = self.owned.get(tok.owner)
            if mine is not None:
                mine.discard(token)
                if not mine:
                    del self.owned[tok.owner]

    def push_row(self, op: str, owner: bytes, device: str, at: int) -> None:
        self._seen(at)
        if op == OP_IOSA:
            self.push.setdefault(owner, {}).setdefault(device, at)
        elif op == OP_IOSD:
            mine = self.push.get(owner)
            if mine is not None:
                mine.pop(device, None)
                if not mine:
                    del self.push[owner]

    def trim_row(self, token: bytes, up_to: int, at: int) -> None:
        self._seen(at)
        if token in self.tokens and up_to > self.trimmed(token):
            self.trims[token] = (up_to, at)

    # --- queries ---------------------------------------------------------------------------
    def open_mailbox(self, owner: bytes) -> bool:
        """A mailbox with no DALL under way (one marked after its INCO): AUTH and IOSA may
        add to it."""
        registered = self.mailboxes.get(owner)
        return registered is not None and self.dalls.get(owner, 0) < registered

    def tokens_of(self, owner: bytes) -> list[SendToken]:
        """In the order LIST and LAST use: start, end, token (interop §2, §3 LIST)."""
        return sorted((self.tokens[t] for t in self.owned.get(owner, ())),
                      key=lambda t: (t.start, t.end, t.token))

    def trimmed(self, token: bytes) -> int:
        """Highest trimmed seq of the token (inclusive), -1 if none."""
        entry = self.trims.get(token)
        return -1 if entry is None else entry[0]

    def push_tokens(self, owner: bytes) -> list[tuple[str, int]]:
        """(device token, registered at µs), ordered by registration then token (IOSL)."""
        return sorted(self.push.get(owner, {}).items(), key=lambda kv: (kv[1], kv[0]))

    def needed_at(self) -> dict[str, set[int]]:
        """Per table, the `at` of every row the current state rests on; compaction deletes
        the others (DEAU'd and DALL'd tokens, removed push tokens, consumed inbox tokens,
        superseded trims and EXTDs, the rows of deregistered mailboxes)."""
        # a DALL mark is needed while its DALL is under way (the mailbox still there)
        send = {at for owner, at in self.dalls.items()
                if owner in self.mailboxes and at > self.mailboxes[owner]}
        for tok in self.tokens.values():
            send.add(tok.auth_at)
            if tok.extd_at is not None:
                send.add(tok.extd_at)
        return {
            HEYA_INBOX_TOKENS.name: set(self.minted.values()),
            HEYA_MAILBOXES.name: set(self.mailboxes.values()),
            HEYA_SEND_TOKENS.name: send,
            HEYA_PUSH_TOKENS.name: {at for devices in self.push.values()
                                    for at in devices.values()},
            HEYA_TRIMS.name: {at for _, at in self.trims.values()},
        }


# --- loading -------------------------------------------------------------------------------------

def micros(col) -> list[int]:
    return pc.cast(col, pa.int64()).to_pylist()


def read_table(path: Path) -> pa.Table:
    """Every row, sorted by `at`."""
    return sql({"t": DeltaTable(str(path))}, f"SELECT * FROM t ORDER BY {H.AT}")


def apply_inbox_tokens(state: HeyaState, t: pa.Table) -> None:
    for token, at in zip(t.column(H.TOKEN).to_pylist(), micros(t.column(H.AT))):
        state.mint(token, at)


def apply_mailboxes(state: HeyaState, t: pa.Table) -> None:
    for op, owner, inbox_token, at in zip(
            t.column(H.OP).to_pylist(), t.column(H.OWNER).to_pylist(),
            t.column(H.INBOX_TOKEN).to_pylist(), micros(t.column(H.AT))):
        state.mailbox_row(op, owner, inbox_token, at)


def apply_send_tokens(state: HeyaState, t: pa.Table) -> None:
    for row in zip(t.column(H.OP).to_pylist(), t.column(H.TOKEN).to_pylist(),
                   t.column(H.OWNER).to_pylist(), t.column(H.START_TIME).to_pylist(),
                   t.column(H.END_TIME).to_pylist(), micros(t.column(H.AT))):
        state.send_token_row(*row)


def apply_push_tokens(state: HeyaState, t: pa.Table) -> None:
    for op, owner, device, at in zip(t.column(H.OP).to_pylist(), t.column(H.OWNER).to_pylist(),
                                     t.column(H.DEVICE_TOKEN).to_pylist(),
                                     micros(t.column(H.AT))):
        state.push_row(op, owner, device.decode("ascii"), at)


def apply_trims(state: HeyaState, t: pa.Table) -> None:
    for row in zip(t.column(H.TOKEN).to_pylist(), t.column(H.UP_TO_SEQ).to_pylist(),
                   micros(t.column(H.AT))):
        state.trim_row(*row)


# Per table, in the order the fold applies them (the owner catches up in the same order).
APPLY = {HEYA_MAILBOXES.name: apply_mailboxes, HEYA_INBOX_TOKENS.name: apply_inbox_tokens,
         HEYA_SEND_TOKENS.name: apply_send_tokens, HEYA_PUSH_TOKENS.name: apply_push_tokens,
         HEYA_TRIMS.name: apply_trims}


def load_state(tables: dict[str, Path]) -> HeyaState:
    """`tables`: table name -> path, for the five tables of `schema_heya`."""
    state = HeyaState()
    for name, apply in APPLY.items():
        apply(state, read_table(tables[name]))
    return state


def table_paths(layout) -> dict[str, Path]:
    """`layout`: delta_tables.layout.Layout. Table name -> path under <data>/tables/."""
    return layout.table_paths(HEYA_TABLES)


def ensure_tables(layout) -> dict[str, Path]:
    """Create the five control tables if missing (idempotent); returns their paths."""
    return layout.ensure_tables(HEYA_TABLES)
