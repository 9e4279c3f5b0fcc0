"""PPP sans-I/O core, no server: the rate limiter, the command codec, the session state table
(bytes in, frames out), the trusted-proxy rule and HTTP polling signatures. Frames are built
here with msgpack from the spec's field tables (004 §5.1, C.1, C.4)."""

from __future__ import annotations

import msgpack
import pytest
from nacl.signing import SigningKey

from engine.ppp import limits, protocol as P
from engine.ppp.session import (Authenticated, Closing, CommandReceived, Phase, PppSession,
                                Refused)
from engine.ratelimit import KeyedBudgets, SlidingWindowLimiter
from ingress.ppp_app import client_ip, parse_trusted


def pack(m):
    return msgpack.packb(m, use_bin_type=True)


def unpack(b):
    return msgpack.unpackb(b, raw=False)


# --- rate limiter --------------------------------------------------------------------------------

def test_sliding_window_allows_exactly_the_budget_then_refuses():
    lim = SlidingWindowLimiter(3, 60)
    assert [lim.allow("k", t) for t in (0, 1, 2)] == [True, True, True]
    assert not lim.allow("k", 59.9)           # budget + 1 inside the window
    assert lim.allow("other", 3)              # keys are independent
    assert lim.allow("k", 60.0)               # the hit at 0 left the window (0, 60]
    assert not lim.allow("k", 60.5)
    assert lim.remaining("k", 61.5) == 1      # hits at 2 and 60 remain


def test_refused_hits_do_not_extend_the_window_and_sweep_drops_idle_keys():
    lim = SlidingWindowLimiter(1, 10)
    assert lim.allow("k", 0)
    for t in range(1, 10):
        assert not lim.allow("k", t)
    assert lim.allow("k", 10)                 # the refusals were not recorded
    assert lim.sweep(100) == 1 and len(lim) == 0


def test_a_limiter_keeps_at_most_max_keys_forgetting_the_one_hit_least_recently():
    """Fresh keys (free to an attacker) cannot grow a limiter past its cap; the key hit least
    recently goes, and its next hit starts a fresh window."""
    lim = SlidingWindowLimiter(1, 3600, max_keys=3)
    for key in ("a", "b", "c"):
        assert lim.allow(key, 0)
    assert not lim.allow("a", 1)              # a is now the most recently hit
    assert lim.allow("d", 2) and len(lim) == 3 and lim.forgotten == 1
    assert lim.remaining("b", 2) == 1         # b (least recent) was forgotten
    assert lim.remaining("a", 2) == 0 and lim.remaining("c", 2) == 0


def test_command_budgets_are_appendix_c3():
    b = KeyedBudgets(limits.command_budget)
    assert (limits.command_budget("STORE"), limits.command_budget("STORE_BACKUP"),
            limits.command_budget("REGISTER_DELIVERY_TOKEN")) == (
        limits.RateBudget(60, 60), limits.RateBudget(5, 3600), limits.RateBudget(30, 60))
    assert all(b.allow("FETCH", b"pk", 0.0) for _ in range(30))
    assert not b.allow("FETCH", b"pk", 1.0)
    assert b.allow("ACK", b"pk", 1.0)         # one budget per command


# --- codec ---------------------------------------------------------------------------------------

def test_decode_commands_from_the_c1_field_table():
    assert P.decode_command(pack({"cmd": "FETCH", "since": 5})) == P.Fetch(5, None)
    assert P.decode_command(pack({"cmd": "FETCH", "since": 5, "cursor": 9})) == P.Fetch(5, 9)
    assert P.decode_command(pack({"cmd": "ACK", "event_ids": [b"a" * 32]})).event_ids == (
        b"a" * 32,)
    assert isinstance(P.decode_command(pack({"cmd": "FETCH_BACKUP"})), P.FetchBackup)
    assert P.decode_command(pack({"cmd": "REGISTER_PUSH", "platform": "fcm", "token": "t"})) \
        == P.RegisterPush("fcm", "t")
    assert "secret-token" not in repr(P.RegisterPush("fcm", "secret-token"))   # never shown
    for bad, reason in [(b"\xc1", "malformed MessagePack"), (pack([1]), "message is not a map"),
                        (pack({"cmd": "NOPE"}), "unknown command"),
                        (pack({"cmd": "FETCH", "since": -1}), "since must be an unsigned integer"),
                        (pack({"cmd": "STORE", "event": "text"}), "event must be bytes"),
                        (pack({"cmd": "REGISTER_PUSH", "platform": "fcm"}),
                         "token must be a string"),
                        (pack({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": b"x" * 11}),
                         "delivery_token must be 12 bytes"),
                        (pack({"cmd": "FETCH", "since": 1}) + b"\x00", "malformed MessagePack")]:
        with pytest.raises(P.ProtocolError) as e:
            P.decode_command(bad)
        assert e.value.reason == reason


def test_reply_frames_are_c4_maps():
    assert unpack(P.stored(b"i" * 32).encode()) == {"cmd": "STORED", "event_id": b"i" * 32}
    assert unpack(P.events([b"e"], 7).encode()) == {"cmd": "EVENTS", "events": [b"e"],
                                                     "cursor": 7}
    assert unpack(P.events([]).encode()) == {"cmd": "EVENTS", "events": []}
    assert unpack(P.backup(b"c", 2, 3).encode()) == {"cmd": "BACKUP", "ciphertext": b"c",
                                                     "version": 2, "stored_at": 3}
    assert P.failure("FETCH_BACKUP", "x").cmd == "BACKUP_FAIL"
    assert P.failure("ACK", "x").cmd == "STORE_FAIL"


# --- session state table ---------------------------------------------------------------------

def session(nonce=b"n" * 32):
    ids = iter(range(1000))
    return PppSession(KeyedBudgets(limits.command_budget), nonce=nonce,
                      token_bytes=lambda n: next(ids).to_bytes(n, "big"))


def test_challenge_auth_ok_then_commands_in_order():
    sk = SigningKey.generate()
    s = session()
    assert unpack(s.greeting()) == {"cmd": "CHALLENGE", "nonce": b"n" * 32}
    s.receive_frame(pack({"cmd": "AUTH", "pubkey": bytes(sk.verify_key),
                          "sig": sk.sign(b"n" * 32).signature}), 0.0)
    assert s.events_received() == [Authenticated(bytes(sk.verify_key))]
    assert [unpack(f) for f in s.frames_to_send()] == [{"cmd": "AUTH_OK"}]
    s.receive_frame(pack({"cmd": "STORE", "event": b"e"}), 0.0)
    s.receive_frame(pack({"cmd": "FETCH", "since": 0}), 0.0)
    a, b = s.events_received()
    assert isinstance(a, CommandReceived) and isinstance(b, CommandReceived)
    assert len(a.request_id) == 12
    s.reply(b.slot, P.events([]))                 # FETCH finished first ...
    assert s.frames_to_send() == []               # ... but waits for the STORE reply
    s.reply(a.slot, P.stored(b"i" * 32))
    assert [unpack(f)["cmd"] for f in s.frames_to_send()] == ["STORED", "EVENTS"]
    assert s.notify(3) and unpack(s.frames_to_send()[0]) == {"cmd": "NOTIFY", "count": 3}


@pytest.mark.parametrize("frame", [
    pack({"cmd": "FETCH", "since": 0}),                                   # before AUTH
    pack({"cmd": "AUTH", "pubkey": b"p" * 32, "sig": b"s" * 64}),          # bad signature
    b"\x93\x01",                                                           # malformed
])
def test_anything_but_a_valid_auth_fails_and_closes(frame):
    s = session()
    s.receive_frame(frame, 0.0)
    ev = s.events_received()
    assert isinstance(ev[0], Refused) and isinstance(ev[-1], Closing) and ev[-1].code == 1008
    assert [unpack(f)["cmd"] for f in s.frames_to_send()] == ["AUTH_FAIL"]
    assert s.phase is Phase.CLOSED and s.pubkey is None
    assert not s.notify(1)
    s.receive_frame(pack({"cmd": "FETCH", "since": 0}), 0.0)   # nothing read after close
    assert s.events_received() == [] and s.frames_to_send() == []


def test_signature_over_another_nonce_is_refused():
    sk = SigningKey.generate()
    s = session()
    s.receive_frame(pack({"cmd": "AUTH", "pubkey": bytes(sk.verify_key),
                          "sig": sk.sign(b"x" * 32).signature}), 0.0)
    assert unpack(s.frames_to_send()[0]) == {"cmd": "AUTH_FAIL", "reason": "bad signature"}


def test_rate_limit_and_malformed_after_auth_keep_the_session_open():
    sk = SigningKey.generate()
    s = session()
    s.receive_frame(pack({"cmd": "AUTH", "pubkey": bytes(sk.verify_key),
                          "sig": sk.sign(b"n" * 32).signature}), 0.0)
    s.frames_to_send(), s.events_received()
    for _ in range(30):                           # FETCH: 30 / 60 s
        s.receive_frame(pack({"cmd": "FETCH", "since": 0}), 1.0)
    owed = [e for e in s.events_received() if isinstance(e, CommandReceived)]
    assert len(owed) == 30
    s.receive_frame(pack({"cmd": "FETCH", "since": 0}), 2.0)
    assert s.frames_to_send() == []               # in order: after the 30 owed replies
    for e in owed:
        s.reply(e.slot, P.events([], None))
    *thirty, f = s.frames_to_send()
    assert len(thirty) == 30
    assert unpack(f)["cmd"] == P.failure("FETCH", "x").cmd
    assert unpack(f)["reason"].startswith("rate limited (")
    # An hourly quota is the shell's, counted across hosts (PppControl.spend): not here.
    for _ in range(6):
        s.receive_frame(pack({"cmd": "FETCH_BACKUP"}), 2.0)
    owed = [e for e in s.events_received() if isinstance(e, CommandReceived)]
    assert len(owed) == 6
    for e in owed:
        s.reply(e.slot, P.backup_empty())
    assert len(s.frames_to_send()) == 6
    s.receive_frame(b"\xc1", 2.0)
    s.receive_frame(pack({"cmd": "AUTH", "pubkey": b"p" * 32, "sig": b"s" * 64}), 2.0)
    s.receive_frame(pack({"cmd": "AUTH", "pubkey": b"short"}), 2.0)   # malformed AUTH too:
    # the session is still authenticated, so not AUTH_FAIL
    assert [unpack(f)["cmd"] for f in s.frames_to_send()] == ["STORE_FAIL"] * 3
    assert s.phase is Phase.READY


# --- trusted proxies, polling signatures -------------------------------------------------------

def test_client_ip_follows_the_trusted_proxy_rule():
    trusted = parse_trusted("127.0.0.0/8,::1,10.0.0.5")
    assert client_ip("203.0.113.9", ["198.51.100.1"], trusted) == "203.0.113.9"   # untrusted peer
    assert client_ip("127.0.0.1", [], trusted) == "127.0.0.1"
    assert client_ip("127.0.0.1", ["198.51.100.1, 203.0.113.7, 10.0.0.5"], trusted) == (
        "203.0.113.7")                       # rightmost untrusted; a spoofed left entry ignored
    assert client_ip("::1", ["10.0.0.5", "127.0.0.2"], trusted) == "10.0.0.5"


def test_http_auth_signature_over_body_and_timestamp():
    sk = SigningKey.generate()
    pk = bytes(sk.verify_key)
    body, ts = b"\x81\xa3cmd\xa3ACK", "1700000000"
    header = f"PPP-Ed25519 {pk.hex()}:{sk.sign(body + ts.encode()).signature.hex()}"
    assert P.http_auth(header, ts, body, 1700000000 + 300, 300) == pk
    assert P.http_auth(header, ts, body, 1700000000 + 301, 300) is None     # too old
    assert P.http_auth(header, ts, body + b"x", 1700000000, 300) is None    # other body
    assert P.http_auth(header, "1700000001", body, 1700000000, 300) is None
    assert P.http_auth(header.replace("PPP-Ed25519", "Bearer"), ts, body, 1700000000, 300) is None
    assert P.http_auth(header, "\u00b2", body, 2, 300) is None   # isdigit() but not ASCII
