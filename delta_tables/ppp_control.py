"""The PPP control plane's owner: delivery tokens and backups, in memory and durable in the
`schema_ppp` tables (write first, fsync'ed; apply to memory after the commit returned, with
the fold the loader uses, so a restart rebuilds what clients were told).

Changes are serialised by one lock (they are rare next to STOREs, which never take it), so
two registrations racing for the cap, or two backups racing for a version, cannot interleave.
Policy (caps, sizes) is applied here because it is read-modify-write under that lock. Never
logs a token, a pubkey or ciphertext.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import Any, Callable

import pyarrow as pa

from .group_commit import DeltaAppendTarget
from .layout import Layout
from .ppp_state import BackupMeta, PppState, ensure_tables, load_state, read_backup, ts
from .schema_ppp import (OP_DELETE, OP_DEREGISTER, OP_REGISTER, OP_STORE,
                                     PPP_BACKUPS, PPP_DELIVERY_TOKENS, PPP_TABLES, Q)
from engine.ppp.limits import MAX_DELIVERY_TOKENS_PER_RECIPIENT

log = logging.getLogger("relay.ingress.ppp")


def utc_micros() -> int:
    return int(datetime.now(timezone.utc).timestamp() * 1_000_000)


class PppControl:
    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros,
                 max_tokens: int = MAX_DELIVERY_TOKENS_PER_RECIPIENT):
        self.layout = layout
        self.fsync = fsync
        self.clock = clock
        self.max_tokens = max_tokens
        self.state = PppState()
        self._paths: dict = {}
        self._targets: dict[str, DeltaAppendTarget] = {}
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        self._paths = await asyncio.to_thread(ensure_tables, self.layout)
        self.state = await asyncio.to_thread(load_state, self._paths)
        self._targets = {name: DeltaAppendTarget(self._paths[name], tdef, fsync=self.fsync)
                         for name, tdef in PPP_TABLES.items()}
        log.info("ppp control plane loaded", extra={
            "event": "ppp_control_loaded", "delivery_tokens": len(self.state.tokens),
            "backups": len(self.state.backups)})

    def recipient_of(self, token: bytes) -> bytes | None:
        return self.state.recipient_of(token)

    def _next_at(self) -> int:
        at = max(self.clock(), self.state.last_at + 1)
        self.state.last_at = at
        return at

    async def _write(self, table: str, row: dict[str, Any]) -> None:
        target = self._targets[table]
        await asyncio.to_thread(target.commit, pa.Table.from_pylist([row], schema=target.schema))

    # --- delivery tokens (§6) ------------------------------------------------------------------
    async def register_token(self, recipient: bytes, token: bytes) -> str | None:
        """None when registered (idempotent), else the refusal reason."""
        async with self._lock:
            owner = self.state.recipient_of(token)
            if owner == recipient:
                return None
            if owner is not None:
                return "delivery token unavailable"
            if self.state.token_count(recipient) >= self.max_tokens:
                return "too many delivery tokens"
            at = self._next_at()
            await self._write(PPP_DELIVERY_TOKENS.name, {
                Q.TOKEN: token, Q.RECIPIENT: recipient, Q.OP: OP_REGISTER, Q.AT: ts(at)})
            self.state.token_row(OP_REGISTER, token, recipient, at)
            return None

    async def deregister_token(self, recipient: bytes, token: bytes) -> bool:
        """True if the caller's token was removed. Someone else's or an unknown token is left
        alone, and the caller gets the same reply either way (no probing for tokens)."""
        async with self._lock:
            if self.state.recipient_of(token) != recipient:
                return False
            at = self._next_at()
            await self._write(PPP_DELIVERY_TOKENS.name, {
                Q.TOKEN: token, Q.RECIPIENT: recipient, Q.OP: OP_DEREGISTER, Q.AT: ts(at)})
            self.state.token_row(OP_DEREGISTER, token, recipient, at)
            return True

    # --- backups (§6 "Backups") ----------------------------------------------------------------
    async def store_backup(self, pubkey: bytes, ciphertext: bytes) -> BackupMeta:
        async with self._lock:
            old = self.state.backups.get(pubkey)
            version = 1 if old is None else old.version + 1
            at = self._next_at()
            await self._write(PPP_BACKUPS.name, {
                Q.PUBKEY: pubkey, Q.OP: OP_STORE, Q.CIPHERTEXT: ciphertext, Q.VERSION: version,
                Q.AT: ts(at)})
            self.state.backup_row(OP_STORE, pubkey, version, at)
            return self.state.backups[pubkey]

    async def fetch_backup(self, pubkey: bytes) -> tuple[bytes, BackupMeta] | None:
        meta = self.state.backups.get(pubkey)
        if meta is None:
            return None
        ct = await asyncio.to_thread(read_backup, self._paths[PPP_BACKUPS.name], pubkey, meta.at)
        return None if ct is None else (ct, meta)

    async def delete_backup(self, pubkey: bytes) -> bool:
        async with self._lock:
            if pubkey not in self.state.backups:
                return False
            at = self._next_at()
            await self._write(PPP_BACKUPS.name, {
                Q.PUBKEY: pubkey, Q.OP: OP_DELETE, Q.CIPHERTEXT: None, Q.VERSION: 0,
                Q.AT: ts(at)})
            self.state.backup_row(OP_DELETE, pubkey, 0, at)
            return True
