"""Strict input on the PPP port (issue 19 item 4): every field of every message has exactly
the type of spec 004 (appendix C.1, the §3.x GiftWrap key table) or is refused with the
protocol's error and lands nothing. Python's `True == 1` and `1.0 == 1` hash equal, so a
GiftWrap map keyed by the floats 1.0-6.0, or by `true` in place of 1, used to be STORED and
landed as sent. Frames are built here with msgpack directly (ppp_wire), sent through the
real WebSocket and the real HTTP endpoints."""

from __future__ import annotations

import asyncio
import os
import time

import msgpack
import pytest
from nacl.signing import SigningKey

from engine.ppp import protocol as P
from engine.ppp.giftwrap import GiftWrap, GiftWrapError

from ppp_wire import Ws, ahttp, pack, signed, signed_get
from test_ppp_shell import Clock, landing_rows, node, note, pk


def wrap_map(recipient: bytes) -> dict:
    now = int(time.time())
    return {1: recipient, 2: os.urandom(32), 3: os.urandom(24), 4: os.urandom(100),
            5: now, 6: now + 3600}


def packed_pairs(pairs: list[tuple]) -> bytes:
    """A map as the given key/value pairs, in order, keys repeated if given twice (msgpack's
    own dict packing cannot say a key twice)."""
    p = msgpack.Packer(use_bin_type=True)
    return p.pack_map_header(len(pairs)) + b"".join(p.pack(k) + p.pack(v) for k, v in pairs)


def float_keys(recipient: bytes) -> bytes:
    return packed_pairs([(float(k), v) for k, v in wrap_map(recipient).items()])


def true_key(recipient: bytes) -> bytes:
    return packed_pairs([(True if k == 1 else k, v) for k, v in wrap_map(recipient).items()])


def twice_key(recipient: bytes) -> bytes:
    m = wrap_map(recipient)
    return packed_pairs([(1, os.urandom(32))] + list(m.items()))


def string_keys(recipient: bytes) -> bytes:
    return packed_pairs([(str(k), v) for k, v in wrap_map(recipient).items()])


BAD_WRAPS = {"float keys 1.0-6.0": float_keys, "true in place of 1": true_key,
             "key 1 twice": twice_key, "string keys": string_keys}


# --- the codecs ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(BAD_WRAPS))
def test_giftwrap_refuses_look_alike_and_repeated_keys(name):
    with pytest.raises(GiftWrapError):
        GiftWrap.decode(BAD_WRAPS[name](os.urandom(32)))
    good = packed_pairs(list(wrap_map(b"r" * 32).items()))
    assert GiftWrap.decode(good).recipient == b"r" * 32


def test_commands_refuse_non_string_keys_repeated_keys_and_short_ids():
    for frame, why in [
            (packed_pairs([("cmd", "FETCH"), ("since", 0), (1, 2)]), "map keys must be strings"),
            (packed_pairs([("cmd", "FETCH"), ("since", 0), ("since", 5)]), "twice"),
            (packed_pairs([("cmd", "FETCH"), ("cmd", "ACK"), ("since", 0)]), "twice"),
            (pack({"cmd": "FETCH", "since": 1.0}), "since must be"),
            (pack({"cmd": "FETCH", "since": True}), "since must be"),
            (pack({"cmd": "FETCH", "since": 0, "cursor": -1}), "cursor must be"),
            (pack({"cmd": "FETCH", "since": -(1 << 63)}), "since must be"),
            (pack({"cmd": "ACK", "event_ids": [b"x" * 31]}), "event_ids must be 32 bytes"),
            (pack({"cmd": "ACK", "event_ids": ["x" * 32]}), "event_ids must be a list"),
            (pack({"cmd": "AUTH", "pubkey": "k" * 32, "sig": b"s" * 64}), "pubkey must be"),
            (pack({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": b"t" * 13}),
             "delivery_token must be 12"),
            (pack({"cmd": "STORE", "event": msgpack.ExtType(1, b"x")}), "event must be bytes"),
            (pack({"cmd": "STORE", "event": b"e"}) + b"\x00", "malformed"),
    ]:
        with pytest.raises(P.ProtocolError) as e:
            P.decode_command(frame)
        assert why in e.value.reason, (frame, e.value.reason)
    # well-formed maps still decode, unknown string-keyed fields still ignored
    assert P.decode_command(pack({"cmd": "FETCH", "since": 0, "x": {1.5: [True]}})) == \
        P.Fetch(0, None)
    assert P.decode_command(pack({"cmd": "ACK", "event_ids": [b"i" * 32]})) == \
        P.Ack((b"i" * 32,))


def test_sealed_note_refuses_repeated_and_mistyped_fields():
    ok, m = note(os.urandom(12))
    assert P.decode_sealed_note(ok).ciphertext == m["ciphertext"]
    for bad in (packed_pairs(list(m.items()) + [("delivery_token", os.urandom(12))]),
                pack({**m, "created_at": float(m["created_at"])}),
                pack({**m, "expires_at": True}),
                pack({**m, "nonce": os.urandom(23)})):
        with pytest.raises(P.ProtocolError):
            P.decode_sealed_note(bad)


# --- through the real listener --------------------------------------------------------------

def test_malformed_gift_wraps_are_refused_over_websocket_and_polling_and_land_nothing(settings):
    async def go():
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            alice, bob = SigningKey.generate(), SigningKey.generate()
            c = await Ws.login(port, alice)
            for name, build in sorted(BAD_WRAPS.items()):
                r = await c.call({"cmd": "STORE", "event": build(pk(bob))})
                assert r["cmd"] == "STORE_FAIL", (name, r)
                assert r["reason"].startswith("malformed event"), (name, r)
                body = pack({"event": build(pk(bob))})
                s, resp, _ = await ahttp(port, "POST", "/v1/events", body, signed(alice, body))
                assert s == 400 and msgpack.unpackb(resp)["cmd"] == "STORE_FAIL", name
            # a repeated key in the command map itself
            await c.send_raw(packed_pairs([("cmd", "STORE"), ("event", b"x"),
                                           ("event", packed_pairs(list(
                                               wrap_map(pk(bob)).items())))]))
            r = await c.recv()
            assert r["cmd"] == "STORE_FAIL" and "twice" in r["reason"], r
            assert landing_rows(settings) == []
            # the session is still usable and a well-formed wrap is stored
            good = packed_pairs(list(wrap_map(pk(bob)).items()))
            assert (await c.call({"cmd": "STORE", "event": good}))["cmd"] == "STORED"
            assert len(landing_rows(settings)) == 1
            # an AUTH keyed by `true`... before AUTH_OK: AUTH_FAIL and closed
            d, nonce = await Ws.open(port)
            await d.send_raw(packed_pairs([("cmd", "AUTH"), ("pubkey", pk(alice)),
                                           ("sig", alice.sign(nonce).signature),
                                           (True, b"")]))
            assert (await d.recv())["cmd"] == "AUTH_FAIL"
            assert await d.closed()
            # sealed submit with a field given twice: 400, nothing landed
            token = os.urandom(12)
            assert (await c.call({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": token}))[
                "cmd"] == "DELIVERY_TOKEN_REGISTERED"
            _, m = note(token)
            twice = packed_pairs(list(m.items()) + [("ciphertext", os.urandom(10))])
            assert (await ahttp(port, "POST", "/v1/note/submit", twice))[0] == 400
            assert len(landing_rows(settings)) == 1
    asyncio.run(go())


def test_polling_fetch_takes_since_and_cursor_as_decimal_digits_only(settings):
    """§5.2 FETCH over HTTP: `since` and `cursor` are uint64. FastAPI's int also took "1.0",
    " 1" and "1_000", and answered a bad one with a 422 JSON body; now 400 STORE_FAIL."""
    async def go():
        async with node(settings, Clock()) as n:
            port = n.ppp.bound_port
            sk = SigningKey.generate()
            for q in ("since=1.0", "since=%201", "since=1_000", "since=true", "since=-1",
                      "since=18446744073709551616", "since=0&cursor=1.5", "since=%C2%B2"):
                s, r, _ = await ahttp(port, "GET", f"/v1/events?{q}", b"", signed(sk, b""))
                assert s == 400 and msgpack.unpackb(r)["cmd"] == "STORE_FAIL", q
            q = "/v1/events?since=5"
            s, r, _ = await ahttp(port, "GET", q, b"", signed_get(sk, q))
            assert s == 200 and msgpack.unpackb(r) == {"cmd": "EVENTS", "events": []}
    asyncio.run(go())
