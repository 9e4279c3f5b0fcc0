"""No secret in any log line, at DEBUG, with every library logging (RELAY_LOG_LIBRARIES=all):
`relay up` runs every protocol end to end (trueseal, Heya, PPP with a sealed note and a
room knock, cursor-sync) and wakes an offline PPP device through each push provider (APNs
over HTTP/2 + TLS, FCM over TLS from a private CA with its OAuth2 endpoint, Web Push), all
configured through the environment alone (with RELAY_TEST_TABLES=s3, the tables on an S3
server too). Then every line every process wrote (stdout and stderr, the JVM's included) is
searched for each secret the test planted or the relay made (keys, tokens, capability URLs,
subscription keys, OAuth2 bearers, envelopes, event ids, sealed-sender fields, S3
credentials) in hex, base64, base64url and URL-quoted form; a find names the logger and
process of the line.

Heavy (1-2 minutes): `pytest -m secrets`."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import signal
import urllib.parse

import pytest
from nacl.signing import SigningKey

from relay.bench.push_providers import FakeApns, FakeFcm, FakeWebPush
from relay_up_process import RelayUp
from runtime import config
from test_logs import _all_protocols, _Used
from test_push_trust import private_ca

pytestmark = pytest.mark.secrets


def forms(value: bytes | str) -> set[str]:
    """The spellings searched for: text, hex (both cases), base64 and base64url with and
    without padding, a 16-character prefix of each, each URL-quoted."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    out = {value} if isinstance(value, str) else set()
    out |= {raw.hex(), raw.hex().upper()}
    for enc in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()):
        out |= {enc, enc.rstrip("="), enc[:16]}
    out |= {urllib.parse.quote(f, safe="") for f in list(out)}
    return {f for f in out if len(f) >= 12}


def push_env(prov_settings) -> dict[str, str]:
    """The push section a test configured, as RELAY_<SECTION>__<KEY> variables."""
    default = config.Settings()
    env = {}
    for dotted, _, _ in config.leaves():
        if not dotted.startswith("push."):
            continue
        value = config._default_from(prov_settings, dotted)
        if value != config._default_from(default, dotted):
            env[config.env_name(dotted)] = (str(value).lower() if isinstance(value, bool)
                                            else str(value))
    return env


async def _push(used: _Used, port: int, prov) -> None:
    """bob registers a token on each platform, goes offline; alice's STORE wakes all three;
    frank's gated room gets a knock while he is offline (spec 004 §7.4)."""
    from ppp_wire import Ws, giftwrap
    bob_sk, alice_sk, frank_sk, erin_sk = (SigningKey.generate() for _ in range(4))
    bob, frank = bytes(bob_sk.verify_key), bytes(frank_sk.verify_key)
    for who, sk in (("bob", bob_sk), ("alice", alice_sk), ("frank", frank_sk),
                    ("erin", erin_sk)):
        used.secret(f"push {who} public key", bytes(sk.verify_key))
        used.secret(f"push {who} private key", bytes(sk))
    apns_tok = used.secret("apns device token", os.urandom(32)).hex()
    fcm_tok = "fcm-" + base64.urlsafe_b64encode(os.urandom(48)).decode().rstrip("=")
    used.secret("fcm registration token", fcm_tok.encode())
    capability = base64.urlsafe_b64encode(os.urandom(64)).decode().rstrip("=")
    sub, _, auth = prov.webpush.subscription(capability)
    keys = json.loads(sub)["keys"]
    used.secret("webpush capability", capability.encode())
    used.secret("webpush endpoint", json.loads(sub)["endpoint"].encode())
    used.secret("webpush auth", auth)
    used.secret("webpush p256dh", base64.urlsafe_b64decode(keys["p256dh"] + "=="))
    apns_frank = used.secret("apns token frank", os.urandom(32)).hex()

    b = await Ws.login(port, bob_sk)
    for platform, token in (("apns", apns_tok), ("fcm", fcm_tok), ("webpush", sub)):
        assert await b.call({"cmd": "REGISTER_PUSH", "platform": platform,
                             "token": token}) == {"cmd": "PUSH_REGISTERED"}
    await b.close()
    f = await Ws.login(port, frank_sk)
    assert await f.call({"cmd": "REGISTER_PUSH", "platform": "apns",
                         "token": apns_frank}) == {"cmd": "PUSH_REGISTERED"}
    gid = used.secret("room id", os.urandom(16))
    assert (await f.call({"cmd": "CREATE_GROUP", "room_id": gid, "gated": True,
                          "max_members": 10}))["cmd"] == "GROUP_CREATED"
    await f.close()
    await asyncio.sleep(1.0)      # both sessions gone: offline
    a = await Ws.login(port, alice_sk)
    event, event_id = giftwrap(bob)
    used.secret("push event", event)
    used.secret("push event id", event_id)
    assert (await a.call({"cmd": "STORE", "event": event}))["cmd"] == "STORED"
    e = await Ws.login(port, erin_sk)
    eph = used.secret("knock ephemeral key", os.urandom(32))
    assert (await e.call({"cmd": "KNOCK", "room_id": gid, "knocker_eph_x25519_pk": eph}))[
        "cmd"] == "KNOCK_OK"

    def woken() -> bool:
        return (any(r.path.endswith(apns_tok) for r in prov.apns.requests)
                and any(r.path.endswith(apns_frank) for r in prov.apns.requests)
                and any(fcm_tok in r.body.decode() for r in prov.fcm.requests)
                and any(r.path.endswith(capability) for r in prov.webpush.requests))
    for _ in range(1200):
        if woken():
            break
        await asyncio.sleep(0.1)
    assert woken(), (len(prov.apns.requests), len(prov.fcm.requests),
                     len(prov.webpush.requests))
    await a.close()
    await e.close()


def test_no_secret_in_any_line_of_any_process_at_debug(tmp_path, s3_endpoint):
    """With RELAY_TEST_TABLES=s3 the tables are on the S3 server (moto) and its credentials
    are among the secrets searched for."""
    ca_file, chain, key = private_ca(tmp_path)
    used = _Used()
    store = {}
    if s3_endpoint:
        from relay.bench.s3_server import BUCKET, CREDENTIALS
        store = {"RELAY_TABLES_DIR": f"s3://{BUCKET}/{tmp_path.name}",
                 "RELAY_S3_ENDPOINT": s3_endpoint}
        for k, v in CREDENTIALS.items():
            used.secret(k, v.encode())

    async def main():
        apns, fcm, webpush = FakeApns(tmp_path), FakeFcm(tmp_path, tls=(chain, key)), \
            FakeWebPush()
        for p in (apns, fcm, webpush):
            await p.start()
        prov = type("Prov", (), {"apns": apns, "fcm": fcm, "webpush": webpush})
        s = config.Settings()
        apns.conf(s)
        fcm.conf(s)
        s.push.fcm.ca_file = str(ca_file)
        s.push.webpush.vapid_subject = "mailto:ops@relay.example"
        s.push.webpush.allow_private_endpoints = True   # the fake is on loopback
        relay = RelayUp(tmp_path / "data", RELAY_LOG_LEVEL="debug", RELAY_LOG_LIBRARIES="all",
                        RELAY_TRIGGER_INTERVAL_MS="100", **store, **push_env(s))
        relay.env.pop("NO_COLOR", None)
        p = relay.ports
        relay_pub = bytes.fromhex(relay.cli("keys").split()[1])
        inbox_token = used.secret("heya inbox token", bytes.fromhex(
            relay.cli("heya", "inbox-token").split()[0]))
        try:
            relay.start()
            await asyncio.to_thread(relay.ready, 240)
            await asyncio.wait_for(asyncio.gather(
                _all_protocols(used, tmp_path, relay_pub, inbox_token, p["TRUESEAL_PUSH"],
                               p["TRUESEAL_RECEIVE"], p["HEYA"], p["PPP"], p["SYNC"]),
                _push(used, p["PPP"], prov)), 180)
            code = await asyncio.to_thread(relay.stop, signal.SIGTERM, timeout=120)
        finally:
            relay.kill()
            for q in (apns, fcm, webpush):
                await q.close()
            (tmp_path / "stdout.log").write_text("".join(relay.stdout))   # for a person
            (tmp_path / "stderr.log").write_text("".join(relay.stderr))
        assert code == 0, "".join(relay.stderr[-20:])
        # what the relay itself held: its keys and the providers' credentials it used
        keys = tmp_path / "data" / "keys"
        used.secret("relay static key", bytes.fromhex(
            (keys / "trueseal_static.key").read_text().strip()))
        vapid = keys / "vapid_private.pem"
        if vapid.exists():
            from cryptography.hazmat.primitives.serialization import load_pem_private_key
            k = load_pem_private_key(vapid.read_bytes(), None)
            used.secret("vapid private key", k.private_numbers().private_value.to_bytes(32, "big"))
        used.secret("apns signing key", apns.signing_key.private_numbers().private_value
                    .to_bytes(32, "big"))
        for i, t in enumerate(sorted(fcm.tokens)):
            used.secret(f"fcm oauth2 access token {i}", t.encode())
        assert fcm.token_requests >= 1
        return relay

    relay = asyncio.run(main())
    lines = []
    for line in relay.stderr:
        try:
            rec = json.loads(line)
            who = f"{rec.get('process')}/{rec.get('logger')}"
        except ValueError:
            who = "(not JSON)"
        lines.append((who, line))
    lines += [("stdout", line) for line in relay.stdout]
    loggers = {w for w, _ in lines}
    assert len(lines) > 500 and any("httpx" in w for w in loggers), sorted(loggers)[:40]
    found = []
    for what, value in used.secrets.items():
        for form in forms(value):
            for who, line in lines:
                if form in line:
                    found.append(f"{what} as {form[:20]!r} in a line of {who}")
                    break
    assert not found, "\n".join(sorted(set(found))[:40])
    everything = "".join(relay.stderr)
    for port in used.ports:       # no client's source port either
        assert not re.search(rf"(?<![\w.]){port}(?!\w)", everything), f"source port {port}"
