"""The PPP control plane's owner: delivery tokens and backups, in memory and durable in the
`schema_ppp` tables: a `ControlTables` (`control.py`: write first, apply to memory after the
commit returned, with the fold the loader uses, so a restart rebuilds what clients were told).

Changes are serialised by its lock (they are rare next to STOREs, which never take it), so
two registrations racing for the cap, or two backups racing for a version, cannot interleave.
Policy (caps, sizes) is applied here because it is read-modify-write under that lock. Never
logs a token, a pubkey or ciphertext.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from engine.ppp.limits import MAX_DELIVERY_TOKENS_PER_RECIPIENT

from .control import ControlTables, utc_micros
from .layout import Layout
from .ppp_state import BackupMeta, PppState, load_state, read_backup, ts
from .schema_ppp import (OP_DELETE, OP_DEREGISTER, OP_REGISTER, OP_STORE, PPP_BACKUPS,
                         PPP_DELIVERY_TOKENS, PPP_TABLES, Q)

log = logging.getLogger("relay.ingress.ppp")


class PppControl(ControlTables):
    tables = PPP_TABLES

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros,
                 max_tokens: int = MAX_DELIVERY_TOKENS_PER_RECIPIENT):
        super().__init__(layout, fsync=fsync, clock=clock)
        self.max_tokens = max_tokens
        self.state = PppState()

    async def load(self) -> None:
        paths = await self.open()
        self.state = await asyncio.to_thread(load_state, paths)
        log.info("ppp control plane loaded", extra={
            "event": "ppp_control_loaded", "delivery_tokens": len(self.state.tokens),
            "backups": len(self.state.backups)})

    def recipient_of(self, token: bytes) -> bytes | None:
        return self.state.recipient_of(token)

    # --- delivery tokens (§6) ------------------------------------------------------------------
    async def register_token(self, recipient: bytes, token: bytes) -> str | None:
        """None when registered (idempotent), else the refusal reason."""
        async with self.lock:
            owner = self.state.recipient_of(token)
            if owner == recipient:
                return None
            if owner is not None:
                return "delivery token unavailable"
            if self.state.token_count(recipient) >= self.max_tokens:
                return "too many delivery tokens"
            await self._token_change(OP_REGISTER, token, recipient)
            return None

    async def deregister_token(self, recipient: bytes, token: bytes) -> bool:
        """True if the caller's token was removed. Someone else's or an unknown token is left
        alone, and the caller gets the same reply either way (no probing for tokens)."""
        async with self.lock:
            if self.state.recipient_of(token) != recipient:
                return False
            await self._token_change(OP_DEREGISTER, token, recipient)
            return True

    async def _token_change(self, op: str, token: bytes, recipient: bytes) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_DELIVERY_TOKENS.name, [{
            Q.TOKEN: token, Q.RECIPIENT: recipient, Q.OP: op, Q.AT: ts(at)}])
        self.state.token_row(op, token, recipient, at)

    # --- backups (§6 "Backups") ----------------------------------------------------------------
    async def store_backup(self, pubkey: bytes, ciphertext: bytes) -> BackupMeta:
        async with self.lock:
            old = self.state.backups.get(pubkey)
            version = 1 if old is None else old.version + 1
            await self._backup_change(OP_STORE, pubkey, ciphertext, version)
            return self.state.backups[pubkey]

    async def fetch_backup(self, pubkey: bytes) -> tuple[bytes, BackupMeta] | None:
        meta = self.state.backups.get(pubkey)
        if meta is None:
            return None
        ct = await asyncio.to_thread(read_backup, self.paths[PPP_BACKUPS.name], pubkey, meta.at)
        return None if ct is None else (ct, meta)

    async def delete_backup(self, pubkey: bytes) -> bool:
        async with self.lock:
            if pubkey not in self.state.backups:
                return False
            await self._backup_change(OP_DELETE, pubkey, None, 0)
            return True

    async def _backup_change(self, op: str, pubkey: bytes, ciphertext: bytes | None,
                             version: int) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_BACKUPS.name, [{
            Q.PUBKEY: pubkey, Q.OP: op, Q.CIPHERTEXT: ciphertext, Q.VERSION: version,
            Q.AT: ts(at)}])
        self.state.backup_row(op, pubkey, version, at)
