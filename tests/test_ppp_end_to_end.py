"""PPP end to end, all real: the ingress node (uvicorn on loopback, landing group commit),
Spark Structured Streaming into the inbox, the PPP inbox tail, NOTIFY, FETCH, ACK, acks rows.

Two users with Ed25519 identities. Alice wraps a real PRESENCE event for bob with the PPP
client library (`engine/ppp/wrap.py`) and STOREs it over an authenticated WebSocket; she also
submits a second one sealed (POST /v1/note/submit) with the pairwise delivery token bob
registered (`engine/ppp/tokens.py`). Bob, connected, gets NOTIFY (window 100 ms here), FETCHes
both GiftWraps, unwraps them and checks alice's signature, ACKs them (the sealed one by its
GiftWrap id: he cannot know which token carried it), and a second FETCH is empty.
Frames are msgpack maps built here from the spec's tables (`ppp_wire`).
"""

from __future__ import annotations

import asyncio
import time

import msgpack
from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.schema import C
from engine.ppp.keys import Identity
from engine.ppp.tokens import recipient_delivery_token, sender_delivery_token
from engine.ppp.wrap import Kind, PresenceContent, Region, Rumor, TimeWindow, unwrap, wrap
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream

from ppp_wire import Ws, ahttp, pack, unpack

NOTIFY_TIMEOUT = 60.0   # one micro-batch normally; generous for a loaded 2-core machine


def presence(sender: Identity, recipient: Identity, message: str):
    now = int(time.time())
    rumor = Rumor(sender.pubkey, Kind.PRESENCE, PresenceContent(
        b"u" * 16, message, Region(52.52, 13.405, 150), TimeWindow(now, now + 3600, "UTC"),
        (recipient.pubkey,)), now)
    return wrap(rumor, sender, recipient.pubkey, created_at=now, expires_at=now + 86400)


def test_two_users_store_sealed_notify_fetch_ack(spark, settings):
    settings.stream.trigger_interval_ms = 100
    settings.heya.enabled = False
    settings.ppp.notify_window_ms = 100
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        stored_id, sealed_wrap_id = asyncio.run(_scenario(settings))
    finally:
        query.stop()
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    ppp = [r for r in inbox if r[C.PROTOCOL] == "ppp"]
    assert sorted(r[C.CURSOR] for r in ppp) == [1, 2]
    acks = DeltaTable(str(Layout.of(settings).acks)).to_pyarrow_table().to_pylist()
    assert {(a[C.PROTOCOL], a[C.SEQ]) for a in acks} == {("ppp", r[C.SEQ]) for r in ppp}
    assert stored_id in {a[C.EVENT_ID] for a in acks}
    # The padding audit sees the seal's bucket through the GiftWrap (stream.padding_overhead.ppp)
    audit = DeltaTable(str(Layout.of(settings).padding_audit)).to_pyarrow_table()
    ppp_audit = [r for r in audit.to_pylist() if r[C.PROTOCOL] == "ppp"]
    assert sum(r[C.ENVELOPES] for r in ppp_audit) == 2
    assert all(r[C.CONFORMING] and r[C.BUCKET] == 1024 for r in ppp_audit)


async def _scenario(settings):
    alice, bob = Identity.generate(), Identity.generate()
    a_sk, b_sk = SigningKey(alice.seed), SigningKey(bob.seed)
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.ppp.bound_port
        b = await Ws.login(port, b_sk)
        r = await b.call({"cmd": "REGISTER_DELIVERY_TOKEN",
                          "delivery_token": recipient_delivery_token(bob, alice.pubkey)})
        assert r == {"cmd": "DELIVERY_TOKEN_REGISTERED"}
        a = await Ws.login(port, a_sk)

        gw1 = presence(alice, bob, "meet at the fountain")
        r = await a.call({"cmd": "STORE", "event": gw1.encode()})
        assert r == {"cmd": "STORED", "event_id": gw1.event_id}

        gw2 = presence(alice, bob, "sealed: I was here")
        body = pack({"delivery_token": sender_delivery_token(alice, bob.pubkey),
                     "ephemeral_pk": gw2.ephemeral_pk, "nonce": gw2.nonce,
                     "ciphertext": gw2.ciphertext, "created_at": gw2.created_at,
                     "expires_at": gw2.expires_at})
        status, resp, _ = await ahttp(port, "POST", "/v1/note/submit", body,
                                      {"Content-Type": "application/msgpack"})
        assert status == 200 and unpack(resp)["cmd"] == "STORED"

        # NOTIFY: bob is connected to this node, so right after each landing commit, before
        # the stream (issue 20's live path); batched: one or two NOTIFYs, 2 in total
        seen = 0
        while seen < 2:
            n = await b.recv(timeout=NOTIFY_TIMEOUT)
            assert n["cmd"] == "NOTIFY"
            seen += n["count"]
        assert seen == 2
        got = await b.call({"cmd": "FETCH", "since": 0})
        assert got["cmd"] == "EVENTS" and len(got["events"]) == 2 and "cursor" not in got
        opened = [unwrap(e, bob) for e in got["events"]]
        assert [o.rumor.content.message for o in opened] == ["meet at the fountain",
                                                             "sealed: I was here"]
        assert all(o.sender == alice.pubkey for o in opened)   # seal signature verified
        # What bob can compute from what he fetched: the GiftWrap (authenticated-path) ids.
        ids = [o.giftwrap.event_id for o in opened]
        assert await a.call({"cmd": "ACK", "event_ids": ids}) == {"cmd": "ACKED", "count": 0}
        assert await b.call({"cmd": "ACK", "event_ids": ids}) == {"cmd": "ACKED", "count": 2}
        assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
        assert msgpack.unpackb(got["events"][1], strict_map_key=False)[1] == bob.pubkey
        # The stream's inbox rows follow: no second NOTIFY, and the ACKs given before them
        # become ack rows once they carry a seq.
        deadline = time.monotonic() + NOTIFY_TIMEOUT
        view = node.ppp.inbox
        while view.early_bytes or node.ppp.service.acks_waiting:
            assert time.monotonic() < deadline, "the stream's rows never arrived"
            await asyncio.sleep(0.05)
        try:
            extra = await b.recv(timeout=0.3)
        except asyncio.TimeoutError:
            extra = None
        assert extra is None
        assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
        return gw1.event_id, ids[1]
    finally:
        await node.close()
