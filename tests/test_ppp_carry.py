"""Carry groups on the relay (spec 004 §8, `ingress/ppp_carry.py`) over real uvicorn, with
frames and signed bytes written here from the spec and the relay's documented choices
(`engine/ppp/carry.py`), not with the relay's encoder: registration and its refusals, consent
per member, leave, persistence across a restart, FETCH_CARRY over WebSocket and HTTP polling,
scoping between groups, page budgets, and the two ways carrying ends (the recipient's ACK, a
courier's ACK_CARRY).
"""

from __future__ import annotations

import asyncio
import os
import struct
import time

import msgpack
from nacl.signing import SigningKey

from ppp_wire import Ws, giftwrap, http_call, signed, signed_get, unpack
from test_ppp_client import NodeThread

WAIT = 90.0


def pk(sk: SigningKey) -> bytes:
    return bytes(sk.verify_key)


def register(sk, gid, members, couriers, *, sig=None) -> dict:
    ms, cs = sorted(members), sorted(couriers)
    msg = (b"PPP-carry-register-v1\x00" + gid + struct.pack(">H", len(ms)) + b"".join(ms)
           + struct.pack(">H", len(cs)) + b"".join(cs))
    return {"cmd": "REGISTER_CARRY_GROUP", "group_id": gid, "members": list(members),
            "couriers": list(couriers), "sig": sig if sig is not None else sk.sign(msg).signature}


def leave(sk, gid) -> dict:
    return {"cmd": "LEAVE_CARRY_GROUP", "group_id": gid,
            "sig": sk.sign(b"PPP-carry-leave-v1\x00" + gid).signature}


def fetch(sk, gid, since=0, cursor=None) -> dict:
    m = {"cmd": "FETCH_CARRY", "group_id": gid, "since": since,
         "sig": sk.sign(b"PPP-carry-fetch-v1\x00" + gid + struct.pack(">Q", since)).signature}
    if cursor is not None:
        m["cursor"] = cursor
    return m


def node(settings) -> NodeThread:
    settings.ppp.port = 0
    settings.ppp.notify_window_ms = 0
    return NodeThread(settings)


async def call(port, sk, *frames) -> list[dict]:
    ws = await Ws.login(port, sk)
    try:
        return [await ws.call(f) for f in frames]
    finally:
        await ws.close()


def refused(reply: dict, reason: str) -> bool:
    return reply["cmd"] == "STORE_FAIL" and reply["reason"].startswith(reason)


def test_registration_consent_leave_and_restart(settings):
    owner, bob, dan, carol, mallory = (SigningKey.generate() for _ in range(5))
    gid = os.urandom(16)
    members, couriers = [pk(owner), pk(bob), pk(dan)], [pk(carol)]
    n = node(settings)
    port = n.node.ppp.bound_port
    try:
        r = asyncio.run(call(port, owner,
                             register(owner, gid, members, couriers, sig=os.urandom(64)),
                             # a signature over the fields without the context: refused
                             register(owner, gid, members, couriers, sig=owner.sign(
                                 gid + b"".join(sorted(members))).signature),
                             register(owner, gid, [pk(owner)] * 2, couriers),
                             register(owner, gid, [], couriers),
                             register(owner, gid, members, couriers)))
        assert [x["cmd"] for x in r[:4]] == ["STORE_FAIL"] * 4
        assert refused(r[0], "bad signature") and refused(r[1], "bad signature")
        assert refused(r[2], "a key is listed twice")
        assert refused(r[3], "a carry group needs members")
        assert r[4] == {"cmd": "CARRY_GROUP_REGISTERED", "group_id": gid}
        too_many = [os.urandom(32) for _ in range(65)]
        (r,) = asyncio.run(call(port, owner, register(owner, os.urandom(16), too_many, couriers)))
        assert refused(r, "at most 64 members")
        # a stranger cannot join; a member consents only to exactly this group
        (r,) = asyncio.run(call(port, mallory, register(mallory, gid, members, couriers)))
        assert refused(r, "not a member of this carry group")
        r = asyncio.run(call(port, bob, register(bob, gid, members, couriers + [pk(mallory)]),
                             register(bob, gid, members, couriers)))
        assert refused(r[0], "carry group differs")
        assert r[1]["cmd"] == "CARRY_GROUP_REGISTERED"
        carry = n.node.ppp.service.carry
        assert carry.control.carry.carried(gid, pk(carol)) == {pk(owner), pk(bob)}  # not dan
        # one answer for a non-courier and for a group that does not exist
        r = asyncio.run(call(port, mallory, fetch(mallory, gid), fetch(mallory, os.urandom(16))))
        assert all(refused(x, "unknown carry group (request ") for x in r)
        (r,) = asyncio.run(call(port, carol, fetch(carol, gid, 5)))
        assert r == {"cmd": "CARRY_EVENTS", "events": []}
        (r,) = asyncio.run(call(port, carol, {**fetch(carol, gid), "since": 9}))  # sig for 0
        assert refused(r, "bad signature")
        (r,) = asyncio.run(call(port, mallory, leave(mallory, gid)))
        assert refused(r, "not in this carry group")
        (r,) = asyncio.run(call(port, bob, leave(bob, gid)))
        assert r == {"cmd": "CARRY_GROUP_LEFT", "group_id": gid}
        assert carry.control.carry.carried(gid, pk(carol)) == {pk(owner)}
        (r,) = asyncio.run(call(port, bob, register(bob, gid, members, couriers)))  # back
        # the owner adds a courier: every member is asked again
        (r,) = asyncio.run(call(port, owner, register(owner, gid, members,
                                                       couriers + [pk(mallory)])))
        assert carry.control.carry.carried(gid, pk(carol)) == {pk(owner)}
        (r,) = asyncio.run(call(port, bob, register(bob, gid, members,
                                                     couriers + [pk(mallory)])))
        assert r["cmd"] == "CARRY_GROUP_REGISTERED"
    finally:
        n.close()
    n = node(settings)                # the control rows rebuild the same groups
    try:
        carry = n.node.ppp.service.carry
        assert carry.control.carry.carried(gid, pk(carol)) == {pk(owner), pk(bob)}
        (r,) = asyncio.run(call(n.node.ppp.bound_port, owner, leave(owner, gid)))
        assert r["cmd"] == "CARRY_GROUP_LEFT"
        assert carry.control.carry.carried(gid, pk(carol)) is None      # dissolved
    finally:
        n.close()


async def _until(pred, what: str):
    deadline = time.monotonic() + WAIT
    while True:
        got = await pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def test_fetch_carry_scoping_budgets_and_the_end_of_carrying(spark, settings):
    from jobs.inbox_stream import start_inbox_stream
    settings.stream.trigger_interval_ms = 100
    alice, bob, dan, erin, carol, fred = (SigningKey.generate() for _ in range(6))
    g1, g2 = os.urandom(16), os.urandom(16)
    n = node(settings)
    port = n.node.ppp.bound_port
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        async def scenario():
            # g1, owned by its courier carol: bob and dan listed, only bob consents.
            # g2: erin, who owns it; fred carries.
            await call(port, carol, register(carol, g1, [pk(bob), pk(dan)], [pk(carol)]))
            await call(port, bob, register(bob, g1, [pk(bob), pk(dan)], [pk(carol)]))
            await call(port, erin, register(erin, g2, [pk(erin)], [pk(fred)]))
            ws = await Ws.login(port, alice)
            sent = {}
            for who, k in (("bob", bob), ("bob", bob), ("bob", bob), ("dan", dan),
                           ("erin", erin)):
                wrap, eid = giftwrap(pk(k))
                assert (await ws.call({"cmd": "STORE", "event": wrap}))["cmd"] == "STORED"
                sent.setdefault(who, []).append((wrap, eid))
            await ws.close()
            bobs = {w for w, _ in sent["bob"]}

            async def carried(courier, gid):
                (r,) = await call(port, courier, fetch(courier, gid))
                assert r["cmd"] == "CARRY_EVENTS"
                return set(r["events"])
            inbox = n.node.ppp.inbox     # waited on directly: FETCH_CARRY has a rate budget

            async def landed():
                return all(inbox.pending_count(pk(k)) == c for k, c in ((bob, 3), (dan, 1),
                                                                         (erin, 1)))
            await _until(landed, "the stream to put the five events in the inbox")
            assert await carried(carol, g1) == bobs   # never dan's (no consent), never erin's
            assert await carried(fred, g2) == {sent["erin"][0][0]}
            # HTTP polling: the same, signed by the Authorization header
            q = f"/v1/events/carry?group={g1.hex()}&since=0"
            status, body, _ = http_call(port, "GET", q, headers=signed_get(carol, q))
            assert status == 200 and set(unpack(body)["events"]) == bobs
            q = f"/v1/events/carry?group={g2.hex()}"
            status, body, _ = http_call(port, "GET", q, headers=signed_get(carol, q))
            assert status == 400 and unpack(body)["reason"].startswith("unknown carry group")
            for bad in ("zz", g1.hex()[:30], g1.hex() + "00"):
                q = f"/v1/events/carry?group={bad}"
                status, _, _ = http_call(port, "GET", q, headers=signed_get(carol, q))
                assert status in (400, 422)
            status, _, _ = http_call(port, "GET", f"/v1/events/carry?group={g1.hex()}")
            assert status == 401
            # budgets: pages of at most page_size events and page_bytes bytes, then a cursor
            svc = n.node.ppp.service.carry
            svc.page_size = 2
            seen, cursor, pages = [], None, 0
            while True:
                (r,) = await call(port, carol, fetch(carol, g1, cursor=cursor))
                seen += r["events"]
                pages += 1
                assert len(r["events"]) <= 2
                cursor = r.get("cursor")
                if cursor is None:
                    break
            assert pages == 2 and sorted(seen) == sorted(bobs)
            svc.page_size, svc.page_bytes = 100, 1     # one event, the least a page holds
            (r,) = await call(port, carol, fetch(carol, g1))
            assert len(r["events"]) == 1 and r["cursor"] == 1
            svc.page_bytes = 1 << 20
            # bob ACKs one himself: no longer carried
            (b1, e1), (b2, e2), (b3, e3) = sent["bob"]
            (r,) = await call(port, bob, {"cmd": "ACK", "event_ids": [e1]})
            assert r == {"cmd": "ACKED", "count": 1}
            assert await carried(carol, g1) == {b2, b3}
            # carol reports one handed over (over HTTP): no longer offered to couriers, but
            # bob's own FETCH still serves it until he ACKs
            body = msgpack.packb({"group_id": g1, "event_ids": [e2, os.urandom(32)]})
            status, raw, _ = http_call(port, "POST", "/v1/events/carry/ack", body,
                                       signed(carol, body))
            assert status == 200 and unpack(raw) == {"cmd": "ACKED", "count": 1}
            assert await carried(carol, g1) == {b3}
            (r,) = await call(port, bob, {"cmd": "FETCH", "since": 0})
            assert set(r["events"]) == {b2, b3}
            # fred (g2's courier) cannot report g1's events, nor erin's through g1
            (r,) = await call(port, fred, {"cmd": "ACK_CARRY", "group_id": g1, "event_ids": [e3]})
            assert refused(r, "unknown carry group")
            (r,) = await call(port, carol, {"cmd": "ACK_CARRY", "group_id": g1,
                                            "event_ids": [sent["erin"][0][1]]})
            assert r == {"cmd": "ACKED", "count": 0}
            assert await carried(fred, g2) == {sent["erin"][0][0]}
            # bob leaves: his events are no longer fetched
            (r,) = await call(port, bob, leave(bob, g1))
            assert r["cmd"] == "CARRY_GROUP_LEFT"
            assert await carried(carol, g1) == set()
        asyncio.run(scenario())
    finally:
        query.stop()
        n.close()

