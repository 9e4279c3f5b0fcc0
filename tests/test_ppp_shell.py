"""The PPP listener on loopback: real uvicorn in the ingress node, the real `websockets`
client and `http.client`, real Delta tables. Frames come from `ppp_wire` (msgpack maps from
the spec's tables). Inbox rows are appended here as the stream commits them (the Spark stream
itself runs in test_ppp_end_to_end.py). NOTIFY window in these tests: 50 ms."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from contextlib import asynccontextmanager
from datetime import datetime, timedelta, timezone

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.schema import C, INBOX
from engine.ppp.limits import MAX_BACKUP_SIZE, MAX_CIPHERTEXT_SIZE, MAX_EVENT_TTL_SECS
from ingress.service import IngressNode

from ppp_wire import Ws, ahttp, giftwrap, pack, sealed_id, signed, signed_get, unpack


class Clock:
    """The rate limiters' monotonic clock, stepped by the test (budgets span minutes)."""
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@asynccontextmanager
async def node(settings, clock: Clock | None = None):
    settings.heya.enabled = False
    settings.ppp.notify_window_ms = 50
    n = IngressNode(settings, fsync=False)
    if clock is not None:
        n.ppp.monotonic = clock
    await n.start()
    try:
        yield n
    finally:
        await n.close()


def pk(sk: SigningKey) -> bytes:
    return bytes(sk.verify_key)


def landing_rows(settings) -> list[dict]:
    out = []
    for path in Layout.of(settings).landing_tables().values():
        out += DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    return out


def table_rows(settings, name) -> list[dict]:
    return DeltaTable(str(Layout.of(settings).tables / name)).to_pyarrow_table().to_pylist()


_seq = iter(range(1_000_000, 2_000_000))


def land_inbox(settings, mailbox: bytes, events: list[tuple[bytes, bytes]], first_cursor=1):
    """Append PPP inbox rows (encoded GiftWrap, event id) as the stream commits them."""
    now = datetime.now(timezone.utc)
    rows = [{
        C.EVENT_ID: eid, C.PROTOCOL: "ppp", C.MAILBOX: mailbox, C.ENVELOPE: env, C.META: None,
        C.RECEIVED_AT: now, C.EXPIRES_AT: now + timedelta(days=1), C.CURSOR: first_cursor + i,
        C.SEQ: next(_seq), C.COMMITTED_AT: now, C.LANDING_TABLE: "node-t/g000001",
        C.LANDING_VERSION: 1, C.BATCH_ID: 0} for i, (env, eid) in enumerate(events)]
    write_deltalake(str(Layout.of(settings).inbox),
                    pa.Table.from_pylist(rows, schema=INBOX.arrow_schema()), mode="append")


async def notified(ws, count: int) -> bool:
    """NOTIFY frames until they add up to `count` (a batch window may split them)."""
    seen = 0
    while seen < count:
        m = await ws.recv(timeout=10)
        assert m["cmd"] == "NOTIFY", m
        seen += m["count"]
    return seen == count


async def until(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


# --- handshake ---------------------------------------------------------------------------------

def test_handshake_and_every_refusal_before_auth_ok(settings):
    async def go():
        async with node(settings) as n:
            port = n.ppp.bound_port
            assert n.listening()["ppp"].endswith(f":{port}")
            sk = SigningKey.generate()
            c = await Ws.login(port, sk)
            await c.close()
            # AUTH with a signature over something else
            c, nonce = await Ws.open(port)
            await c.send({"cmd": "AUTH", "pubkey": pk(sk), "sig": sk.sign(b"x" + nonce).signature})
            assert await c.recv() == {"cmd": "AUTH_FAIL", "reason": "bad signature"}
            assert await c.closed()
            # a command before AUTH (even a valid STORE): refused, closed, nothing stored
            ev, _ = giftwrap(pk(sk))
            for frame in (pack({"cmd": "STORE", "event": ev}), b"\xc1\x00", b"text frame"):
                c, _ = await Ws.open(port)
                await c.send_raw(frame if frame != b"text frame" else "text frame")
                r = await c.recv()
                assert r["cmd"] == "AUTH_FAIL"
                assert await c.closed()
            # handshake timeout: no AUTH, the server closes
            n.ppp.conf.handshake_timeout_seconds = 0.3
            c, _ = await Ws.open(port)
            assert await c.closed()
            assert n.ppp.rejected["handshake_timeout"] == 1
            assert landing_rows(settings) == []
    asyncio.run(go())


# --- STORE -------------------------------------------------------------------------------------

def test_store_lands_after_commit_and_refusals_store_nothing(settings, caplog):
    async def go():
        async with node(settings) as n:
            port = n.ppp.bound_port
            alice, bob = SigningKey.generate(), SigningKey.generate()
            c = await Ws.login(port, alice)
            far = int(time.time()) + 10 * MAX_EVENT_TTL_SECS
            ev, eid = giftwrap(pk(bob), expires_at=far)
            r = await c.call({"cmd": "STORE", "event": ev})
            assert r == {"cmd": "STORED", "event_id": eid}
            (row,) = landing_rows(settings)       # STORED came after the landing commit
            assert (row[C.PROTOCOL], row[C.MAILBOX], row[C.ENVELOPE], row[C.EVENT_ID]) == (
                "ppp", pk(bob), ev, eid)
            assert row[C.EXPIRES_AT].timestamp() <= time.time() + MAX_EVENT_TTL_SECS + 1
            # Each abuse gets STORE_FAIL with a request id; nothing more is stored.
            expired, _ = giftwrap(pk(bob), expires_at=int(time.time()) - 1)
            oversize, _ = giftwrap(pk(bob), ciphertext=os.urandom(MAX_CIPHERTEXT_SIZE + 1))
            bad_recipient = pack({1: b"short", 2: os.urandom(32), 3: os.urandom(24),
                                  4: b"c", 5: 1, 6: far})
            for frame, why in [({"cmd": "STORE", "event": ev}, "duplicate event"),
                               ({"cmd": "STORE", "event": expired}, "event expired"),
                               ({"cmd": "STORE", "event": oversize}, "ciphertext too large"),
                               ({"cmd": "STORE", "event": bad_recipient}, "malformed event"),
                               ({"cmd": "STORE"}, "event must be bytes")]:
                r = await c.call(frame)
                assert r["cmd"] == "STORE_FAIL" and r["reason"].startswith(why), r
                rid = r["reason"].rsplit("(request ", 1)[1].rstrip(")")
                assert len(rid) == 12
                assert any(getattr(rec, "request_id", None) == rid for rec in caplog.records)
            await c.send_raw(b"\xc1")             # malformed MessagePack after AUTH
            r = await c.recv()
            assert r["cmd"] == "STORE_FAIL" and r["reason"].startswith("malformed MessagePack")
            assert (await c.call({"cmd": "FETCH", "since": 0}))["cmd"] == "EVENTS"  # still open
            assert len(landing_rows(settings)) == 1
    caplog.set_level("INFO")
    asyncio.run(go())


def test_rate_limits_allow_exactly_the_budget(settings):
    async def go():
        clock = Clock()
        async with node(settings, clock) as n:
            port = n.ppp.bound_port
            sk = SigningKey.generate()
            c = await Ws.login(port, sk)
            # to someone not connected here: no NOTIFY among the replies (issue 20's live path)
            evs = [giftwrap(os.urandom(32))[0] for _ in range(61)]
            for e in evs[:60]:                    # STORE: 60 / 60 s, pipelined
                await c.send({"cmd": "STORE", "event": e})
            assert [(await c.recv())["cmd"] for _ in range(60)] == ["STORED"] * 60
            r = await c.call({"cmd": "STORE", "event": evs[60]})
            assert r["cmd"] == "STORE_FAIL" and r["reason"].startswith("rate limited")
            assert len(landing_rows(settings)) == 60
            for _ in range(30):                   # FETCH: 30 / 60 s
                assert (await c.call({"cmd": "FETCH", "since": 0}))["cmd"] == "EVENTS"
            assert (await c.call({"cmd": "FETCH", "since": 0}))["reason"].startswith(
                "rate limited")
            # The budget is per pubkey, not per socket.
            c2 = await Ws.login(port, sk)
            assert (await c2.call({"cmd": "FETCH", "since": 0}))["cmd"] == "STORE_FAIL"
            clock.t += 60.0                       # the window slid past the first 30
            assert (await c2.call({"cmd": "FETCH", "since": 0}))["cmd"] == "EVENTS"
            r = await c2.call({"cmd": "STORE", "event": evs[60]})
            assert r["cmd"] == "STORED"
    asyncio.run(go())


# --- FETCH / ACK / NOTIFY ------------------------------------------------------------------------

def test_fetch_ack_scoped_to_the_caller_paginated_and_notified(settings):
    async def go():
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            alice, bob = SigningKey.generate(), SigningKey.generate()
            a = await Ws.login(port, alice)
            b = await Ws.login(port, bob)
            events = [giftwrap(pk(bob), created_at=1000 + i) for i in range(150)]
            land_inbox(settings, pk(bob), events)
            assert await b.recv() == {"cmd": "NOTIFY", "count": 150}   # one, batched
            # alice sees none of bob's events and cannot ack them
            assert await a.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
            ids = [eid for _, eid in events]
            assert await a.call({"cmd": "ACK", "event_ids": ids}) == {"cmd": "ACKED", "count": 0}
            assert table_rows(settings, "acks") == []
            # bob: two pages in cursor order
            p1 = await b.call({"cmd": "FETCH", "since": 0})
            assert p1["events"] == [e for e, _ in events[:100]] and p1["cursor"] == 100
            p2 = await b.call({"cmd": "FETCH", "since": 0, "cursor": p1["cursor"]})
            assert p2 == {"cmd": "EVENTS", "events": [e for e, _ in events[100:]]}
            since = await b.call({"cmd": "FETCH", "since": 1148})       # created_at > since
            assert since["events"] == [events[149][0]]
            r = await b.call({"cmd": "ACK", "event_ids": ids[:100] + ids[:3] + [os.urandom(32)]})
            assert r == {"cmd": "ACKED", "count": 100}                   # own, unacked only
            acks = table_rows(settings, "acks")
            assert len(acks) == 100 and {x[C.PROTOCOL] for x in acks} == {"ppp"}
            assert {x[C.MAILBOX] for x in acks} == {pk(bob)} and acks[0][C.DEVICE] is None
            r = await b.call({"cmd": "FETCH", "since": 0})
            assert r == {"cmd": "EVENTS", "events": [e for e, _ in events[100:]]}
            assert (await b.call({"cmd": "ACK", "event_ids": ids}))["count"] == 50
            assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
        # After a restart the view is rebuilt from inbox minus acks: still nothing for bob.
        async with node(settings, Clock()) as n:
            b = await Ws.login(n.ppp.bound_port, bob)
            assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
            # ... and a known event is still a duplicate
            r = await b.call({"cmd": "STORE", "event": events[0][0]})
            assert r["reason"].startswith("duplicate event")
    asyncio.run(go())


# --- sealed sender ---------------------------------------------------------------------------------

def note(token: bytes, **kw) -> tuple[bytes, dict]:
    now = int(time.time())
    m = {"delivery_token": token, "ephemeral_pk": os.urandom(32), "nonce": os.urandom(24),
         "ciphertext": os.urandom(1040), "created_at": now, "expires_at": now + 3600}
    m.update(kw)
    return pack(m), m


def test_delivery_tokens_sealed_submit_limits_and_restart(settings, caplog):
    caplog.set_level("INFO")

    async def go():
        clock = Clock()
        bob = SigningKey.generate()
        token = os.urandom(12)
        async with node(settings, clock) as n:
            port = n.ppp.bound_port
            post = lambda body, h=None: ahttp(port, "POST", "/v1/note/submit", body, h)  # noqa
            body, _ = note(token)
            assert (await post(body))[0] == 401           # unknown token
            b = await Ws.login(port, bob)
            assert await b.call({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": token}) == {
                "cmd": "DELIVERY_TOKEN_REGISTERED"}
            status, resp, _ = await post(body)
            m = unpack(body)
            eid = sealed_id(m["ephemeral_pk"], m["nonce"], m["ciphertext"], token, m["created_at"])
            assert status == 200 and unpack(resp) == {"cmd": "STORED", "event_id": eid}
            (row,) = landing_rows(settings)
            gw = unpack(row[C.ENVELOPE])               # a GiftWrap for the token's recipient
            assert row[C.EVENT_ID] == eid and row[C.MAILBOX] == pk(bob)
            assert gw == {1: pk(bob), 2: m["ephemeral_pk"], 3: m["nonce"], 4: m["ciphertext"],
                          5: m["created_at"], 6: m["expires_at"]}
            # per token: 2 / 1 s (the replay above was one)
            assert (await post(body))[0] == 409            # duplicate: 2nd hit of the token
            assert (await post(note(token)[0]))[0] == 429   # 3rd hit
            clock.t += 1.0
            too_far, _ = note(token, expires_at=int(time.time()) + 10 * MAX_EVENT_TTL_SECS)
            assert (await post(too_far))[0] == 200          # clamped
            expired, _ = note(token, expires_at=int(time.time()) - 5)
            assert (await post(expired))[0] == 400
            assert (await post(b"\xc1"))[0] == 400
            assert (await post(b"x" * (128 * 1024 + 1)))[0] == 413
            assert len(landing_rows(settings)) == 2
            # bob is connected here: both notes reach him before any stream runs (issue 20)
            assert await notified(b, 2)
            r = await b.call({"cmd": "FETCH", "since": 0})
            assert r["cmd"] == "EVENTS" and len(r["events"]) == 2
            clamped = max(r[C.EXPIRES_AT] for r in landing_rows(settings))
            assert clamped.timestamp() <= time.time() + MAX_EVENT_TTL_SECS + 1
            # per IP: 120 / 60 s whatever the token; X-Forwarded-For from loopback (trusted)
            clock.t += 60.0
            for i in range(120):
                assert (await post(note(os.urandom(12))[0],
                                   {"X-Forwarded-For": "198.51.100.7"}))[0] == 401
            assert (await post(note(os.urandom(12))[0],
                               {"X-Forwarded-For": "198.51.100.7"}))[0] == 429
            assert (await post(note(os.urandom(12))[0],
                               {"X-Forwarded-For": "198.51.100.8"}))[0] == 401
            # cap: MAX_DELIVERY_TOKENS_PER_RECIPIENT (100); default budget 30 / 60 s
            for i in range(99):
                if i % 30 == 0:
                    clock.t += 60.0
                r = await b.call({"cmd": "REGISTER_DELIVERY_TOKEN",
                                  "delivery_token": os.urandom(12)})
                assert r == {"cmd": "DELIVERY_TOKEN_REGISTERED"}, (i, r)
            r = await b.call({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": os.urandom(12)})
            assert r["cmd"] == "STORE_FAIL" and r["reason"].startswith("too many delivery tokens")
        # Durable: after a restart the token still routes.
        async with node(settings, clock) as n:
            port = n.ppp.bound_port
            assert (await ahttp(port, "POST", "/v1/note/submit", note(token)[0]))[0] == 200
            b = await Ws.login(port, bob)
            r = await b.call({"cmd": "DEREGISTER_DELIVERY_TOKEN", "delivery_token": token})
            assert r == {"cmd": "DELIVERY_TOKEN_DEREGISTERED"}
            assert (await ahttp(port, "POST", "/v1/note/submit", note(token)[0]))[0] == 401
        # Sealed endpoints log coarse outcomes only.
        for rec in caplog.records:
            if getattr(rec, "event", None) == "ppp_sealed":
                assert not hasattr(rec, "request_id") and "198.51" not in rec.getMessage()
                assert set(vars(rec)) & {"ip", "token", "client"} == set()
    asyncio.run(go())


# --- backups -----------------------------------------------------------------------------------------

def test_backups_round_trip_version_limit_budget_and_restart(settings):
    async def go():
        sk = SigningKey.generate()
        async with node(settings, Clock()) as n:
            c = await Ws.login(n.ppp.bound_port, sk)
            assert await c.call({"cmd": "FETCH_BACKUP"}) == {"cmd": "BACKUP_EMPTY"}
            r1 = await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"one"})
            assert r1["cmd"] == "BACKUP_STORED" and r1["version"] == 1
            assert abs(r1["stored_at"] - time.time()) < 600
            r = await c.call({"cmd": "STORE_BACKUP", "ciphertext": os.urandom(MAX_BACKUP_SIZE + 1)})
            assert r["cmd"] == "BACKUP_FAIL" and r["reason"].startswith("backup too large")
            big = os.urandom(MAX_BACKUP_SIZE)             # exactly 5 MiB is accepted
            assert (await c.call({"cmd": "STORE_BACKUP", "ciphertext": big}))["version"] == 2
            got = await c.call({"cmd": "FETCH_BACKUP"})
            assert got["cmd"] == "BACKUP" and got["ciphertext"] == big and got["version"] == 2
        async with node(settings, Clock()) as n:           # durable
            c = await Ws.login(n.ppp.bound_port, sk)
            got = await c.call({"cmd": "FETCH_BACKUP"})
            assert got["ciphertext"] == big and got["version"] == 2
            other = await Ws.login(n.ppp.bound_port, SigningKey.generate())
            assert await other.call({"cmd": "FETCH_BACKUP"}) == {"cmd": "BACKUP_EMPTY"}
            # STORE_BACKUP: 5 / hour, and the restart kept the 3 charged before it (the
            # oversize one too: the quota is charged before the command runs)
            for v in (3, 4):
                assert (await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"v"}))["version"] == v
            r = await c.call({"cmd": "STORE_BACKUP", "ciphertext": b"v"})
            assert r["cmd"] == "BACKUP_FAIL" and r["reason"].startswith("rate limited")
            assert await c.call({"cmd": "DELETE_BACKUP"}) == {"cmd": "BACKUP_DELETED"}
            assert await c.call({"cmd": "FETCH_BACKUP"}) == {"cmd": "BACKUP_EMPTY"}
    asyncio.run(go())


# --- HTTP polling ---------------------------------------------------------------------------------------

def test_polling_transport_same_semantics_and_signatures_checked(settings):
    async def go():
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            alice, bob = SigningKey.generate(), SigningKey.generate()
            ev, eid = giftwrap(pk(bob))
            body = pack({"event": ev})
            t0 = int(time.time())
            s, r, _ = await ahttp(port, "POST", "/v1/events", body, signed(alice, body, ts=t0))
            assert s == 200 and unpack(r) == {"cmd": "STORED", "event_id": eid}
            # Ed25519 is deterministic: another timestamp makes another, unreplayed signature
            h = signed(alice, body, ts=t0 - 1)
            s, r, _ = await ahttp(port, "POST", "/v1/events", body, h)
            assert s == 409 and unpack(r)["reason"].startswith("duplicate event")
            assert (await ahttp(port, "POST", "/v1/events", body, h))[0] == 401     # replayed
            old = signed(alice, body, ts=int(time.time()) - 301)
            assert (await ahttp(port, "POST", "/v1/events", body, old))[0] == 401
            forged = dict(signed(bob, body))
            forged["Authorization"] = forged["Authorization"].replace(pk(bob).hex(),
                                                                     pk(alice).hex())
            assert (await ahttp(port, "POST", "/v1/events", body, forged))[0] == 401
            assert (await ahttp(port, "POST", "/v1/events", body))[0] == 401
            assert len(landing_rows(settings)) == 1
            land_inbox(settings, pk(bob), [(ev, eid)])
            await until(lambda: n.ppp.inbox.pending_count(pk(bob)) == 1)
            q = "/v1/events?since=0"
            s, r, _ = await ahttp(port, "GET", q, b"", signed_get(alice, q))
            assert unpack(r) == {"cmd": "EVENTS", "events": []}
            s, r, _ = await ahttp(port, "GET", q, b"", signed_get(bob, q))
            assert s == 200 and unpack(r) == {"cmd": "EVENTS", "events": [ev]}
            ack = pack({"event_ids": [eid]})
            s, r, _ = await ahttp(port, "POST", "/v1/events/ack", ack, signed(alice, ack))
            assert unpack(r) == {"cmd": "ACKED", "count": 0}
            s, r, _ = await ahttp(port, "POST", "/v1/events/ack", ack, signed(bob, ack))
            assert unpack(r) == {"cmd": "ACKED", "count": 1}
            s, r, _ = await ahttp(port, "GET", q, b"", signed_get(bob, q))
            assert unpack(r) == {"cmd": "EVENTS", "events": []}
            # FETCH budget shared with the WebSocket: 30 / 60 s, 2 used above by bob
            w = await Ws.login(port, bob)
            for _ in range(28):
                assert (await w.call({"cmd": "FETCH", "since": 0}))["cmd"] == "EVENTS"
            s, r, hdr = await ahttp(port, "GET", q, b"", signed_get(bob, q))
            assert s == 429 and unpack(r)["reason"].startswith("rate limited")
            assert hdr.get("retry-after") == "60"
            # OpenAPI documents the HTTP surface with MessagePack bodies.
            s, r, _ = await ahttp(port, "GET", "/openapi.json")
            import json
            spec = json.loads(r)
            assert {"/v1/note/submit", "/v1/events", "/v1/events/ack"} <= set(spec["paths"])
            note_post = spec["paths"]["/v1/note/submit"]["post"]
            assert "application/msgpack" in note_post["requestBody"]["content"]
            assert {"200", "401", "413", "429"} <= set(note_post["responses"])
    asyncio.run(go())


# --- review fixes ----------------------------------------------------------------------------------

def test_polling_refusals_are_logged_with_their_request_id_and_odd_timestamps_are_401(
        settings, caplog):
    """§5.x: a STORE_FAIL's request id is the one in the server log, on the HTTP transport too
    (a malformed polling body used to get an id that was logged nowhere). A timestamp header
    of non-ASCII digits ("²" is `isdigit()`) used to raise inside the auth check: 500."""
    caplog.set_level("INFO")

    async def go():
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            alice = SigningKey.generate()
            for path, body in (("/v1/events", pack({"event": "not bytes"})),
                               ("/v1/events/ack", pack({"event_ids": b"not a list"})),
                               ("/v1/events", b"\xc1")):
                s, r, _ = await ahttp(port, "POST", path, body, signed(alice, body))
                reply = unpack(r)
                assert s == 400 and reply["cmd"] == "STORE_FAIL", (path, reply)
                rid = reply["reason"].rsplit("(request ", 1)[1].rstrip(")")
                assert any(getattr(rec, "request_id", None) == rid
                           and getattr(rec, "event", None) == "ppp_command_refused"
                           for rec in caplog.records), path
            h = signed(alice, b"")
            h["X-PPP-Timestamp"] = "\u00b2"        # sent as the latin-1 byte 0xb2
            s, r, _ = await ahttp(port, "GET", "/v1/events?since=0", b"", h)
            assert s == 401 and unpack(r)["cmd"] == "AUTH_FAIL"
            assert landing_rows(settings) == []
    asyncio.run(go())


def test_connection_cap_and_concurrent_duplicate_stores(settings):
    """`ppp.max_connections` bounds WebSockets (it used to be read and never applied); and the
    same event STOREd at once from two sockets and the polling transport lands once: one
    STORED, every other copy STORE_FAIL "duplicate event" (§4.5 MUST reject)."""
    from websockets.exceptions import InvalidStatus

    async def go():
        settings.ppp.max_connections = 2
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            alice, bob = SigningKey.generate(), SigningKey.generate()
            a1 = await Ws.login(port, alice)
            a2 = await Ws.login(port, bob)
            try:
                await Ws.open(port)
                raise AssertionError("a third WebSocket was accepted past max_connections=2")
            except InvalidStatus as e:
                assert e.response.status_code == 403
            assert n.ppp.rejected["max_connections"] == 1
            ev, eid = giftwrap(os.urandom(32))    # not to bob, connected: no NOTIFY in between
            body = pack({"event": ev})
            for _ in range(5):
                await a1.send({"cmd": "STORE", "event": ev})
                await a2.send({"cmd": "STORE", "event": ev})
            http = asyncio.ensure_future(ahttp(port, "POST", "/v1/events", body,
                                               signed(alice, body)))
            replies = [await a1.recv() for _ in range(5)] + [await a2.recv() for _ in range(5)]
            s, r, _ = await http
            replies.append(unpack(r))
            assert [x for x in replies if x["cmd"] == "STORED"] == [
                {"cmd": "STORED", "event_id": eid}]
            assert all(x["reason"].startswith("duplicate event")
                       for x in replies if x["cmd"] != "STORED")
            assert len(landing_rows(settings)) == 1
            await a2.close()
            await until(lambda: n.ppp.connections == 1)
            c = await Ws.login(port, bob)              # a slot is free again
            await c.close()
            await a1.close()
    asyncio.run(go())


def test_fetch_reads_envelopes_beyond_the_memory_budget_from_the_inbox(settings):
    """An offline recipient's backlog costs disk, not RAM: with room for three envelopes,
    FETCH still returns all ten byte for byte, the rest read back from the inbox table."""
    settings.ppp.cache_bytes = 3 * 1200

    async def go():
        async with node(settings, Clock()) as n:
            bob = SigningKey.generate()
            events = [giftwrap(pk(bob), created_at=1000 + i) for i in range(10)]
            land_inbox(settings, pk(bob), events)
            b = await Ws.login(n.ppp.bound_port, bob)
            await b.recv()                                              # NOTIFY
            cache = n.ppp.inbox.envelopes
            assert cache.held_bytes <= settings.ppp.cache_bytes
            got = await b.call({"cmd": "FETCH", "since": 0})
            assert got["events"] == [e for e, _ in events]
            assert cache.disk_reads == 1 and cache.held_bytes <= settings.ppp.cache_bytes
            r = await b.call({"cmd": "ACK", "event_ids": [eid for _, eid in events[:9]]})
            assert r == {"cmd": "ACKED", "count": 9}
            assert await b.call({"cmd": "FETCH", "since": 0}) == {
                "cmd": "EVENTS", "events": [events[9][0]]}
    asyncio.run(go())


def test_a_connected_recipient_gets_an_event_right_after_its_landing_commit(settings):
    """Issue 20's live path: NOTIFY and FETCH right after the landing commit, before the
    stream gives the event a cursor; when its inbox row follows, no second NOTIFY and no
    second copy, and an ACK given before the row becomes the row's ack once its seq is known."""
    async def go():
        async with node(settings) as n:
            port = n.ppp.bound_port
            alice, bob, carol = (SigningKey.generate() for _ in range(3))
            b = await Ws.login(port, bob)
            c = await Ws.login(port, carol)
            a = await Ws.login(port, alice)
            (ev1, id1), (ev2, id2) = giftwrap(pk(bob)), giftwrap(pk(bob))
            for ev, eid in ((ev1, id1), (ev2, id2)):
                assert await a.call({"cmd": "STORE", "event": ev}) == {
                    "cmd": "STORED", "event_id": eid}
            assert await notified(b, 2)
            assert await b.call({"cmd": "FETCH", "since": 0}) == {
                "cmd": "EVENTS", "events": [ev1, ev2]}
            # nobody else sees them, nor can ack them
            assert await c.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
            assert await c.call({"cmd": "ACK", "event_ids": [id1]}) == {"cmd": "ACKED", "count": 0}
            # bob acks the first before the stream has seen either
            assert await b.call({"cmd": "ACK", "event_ids": [id1]}) == {"cmd": "ACKED", "count": 1}
            assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": [ev2]}
            # the stream's rows arrive: ev2 stays once, ev1's ack row is written with its seq
            land_inbox(settings, pk(bob), [(ev1, id1), (ev2, id2)])
            await until(lambda: n.ppp.inbox.pending_count(pk(bob)) == 1)
            acks_path = Layout.of(settings).acks

            def acked_rows():
                return DeltaTable(str(acks_path)).to_pyarrow_table().to_pylist()
            await until(lambda: len(acked_rows()) == 1)
            (row,) = acked_rows()
            inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table()
            seq1 = [r[C.SEQ] for r in inbox.to_pylist() if r[C.EVENT_ID] == id1]
            assert row[C.EVENT_ID] == id1 and [row[C.SEQ]] == seq1 and row[C.CURSOR] == 1
            assert await b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": [ev2]}
            try:
                extra = await b.recv(timeout=0.5)
            except asyncio.TimeoutError:
                extra = None
            assert extra is None, "the inbox row of an event served early is not NOTIFY'd again"
            assert await b.call({"cmd": "ACK", "event_ids": [id2]}) == {"cmd": "ACKED", "count": 1}
            assert len(acked_rows()) == 2
            assert n.ppp.inbox.early_bytes == 0
    asyncio.run(go())
