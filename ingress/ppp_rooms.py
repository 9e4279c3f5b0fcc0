"""What the PPP room commands do (spec 004 §7, appendix C): one `RoomService` under the
WebSocket (`ppp_app.py`) and the sealed endpoint `POST /v1/room/submit`.

Who may do what (the refusal is the command's STORE_FAIL with a stable reason and the
request id, §7.7):

* CREATE_ROOM: any authenticated pubkey, which becomes the admin. max_members 1-100,
  expires_at > now (clamped to now + MAX_EVENT_TTL_SECS: a room is not a way to keep
  ciphertext longer than an event may live), both S2 tokens valid and the coarse cell
  containing the fine one, at level 8 or finer (`engine/ppp/rooms.py`). A live room of the
  same id refuses it.
* UPDATE_ROOM, REGISTER_TOKEN, REVOKE_TOKENS, ROTATE_ROOM_KEY: the admin only ("not room
  admin"); REGISTER_TOKEN also needs the admin's signature over member_token || room_id and
  a member slot (`ppp_control.register_member`). A rotation's grace is clamped to [0, 600] s.
* STORE_ROOM: any authenticated pubkey for an open room; a gated room takes it from its
  admin, from a pubkey the relay knows as a member (the admin ADMITted its knock, or it
  once sent a valid token; `room_state.py` `member` rows), as C.1's STORE_ROOM has no token
  field, or with a valid member token (this relay's optional `member_token` field: it lets
  a member the relay has not met, one invited by GroupInvite, use the authenticated path;
  its pubkey is remembered then). A kick forgets the pubkey, a revoke or rotation every
  one. The sealed endpoint always needs a valid token.
* FETCH_ROOM, DISCOVER_ROOMS: any authenticated pubkey (room messages are ciphertext under
  the room key; discovery shows what §7.1's RoomInfo shows).
* KNOCK: any authenticated pubkey, on a BLE-enabled room or a group (§7.6: a group is
  joined by invite or by a knock against its id); KNOCK_NOTIFY to the admin's open
  WebSockets (push fallback: issue 15). ADMIT: the admin, a live knock (120 s); ADMITTED
  to the knocker's WebSockets, or kept for the knock's remaining TTL until the knocker
  has one (`engine/ppp/knocks.py`: knocks live in memory, not in a table).
* CREATE_GROUP: like CREATE_ROOM without cells or expiry (§7.6: expires_at in the year
  9999, never discoverable). DELETE_GROUP: the admin, groups only; one `delete` row in
  `ppp_rooms` is the commit point (`delta_tables/room_state.py`), after which the group
  answers "unknown room" everywhere; compaction then empties its messages.
* KICK_MEMBER / BAN_MEMBER: "feature disabled" unless `ppp.moderation` (§7.7: off by
  default). On: the admin only; MEMBER_KICKED / MEMBER_BANNED to the admin, KICKED to the
  member's WebSockets, which stop hearing the room; a ban is durable and refuses the
  pubkey's KNOCK, STORE_ROOM and FETCH_ROOM on that room ("banned") until the room is gone.
  The relay cannot revoke the member's token (it cannot link token to pubkey): to shut a
  kicked member out of sealed submission the admin rotates the key.
* An unknown room, and an expired one, refuse everything but CREATE_ROOM / CREATE_GROUP.

Landing: a room message is appended to `landing` like any envelope (protocol `ppp_room`),
then ROOM_STORED waits for the stream's inbox commit that numbers it (`egress/ppp_rooms.py`).
The same message again (same nonce and ciphertext) is the same event id: answered with the
number it has. If the stream does not number it within `room_sequence_timeout_seconds` the
reply is STORE_FAIL "sequence pending": the message is durable and will be numbered; the
client's retry of the same bytes gets its number once it has one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from datetime import datetime, timezone
from typing import Callable

import msgpack
from nacl.exceptions import CryptoError
from nacl.signing import VerifyKey

from delta_tables.ppp_control import PppControl
from delta_tables.schema import C
from egress.ppp_rooms import RoomInbox, Subscriber
from engine.ppp import protocol as P
from engine.ppp import rooms as R
from engine.ppp.knocks import REQUEST_ID_LEN, Admission, Knock, KnockBook
from engine.ppp.limits import MAX_EVENT_TTL_SECS
from runtime.log_rate import LogRate

log = logging.getLogger("relay.ingress.ppp")

# Reasons (stable texts: tests and clients match them).
UNKNOWN_ROOM = "unknown room"
ROOM_EXPIRED = "room expired"
NOT_ADMIN = "not room admin"
MEMBERSHIP = "member token required"
PENDING = "sequence pending"
BANNED = "banned"
DISABLED = "feature disabled"


class SealedRoomOutcome:
    """Coarse outcomes of POST /v1/room/submit (logged without token, room or address)."""
    OK = "accepted"
    UNKNOWN_ROOM = "unknown_room"
    EXPIRED = "room_expired"
    TOKEN = "token_rejected"
    RATE_LIMITED = "rate_limited"
    INVALID = "invalid"
    PENDING = "pending"
    UNAVAILABLE = "unavailable"


class RoomService:
    def __init__(self, appender, view: RoomInbox, control: PppControl, fail, *,
                 clock: Callable[[], float] = time.time, sequence_timeout: float = 10.0,
                 moderation: bool = False,
                 tell: Callable[[bytes, P.Reply], int] = lambda pubkey, reply: 0,
                 token_bytes: Callable[[int], bytes] = os.urandom):
        """`fail(cmd, reason, request_id)`: the PppService's counted, logged refusal.
        `tell(pubkey, reply)`: push a frame to that pubkey's open WebSockets here; returns
        how many."""
        self.appender = appender
        self.view = view
        self.control = control
        self.fail = fail
        self.clock = clock
        self.sequence_timeout = sequence_timeout
        self.moderation = moderation
        self.tell = tell
        # A knock whose admin has no WebSocket here: the push desk wakes the admin.
        self.on_admin_offline: Callable[[bytes], None] = lambda admin: None
        self.token_bytes = token_bytes
        self.knocks = KnockBook()
        self.stored = 0
        self.quiet = LogRate()   # storage failures: one line per 10 s while they last

    async def run(self, pubkey: bytes, cmd: P.RoomCommand, rid: str,
                  session: Subscriber | None) -> P.Reply:
        now = self.clock()
        if isinstance(cmd, P.CreateRoom):
            return await self._create(pubkey, cmd, rid, session, now)
        if isinstance(cmd, P.CreateGroup):
            return await self._create_group(pubkey, cmd, rid, session, now)
        if isinstance(cmd, (P.KickMember, P.BanMember)) and not self.moderation:
            return self.fail(cmd.name, DISABLED, rid)
        if isinstance(cmd, P.DiscoverRooms):
            try:
                cell = R.parse_cell(cmd.s2_cell_id)
            except R.CellError as e:
                return self.fail(cmd.name, e.args[0], rid)
            if cell.level() < R.MIN_DISCOVERY_LEVEL:
                return self.fail(cmd.name, f"s2 cell coarser than level "
                                           f"{R.MIN_DISCOVERY_LEVEL}", rid)
            found = self.control.rooms.discover(cell, now, R.MAX_DISCOVERED)
            return P.rooms([r.info(self.control.rooms.members(r.room_id)) for r in found])
        room = await self._room(cmd.room_id)
        if room is None:
            return self.fail(cmd.name, UNKNOWN_ROOM, rid)
        if room.expired(now):
            return self.fail(cmd.name, ROOM_EXPIRED, rid)
        if isinstance(cmd, (P.FetchRoom, P.StoreRoom, P.Knock)) and \
                self.control.rooms.banned(room.room_id, pubkey):
            return self.fail(cmd.name, BANNED, rid)
        if isinstance(cmd, P.Knock):
            return self._knock(pubkey, room, cmd, rid, now)
        if isinstance(cmd, P.FetchRoom):
            return await self._fetch(room, cmd.since_id, session, now)
        if isinstance(cmd, P.StoreRoom):
            return await self._store(pubkey, room, cmd, rid, session, now)
        if pubkey != room.admin:
            return self.fail(cmd.name, NOT_ADMIN, rid)
        if isinstance(cmd, P.UpdateRoom):
            await self.control.update_room(R.Room(
                room.room_id, room.admin, room.room_type, room.fine, room.coarse,
                room.gated if cmd.gated is None else cmd.gated,
                room.proximity_required if cmd.proximity_required is None
                else cmd.proximity_required,
                room.ble_enabled, room.max_members, room.created_at, room.expires_at))
            return P.room_updated(room.room_id)
        if isinstance(cmd, P.RegisterToken):
            try:
                VerifyKey(room.admin).verify(
                    R.token_signed_message(cmd.member_token, room.room_id), cmd.admin_signature)
            except (CryptoError, ValueError, TypeError):
                return self.fail(cmd.name, "bad admin signature", rid)
            why = await self.control.register_member(room, cmd.member_token)
            return P.token_registered() if why is None else self.fail(cmd.name, why, rid)
        if isinstance(cmd, P.RevokeTokens):
            return P.tokens_revoked(await self.control.revoke_members(room.room_id))
        if isinstance(cmd, P.RotateRoomKey):
            grace_until = int(now) + R.clamp_grace(cmd.grace_seconds)
            count = await self.control.rotate_members(room.room_id, grace_until * 1_000_000)
            self.view.key_rotated(room.room_id, grace_until, session)
            return P.key_rotated(room.room_id, count, grace_until)
        if isinstance(cmd, P.Admit):
            return await self._admit(pubkey, room, cmd, rid, now)
        if isinstance(cmd, P.DeleteGroup):
            if room.room_type != R.TYPE_GROUP:
                return self.fail(cmd.name, "not a group", rid)
            await self.control.delete_room(room)     # the commit point
            self.view.forget_room(room.room_id)
            self.knocks.drop_room(room.room_id)
            return P.group_deleted(room.room_id)
        if isinstance(cmd, (P.KickMember, P.BanMember)):
            return await self._moderate(room, cmd)
        return self.fail(cmd.name, DISABLED, rid)

    # --- rooms -----------------------------------------------------------------------------------
    async def _create(self, pubkey: bytes, cmd: P.CreateRoom, rid: str,
                      session: Subscriber | None, now: float) -> P.Reply:
        why = self._members_refused(cmd.max_members)
        if why is None and cmd.expires_at <= now:
            why = "expires_at must be in the future"
        if why is None:
            try:
                fine, coarse = R.parse_cell(cmd.s2_cell_id), R.parse_cell(cmd.s2_coarse_id)
                why = R.check_placement(fine, coarse)
            except R.CellError as e:
                why = e.args[0]
        if why is not None:
            return self.fail(cmd.name, why, rid)
        return await self._open(R.Room(
            cmd.room_id, pubkey, R.TYPE_ROOM, fine.to_token(), coarse.to_token(), cmd.gated,
            cmd.proximity_required, cmd.ble_enabled, cmd.max_members, int(now),
            min(cmd.expires_at, int(now) + MAX_EVENT_TTL_SECS)), cmd.name, rid, session, now)

    async def _create_group(self, pubkey: bytes, cmd: P.CreateGroup, rid: str,
                            session: Subscriber | None, now: float) -> P.Reply:
        why = self._members_refused(cmd.max_members)
        if why is not None:
            return self.fail(cmd.name, why, rid)
        return await self._open(R.Room(
            cmd.room_id, pubkey, R.TYPE_GROUP, None, None, cmd.gated, False, False,
            cmd.max_members, int(now), R.GROUP_EXPIRES_AT), cmd.name, rid, session, now)

    @staticmethod
    def _members_refused(max_members: int) -> str | None:
        if R.MIN_MEMBERS <= max_members <= R.MAX_MEMBERS:
            return None
        return f"max_members must be {R.MIN_MEMBERS}-{R.MAX_MEMBERS}"

    async def _open(self, room: R.Room, cmd: str, rid: str, session: Subscriber | None,
                    now: float) -> P.Reply:
        """A new room or group: durable, the creator's session subscribed, the reply."""
        why = await self.control.create_room(room, now)
        if why is not None:
            return self.fail(cmd, why, rid)
        if session is not None:
            self.view.subscribe(room.room_id, session)
        if room.room_type == R.TYPE_GROUP:
            return P.group_created(room.room_id)
        return P.room_created(room.room_id)

    # --- knock / admit (§7.4) --------------------------------------------------------------------
    def _knock(self, pubkey: bytes, room: R.Room, cmd: P.Knock, rid: str,
               now: float) -> P.Reply:
        if not (room.ble_enabled or room.room_type == R.TYPE_GROUP):
            return self.fail(cmd.name, "knock not enabled", rid)
        request_id = cmd.request_id or self.token_bytes(REQUEST_ID_LEN)
        knock = Knock(room.room_id, request_id, pubkey, cmd.knocker_eph_x25519_pk,
                      cmd.handle, now)
        if not self.knocks.add(knock):
            return self.fail(cmd.name, "duplicate request id", rid)
        if not self.tell(room.admin, P.knock_notify(room.room_id, knock.eph_pk, request_id,
                                                    knock.handle)):
            self.on_admin_offline(room.admin)    # spec 004 §7.4: "or push fallback"
        return P.knock_ok(request_id)

    async def _admit(self, pubkey: bytes, room: R.Room, cmd: P.Admit, rid: str,
                     now: float) -> P.Reply:
        knock = self.knocks.take(room.room_id, cmd.request_id, now)
        if knock is None:
            return self.fail(cmd.name, "unknown knock", rid)
        await self.control.remember_member(room.room_id, knock.knocker)
        told = self.tell(knock.knocker, P.admitted(room.room_id, knock.request_id, room.admin,
                                                   cmd.encrypted_grant))
        if not told:
            self.knocks.admitted(Admission(knock, room.admin, cmd.encrypted_grant))
        return P.admit_ok(knock.request_id, cmd.encrypted_grant)

    def on_login(self, pubkey: bytes) -> None:
        """A session of `pubkey` authenticated: admissions it missed are told now."""
        for a in self.knocks.admitted_for(pubkey, self.clock()):
            self.tell(pubkey, P.admitted(a.knock.room_id, a.knock.request_id, a.admin,
                                         a.grant))

    # --- moderation (§7.7) -----------------------------------------------------------------------
    async def _moderate(self, room: R.Room, cmd: P.KickMember | P.BanMember) -> P.Reply:
        member = cmd.member_pubkey
        if isinstance(cmd, P.BanMember):
            await self.control.ban_member(room.room_id, member)
        await self.control.forget_member(room.room_id, member)
        self.knocks.drop_knocker(room.room_id, member)
        self.view.unsubscribe_pubkey(room.room_id, member)
        self.tell(member, P.kicked(room.room_id))
        if isinstance(cmd, P.BanMember):
            return P.member_banned(room.room_id, member)
        return P.member_kicked(room.room_id, member)

    # --- messages --------------------------------------------------------------------------------
    async def _fetch(self, room: R.Room, since_id: int, session: Subscriber | None,
                     now: float) -> P.Reply:
        if session is not None:
            self.view.subscribe(room.room_id, session)
        msgs = self.view.fetch(room.room_id, since_id, R.FETCH_ROOM_LIMIT, now)
        envelopes = await self.view.envelopes_of(msgs)
        out = []
        for m, env in zip(msgs, envelopes):
            if env is None:
                continue   # left the inbox since (expired and compacted)
            nonce, ct = R.split_envelope(env)
            out.append({"id": m.cursor, "nonce": nonce, "ciphertext": ct,
                        "stored_at": m.stored_at})
        return P.room_messages(room.room_id, out)

    async def _room(self, room_id: bytes) -> R.Room | None:
        """The room, looked for in the tables too (created on another host)."""
        await self.control.known(lambda: room_id in self.control.rooms.rooms)
        return self.control.rooms.rooms.get(room_id)

    async def _store(self, pubkey: bytes, room: R.Room, cmd: P.StoreRoom, rid: str,
                     session: Subscriber | None, now: float) -> P.Reply:
        why = R.check_message(cmd.nonce, cmd.ciphertext)
        if why is not None:
            return self.fail(cmd.name, why, rid)
        if room.gated and pubkey != room.admin:
            rooms = self.control.rooms

            def member() -> tuple[bool, bool]:
                return (rooms.known_member(room.room_id, pubkey),
                        cmd.member_token is not None and rooms.token_valid(
                            room.room_id, cmd.member_token, int(now * 1_000_000)))
            # registered on another host: looked for in the tables before a refusal
            await self.control.known(lambda: any(member()))
            known, token = member()
            if not (known or token):
                return self.fail(cmd.name, MEMBERSHIP, rid)
            if token and not known:
                await self.control.remember_member(room.room_id, pubkey)
        if session is not None:
            self.view.subscribe(room.room_id, session)
        seq, why = await self.land(room, cmd.nonce, cmd.ciphertext, now)
        if why is not None:
            return self.fail(cmd.name, why, rid)
        return P.room_stored(room.room_id, seq)

    async def sealed(self, sub: P.SealedRoomSubmit,
                     token_allowed: Callable[[bytes], bool]) -> tuple[str, P.Reply | None]:
        """POST /v1/room/submit after the caller's body limit and per-IP budget, in §7.3's
        order: lengths, the room (known, not expired), the member token (grace period
        respected), the per-token budget (`token_allowed(room_id + token)`, the caller's
        limiter), then the landing: (outcome, ROOM_STORED or None)."""
        now = self.clock()
        if R.check_message(sub.nonce, sub.ciphertext) is not None:
            return SealedRoomOutcome.INVALID, None
        room = await self._room(sub.room_id)
        if room is None:
            return SealedRoomOutcome.UNKNOWN_ROOM, None
        if room.expired(now):
            return SealedRoomOutcome.EXPIRED, None
        if not await self.control.known(lambda: self.control.rooms.token_valid(
                room.room_id, sub.member_token, int(now * 1_000_000))):
            return SealedRoomOutcome.TOKEN, None
        if not token_allowed(sub.room_id + sub.member_token):
            return SealedRoomOutcome.RATE_LIMITED, None
        seq, why = await self.land(room, sub.nonce, sub.ciphertext, now)
        if why == PENDING:
            return SealedRoomOutcome.PENDING, None
        if why is not None:
            return SealedRoomOutcome.UNAVAILABLE, None
        return SealedRoomOutcome.OK, P.room_stored(room.room_id, seq)

    async def land(self, room: R.Room, nonce: bytes, ciphertext: bytes,
                   now: float) -> tuple[int | None, str | None]:
        """(sequence number, None) once the inbox row is in; (None, reason) otherwise."""
        eid = R.room_event_id(room.room_id, nonce, ciphertext)
        known = self.view.sequence_of(eid)
        if known is not None:
            return known, None
        fut = self.view.wait(eid)
        try:
            try:
                await self.appender.append({
                    C.EVENT_ID: eid, C.PROTOCOL: R.ROOM_PROTOCOL, C.MAILBOX: room.room_id,
                    C.ENVELOPE: R.room_envelope(nonce, ciphertext),
                    C.META: msgpack.packb(int(now)),
                    C.RECEIVED_AT: datetime.fromtimestamp(now, timezone.utc),
                    C.EXPIRES_AT: datetime.fromtimestamp(
                        min(room.expires_at, int(now) + MAX_EVENT_TTL_SECS), timezone.utc)})
            except Exception as exc:
                if (dropped := self.quiet.allow("room_store_failed")) is not None:
                    log.error("ppp room landing append failed", extra={
                        "event": "ppp_store_failed", "error": type(exc).__name__,
                        "suppressed": dropped})
                return None, "storage unavailable"
            self.stored += 1
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.sequence_timeout), None
            except asyncio.TimeoutError:
                return None, PENDING
        finally:
            if not fut.done():
                fut.cancel()
            self.view.forget_waiter(eid, fut)
