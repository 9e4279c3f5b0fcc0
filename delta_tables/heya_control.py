"""The Heya control plane: inbox tokens, mailboxes, send tokens, push registrations and
trims, held in memory and made durable in the `schema_heya` tables, by every host that serves
Heya at once.

A `ControlTables` (`control.py`): every change is a read-modify-write run by `change`, written
first (fenced against the other hosts' commits) and applied to memory after the commit
returned, with the fold functions the loader uses (`heya_state.py`). A change that loses its
commit to another host is decided again on the refreshed state, so two INCOs of one inbox
token, on one host or two, make one mailbox and one refusal, and two EXTDs of one send token
both count. A token or mailbox unknown here is looked for in the tables before it is refused
(`known`): it may have been made on another host.

Policy (who may do what) is the shell's (`ingress/heya.py`); this module stores. It never
logs a token, a certificate digest or a push token.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from datetime import datetime, timezone
from typing import Any, Callable

import pyarrow as pa

from .control import (CHANGE_ATTEMPTS, ControlBusy, ControlConflict, ControlTables,
                      fenced_append, rows_after, utc_micros)
from .heya_state import APPLY, HeyaState, SendToken, ensure_tables, micros
from .layout import Layout, ensure_table
from .schema_heya import (HEYA_INBOX_TOKENS, HEYA_MAILBOXES, HEYA_PUSH_TOKENS, HEYA_SEND_TOKENS,
                          HEYA_TABLES, HEYA_TRIMS, OP_AUTH, OP_DALL, OP_DEAU, OP_EXTD, OP_INCO,
                          OP_DALL_MARK, OP_IOSA, OP_IOSD, H)

log = logging.getLogger("relay.ingress.heya")

TOKEN_LEN = 32


def _ts(micros: int) -> datetime:
    return datetime.fromtimestamp(micros / 1_000_000, timezone.utc)


class HeyaControl(ControlTables):
    tables = {name: HEYA_TABLES[name] for name in APPLY}   # in fold order

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros):
        """`clock` returns unix microseconds (row times; tests move it)."""
        super().__init__(layout, fsync=fsync, clock=clock)
        self.state = HeyaState()

    async def load(self) -> None:
        """Create the tables if needed and fold them into memory."""
        self.state = HeyaState()
        await self.open()
        log.info("heya control plane loaded", extra={
            "event": "heya_control_loaded", "mailboxes": len(self.state.mailboxes),
            "send_tokens": len(self.state.tokens)})

    def fold(self, found: dict[str, pa.Table]) -> None:
        for name, apply in APPLY.items():
            if name in found:
                apply(self.state, found[name])

    # --- reads (memory; `known` looks in the tables for what another host made) ---------------
    async def find_mailbox(self, owner: bytes) -> bool:
        return await self.known(lambda: owner in self.state.mailboxes)

    async def find_send_token(self, token: bytes) -> SendToken | None:
        await self.known(lambda: token in self.state.tokens)
        return self.state.tokens.get(token)

    async def owns(self, owner: bytes, token: bytes) -> bool:
        return await self.known(lambda: self._owned(owner, token) is not None)

    def is_mailbox(self, owner: bytes) -> bool:
        return owner in self.state.mailboxes

    def send_token(self, token: bytes) -> SendToken | None:
        return self.state.tokens.get(token)

    def owner_of(self, token: bytes) -> bytes | None:
        tok = self.state.tokens.get(token)
        return None if tok is None else tok.owner

    def tokens_of(self, owner: bytes) -> list[SendToken]:
        return self.state.tokens_of(owner)

    def trimmed(self, token: bytes) -> int:
        return self.state.trimmed(token)

    def push_tokens(self, owner: bytes) -> list[tuple[str, int]]:
        """(device token, registered unix seconds), IOSL order."""
        return [(d, at // 1_000_000) for d, at in self.state.push_tokens(owner)]

    # --- writes (`ControlTables.write`: durable before memory changes) ----------------------
    async def inco(self, owner: bytes, inbox_token: bytes) -> bool:
        """Consume `inbox_token` and make `owner` a mailbox, in one row (so the token is never
        burnt without the mailbox, interop §5.11). False: unknown or used token, or `owner`
        is a mailbox already."""
        async def body():
            if not await self.fresh(lambda: owner not in self.state.mailboxes):
                return False          # a mailbox, unless another host's DALL says otherwise
            # minted by `relay heya inbox-token`; a stale view of its use loses the commit
            if not await self.fresh(lambda: inbox_token in self.state.minted):
                return False
            at = self.next_at(self.state)
            await self.write(HEYA_MAILBOXES.name, [{
                H.OWNER: owner, H.OP: OP_INCO, H.INBOX_TOKEN: inbox_token, H.AT: _ts(at)}])
            self.state.mailbox_row(OP_INCO, owner, inbox_token, at)
            return True
        return await self.change(body)

    async def auth(self, owner: bytes, start: int, end: int) -> SendToken | None:
        """None if `owner` is no mailbox, or its DALL is under way (on any host)."""
        async def body():
            if not await self.fresh(lambda: self.state.open_mailbox(owner)):
                return None
            token = secrets.token_bytes(TOKEN_LEN)
            at = self.next_at(self.state)
            await self.write(HEYA_SEND_TOKENS.name, [self._token_row(
                OP_AUTH, token, owner, start, end, at)])
            self.state.send_token_row(OP_AUTH, token, owner, start, end, at)
            return self.state.tokens[token]
        return await self.change(body)

    def _token_row(self, op: str, token: bytes, owner: bytes, start: int, end: int,
                   at: int) -> dict[str, Any]:
        return {H.TOKEN: token, H.OWNER: owner, H.OP: op, H.START_TIME: start,
                H.END_TIME: end, H.AT: _ts(at)}

    def _owned(self, owner: bytes, token: bytes) -> SendToken | None:
        tok = self.state.tokens.get(token)
        return tok if tok is not None and tok.owner == owner else None

    async def _fresh_owned(self, owner: bytes, token: bytes) -> SendToken | None:
        """`_owned`, looked for in the tables too (made on another host)."""
        await self.fresh(lambda: self._owned(owner, token) is not None)
        return self._owned(owner, token)

    async def deau(self, owner: bytes, token: bytes) -> bool:
        """Revoke `token` if `owner` holds it; its messages go with it (compaction)."""
        async def body():
            tok = await self._fresh_owned(owner, token)
            if tok is None:
                return False
            at = self.next_at(self.state)
            await self.write(HEYA_SEND_TOKENS.name, [self._token_row(
                OP_DEAU, token, owner, tok.start, tok.end, at)])
            self.state.send_token_row(OP_DEAU, token, owner, tok.start, tok.end, at)
            return True
        return await self.change(body)

    async def extd(self, owner: bytes, token: bytes, seconds: int,
                   max_end: int) -> int | None:
        """New end = old end + seconds (interop §3 EXTD); None if not `owner`'s token or the
        new end would not fit the 10-digit field."""
        async def body():
            tok = await self._fresh_owned(owner, token)
            if tok is None or tok.end + seconds > max_end:
                return None
            end = tok.end + seconds
            at = self.next_at(self.state)
            await self.write(HEYA_SEND_TOKENS.name, [self._token_row(
                OP_EXTD, token, owner, tok.start, end, at)])
            self.state.send_token_row(OP_EXTD, token, owner, tok.start, end, at)
            return end
        return await self.change(body)

    async def trim(self, owner: bytes, token: bytes, up_to: int) -> bool:
        """Record that `token`'s messages with seq <= up_to are deleted (compaction removes
        them from the inbox). False if `owner` does not hold `token`."""
        async def body():
            if await self._fresh_owned(owner, token) is None:
                return False
            if up_to <= self.state.trimmed(token):
                return True
            at = self.next_at(self.state)
            await self.write(HEYA_TRIMS.name, [{H.TOKEN: token, H.UP_TO_SEQ: up_to,
                                                 H.AT: _ts(at)}])
            self.state.trim_row(token, up_to, at)
            return True
        return await self.change(body)

    @staticmethod
    def _push_row(op: str, owner: bytes, device: str, at: int) -> dict[str, Any]:
        return {H.OWNER: owner, H.DEVICE_TOKEN: device.encode("ascii"), H.OP: op, H.AT: _ts(at)}

    async def iosa(self, owner: bytes, device: str) -> bool:
        """Register a push token; registering it again keeps the first registration
        (interop §3 IOSA: ON CONFLICT DO NOTHING). False if `owner` is no mailbox, or its
        DALL is under way."""
        async def body():
            if not await self.fresh(lambda: self.state.open_mailbox(owner)):
                return False
            if device in self.state.push.get(owner, {}):
                return True
            at = self.next_at(self.state)
            await self.write(HEYA_PUSH_TOKENS.name, [self._push_row(OP_IOSA, owner, device, at)])
            self.state.push_row(OP_IOSA, owner, device, at)
            return True
        return await self.change(body)

    async def iosd(self, owner: bytes, device: str) -> bool:
        async def body():
            if not await self.fresh(lambda: device in self.state.push.get(owner, {})):
                return False
            at = self.next_at(self.state)
            await self.write(HEYA_PUSH_TOKENS.name, [self._push_row(OP_IOSD, owner, device, at)])
            self.state.push_row(OP_IOSD, owner, device, at)
            return True
        return await self.change(body)

    async def dall(self, owner: bytes) -> list[bytes] | None:
        """Deregister the mailbox: revoke every send token (their messages go with them),
        remove every push token, then the mailbox itself (README "Deregistering an inbox").
        Written in that order, so a crash part-way leaves a mailbox whose DALL can be
        repeated. Returns the revoked tokens; None if `owner` is not a mailbox.

        Across hosts: the DEAUs go with a DALL mark (`OP_DALL_MARK`) in the table AUTH
        writes, and the push step always commits (empty if no push token), so an AUTH or
        IOSA racing this DALL on another host either commits first, and is revoked here
        (this commit then loses and is decided again), or sees the mark and is refused."""
        revoked: list[bytes] = []     # over attempts: a retry finds the first ones revoked

        async def body():
            if not await self.fresh(lambda: owner in self.state.mailboxes):
                return None
            tokens = self.state.tokens_of(owner)
            ats = [self.next_at(self.state) for _ in range(len(tokens) + 1)]
            await self.write(HEYA_SEND_TOKENS.name, [
                self._token_row(OP_DEAU, t.token, owner, t.start, t.end, at)
                for t, at in zip(tokens, ats)] + [
                self._token_row(OP_DALL_MARK, b"", owner, 0, 0, ats[-1])])
            for t, at in zip(tokens, ats):
                self.state.send_token_row(OP_DEAU, t.token, owner, t.start, t.end, at)
            self.state.send_token_row(OP_DALL_MARK, b"", owner, 0, 0, ats[-1])
            revoked.extend(t.token for t in tokens)
            devices = [d for d, _ in self.state.push_tokens(owner)]
            ats = [self.next_at(self.state) for _ in devices]
            await self.write(HEYA_PUSH_TOKENS.name, [
                self._push_row(OP_IOSD, owner, d, at) for d, at in zip(devices, ats)])
            for d, at in zip(devices, ats):
                self.state.push_row(OP_IOSD, owner, d, at)
            at = self.next_at(self.state)
            await self.write(HEYA_MAILBOXES.name, [{
                H.OWNER: owner, H.OP: OP_DALL, H.INBOX_TOKEN: None, H.AT: _ts(at)}])
            self.state.mailbox_row(OP_DALL, owner, None, at)
            return list(revoked)
        return await self.change(body)


def mint_inbox_tokens(layout: Layout, count: int = 1, *, fsync: bool = True) -> list[bytes]:
    """`relay heya inbox-token`: append `count` fresh inbox tokens (durable when this returns)
    for the operator to hand out; an ingress node picks them up at the next INCO. Fenced like
    every control commit, so their `at` follow every row of the table."""
    paths = ensure_tables(layout)
    tokens = [secrets.token_bytes(TOKEN_LEN) for _ in range(count)]
    path = paths[HEYA_INBOX_TOKENS.name]
    for _ in range(CHANGE_ATTEMPTS):
        dt = ensure_table(path, HEYA_INBOX_TOKENS)
        t = rows_after(dt, 0)
        last = max(micros(t.column(H.AT)), default=0)
        now = max(utc_micros(), last + 1)
        rows = [{H.TOKEN: tok, H.AT: _ts(now + i)} for i, tok in enumerate(tokens)]
        try:
            fenced_append(dt, HEYA_INBOX_TOKENS.name, path,
                          pa.Table.from_pylist(rows, schema=HEYA_INBOX_TOKENS.arrow_schema()),
                          fsync=fsync)
            return tokens
        except ControlConflict:
            continue
    raise ControlBusy("inbox tokens: lost the commit to other writers every time")
