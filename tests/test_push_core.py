"""The pure push core: the wake-up planner's rules, what provider answers mean, which tokens
are well formed, what a wake-up carries."""

from __future__ import annotations

import base64
import json
import random

import pytest

from engine.push import requests as R
from engine.push.coalesce import Decision, WakePlanner
from engine.push.outcomes import Outcome, backoff, classify, retry_after
from engine.push.platforms import TokenError, check_token, parse_subscription

D = b"device-1"


def test_a_burst_wakes_once_and_a_returning_device_is_woken_again_once_per_window():
    p = WakePlanner(30)
    assert p.offer(D, 100.0, None) is Decision.SEND
    p.sent(D, 100.0)
    # the rest of the burst, the device never back: covered by that wake-up
    assert [p.offer(D, t, None) for t in (101, 110, 129.9)] == [Decision.COVERED] * 3
    assert p.offer(D, 115, last_seen=90.0) is Decision.COVERED     # seen before the wake-up
    # it came back after the wake-up and left: this row is news, woken at the window's end
    assert p.offer(D, 120, last_seen=112.0) is Decision.DEFER
    assert p.offer(D, 121, last_seen=112.0) is Decision.DEFER      # joins the same one
    assert p.due_at(D) == 130.0 and p.next_due() == 130.0
    assert p.take_due(129.0) == [] and p.take_due(130.0) == [D]
    p.sent(D, 130.0)
    assert p.due_at(D) is None
    assert p.offer(D, 170.0, None) is Decision.SEND                # a new window


def test_restore_after_a_crash():
    p = WakePlanner(30)
    p.restore(D, 100.0)                              # sent, with its outcome recorded
    assert p.offer(D, 105, None) is Decision.COVERED
    q = WakePlanner(30)
    q.restore(D, 100.0, unsure=True)                 # intent without outcome: send again
    assert q.offer(D, 105, None) is Decision.SEND
    q.sent(D, 105)
    assert q.offer(D, 106, None) is Decision.COVERED
    assert q.prune(200.0) == 1 and len(q) == 0


def test_window_zero_wakes_for_every_row():
    p = WakePlanner(0)
    for t in (1.0, 1.0, 2.0):
        assert p.offer(D, t, None) is Decision.SEND
        p.sent(D, t)


@pytest.mark.parametrize("platform,status,body,outcome", [
    ("apns", 200, b"", Outcome.SENT),
    ("apns", 410, b'{"reason":"Unregistered","timestamp":1}', Outcome.UNREGISTERED),
    ("apns", 400, b'{"reason":"BadDeviceToken"}', Outcome.UNREGISTERED),
    ("apns", 400, b'{"reason":"DeviceTokenNotForTopic"}', Outcome.UNREGISTERED),
    ("apns", 400, b'{"reason":"PayloadTooLarge"}', Outcome.FAILED),
    ("apns", 403, b'{"reason":"ExpiredProviderToken"}', Outcome.RETRY),
    ("apns", 403, b'{"reason":"InvalidProviderToken"}', Outcome.FAILED),
    ("apns", 429, b'{"reason":"TooManyRequests"}', Outcome.RETRY),
    ("apns", 503, b"not json", Outcome.RETRY),
    ("fcm", 200, b"{}", Outcome.SENT),
    ("fcm", 404, b'{"error":{"status":"NOT_FOUND"}}', Outcome.UNREGISTERED),
    ("fcm", 400, json.dumps({"error": {"status": "INVALID_ARGUMENT", "details": [
        {"errorCode": "UNREGISTERED"}]}}).encode(), Outcome.UNREGISTERED),
    ("fcm", 400, b'{"error":{"status":"INVALID_ARGUMENT"}}', Outcome.FAILED),
    ("fcm", 401, b"{}", Outcome.RETRY),
    ("fcm", 500, b"{}", Outcome.RETRY),
    ("webpush", 201, b"", Outcome.SENT),
    ("webpush", 404, b"", Outcome.UNREGISTERED),
    ("webpush", 410, b"", Outcome.UNREGISTERED),
    ("webpush", 413, b"", Outcome.FAILED),
    ("webpush", 429, b"", Outcome.RETRY),
    ("sms", 200, b"", Outcome.FAILED),
])
def test_provider_answers(platform, status, body, outcome):
    assert classify(platform, status, body).outcome is outcome


def test_credential_expiry_asks_for_a_refresh_and_retry_after_is_read():
    assert classify("apns", 403, b'{"reason":"ExpiredProviderToken"}').refresh_credential
    assert classify("fcm", 401).refresh_credential
    assert retry_after("7", 0) == 7.0
    assert retry_after("Wed, 21 Oct 2015 07:28:10 GMT", 1445412480.0) == 10.0
    assert retry_after("soon", 0) is None and retry_after(None, 0) is None
    rng = random.Random(1)
    assert all(0 <= backoff(n, 0.5, 30, rng) <= min(30, 0.5 * 2 ** (n - 1)) for n in range(1, 12))


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


def test_tokens():
    check_token("apns", "ab" * 32)
    check_token("fcm", "dQw4w9WgXcQ:APA91b" + "x" * 140)
    sub = json.dumps({"endpoint": "https://push.example/abc",
                      "keys": {"p256dh": _b64(b"\x04" + b"k" * 64), "auth": _b64(b"a" * 16)}})
    check_token("webpush", sub)
    assert "push.example" not in repr(parse_subscription(sub))
    for platform, token in [("apns", "xyz"), ("apns", "ab"), ("fcm", "has space"), ("fcm", ""),
                            ("webpush", "[]"), ("webpush", "{}"), ("sms", "1"),
                            ("webpush", sub.replace("https://", "ftp://")),
                            ("webpush", sub.replace(_b64(b"a" * 16), _b64(b"a" * 15))),
                            ("fcm", "x" * 4097)]:
        with pytest.raises(TokenError):
            check_token(platform, token)


def test_a_wake_up_carries_nothing_but_the_wake():
    collapse = R.collapse_id(b"dev", 123)
    assert collapse == R.collapse_id(b"dev", 123) != R.collapse_id(b"dev", 124)
    assert len(collapse) == 16
    headers, body = R.apns(collapse, "org.example.app", 1000.0)
    assert json.loads(body) == {"aps": {"alert": {"loc-key": "PPP_NEW_MESSAGE"},
                                        "mutable-content": 1, "sound": "default"}}
    assert headers["apns-collapse-id"] == collapse and headers["apns-expiration"] == "87400"
    msg = json.loads(R.fcm("tok", collapse))["message"]
    assert msg == {"token": "tok", "data": {"wake": "1"},
                   "android": {"priority": "HIGH", "collapse_key": collapse, "ttl": "86400s"}}
    assert R.webpush_headers(collapse)["Topic"] == collapse


def test_web_push_refuses_private_endpoints_and_prints_its_vapid_key(tmp_path):
    """A subscription is a URL a client chose: the relay does not POST to loopback or
    private addresses unless told to (SSRF); the VAPID key is made once and kept."""
    import asyncio
    import subprocess
    import sys

    from egress.push.providers import WebPush
    from runtime.config import WebPushConf
    sub = json.dumps({"endpoint": "https://127.0.0.1:9/wp/x",
                      "keys": {"p256dh": _b64(b"\x04" + b"k" * 64), "auth": _b64(b"a" * 16)}})
    wp = WebPush(WebPushConf(vapid_subject="mailto:ops@example.org"), str(tmp_path), 1.0)
    ans = asyncio.run(wp.send(sub.encode(), "c0ffee"))
    assert ans.outcome is Outcome.UNREGISTERED and ans.reason == "endpoint not allowed"
    http = sub.replace("https://127.0.0.1:9", "http://push.example")
    assert asyncio.run(wp.send(http.encode(), "c0ffee")).outcome is Outcome.UNREGISTERED
    asyncio.run(wp.close())
    key = (tmp_path / "keys" / "vapid_private.pem")
    assert key.exists() and key.stat().st_mode & 0o077 == 0
    out = subprocess.run([sys.executable, "-m", "relay.cli", "--data-dir", str(tmp_path),
                          "push", "--vapid-public-key"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert base64.urlsafe_b64decode(out + "=" * (-len(out) % 4)) == wp.public_key


def test_apns_never_puts_a_non_hex_token_into_its_request_path(tmp_path):
    import asyncio

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from egress.push.providers import Apns
    from runtime.config import ApnsConf
    key = tmp_path / "k.p8"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    # an unroutable URL: a request would fail as a network error (RETRY), not UNREGISTERED
    apns = Apns(ApnsConf(key_file=str(key), key_id="K", team_id="T", url="https://192.0.2.1"),
                0.5)
    for token in (b"../../3/device/x?y", b"", "é".encode()):
        ans = asyncio.run(apns.send(token, "c0ffee"))
        assert ans.outcome is Outcome.UNREGISTERED and "not hex" in ans.reason
    asyncio.run(apns.close())


def test_prune_forgets_in_wake_up_order_and_keeps_what_is_due():
    p = WakePlanner(10)
    for dev, t in ((b"a", 0.0), (b"b", 5.0), (b"c", 7.0)):
        p.offer(dev, t, None)
        p.sent(dev, t)
    p.sent(b"a", 8.0)                                   # woken again: now the newest
    assert p.offer(b"b", 9.0, last_seen=6.0) is Decision.DEFER     # due at 15
    assert p.prune(16.0) == 0                           # b is due; c (7) still inside
    assert p.prune(17.5) == 1 and b"c" not in p and b"a" in p
    assert p.take_due(17.5) == [b"b"] and p.next_due() == 15.0
    p.cancel(b"b")
    assert p.next_due() is None
    assert p.prune(20.0) == 2 and len(p) == 0
