"""Push wake-ups end to end, all real: the ingress node (PPP over uvicorn, Heya over TLS,
cursor-sync over QUIC), the Spark stream into the inbox, the push job (`egress/push/job.py`)
with its production provider clients, and providers on loopback that answer as APNs, FCM
and Web Push document (relay/bench/push_providers.py: HTTP/2 + TLS + ES256 JWT for APNs, OAuth2
JWT-bearer + FCM v1 for FCM, RFC 8291 encrypted bodies for Web Push).

PPP: bob registers a token on each platform (REGISTER_PUSH -> PUSH_REGISTERED), goes offline,
and a burst of events for him wakes each device exactly once; online, he is not woken; a 410
deletes carol's token (in memory, in the Delta table, and after a reload); dave's 503s are
retried; a knock wakes an offline admin; no provider request carries an envelope byte, a
pubkey, a room id or an event id. Heya and cursor-sync wake their offline devices the same
way (Heya through APNs, cursor-sync through FCM and Web Push), never the pushing device.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import http_ece
from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.ppp_state import load_state
from delta_tables.schema_ppp import PPP_PUSH_TOKENS, PPP_TABLES
from delta_tables.schema_push import PUSH_LOG
from egress.push.job import PushJob
from egress.push.providers import providers
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream

from relay.bench.push_providers import FakeApns, FakeFcm, FakeWebPush
from ppp_wire import Ws, giftwrap, unpack

WAIT = 60.0


async def until(cond, timeout: float = WAIT, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def push_log(settings) -> list[dict]:
    return DeltaTable(str(Layout.of(settings).table(PUSH_LOG))).to_pyarrow_table() \
        .to_pylist()


class Providers:
    def __init__(self, tmp_path):
        self.apns = FakeApns(tmp_path)
        self.fcm = FakeFcm(tmp_path)
        self.webpush = FakeWebPush()

    async def __aenter__(self):
        await self.apns.start()
        await self.fcm.start()
        await self.webpush.start()
        return self

    async def __aexit__(self, *exc):
        await self.apns.close()
        await self.fcm.close()
        await self.webpush.close()

    def configure(self, settings) -> None:
        self.apns.conf(settings)
        self.fcm.conf(settings)
        settings.push.webpush.vapid_subject = "mailto:ops@relay.example"
        settings.push.webpush.allow_private_endpoints = True   # the fake is on loopback

    def requests_to(self, token: str) -> list:
        """Every provider request that addressed `token`."""
        out = [r for r in self.apns.requests if r.path.endswith("/" + token)]
        out += [r for r in self.fcm.requests if json.loads(r.body)["message"]["token"] == token]
        out += [r for r in self.webpush.requests if r.path == f"/wp/{token}"]
        return out


def _base_settings(settings, tmp_path):
    settings.stream.trigger_interval_ms = 100
    settings.ppp.notify_window_ms = 100
    settings.push.window_seconds = 4.0
    settings.push.retry_base_ms = 50
    settings.push.retry_max_ms = 200


class JobRunner:
    def __init__(self, settings):
        self.job = PushJob(settings, providers(settings.push, settings.data_dir))
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        self.task = asyncio.create_task(self.job.run(self.stop))
        return self.job

    async def __aexit__(self, *exc):
        self.stop.set()
        await self.task


def test_ppp_wakeups(spark, settings, tmp_path):
    _base_settings(settings, tmp_path)
    settings.heya.enabled = False
    settings.sync.enabled = False
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        out = asyncio.run(_ppp(settings, tmp_path))
    finally:
        query.stop()
    log = push_log(settings)
    final = [r for r in log if r["outcome"] != "intent"]
    # every real request had its intent recorded first, under the same wake_at
    intents = {(r["device"], r["wake_at"]) for r in log if r["outcome"] == "intent"}
    assert {(r["device"], r["wake_at"]) for r in final} == intents
    assert {r["outcome"] for r in final} >= {"sent", "unregistered"}
    retried = [r for r in final if r["attempts"] == 3]
    assert len(retried) == 1 and retried[0]["outcome"] == "sent"          # dave: 503, 503, 200
    assert all(r["inbox_to_push_ms"] is not None for r in final if r["trigger"] == "message")
    # push_log never holds a token or a pubkey
    raw = json.dumps([{k: (v.hex() if isinstance(v, bytes) else str(v)) for k, v in r.items()}
                      for r in log])
    for secret in out["secrets"]:
        assert secret not in raw
    # carol's dead token: deleted in the Delta table, and still gone after a reload
    paths = Layout.of(settings).table_paths(PPP_TABLES)
    rows = DeltaTable(str(paths[PPP_PUSH_TOKENS.name])).to_pyarrow_table().to_pylist()
    assert [r["op"] for r in sorted(rows, key=lambda r: r["at"])
            if r["pubkey"] == out["carol"]] == ["register", "deregister"]
    assert load_state(paths).push_tokens(out["carol"]) == []
    assert len(load_state(paths).push_tokens(out["bob"])) == 3


async def _ppp(settings, tmp_path):
    async with Providers(tmp_path) as prov:
        prov.configure(settings)
        node = IngressNode(settings, fsync=False)
        await node.start()
        try:
            async with JobRunner(settings) as job:
                return await _ppp_scenario(settings, node, job, prov)
        finally:
            await node.close()


async def _ppp_scenario(settings, node, job, prov):
    port = node.ppp.bound_port
    bob_sk, alice_sk, carol_sk, dave_sk, frank_sk, erin_sk = (
        SigningKey.generate() for _ in range(6))
    bob, carol, dave, frank = (bytes(k.verify_key) for k in (bob_sk, carol_sk, dave_sk,
                                                              frank_sk))
    apns_bob, fcm_bob = os.urandom(32).hex(), "fcm-bob-" + os.urandom(8).hex()
    sub_bob, ua_key, ua_auth = prov.webpush.subscription("bob")
    apns_carol, fcm_dave, apns_frank = (os.urandom(32).hex(), "fcm-dave-" + os.urandom(8).hex(),
                                        os.urandom(32).hex())
    prov.apns.script.answers[apns_carol] = [410]
    prov.fcm.script.answers[fcm_dave] = [503, 503, 200]

    b = await Ws.login(port, bob_sk)
    for platform, token in (("apns", apns_bob), ("fcm", fcm_bob), ("webpush", sub_bob)):
        assert await b.call({"cmd": "REGISTER_PUSH", "platform": platform,
                             "token": token}) == {"cmd": "PUSH_REGISTERED"}
    # registering again is idempotent; malformed registrations are refused, nothing stored
    assert await b.call({"cmd": "REGISTER_PUSH", "platform": "apns",
                         "token": apns_bob}) == {"cmd": "PUSH_REGISTERED"}
    for platform, token in (("sms", "x"), ("apns", "not-hex"), ("webpush", "{}"),
                            ("fcm", "")):
        r = await b.call({"cmd": "REGISTER_PUSH", "platform": platform, "token": token})
        assert r["cmd"] == "STORE_FAIL" and r["reason"].startswith("bad push token"), r
    assert len(node.ppp.control.push_tokens(bob)) == 3
    for sk, platform, token in ((carol_sk, "apns", apns_carol), (dave_sk, "fcm", fcm_dave),
                                (frank_sk, "apns", apns_frank)):
        c = await Ws.login(port, sk)
        assert await c.call({"cmd": "REGISTER_PUSH", "platform": platform,
                             "token": token}) == {"cmd": "PUSH_REGISTERED"}
        await c.close()
    await b.close()
    await until(lambda: bob not in node.ppp.inbox.sessions, what="bob offline")

    # 1. A burst of five events to offline bob: one wake-up per device.
    a = await Ws.login(port, alice_sk)
    wraps = [giftwrap(bob) for _ in range(5)]
    for gw, eid in wraps:
        assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    await until(lambda: all(len(prov.requests_to(t)) == 1 for t in (apns_bob, fcm_bob, "bob")),
                what="bob's three devices woken")
    # the burst's later rows are covered by that wake-up: nothing more within the window,
    # nor after it (bob never came back)
    await asyncio.sleep(settings.push.window_seconds + 1.5)
    assert [len(prov.requests_to(t)) for t in (apns_bob, fcm_bob, "bob")] == [1, 1, 1]

    # 2. Online bob is not woken (he gets NOTIFY on his WebSocket).
    b = await Ws.login(port, bob_sk)
    gw, _ = giftwrap(bob)
    assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    assert (await b.recv(timeout=WAIT))["cmd"] == "NOTIFY"
    inbox_now = DeltaTable(str(Layout.of(settings).inbox)).version()
    await until(lambda: job.version >= inbox_now and not job.held, what="the job to read it")
    await asyncio.sleep(0.5)
    assert [len(prov.requests_to(t)) for t in (apns_bob, fcm_bob, "bob")] == [1, 1, 1]
    fetched = await b.call({"cmd": "FETCH", "since": 0})
    assert len(fetched["events"]) == 6
    await b.close()
    await until(lambda: bob not in node.ppp.inbox.sessions, what="bob offline again")

    # 3. Back offline after he used the wake-up: news wakes him again (once per window).
    gw, _ = giftwrap(bob)
    assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    await until(lambda: all(len(prov.requests_to(t)) == 2 for t in (apns_bob, fcm_bob, "bob")),
                what="bob woken a second time")

    # 4. carol's token is dead (410): deleted; dave's provider fails twice (503), then takes it.
    for who in (carol, dave):
        gw, _ = giftwrap(who)
        assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    await until(lambda: node.ppp.control.push_tokens(carol) == [], what="carol's token removed")
    await until(lambda: len(prov.requests_to(fcm_dave)) == 3, what="dave's retries")
    assert len(prov.requests_to(apns_carol)) == 1
    gw, _ = giftwrap(carol)                       # carol's token is gone: no more attempts
    assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    inbox_now = DeltaTable(str(Layout.of(settings).inbox)).version()
    await until(lambda: job.version >= inbox_now and not job.held, what="the job to read it")
    await asyncio.sleep(0.5)
    assert len(prov.requests_to(apns_carol)) == 1

    # 5. A knock on frank's group while frank is offline wakes frank (spec 004 §7.4).
    f = await Ws.login(port, frank_sk)
    gid = os.urandom(16)
    assert (await f.call({"cmd": "CREATE_GROUP", "room_id": gid, "gated": True,
                          "max_members": 10}))["cmd"] == "GROUP_CREATED"
    await f.close()
    await until(lambda: frank not in node.ppp.inbox.sessions, what="frank offline")
    e = await Ws.login(port, erin_sk)
    r = await e.call({"cmd": "KNOCK", "room_id": gid, "knocker_eph_x25519_pk": os.urandom(32)})
    assert r["cmd"] == "KNOCK_OK"
    await until(lambda: len(prov.requests_to(apns_frank)) == 1, what="frank woken by a knock")

    # 6. Woken, online within the window (he fetched), offline again, news: one more
    #    wake-up, at the end of the window, not at once.
    gina_sk = SigningKey.generate()
    gina, apns_gina = bytes(gina_sk.verify_key), os.urandom(32).hex()
    g = await Ws.login(port, gina_sk)
    assert (await g.call({"cmd": "REGISTER_PUSH", "platform": "apns", "token": apns_gina}))[
        "cmd"] == "PUSH_REGISTERED"
    await g.close()
    await until(lambda: gina not in node.ppp.inbox.sessions, what="gina offline")
    gw, _ = giftwrap(gina)
    assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    await until(lambda: len(prov.requests_to(apns_gina)) == 1, what="gina woken")
    first = prov.apns.arrival_times[-1][0]
    g = await Ws.login(port, gina_sk)
    await g.close()
    await until(lambda: gina not in node.ppp.inbox.sessions, what="gina offline again")
    gw, _ = giftwrap(gina)
    assert (await a.call({"cmd": "STORE", "event": gw}))["cmd"] == "STORED"
    await until(lambda: len(prov.requests_to(apns_gina)) == 2, what="gina's deferred wake-up")
    second = [t for t, tok, _ in prov.apns.arrival_times if tok == apns_gina][-1]
    assert second - first >= settings.push.window_seconds - 0.5
    assert job.stats.decided["defer"] >= 1

    # The payloads: wake signals only.
    secrets = [bob, carol, dave, frank, bytes(alice_sk.verify_key), gid] + [
        eid for _, eid in wraps] + [unpack(gw)[4][:32] for gw, _ in wraps]
    everything = [r for r in prov.apns.requests + prov.fcm.requests + prov.webpush.requests]
    for req in everything:
        blob = req.body + json.dumps(req.headers).encode() + req.path.encode()
        for s in secrets:
            assert s not in blob and s.hex().encode() not in blob
    for req in prov.apns.requests:
        body = json.loads(req.body)
        assert body == {"aps": {"alert": {"loc-key": "PPP_NEW_MESSAGE"}, "mutable-content": 1,
                                "sound": "default"}}
        assert req.headers["apns-push-type"] == "alert" and req.headers["apns-collapse-id"]
    for req in prov.fcm.requests:
        msg = json.loads(req.body)["message"]
        assert msg["data"] == {"wake": "1"} and msg["android"]["priority"] == "HIGH"
    assert prov.fcm.token_requests >= 1
    for req in [r for r in prov.webpush.requests if r.path == "/wp/bob"]:
        assert req.headers["content-encoding"] == "aes128gcm"
        assert req.headers["authorization"].startswith("vapid t=")
        plain = http_ece.decrypt(req.body, private_key=ua_key, auth_secret=ua_auth,
                                 version="aes128gcm")
        assert plain == b'{"wake":1}'
    assert prov.apns.bad_auth == 0
    await a.close()
    await e.close()
    return {"carol": carol, "bob": bob,
            "secrets": [x.hex() for x in (bob, carol, dave, frank)] + [apns_bob, fcm_bob,
                                                                      apns_carol, fcm_dave]}


def test_heya_and_sync_wakeups(spark, settings, tmp_path):
    _base_settings(settings, tmp_path)
    settings.ppp.enabled = False
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        asyncio.run(_heya_sync(settings, tmp_path))
    finally:
        query.stop()
    final = [r for r in push_log(settings) if r["outcome"] not in ("intent",)]
    assert {(r["protocol"], r["platform"], r["outcome"]) for r in final} == {
        ("heya", "apns", "sent"), ("sync", "fcm", "sent"), ("sync", "webpush", "sent"),
        ("sync", "apns", "unregistered")}


async def _heya_sync(settings, tmp_path):
    from delta_tables.heya_control import mint_inbox_tokens
    from heya_client import Cert, HeyaClient, recv_line, send_line
    from sync_client import Device, device_session, group_id, push, register_push

    async with Providers(tmp_path) as prov:
        prov.configure(settings)
        (inbox_token,) = mint_inbox_tokens(Layout.of(settings), fsync=False)
        node = IngressNode(settings, fsync=False)
        await node.start()
        try:
            async with JobRunner(settings):
                # Heya: alice's mailbox with an iOS device token (IOSA), then offline.
                port = node.heya.bound_port
                alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
                a = await HeyaClient.connect(port, alice)
                a.send(b"INCO " + inbox_token.hex().encode() + b"\n")
                await a.expect(b"INCO ")
                await a.read_exact(64)
                await a.expect(b"\n")
                a.send(b"AUTH 0 2220385707\n")
                await a.expect(b"AUTH ")
                t_hex = await a.read_exact(64)
                await a.expect(b" 0 2220385707\n")
                ios = os.urandom(32).hex()
                a.send(b"IOSA " + ios.encode() + b"\n")
                await a.expect(b"IOSA " + ios.encode() + b"\n")
                a.send(b"QUIT\n")
                assert await a.closed_by_server()
                b = await HeyaClient.connect(port, bob)
                for body in (b"one", b"two", b"three"):
                    b.send(send_line(t_hex, body))
                    await b.expect(recv_line(body))
                await until(lambda: len(prov.requests_to(ios)) == 1, what="alice's iPhone woken")

                # cursor-sync: device a pushes; b (FCM) and c (Web Push) are offline; d's
                # APNs token is dead. a itself is never woken for its own blobs.
                sport = node.sync.bound_port
                g, da, db, dc, dd = group_id(b"push"), Device(), Device(), Device(), Device()
                ca, _ = await device_session(sport, da, g, version=1)
                exp = 2 ** 40
                fcm_b, apns_a, apns_d = "fcm-b-" + os.urandom(8).hex(), os.urandom(32).hex(), \
                    os.urandom(32).hex()
                sub_c, _, _ = prov.webpush.subscription("c")
                prov.apns.script.answers[apns_d] = [410]
                assert await ca.request(register_push("apns", apns_a)) == ["Done", "RegisterPush"]
                for dev, platform, token in ((db, "fcm", fcm_b), (dc, "webpush", sub_c),
                                             (dd, "apns", apns_d)):
                    c, _ = await device_session(sport, dev, g, admission=[
                        da.id, exp, da.admit(g, dev.id, exp)])
                    assert await c.request(register_push(platform, token)) == [
                        "Done", "RegisterPush"]
                    await c.close()
                await until(lambda: len(node.sync.group_sessions(g)) == 1, what="b, c, d gone")
                for n in range(1, 4):
                    assert (await ca.request(push(n.to_bytes(16, "big"), b"blob", 0)))[0] == \
                        "PushAck"
                await until(lambda: all(len(prov.requests_to(t)) == 1
                                        for t in (fcm_b, "c", apns_d)), what="b, c, d woken")
                await until(lambda: (g, dd.id) not in node.sync.control.state.push,
                            what="d's dead token deregistered")
                await asyncio.sleep(1.0)
                assert prov.requests_to(apns_a) == []          # the pushing device: never
                assert [len(prov.requests_to(t)) for t in (fcm_b, "c", ios)] == [1, 1, 1]
                await ca.close()
        finally:
            await node.close()
