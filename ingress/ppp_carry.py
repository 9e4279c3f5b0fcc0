"""Carry groups on the relay (spec 004 §8): REGISTER_CARRY_GROUP, LEAVE_CARRY_GROUP,
FETCH_CARRY and ACK_CARRY, for both transports (`PppService.run` hands them here).

Who may do what is `engine/ppp/carry.py`; the groups are PPP control rows
(`ppp_carry_groups`, written before the reply). A courier is served from the PPP inbox view
of this process: the still-unacked, unexpired inbox events of the group's consenting members
(never a departed member's, never another group's), `created_at > since`, oldest first, in
pages of at most `FETCH_PAGE_SIZE` events and `CARRY_PAGE_BYTES` envelope bytes; `cursor`
continues a page (an offset: events acked between pages can shift it, so a courier that
matters fetches from `since` again later; it dedups by event id).

Carrying ends for an event when its recipient ACKs it (any path: the inbox drops it) or when
a courier of the group reports having handed it over (ACK_CARRY). A courier's report only
stops couriers being offered the event: the recipient's own FETCH still serves it until the
recipient ACKs, so a lying courier can make mail travel the slow way, never vanish. Reports
are held in memory until the event expires; after a restart couriers may be offered an event
once more, which its recipient drops as a duplicate.
"""

from __future__ import annotations

from typing import Callable

from delta_tables.ppp_control import PppControl
from egress.ppp_inbox import PppEvent, PppInbox
from engine.ppp import carry as K
from engine.ppp import protocol as P
from engine.ppp.limits import CARRY_PAGE_BYTES, FETCH_PAGE_SIZE, MAX_ACK_IDS


class CarryService:
    def __init__(self, inbox: PppInbox, control: PppControl,
                 fail: Callable[[str, str, str], P.Reply], *, clock: Callable[[], float],
                 page_size: int = FETCH_PAGE_SIZE, page_bytes: int = CARRY_PAGE_BYTES):
        self.inbox = inbox
        self.control = control
        self._fail = fail
        self.clock = clock
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.handed_over: dict[bytes, float] = {}   # event id -> expires (ACK_CARRY)

    async def run(self, pubkey: bytes, cmd: P.CarryCommand, request_id: str) -> P.Reply:
        if isinstance(cmd, P.RegisterCarryGroup):
            return await self.register(pubkey, cmd, request_id)
        if isinstance(cmd, P.LeaveCarryGroup):
            if not K.verified(pubkey, K.leave_message(cmd.group_id), cmd.sig):
                return self._fail(cmd.name, "bad signature", request_id)
            why = await self.control.carry_change(K.OP_LEAVE, pubkey, cmd.group_id, None)
            if why is not None:
                return self._fail(cmd.name, why, request_id)
            return P.carry_group_left(cmd.group_id)
        if isinstance(cmd, P.FetchCarry):
            return await self.fetch(pubkey, cmd, request_id)
        return self.ack(pubkey, cmd, request_id)

    async def register(self, pubkey: bytes, cmd: P.RegisterCarryGroup,
                       request_id: str) -> P.Reply:
        try:
            d = K.Definition.of(cmd.members, cmd.couriers)
        except K.CarryError as e:
            return self._fail(cmd.name, e.args[0], request_id)
        if not K.verified(pubkey, K.register_message(cmd.group_id, d), cmd.sig):
            return self._fail(cmd.name, "bad signature", request_id)
        why = await self.control.carry_change(K.OP_REGISTER, pubkey, cmd.group_id, d)
        if why is not None:
            return self._fail(cmd.name, why, request_id)
        return P.carry_group_registered(cmd.group_id)

    def _carried(self, courier: bytes, cmd) -> frozenset[bytes] | None:
        return self.control.carry.carried(cmd.group_id, courier)

    def _offered(self, members: frozenset[bytes], since: int, now: float) -> list[PppEvent]:
        gone = [i for i, exp in self.handed_over.items() if exp <= now]
        for i in gone:
            del self.handed_over[i]
        evts = [ev for m in members for ev in self.inbox.inbox_events(m, since, now)
                if ev.event_id not in self.handed_over and ev.wrap_id not in self.handed_over]
        evts.sort(key=lambda ev: (ev.created_at, ev.event_id))
        return evts

    async def fetch(self, pubkey: bytes, cmd: P.FetchCarry, request_id: str) -> P.Reply:
        """`cmd.sig` None: HTTP, where the Authorization header signed the request."""
        if cmd.sig is not None and not K.verified(
                pubkey, K.fetch_message(cmd.group_id, cmd.since), cmd.sig):
            return self._fail(cmd.name, "bad signature", request_id)
        # registered on another host: looked for in the tables before a refusal
        await self.control.known(lambda: self._carried(pubkey, cmd) is not None)
        members = self._carried(pubkey, cmd)
        if members is None:
            return self._fail(cmd.name, K.UNKNOWN, request_id)
        offset = cmd.cursor or 0
        evts = self._offered(members, cmd.since, self.clock())
        page: list[PppEvent] = []
        size = 0
        for ev in evts[offset:offset + self.page_size]:
            if page and size + ev.size > self.page_bytes:
                break
            page.append(ev)
            size += ev.size
        envelopes = await self.inbox.envelopes_of(page)
        nxt = offset + len(page)
        return P.events([e for e in envelopes if e is not None],
                        nxt if nxt < len(evts) else None, "CARRY_EVENTS")

    def ack(self, pubkey: bytes, cmd: P.AckCarry, request_id: str) -> P.Reply:
        if len(cmd.event_ids) > MAX_ACK_IDS:
            return self._fail(cmd.name, "too many event ids", request_id)
        members = self._carried(pubkey, cmd)
        if members is None:
            return self._fail(cmd.name, K.UNKNOWN, request_id)
        count = 0
        for eid in cmd.event_ids:
            for m in members:
                ev = self.inbox.pending_event(m, eid)
                if ev is not None:
                    count += ev.event_id not in self.handed_over
                    self.handed_over[ev.event_id] = ev.expires
                    break
        return P.acked(count)
