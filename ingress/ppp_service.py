"""What every PPP command does, for both transports (WebSocket §5.1 and HTTP polling §5.2)
and the sealed-sender endpoint (§6): one `PppService`, so the two transports cannot drift.

A command arrives here already authenticated (the pubkey) and charged to its per-minute rate
budget (`engine/ppp/session.py` for the WebSocket, `ingress/ppp_app.py` for HTTP, one shared
`KeyedBudgets` per host). A command under an hourly quota (`limits.QUOTAS`: backups,
discovery, carry-group changes) is charged here instead, against every host's hits
(`PppControl.spend`); past it, the same "rate limited" failure. Each method returns the C.4
reply.

* STORE: the GiftWrap must decode (recipient 32 bytes, ...), ciphertext <= MAX_CIPHERTEXT_SIZE,
  expires_at > now; expiry clamped to now + MAX_EVENT_TTL_SECS; event_id by §4.5
  (authenticated form); a duplicate (held by the relay, or being landed) is refused. STORED
  only after the landing commit returned. Failure reasons end with the request id, which the
  log line carries too (§5.x).
* FETCH / ACK: the caller's own mailbox only (`PppInbox`); acks are durable `acks` rows
  before ACKED is sent, and only the caller's unacked events count.
* Room commands (§7) are `ppp_rooms.RoomService`'s, carry-group commands (§8)
  `ppp_carry.CarryService`'s, reached through `run` like the rest.
* Sealed Note: token -> recipient (unknown: 401), clamp, the sealed event id, landed as a
  GiftWrap addressed to the token's recipient, so FETCH returns it like any other event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable

import msgpack

from delta_tables.ppp_control import PppControl
from delta_tables.schema import C
from egress.ppp_inbox import PppInbox
from engine.ppp import protocol as P
from engine.ppp.giftwrap import GiftWrap, GiftWrapError
from engine.ppp.ids import PROTOCOL, sealed_event_id
from engine.ppp.limits import (EVENT_ID_LEN, FETCH_PAGE_SIZE, MAX_ACK_IDS, MAX_BACKUP_SIZE,
                               MAX_CIPHERTEXT_SIZE, MAX_EVENT_TTL_SECS, QUOTAS)
from engine.ppp.session import with_request_id
from engine.push.platforms import TokenError, check_token
from runtime.handoff import Handoff
from runtime.log_rate import LogRate

from .ppp_carry import CarryService
from .ppp_rooms import RoomService

log = logging.getLogger("relay.ingress.ppp")

# A refusal's line carries the request id of its reply (§5.x); under a flood, at most one
# such line per second per (command, reason), the next saying how many were not made.
REFUSAL_LOG_SECONDS = 1.0


def landing_row(event_id_: bytes, recipient: bytes, envelope: bytes, created_at: int,
                received_at: datetime, expires_at: int) -> dict[str, Any]:
    """One LANDING row: mailbox = recipient pubkey, envelope = the encoded GiftWrap."""
    return {
        C.EVENT_ID: event_id_, C.PROTOCOL: PROTOCOL, C.MAILBOX: recipient,
        C.ENVELOPE: envelope, C.META: msgpack.packb(created_at),
        C.RECEIVED_AT: received_at,
        C.EXPIRES_AT: datetime.fromtimestamp(expires_at, timezone.utc),
    }


def _address(session) -> str | None:
    """The client address a WebSocket session is counted by (its admission ticket's)."""
    ticket = getattr(getattr(session, "conn", None), "ticket", None)
    return getattr(ticket, "address", None)


class SealedOutcome:
    """Coarse outcomes of the sealed endpoint (§5.x: no request id, token or IP is logged)."""
    OK = "accepted"
    UNKNOWN_TOKEN = "token_rejected"
    RATE_LIMITED = "rate_limited"
    INVALID = "invalid"
    DUPLICATE = "duplicate"


class PppService:
    def __init__(self, appender, ack_appender, inbox: PppInbox, control: PppControl, *,
                 clock: Callable[[], float] = time.time, page_size: int = FETCH_PAGE_SIZE,
                 counters=None, room_view=None, room_sequence_timeout: float = 10.0,
                 moderation: bool = False):
        """`appender`: the node's landing GroupCommitAppender; `ack_appender`: one over the
        `acks` table. `clock`: unix seconds (expiry checks; tests move it). `room_view`: an
        `egress.ppp_rooms.RoomInbox` (None: room commands are refused as disabled)."""
        self.appender = appender
        self.ack_appender = ack_appender
        self.inbox = inbox
        self.control = control
        self.clock = clock
        self.page_size = page_size
        # The listener's `accepted` / `rejected` counters (runtime/listener.py, metrics).
        self.counters = counters
        self._landing: set[bytes] = set()   # ids being landed by this process
        # runtime/peer_link.PeerListener: hosts where a recipient has a session get its
        # events at once (None: one host, or the peer channel off)
        self.peers = None
        self._deferred: set[asyncio.Task] = set()   # ack rows of events acked early
        inbox.on_deferred_acks = self._write_deferred_acks
        self.stored = 0
        self.refused: dict[str, int] = {}
        self.refusal_lines = LogRate(REFUSAL_LOG_SECONDS)
        self.quiet = LogRate()   # storage failures: one line per 10 s while they last
        self.discovery = None     # a DiscoveryService, set by the listener (ppp_app.py)
        self.carry = CarryService(inbox, control, self._fail, clock=clock, page_size=page_size)
        self.rooms = None if room_view is None else RoomService(
            appender, room_view, control, self._fail, clock=clock,
            sequence_timeout=room_sequence_timeout, moderation=moderation, tell=self.tell)

    # --- dispatch ----------------------------------------------------------------------------
    async def run(self, pubkey: bytes, cmd: P.Command, request_id: str,
                  session=None) -> P.Reply:
        """`session`: the WebSocket connection asking (room subscriptions), if any."""
        if isinstance(cmd, P.RoomCommand) and self.rooms is not None:
            return await self.rooms.run(pubkey, cmd, request_id, session)
        if isinstance(cmd, P.DiscoveryCommand) and self.discovery is not None:
            # charges its quotas itself, after a look at the address's budget
            return await self.discovery.run(pubkey, cmd, request_id, _address(session))
        if cmd.name in QUOTAS and not await self.control.spend(pubkey, cmd.name):
            return self._fail(cmd.name, "rate limited", request_id)
        if isinstance(cmd, P.CarryCommand):
            return await self.carry.run(pubkey, cmd, request_id)
        if isinstance(cmd, P.Store):
            return await self.store(cmd.event, request_id)
        if isinstance(cmd, P.Fetch):
            return await self.fetch(pubkey, cmd.since, cmd.cursor)
        if isinstance(cmd, P.Ack):
            return await self.ack(pubkey, cmd.event_ids, request_id)
        if isinstance(cmd, P.RegisterDeliveryToken):
            why = await self.control.register_token(pubkey, cmd.delivery_token)
            if why is not None:
                return self._fail("REGISTER_DELIVERY_TOKEN", why, request_id)
            return P.delivery_token_registered()
        if isinstance(cmd, P.DeregisterDeliveryToken):
            await self.control.deregister_token(pubkey, cmd.delivery_token)
            return P.delivery_token_deregistered()
        if isinstance(cmd, P.RegisterPush):
            try:
                check_token(cmd.platform, cmd.token)
            except TokenError as e:
                return self._fail("REGISTER_PUSH", f"bad push token: {e}", request_id)
            why = await self.control.register_push(pubkey, cmd.platform,
                                                   cmd.token.encode("utf-8"))
            if why is not None:
                return self._fail("REGISTER_PUSH", why, request_id)
            return P.push_registered()
        if isinstance(cmd, P.StoreBackup):
            if len(cmd.ciphertext) > MAX_BACKUP_SIZE:
                return self._fail("STORE_BACKUP", "backup too large", request_id)
            meta = await self.control.store_backup(pubkey, cmd.ciphertext)
            return P.backup_stored(meta.version, meta.stored_at)
        if isinstance(cmd, P.FetchBackup):
            got = await self.control.fetch_backup(pubkey)
            if got is None:
                return P.backup_empty()
            ct, meta = got
            return P.backup(ct, meta.version, meta.stored_at)
        if isinstance(cmd, P.DeleteBackup):
            await self.control.delete_backup(pubkey)
            return P.backup_deleted()
        return self._fail(cmd.name, "feature disabled", request_id)

    def tell(self, pubkey: bytes, reply: P.Reply) -> int:
        """Push an unsolicited frame to `pubkey`'s open WebSockets here; how many took it."""
        return sum(1 for s in self.inbox.sessions.of(pubkey) if s.push(reply))

    def _fail(self, cmd: str, reason: str, request_id: str) -> P.Reply:
        self.count_refused(reason)
        if (dropped := self.refusal_logged(cmd, reason)) is not None:
            log.info("ppp command refused", extra={
                "event": "ppp_command_refused", "cmd": cmd, "reason": reason,
                "request_id": request_id, "suppressed": dropped})
        return P.failure(cmd, with_request_id(reason, request_id))

    def refusal_logged(self, cmd: str | None, reason: str) -> int | None:
        """None: skip this refusal's line (a flood); else make it, with this `suppressed`."""
        return self.refusal_lines.allow((cmd, reason.split(":")[0]))

    def count_refused(self, reason: str) -> None:
        key = reason.split(":")[0].replace(" ", "_")
        self.refused[key] = self.refused.get(key, 0) + 1
        if self.counters is not None:
            self.counters.rejected[key] += 1

    # --- STORE ---------------------------------------------------------------------------------
    def _check_wrap(self, gw: GiftWrap, now: float) -> tuple[str | None, int]:
        """(refusal reason or None, clamped expires_at)."""
        if len(gw.ciphertext) > MAX_CIPHERTEXT_SIZE:
            return "ciphertext too large", 0
        if gw.expires_at <= now:
            return "event expired", 0
        return None, min(gw.expires_at, int(now) + MAX_EVENT_TTL_SECS)

    async def store(self, event: bytes, request_id: str) -> P.Reply:
        now = self.clock()
        try:
            gw = GiftWrap.decode(event)
        except GiftWrapError as e:
            return self._fail("STORE", f"malformed event: {e.args[0]}", request_id)
        why, expires = self._check_wrap(gw, now)
        if why is not None:
            return self._fail("STORE", why, request_id)
        eid = gw.event_id
        reply = await self._land(eid, eid, gw.recipient, event, gw.created_at, expires, now)
        if reply is not None:
            return self._fail("STORE", reply, request_id)
        return P.stored(eid)

    async def _land(self, eid: bytes, wrap_id: bytes, recipient: bytes, envelope: bytes,
                    created_at: int, expires: int, now: float) -> str | None:
        """Append and wait for the landing commit; the refusal reason or None. A recipient
        connected here gets the event at once (`PppInbox.land_early`), one connected to another
        host over the peer channel (`PppInbox.land_handed` there)."""
        if self.inbox.is_known(eid) or eid in self._landing:
            return "duplicate event"
        self._landing.add(eid)
        try:
            await self.appender.append(landing_row(
                eid, recipient, envelope, created_at,
                datetime.fromtimestamp(now, timezone.utc), expires))
        except Exception as exc:
            if (dropped := self.quiet.allow("store_failed")) is not None:
                log.error("ppp landing append failed", extra={
                    "event": "ppp_store_failed", "error": type(exc).__name__,
                    "suppressed": dropped})
            return "storage unavailable"
        finally:
            self._landing.discard(eid)
        self.inbox.remember(eid, float(expires))
        self.inbox.land_early(recipient, eid, wrap_id, envelope, created_at, float(expires))
        if self.peers is not None:
            self.peers.send(Handoff(PROTOCOL, recipient, eid,
                                    datetime.fromtimestamp(expires, timezone.utc), envelope))
        self.stored += 1
        if self.counters is not None:
            self.counters.accepted += 1
        return None

    # --- FETCH / ACK ---------------------------------------------------------------------------
    async def fetch(self, pubkey: bytes, since: int, cursor: int | None) -> P.Reply:
        evts, nxt = self.inbox.fetch(pubkey, since, cursor, self.page_size, self.clock())
        envelopes = await self.inbox.envelopes_of(evts)
        # None: the row left the inbox since (expired and compacted): not served
        return P.events([env for env in envelopes if env is not None], nxt)

    async def ack(self, pubkey: bytes, ids, request_id: str) -> P.Reply:
        if len(ids) > MAX_ACK_IDS:
            return self._fail("ACK", "too many event ids", request_id)
        ids = [i for i in ids if len(i) == EVENT_ID_LEN]
        taken, early = self.inbox.take(pubkey, ids)
        if not taken and not early:
            return P.acked(0)
        try:
            await self._append_acks(pubkey, taken)
        except Exception as exc:
            self.inbox.put_back(pubkey, taken, early)
            self._ack_failed(exc)
            return self._fail("ACK", "storage unavailable", request_id)
        # Early events' ack rows wait for their seq (`_write_deferred_acks`): ACKED before
        # that row is durable, so a crash in between delivers them once more (at least once).
        return P.acked(len(taken) + len(early))

    async def _append_acks(self, pubkey: bytes, events) -> None:
        at = datetime.now(timezone.utc)
        await asyncio.gather(*(self.ack_appender.append({
            C.PROTOCOL: PROTOCOL, C.MAILBOX: pubkey, C.EVENT_ID: ev.event_id,
            C.SEQ: ev.seq, C.CURSOR: ev.cursor, C.DEVICE: None, C.ACKED_AT: at})
            for ev in events))

    def _ack_failed(self, exc: BaseException) -> None:
        if (dropped := self.quiet.allow("ack_failed")) is not None:
            log.error("ppp ack append failed", extra={
                "event": "ppp_ack_failed", "error": type(exc).__name__,
                "suppressed": dropped})

    @property
    def acks_waiting(self) -> int:
        """Deferred ack rows being written (tests wait for 0)."""
        return len(self._deferred)

    async def drain(self) -> None:
        """Before the ack appender closes: let deferred ack rows finish."""
        await asyncio.gather(*self._deferred, return_exceptions=True)

    def _write_deferred_acks(self, pubkey: bytes, events) -> None:
        """The inbox rows of events acked early arrived: write their ack rows now. If that
        fails they are pending again (FETCH serves them once more)."""
        async def write():
            try:
                await self._append_acks(pubkey, events)
            except Exception as exc:
                self.inbox.put_back(pubkey, events)
                self._ack_failed(exc)
        task = asyncio.get_running_loop().create_task(write(), name="ppp-deferred-acks")
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    # --- sealed Note (§6) ----------------------------------------------------------------------
    async def sealed_note(self, note: P.SealedNoteSubmit) -> tuple[str, bytes | None]:
        """(outcome, event_id). Token and rate checks are the caller's (HTTP status codes)."""
        recipient = self.control.recipient_of(note.delivery_token)
        if recipient is None:
            return SealedOutcome.UNKNOWN_TOKEN, None
        now = self.clock()
        gw = GiftWrap(recipient, note.ephemeral_pk, note.nonce, note.ciphertext,
                      note.created_at, note.expires_at)
        why, expires = self._check_wrap(gw, now)
        if why is not None or not note.ciphertext:
            return SealedOutcome.INVALID, None
        gw = GiftWrap(recipient, note.ephemeral_pk, note.nonce, note.ciphertext,
                      note.created_at, expires)
        eid = sealed_event_id(note.ephemeral_pk, note.nonce, note.ciphertext,
                              note.delivery_token, note.created_at)
        why = await self._land(eid, gw.event_id, recipient, gw.encode(), gw.created_at,
                               expires, now)
        if why == "duplicate event":
            return SealedOutcome.DUPLICATE, None
        if why is not None:
            return "unavailable", None
        return SealedOutcome.OK, eid
