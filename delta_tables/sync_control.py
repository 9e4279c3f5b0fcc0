"""The cursor-sync control plane's owner: group membership, device acknowledgement progress
and push registrations, in memory and durable in the `schema_sync` tables.

A `ControlTables` (`control.py`): membership changes and push registrations are written first
(one fsync'ed append fenced against the other hosts' commits; admissions that arrive together
share it) and applied after the commit returned, so what a client was told survives a restart
and two joins / revokes cannot interleave, on one host or several (a batch that loses its
commit to another host is decided again on the refreshed state). Ack progress is applied to
memory at once and written by a group-committed appender in the background, per host and
unfenced: its fold keeps each device's highest cursor, whatever the order rows arrive in, so
the other hosts read it back over `ACK_WINDOW_US` on each refresh. Losing the newest progress
in a crash only delays a DELETE until the device pulls again (the safe direction).

Policy (who may do what) is the shell's; this module stores. It never logs an id or token.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import Callable

from runtime.log_rate import LogRate

from .control import ControlConflict, ControlTables, utc_micros
from .group_commit import DeltaAppendTarget, GroupCommitAppender
from .layout import Layout
from .schema_sync import (OP_CREATE, OP_JOIN, OP_REGISTER, OP_REVOKE, OP_UNREGISTER,
                          SYNC_DEVICE_ACKS, SYNC_MEMBERS, SYNC_PUSH, SYNC_TABLES, S)
from .sync_state import SyncState, apply

log = logging.getLogger("relay.ingress.sync")


# Ack rows are written unfenced by each host, with its own clock: a refresh reads them again
# this far back (a host's clock ahead of another's by more than this, plus its group commit's
# delay, would hide its acks from that host until a restart; clocks are NTP-synchronised).
ACK_WINDOW_US = 60_000_000


class SyncControl(ControlTables):
    tables = SYNC_TABLES
    unfenced = {SYNC_DEVICE_ACKS.name: ACK_WINDOW_US}

    def __init__(self, layout: Layout, *, fsync: bool = True,
                 clock: Callable[[], int] = utc_micros):
        super().__init__(layout, fsync=fsync, clock=clock)
        self.state = SyncState()
        self._acks: GroupCommitAppender | None = None
        self._pending_acks: set[asyncio.Task] = set()
        self._admits: list[tuple] = []          # (group, device, admitter, open_group, future)
        self._admitting: asyncio.Task | None = None
        self.quiet = LogRate()      # a failing table fails every PULL's ack: one line per 10 s

    async def load(self) -> None:
        # members: admissions that arrive together share an append; push: one per change;
        # acks: group-committed in the background
        self.state = SyncState()
        paths = await self.open()
        self._acks = GroupCommitAppender(
            DeltaAppendTarget(paths[SYNC_DEVICE_ACKS.name], SYNC_DEVICE_ACKS, fsync=self.fsync))
        await self._acks.start()
        log.info("sync control plane loaded", extra={
            "event": "sync_control_loaded", "groups": len(self.state.members)})

    def fold(self, found) -> None:
        apply(self.state, found)

    async def close(self) -> None:
        await self.stop_following()
        if self._admitting is not None:
            await asyncio.gather(self._admitting, return_exceptions=True)
        if self._pending_acks:
            await asyncio.gather(*self._pending_acks, return_exceptions=True)
        if self._acks is not None:
            await self._acks.close()

    def _at(self) -> datetime:
        """Row times: after every `at` folded or written (`ControlTables.next_at`)."""
        return datetime.fromtimestamp(self.next_at() / 1_000_000, timezone.utc)

    # --- membership ----------------------------------------------------------------------------
    async def admit(self, group: bytes, device: bytes, admitter: bytes | None, *,
                    open_group: bool = False) -> str:
        """Make `device` a member: "member" (already), "created" (first device of a new group),
        "joined", or "refused" (revoked here, or the group exists and no live admitter).
        `open_group`: 0k-sync semantics, anyone not revoked joins an existing group.

        Admissions that arrive together share one commit (`_admit_batches`): a wave of new
        devices was one Delta commit each, in line behind the lock, so a new device's HELLO
        waited behind hundreds of commits (the hostile-load suite's 300 new devices)."""
        fut = asyncio.get_running_loop().create_future()
        self._admits.append((group, device, admitter, open_group, fut))
        if self._admitting is None:
            self._admitting = asyncio.create_task(self._admit_batches())
        return await fut

    async def _admit_batches(self) -> None:
        """Decide every waiting admission under the lock, in arrival order, each seeing the
        ones before it in the batch (a group created there can be joined there); write their
        rows as one commit; apply them after it returned; answer. A failed commit fails
        exactly the admissions that needed it."""
        try:
            while self._admits:
                batch, self._admits = self._admits, []
                await self.change(lambda: self._admit_batch(batch))
        finally:
            self._admitting = None

    async def _admit_batch(self, batch: list) -> None:
        await self._catch_up()   # a group or admitter another host made is no refusal here
        st = self.state
        joined: set[tuple[bytes, bytes]] = set()     # members by this batch's rows
        created: set[bytes] = set()

        def member(group: bytes, device: bytes | None) -> bool:
            return device is not None and (st.is_member(group, device)
                                           or (group, device) in joined)

        rows, outcomes = [], []
        for group, device, admitter, open_group, _ in batch:
            if st.is_revoked(group, device):
                outcomes.append(("refused", False))
                continue
            if member(group, device):
                outcomes.append(("member", False))
                continue
            exists = st.exists(group) or group in created
            if exists and not open_group and not member(group, admitter):
                outcomes.append(("refused", False))
                continue
            op = OP_JOIN if exists else OP_CREATE
            rows.append({S.GROUP_ID: group, S.DEVICE_ID: device, S.OP: op,
                         S.ADMITTER: admitter if op == OP_JOIN else None, S.AT: self._at()})
            joined.add((group, device))
            if op == OP_CREATE:
                created.add(group)
            outcomes.append(("joined" if exists else "created", True))
        failed: Exception | None = None
        if rows:
            try:
                await self.write(SYNC_MEMBERS.name, rows)
            except ControlConflict:
                raise       # decided again on the refreshed state (`change`)
            except Exception as exc:     # noqa: BLE001 - the callers' error, not the loop's
                failed = exc
            else:
                for row in rows:
                    st.member_row(row[S.OP], row[S.GROUP_ID], row[S.DEVICE_ID])
        for (*_, fut), (outcome, wrote) in zip(batch, outcomes):
            if fut.done():            # its caller went away; the row stands all the same
                continue
            if wrote and failed is not None:
                fut.set_exception(failed)
            else:
                fut.set_result(outcome)

    async def revoke(self, group: bytes, device: bytes, by: bytes) -> bool:
        """False if `device` is not a member (nothing written)."""
        async def body() -> bool:
            if not await self.fresh(lambda: self.state.is_member(group, device)):
                return False
            await self.write(SYNC_MEMBERS.name, [{
                S.GROUP_ID: group, S.DEVICE_ID: device, S.OP: OP_REVOKE, S.ADMITTER: by,
                S.AT: self._at()}])
            self.state.member_row(OP_REVOKE, group, device)
            return True
        return await self.change(body)

    # --- ack progress --------------------------------------------------------------------------
    def record_ack(self, group: bytes, device: bytes, cursor: int) -> bool:
        """Advance the device's progress (never backwards); durable in the background."""
        if cursor <= self.state.acked_cursor(group, device):
            return False
        self.state.ack_row(group, device, cursor)
        if self._acks is not None:
            task = asyncio.create_task(self._acks.append({
                S.GROUP_ID: group, S.DEVICE_ID: device, S.CURSOR: cursor, S.AT: self._at()}))
            self._pending_acks.add(task)
            task.add_done_callback(self._ack_done)
        return True

    def _ack_done(self, task: asyncio.Task) -> None:
        self._pending_acks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = type(task.exception()).__name__
            if (dropped := self.quiet.allow(error)) is not None:
                log.warning("sync ack progress not stored", extra={
                    "event": "sync_store_failed", "error": error, "suppressed": dropped})

    async def flush_acks(self) -> None:
        if self._pending_acks:
            await asyncio.gather(*list(self._pending_acks), return_exceptions=True)

    # --- push registrations --------------------------------------------------------------------
    async def push_registration(self, group: bytes, device: bytes, platform: str, token: bytes,
                                register: bool) -> None:
        op = OP_REGISTER if register else OP_UNREGISTER
        async def body() -> None:
            await self.write(SYNC_PUSH.name, [{
                S.GROUP_ID: group, S.DEVICE_ID: device, S.OP: op, S.PLATFORM: platform,
                S.TOKEN: token, S.AT: self._at()}])
            self.state.push_row(op, group, device, platform, token)
        await self.change(body)

    def __repr__(self) -> str:
        return f"SyncControl({self.state!r})"
