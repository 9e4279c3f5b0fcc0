"""The PPP control plane's owner: delivery tokens, backups, rooms and room member tokens, in
memory and durable in the
`schema_ppp` tables: a `ControlTables` (`control.py`: write first, apply to memory after the
commit returned, with the fold the loader uses, so a restart rebuilds what clients were told).

Every host serving PPP holds one. A change is a read-modify-write (`ControlTables.change`)
whose commit is fenced against the other hosts' commits to its table, and decided again when it
loses, so two registrations racing for the cap, or two backups racing for a version, cannot
interleave, on one host or two. Policy (caps, sizes) is applied here because it is
read-modify-write. Never
logs a token, a pubkey or ciphertext.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from engine.ppp.carry import CarryGroups, Definition
from engine.ppp.limits import MAX_DELIVERY_TOKENS_PER_RECIPIENT
from engine.ppp.rooms import Room

from .control import ControlTables, utc_micros
from .layout import Layout
from .ppp_state import COLUMNS, BackupMeta, PppState, apply, read_backup, ts
from .schema_ppp import (OP_BAN, OP_MEMBER, OP_UNMEMBER, OP_CLEAR, OP_CREATE, OP_DELETE, OP_DEREGISTER, OP_PUBLISH,
                         OP_REGISTER, OP_REVOKE, OP_ROTATE, OP_STORE, OP_UPDATE, PPP_BACKUPS,
                         PPP_CARRY_GROUPS, PPP_DELIVERY_TOKENS, PPP_DISCOVERY, PPP_PUSH_TOKENS,
                         PPP_ROOM_TOKENS, PPP_ROOMS, PPP_TABLES, Q)

# A pubkey's push tokens (one per device it is active on: phone, tablet, watch, browsers).
# Appendix C sets no cap; this one bounds what one identity can make the push job send.
MAX_PUSH_TOKENS_PER_PUBKEY = 10

log = logging.getLogger("relay.ingress.ppp")


class PppControl(ControlTables):
    tables = PPP_TABLES
    columns = COLUMNS

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros,
                 max_tokens: int = MAX_DELIVERY_TOKENS_PER_RECIPIENT):
        super().__init__(layout, fsync=fsync, clock=clock)
        self.max_tokens = max_tokens
        self.state = PppState()

    async def load(self) -> None:
        self.state = PppState()
        await self.open()
        log.info("ppp control plane loaded", extra={
            "event": "ppp_control_loaded", "delivery_tokens": len(self.state.tokens),
            "backups": len(self.state.backups), "rooms": len(self.state.rooms.rooms)})

    def fold(self, found) -> None:
        apply(self.state, found)

    async def find_recipient(self, token: bytes) -> bytes | None:
        """`recipient_of`, looked for in the tables too (registered on another host)."""
        await self.known(lambda: self.state.recipient_of(token) is not None)
        return self.state.recipient_of(token)

    def recipient_of(self, token: bytes) -> bytes | None:
        return self.state.recipient_of(token)

    # --- push registrations (REGISTER_PUSH) ----------------------------------------------------
    async def register_push(self, pubkey: bytes, platform: str, token: bytes) -> str | None:
        """None when registered (again: idempotent), else the refusal reason."""
        async def body():
            mine = self.state.push.get(pubkey, {})
            if (platform, token) in mine:
                return None
            if (len(mine) >= MAX_PUSH_TOKENS_PER_PUBKEY
                    and not any(t == token for _, t in mine)):
                return "too many push tokens"
            await self._push_change(OP_REGISTER, pubkey, platform, token)
            return None
        return await self.change(body)

    async def deregister_push(self, pubkey: bytes, platform: str, token: bytes) -> bool:
        """The push job's removal of a token its provider called dead; False if it was gone."""
        async def body():
            if not await self.fresh(lambda: (platform, token) in self.state.push.get(pubkey, {})):
                return False
            await self._push_change(OP_DEREGISTER, pubkey, platform, token)
            return True
        return await self.change(body)

    def push_tokens(self, pubkey: bytes) -> list[tuple[str, bytes]]:
        return self.state.push_tokens(pubkey)

    def has_push(self, pubkey: bytes) -> bool:
        return bool(self.state.push.get(pubkey))

    async def _push_change(self, op: str, pubkey: bytes, platform: str, token: bytes) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_PUSH_TOKENS.name, [{
            Q.PUBKEY: pubkey, Q.PLATFORM: platform, Q.TOKEN: token, Q.OP: op, Q.AT: ts(at)}])
        self.state.push_row(op, pubkey, platform, token, at)

    # --- carry groups (§8) --------------------------------------------------------------------
    @property
    def carry(self) -> CarryGroups:
        return self.state.carry

    async def carry_change(self, op: str, signer: bytes, group_id: bytes,
                           d: Definition | None) -> str | None:
        """None when written and applied, else the refusal reason (engine/ppp/carry.py)."""
        async def body():
            why = self.state.carry.check(op, signer, group_id, d)
            if why is not None:       # the group as another host left it, before refusing
                await self._catch_up()
                why = self.state.carry.check(op, signer, group_id, d)
            if why is not None:
                return why
            members, couriers = (None, None) if d is None else d.pack()
            at = self.next_at(self.state)
            await self.write(PPP_CARRY_GROUPS.name, [{
                Q.GROUP_ID: group_id, Q.PUBKEY: signer, Q.OP: op, Q.MEMBERS: members,
                Q.COURIERS: couriers, Q.AT: ts(at)}])
            self.state.carry_row(op, group_id, signer, members, couriers, at)
            return None
        return await self.change(body)

    # --- delivery tokens (§6) ------------------------------------------------------------------
    async def register_token(self, recipient: bytes, token: bytes) -> str | None:
        """None when registered (idempotent), else the refusal reason."""
        async def body():
            owner = self.state.recipient_of(token)
            if owner == recipient:
                return None
            if owner is not None:
                return "delivery token unavailable"
            if self.state.token_count(recipient) >= self.max_tokens:
                return "too many delivery tokens"
            await self._token_change(OP_REGISTER, token, recipient)
            return None
        return await self.change(body)

    async def deregister_token(self, recipient: bytes, token: bytes) -> bool:
        """True if the caller's token was removed. Someone else's or an unknown token is left
        alone, and the caller gets the same reply either way (no probing for tokens)."""
        async def body():
            if not await self.fresh(lambda: self.state.recipient_of(token) == recipient):
                return False
            await self._token_change(OP_DEREGISTER, token, recipient)
            return True
        return await self.change(body)

    async def _token_change(self, op: str, token: bytes, recipient: bytes) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_DELIVERY_TOKENS.name, [{
            Q.TOKEN: token, Q.RECIPIENT: recipient, Q.OP: op, Q.AT: ts(at)}])
        self.state.token_row(op, token, recipient, at)

    # --- backups (§6 "Backups") ----------------------------------------------------------------
    async def store_backup(self, pubkey: bytes, ciphertext: bytes) -> BackupMeta:
        async def body():
            old = self.state.backups.get(pubkey)
            version = 1 if old is None else old.version + 1
            await self._backup_change(OP_STORE, pubkey, ciphertext, version)
            return self.state.backups[pubkey]
        return await self.change(body)

    async def fetch_backup(self, pubkey: bytes) -> tuple[bytes, BackupMeta] | None:
        """The newest backup, whichever host stored it (rare: worth a refresh)."""
        await self.refresh()
        meta = self.state.backups.get(pubkey)
        if meta is None:
            return None
        ct = await asyncio.to_thread(read_backup, self.paths[PPP_BACKUPS.name], pubkey, meta.at)
        return None if ct is None else (ct, meta)

    async def delete_backup(self, pubkey: bytes) -> bool:
        async def body():
            if not await self.fresh(lambda: pubkey in self.state.backups):
                return False
            await self._backup_change(OP_DELETE, pubkey, None, 0)
            return True
        return await self.change(body)

    async def _backup_change(self, op: str, pubkey: bytes, ciphertext: bytes | None,
                             version: int) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_BACKUPS.name, [{
            Q.PUBKEY: pubkey, Q.OP: op, Q.CIPHERTEXT: ciphertext, Q.VERSION: version,
            Q.AT: ts(at)}])
        self.state.backup_row(op, pubkey, version, at)

    # --- rooms (§7): who may is `ingress/ppp_rooms.py`'s; what fits is decided here -------------
    @property
    def rooms(self):
        return self.state.rooms

    async def create_room(self, room: Room, now: float) -> str | None:
        """None when created; a live room with this id (anyone's) refuses it."""
        async def body():
            if self.state.rooms.live(room.room_id, now) is not None:
                return "room exists"
            await self._room_change(OP_CREATE, room)
            return None
        return await self.change(body)

    async def delete_room(self, room: Room) -> None:
        """DELETE_GROUP: one `delete` row, the commit point (`room_state.py`)."""
        async def body():
            await self._room_change(OP_DELETE, room)
        return await self.change(body)

    async def ban_member(self, room_id: bytes, pubkey: bytes) -> None:
        async def body():
            if not self.state.rooms.banned(room_id, pubkey):
                await self._member_change(room_id, OP_BAN, pubkey, None)
        return await self.change(body)

    async def remember_member(self, room_id: bytes, pubkey: bytes) -> None:
        async def body():
            if not self.state.rooms.known_member(room_id, pubkey):
                await self._member_change(room_id, OP_MEMBER, pubkey, None)
        return await self.change(body)

    async def forget_member(self, room_id: bytes, pubkey: bytes) -> None:
        async def body():
            if self.state.rooms.known_member(room_id, pubkey):
                await self._member_change(room_id, OP_UNMEMBER, pubkey, None)
        return await self.change(body)

    async def update_room(self, room: Room) -> None:
        async def body():
            await self._room_change(OP_UPDATE, room)
        return await self.change(body)

    async def _room_change(self, op: str, room: Room) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_ROOMS.name, [{
            Q.ROOM_ID: room.room_id, Q.OP: op, Q.ADMIN: room.admin, Q.ROOM_TYPE: room.room_type,
            Q.S2_CELL: room.fine, Q.S2_COARSE: room.coarse, Q.GATED: room.gated,
            Q.PROXIMITY: room.proximity_required, Q.BLE: room.ble_enabled,
            Q.MAX_MEMBERS: room.max_members, Q.CREATED_AT: ts(room.created_at * 1_000_000),
            Q.EXPIRES_AT: ts(room.expires_at * 1_000_000), Q.AT: ts(at)}])
        self.state.room_row(op, room, at)

    async def register_member(self, room: Room, token: bytes) -> str | None:
        """§7.3: idempotent; the unmarked tokens stay below `max_members`."""
        async def body():
            if self.state.rooms.token_valid_until(room.room_id, token) is None:
                return None
            if self.state.rooms.members(room.room_id) >= room.max_members:
                return "room full"
            await self._member_change(room.room_id, OP_REGISTER, token, None)
            return None
        return await self.change(body)

    async def revoke_members(self, room_id: bytes) -> int:
        """Every token of the room, marked or not, is refused from now on; returns how many
        were valid (the TOKENS_REVOKED count)."""
        async def body():
            now_us = self.clock()
            t = self.state.rooms.tokens.get(room_id)
            count = 0 if t is None else sum(1 for v in t.valid_until.values()
                                            if v is None or v > now_us)
            await self._member_change(room_id, OP_REVOKE, None, None)
            return count
        return await self.change(body)

    async def rotate_members(self, room_id: bytes, grace_until_us: int) -> int:
        """Marks every unmarked token valid until `grace_until_us`; returns how many."""
        async def body():
            count = self.state.rooms.members(room_id)
            await self._member_change(room_id, OP_ROTATE, None, grace_until_us)
            return count
        return await self.change(body)

    async def _member_change(self, room_id: bytes, op: str, token: bytes | None,
                             grace_until: int | None) -> None:
        at = self.next_at(self.state)
        await self.write(PPP_ROOM_TOKENS.name, [{
            Q.ROOM_ID: room_id, Q.TOKEN: token, Q.OP: op,
            Q.GRACE_UNTIL: None if grace_until is None else ts(grace_until), Q.AT: ts(at)}])
        self.state.room_token_row(op, room_id, token, grace_until, at)

    # --- contact discovery (§9) ------------------------------------------------------------------
    async def publish_hashes(self, pubkey: bytes, hashes, pepper_id: int) -> int:
        """Replace the caller's published set (one commit: a clear row, a row per hash)."""
        async def body():
            uniq = list(dict.fromkeys(hashes))
            rows = [(OP_CLEAR, None)] + [(OP_PUBLISH, h) for h in uniq]
            ats = [self.next_at(self.state) for _ in rows]
            await self.write(PPP_DISCOVERY.name, [{
                Q.PUBKEY: pubkey, Q.OP: op, Q.HASH: h, Q.PEPPER_ID: pepper_id, Q.AT: ts(at)}
                for (op, h), at in zip(rows, ats)])
            for (op, h), at in zip(rows, ats):
                self.state.discovery_row(op, pubkey, h, pepper_id, at)
            return len(uniq)
        return await self.change(body)
