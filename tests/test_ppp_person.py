"""PPP as a person uses it (spec 004, client side): devices driven through the client library
and the `relay ppp` CLI against a real relay on loopback (the ingress node on its own loop in
a thread, the Spark stream into the inbox, egress), each device with its own seed file and
state directory.

- Blinded mail is never missed: Bob offline for three days (the clients' clocks moved, the
  relay's real) finds every message in the mailboxes of those days; a walk of today and
  yesterday only (what the client did before) misses two of them; Alice, who knows every
  mailbox id, cannot authenticate as one to fetch or acknowledge Bob's mail.
- The offline queue: the relay down, `relay ppp send` queues; `relay ppp flush` delivers
  when it is back; a sealed send without a registered token falls back to STORE.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest

from engine.ppp import blinded as B
from engine.ppp.keys import Identity
from jobs.inbox_stream import start_inbox_stream
from relay import cli
from relay.ppp_client import (PppClient, PppRefused, read_seed, receive, receive_blinded,
                              send_blinded)
from relay.ppp_device import Device
from test_ppp_client import NodeThread

TIMEOUT = 90.0
DAY = B.EPOCH_SECONDS


@pytest.fixture
def stream(spark, settings):
    settings.stream.trigger_interval_ms = 100
    settings.heya.enabled = False
    settings.ppp.notify_window_ms = 0
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    try:
        yield settings
    finally:
        query.stop()


@pytest.fixture
def relay(stream):
    node = NodeThread(stream)
    try:
        yield node
    finally:
        node.close()


def run_cli(capsys, *argv) -> list[dict]:
    cli.main(list(argv))
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def keygen(capsys, tmp_path, name: str) -> tuple[str, Identity]:
    path = str(tmp_path / f"{name}.seed")
    cli.main(["ppp", "keygen", "--out", path])
    capsys.readouterr()
    return path, read_seed(path)


def _until(fn, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, what
        time.sleep(1.0)     # FETCH is rate-limited (C.3: 30 a minute per pubkey)


# --- blinded mail, never missed -------------------------------------------------------------

class _AliceAsMailbox:
    """What Alice can put together for Bob's mailbox: its id (she routes mail to it) and the
    best key she has, the one the first design derived from the pair's shared secret."""

    def __init__(self, alice: Identity, bob_pk: bytes, epoch: int):
        self.pubkey = B.their_mailbox_id(alice, bob_pk, epoch)
        seed = hashlib.blake2b(b"ppp-blinded-mailbox-v1" + bob_pk + struct.pack(">Q", epoch),
                               digest_size=32, key=alice.dh(bob_pk)).digest()
        self._key = Identity.from_seed(seed)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def test_blinded_recipient_offline_three_days(relay):
    alice, bob = Identity.generate(), Identity.generate()
    url = relay.url
    day0 = int(time.time())
    bob_state: dict = {}

    async def online(now):
        return await receive_blinded(url, bob, [alice.pubkey], now=now, ack=True,
                                     state=bob_state)

    # Bob is online on day 0 (nothing yet; his sealed tokens for the week are registered)
    assert asyncio.run(online(day0)) == []
    st = bob_state[alice.pubkey.hex()]
    assert st["tokens_through"] == B.epoch_of(day0) + 7

    # ... then offline three days, while Alice writes on each of them.
    sent = {}
    for k, sealed in ((1, True), (2, False), (3, True)):
        r = asyncio.run(send_blinded(url, alice, bob.pubkey, f"day {k}", now=day0 + k * DAY,
                                     sealed=sealed))
        assert r.via == ("sealed" if sealed else "ws"), r
        sent[k] = r

    # Alice knows each mailbox's id but cannot be it: AUTH as it is refused.
    async def alice_tries():
        with pytest.raises(PppRefused) as e:
            await PppClient.connect(url, _AliceAsMailbox(alice, bob.pubkey,
                                                        B.epoch_of(day0 + DAY)))
        return e.value.cmd
    assert asyncio.run(alice_tries()) == "AUTH_FAIL"

    day4 = day0 + 4 * DAY
    # The stream takes the three events into the inbox (looked at without acknowledging).
    _until(lambda: len(asyncio.run(receive_blinded(url, bob, [alice.pubkey], now=day4,
                                                   max_ttl=5 * DAY, tokens_ahead=0))) == 3,
           "the three days' messages never reached the inbox")
    # Walking today and yesterday only, as the client once did, misses days 1 and 2.
    short = asyncio.run(receive_blinded(url, bob, [alice.pubkey], now=day4, max_ttl=DAY,
                                        tokens_ahead=0))
    assert sorted(r.opened.rumor.content.message for r in short) == ["day 3"]

    # Bob back on day 4: every message, each from its day's mailbox, verified and acknowledged.
    got = asyncio.run(online(day4))
    assert sorted((r.extra["mailbox_epoch"] - B.epoch_of(day0), r.opened.rumor.content.message)
                  for r in got) == [(1, "day 1"), (2, "day 2"), (3, "day 3")]
    assert all(r.acked and r.opened.sender == alice.pubkey for r in got)
    assert st["drained_before"] == B.epoch_of(day4) - 1
    # Acknowledged: gone from the relay; the next walk starts at yesterday, not 30 days back.
    _until(lambda: asyncio.run(receive_blinded(url, bob, [alice.pubkey], now=day4,
                                               max_ttl=5 * DAY, tokens_ahead=0)) == [],
           "acknowledged mail still offered")
    assert list(B.epochs_to_walk(day4, drained_before=st["drained_before"])) == [
        B.epoch_of(day4) - 1, B.epoch_of(day4), B.epoch_of(day4) + 1]


def test_walk_covers_the_longest_lifetime():
    now = 1_765_000_000
    days = B.epochs_to_walk(now)
    assert days[0] == B.epoch_of(now - 30 * DAY) and days[-1] == B.epoch_of(now) + 1
    assert len(days) == 32
    # a sender may give an event at most 30 days (C.2 MAX_EVENT_TTL_SECS): that day's
    # mailbox is the oldest one that can still hold mail
    assert B.epoch_of(now - B.MAX_EVENT_TTL_SECS) in days


# --- the offline queue and the sealed fallback ---------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_relay_down_send_queued_then_delivered(stream, tmp_path, capsys):
    settings = stream
    alice_seed, alice = keygen(capsys, tmp_path, "alice")
    bob_seed, bob = keygen(capsys, tmp_path, "bob")
    port = _free_port()
    url = f"ws://127.0.0.1:{port}/v1/ws"

    # The relay is down: both sends are kept in Alice's outbox, nothing lost, exit status 0.
    (q1,) = run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
                    "--text", "written offline", "--url", url)
    (q2,) = run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
                    "--text", "sealed, offline", "--sealed", "--url", url)
    (q3,) = run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
                    "--text", "blinded, offline", "--blinded", "--url", url)
    assert q1["queued"] and q2["queued"] and q3["queued"]
    assert len({q1["event_id"], q2["event_id"], q3["event_id"]}) == 3
    outbox = Device.beside(alice_seed).load("outbox", [])
    assert [e["event_id"] for e in outbox] == [q["event_id"] for q in (q1, q2, q3)]
    assert outbox[2]["blinded_for"] == bob.pubkey_hex
    # (each send retried those before it: four attempts, three, two)
    still = run_cli(capsys, "ppp", "flush", "--seed", alice_seed, "--url", url)
    assert still == [{"event_id": q["event_id"], "queued": True, "attempts": n}
                     for q, n in ((q1, 4), (q2, 3), (q3, 2))]

    # The relay comes back on that port: the queue is delivered. Bob never registered a
    # delivery token, so the sealed one falls back to authenticated STORE (§6.3).
    settings.ppp.port = port
    node = NodeThread(settings)
    try:
        # Alice's device comes back online two days later (its clock moved; the relay's not)
        later = int(time.time()) + 2 * DAY
        from relay.ppp_client import Outbox
        done = asyncio.run(Outbox(Device.beside(alice_seed)).flush(url, alice, now=later))
        by_id = {d["event_id"]: d for d in done}
        assert by_id[q1["event_id"]]["via"] == "ws"
        assert by_id[q2["event_id"]]["via"] == "ws-fallback"
        assert by_id[q2["event_id"]]["fallback_reason"] == "sealed HTTP 401"
        assert Device.beside(alice_seed).load("outbox", None) == []
        assert run_cli(capsys, "ppp", "flush", "--seed", alice_seed, "--url", url) == []

        got: list = []
        _until(lambda: got.extend(asyncio.run(receive(url, bob, ack=True))) or len(got) >= 2,
               "queued mail never arrived")
        assert sorted(r.opened.rumor.content.message for r in got) == [
            "sealed, offline", "written offline"]
        # The blinded one was re-routed to the mailbox of the day it was sent, the only one
        # Bob still walks once the days before are emptied.
        assert by_id[q3["event_id"]]["via"] == "ws"
        late = _until(lambda: asyncio.run(receive_blinded(
            url, bob, [alice.pubkey], now=later, max_ttl=0, tokens_ahead=0)),
            "the re-routed blinded event never arrived")
        assert [(r.extra["mailbox_epoch"], r.opened.rumor.content.message) for r in late] == [
            (B.epoch_of(later), "blinded, offline")]
    finally:
        node.close()


# --- backups: a new device from the recovery phrase alone ----------------------------------

def test_bip39_vector_and_backup_key():
    from engine.ppp.backup import (BackupError, backup_key, identity_from_mnemonic,
                                   mnemonic_of, open_backup, seal_backup)
    # BIP-39's published vector (entropy 00...00, 256 bits, passphrase "TREZOR")
    phrase = "abandon " * 23 + "art"
    assert mnemonic_of(Identity.from_seed(bytes(32))) == phrase
    bip39_seed = bytes.fromhex(
        "bda85446c68413707090a52022edd26a1c9462295029f2e60cd7c4f2bbd30971"
        "70af7a4d73245cafa9c3cca8d561a7c3de6f5d4a10be8ed2a5e608d68f92fcc8")
    assert backup_key(phrase, "TREZOR") == hashlib.blake2b(b"ppp-backup-v1", digest_size=32,
                                                           key=bip39_seed).digest()
    assert identity_from_mnemonic(phrase.upper()).seed == bytes(32)
    with pytest.raises(BackupError, match="checksum"):
        identity_from_mnemonic("abandon " * 24)
    blob = seal_backup({"mail": [1]}, backup_key(phrase))
    assert open_backup(blob, backup_key(phrase)) == {"mail": [1]}
    with pytest.raises(BackupError, match="does not open"):
        open_backup(blob, backup_key(phrase, "another passphrase"))


def test_restore_on_a_fresh_device_and_read_old_mail(relay, tmp_path, capsys):
    url = ["--url", relay.url]
    alice_seed, alice = keygen(capsys, tmp_path, "alice")
    bob_seed, bob = keygen(capsys, tmp_path, "bob")
    for text in ("first", "second"):
        run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
                "--text", text, *url)
    got: list = []
    _until(lambda: got.extend(run_cli(capsys, "ppp", "receive", "--seed", bob_seed, "--ack",
                                      *url)) or len(got) >= 2, "mail never arrived")
    assert all(g["acked"] for g in got)           # read and acknowledged: gone from the relay

    cli.main(["ppp", "recovery-phrase", "--seed", bob_seed])
    out = capsys.readouterr()
    words = out.out.split()
    assert len(words) == 24 and "write these words down" in out.err
    (created,) = run_cli(capsys, "ppp", "backup", "create", "--seed", bob_seed, *url)
    assert created["version"] >= 1 and created["bytes"] > 0
    (shown,) = run_cli(capsys, "ppp", "backup", "show", "--seed", bob_seed, *url)
    assert shown == {"version": created["version"], "stored_at": created["stored_at"],
                     "bytes": created["bytes"]}

    # Bob's phone is lost. A new one, with the 24 words only.
    phrase = tmp_path / "words.txt"
    phrase.write_text(" ".join(words) + "\n")
    new_seed, new_state = str(tmp_path / "new.seed"), str(tmp_path / "new-device")
    bad = tmp_path / "bad.txt"
    bad.write_text(" ".join(words[:-1] + [words[0] if words[-1] != words[0] else words[1]]))
    with pytest.raises(SystemExit):
        cli.main(["ppp", "backup", "restore", "--phrase-file", str(bad), "--out", new_seed,
                  "--state", new_state, *url])
    assert "recovery phrase" in capsys.readouterr().err
    (restored,) = run_cli(capsys, "ppp", "backup", "restore", "--phrase-file", str(phrase),
                          "--out", new_seed, "--state", new_state, *url)
    assert restored["pubkey"] == bob.pubkey_hex and restored["restored"]
    assert restored["mail"] == 2
    old = run_cli(capsys, "ppp", "mail", "--seed", new_seed, "--state", new_state)
    assert sorted(m["message"] for m in old) == ["first", "second"]
    assert all(m["sender"] == alice.pubkey_hex for m in old)
    # ... and it is Bob: new mail opens there too, and joins the kept history.
    run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
            "--text", "third", *url)
    more: list = []
    _until(lambda: more.extend(run_cli(capsys, "ppp", "receive", "--seed", new_seed,
                                       "--state", new_state, "--ack", *url)) or more,
           "new mail never arrived on the new device")
    assert [m["message"] for m in more] == ["third"]
    assert len(run_cli(capsys, "ppp", "mail", "--seed", new_seed, "--state", new_state)) == 3


# --- out-of-band verification, key changes, REVOKE, KEY_EXCHANGE_RETURN ----------------------

def test_verification_urls_are_signed_single_use_and_expire():
    from engine.ppp import verify as V
    alice, bob, carol = (Identity.generate() for _ in range(3))
    now = 1_765_000_000
    inv = V.Invite.make(alice, "https://relay.example", now)
    url = inv.url("ppp.example")
    assert url.startswith("https://ppp.example/v?p=")
    assert V.Invite.parse(url, now + 60) == inv
    with pytest.raises(V.VerifyError, match="expired"):
        V.Invite.parse(url, now + V.INVITE_TTL + 1)
    # a key swapped into the link does not carry the signature
    forged = url.replace(f"p={V._b64(alice.pubkey)}", f"p={V._b64(carol.pubkey)}")
    with pytest.raises(V.VerifyError, match="does not verify"):
        V.Invite.parse(forged, now)
    pending = {inv.invite_token.hex(): {"issued_at": now}}
    acc = V.Accept.make(bob, inv)
    # Bob's accept names Alice: forwarded to Carol (same token in her pending set) it fails
    with pytest.raises(V.VerifyError, match="does not verify"):
        V.check_accept(carol, acc, dict(pending), now)
    assert V.check_accept(alice, V.Accept.parse(acc.url("x")), pending, now) == {
        "issued_at": now}
    with pytest.raises(V.VerifyError, match="already used"):
        V.check_accept(alice, acc, pending, now)
    late = {inv.invite_token.hex(): {"issued_at": now}}
    with pytest.raises(V.VerifyError, match="expired"):
        V.check_accept(alice, acc, late, now + V.INVITE_TTL + 1)


def test_verify_a_contact_and_see_a_changed_key_flagged(relay, tmp_path, capsys):
    from engine.ppp.wrap import Kind
    from relay.ppp_client import build_event, deliver, key_exchange_return_content
    url = ["--url", relay.url]
    alice_seed, alice = keygen(capsys, tmp_path, "alice")
    bob_seed, bob = keygen(capsys, tmp_path, "bob")
    bob2_seed, bob2 = keygen(capsys, tmp_path, "bob2")
    carol_seed, carol = keygen(capsys, tmp_path, "carol")
    dave_seed, dave = keygen(capsys, tmp_path, "dave")

    (inv,) = run_cli(capsys, "ppp", "verify", "invite", "--seed", alice_seed,
                     "--domain", "ppp.example", *url)
    (acc,) = run_cli(capsys, "ppp", "verify", "accept", "--seed", bob_seed, "--invite",
                     inv["invite_url"], "--name", "alice", "--via", "signal",
                     "--domain", "ppp.example")
    assert acc["pubkey"] == alice.pubkey_hex and acc["level"] == 1
    (done,) = run_cli(capsys, "ppp", "verify", "complete", "--seed", alice_seed, "--accept",
                      acc["accept_url"], "--name", "bob", "--via", "signal")
    assert done["pubkey"] == bob.pubkey_hex and done["level"] == 1
    assert [done["fingerprint"]] == [line for line in (
        cli.main(["ppp", "fingerprint", "--seed", bob_seed, "--contact", alice.pubkey_hex])
        or capsys.readouterr().out.splitlines())]
    with pytest.raises(SystemExit):                              # single use
        run_cli(capsys, "ppp", "verify", "complete", "--seed", alice_seed, "--accept",
                acc["accept_url"], "--name", "bob")
    assert "already used" in capsys.readouterr().err
    run_cli(capsys, "ppp", "contacts", "--seed", alice_seed, "add", "--name", "carol",
            "--pubkey", carol.pubkey_hex)
    (bob_pin, carol_pin) = run_cli(capsys, "ppp", "contacts", "--seed", alice_seed)
    assert (bob_pin["contact_id"], bob_pin["verification_level"], bob_pin["verified_via"],
            bob_pin["level_name"]) == ("bob", 1, "signal", "oob-verified")
    assert carol_pin["verification_level"] == 0

    # Bob sends, then revokes; Bob and Carol move to new keys; Carol forges nothing she can't.
    (sent,) = run_cli(capsys, "ppp", "send", "--seed", bob_seed, "--to", alice.pubkey_hex,
                      "--text", "meet at noon", *url)
    _until(lambda: run_cli(capsys, "ppp", "receive", "--seed", alice_seed, "--ack", *url),
           "Bob's message never arrived")
    assert [m["message"] for m in run_cli(capsys, "ppp", "mail", "--seed", alice_seed)] == [
        "meet at noon"]
    run_cli(capsys, "ppp", "revoke", "--seed", bob_seed, "--to", alice.pubkey_hex,
            "--presence-id", sent["presence_id"], *url)
    (rot,) = run_cli(capsys, "ppp", "rotate-key", "--seed", bob_seed, "--new-seed", bob2_seed,
                     "--to", alice.pubkey_hex, *url)
    assert rot["kind"] == "KEY_ROTATION"
    carol2 = Identity.generate()
    from engine.ppp import verify as V

    async def more():
        await deliver(relay.url, carol, build_event(carol, alice.pubkey, Kind.KEY_ROTATION,
                                                    V.key_rotation_content(carol, carol2.pubkey)))
        await deliver(relay.url, carol, build_event(carol, alice.pubkey, Kind.KEY_ROTATION, {
            "new_pubkey": dave.pubkey, "migration_sig": bytes(64)}))      # not Carol's doing
        await deliver(relay.url, dave, build_event(dave, alice.pubkey, Kind.KEY_EXCHANGE_RETURN,
                                                   key_exchange_return_content(dave,
                                                                               alice.pubkey)))
        await deliver(relay.url, dave, build_event(dave, alice.pubkey, Kind.KEY_EXCHANGE_RETURN,
                                                   key_exchange_return_content(dave,
                                                                               carol.pubkey)))
    asyncio.run(more())

    notices: list = []

    def poll():
        cli.main(["ppp", "receive", "--seed", alice_seed, "--ack", *url])
        out = capsys.readouterr()
        poll.err += out.err
        notices.extend(json.loads(x)["notice"] for x in out.out.splitlines() if '"notice"' in x)
        return len(notices) >= 6
    poll.err = ""
    _until(poll, "the revoke, rotations and key returns never arrived")

    assert {"revoked": sent["presence_id"], "removed": 1} in notices
    kept = run_cli(capsys, "ppp", "mail", "--seed", alice_seed)
    assert [m["kind"] for m in kept if m["kind"] == "PRESENCE"] == []      # revoked
    assert sorted(m["kind"] for m in kept) == ["KEY_EXCHANGE_RETURN"] * 2 + [
        "KEY_ROTATION"] * 3 + ["REVOKE"]
    changes = {n["key_change"]["contact_id"]: n["key_change"] for n in notices
               if "key_change" in n}
    # Bob was verified: a prominent warning, the old key kept until Alice approves.
    assert changes["bob"]["severity"] == "warning" and not changes["bob"]["accepted"]
    assert changes["bob"]["new_pubkey"] == bob2.pubkey_hex
    assert "WARNING: bob:" in poll.err
    # Carol was only discovered: a notice, the new key taken (TOFU).
    assert changes["carol"]["severity"] == "notice" and changes["carol"]["accepted"]
    refused = [n["refused"] for n in notices if "refused" in n]
    assert sorted(refused) == ["KEY_EXCHANGE_RETURN is bound to another initiator",
                               "KEY_ROTATION migration signature does not verify"]
    assert any(n.get("contact_added") and n["pubkey"] == dave.pubkey_hex for n in notices)
    pins = {c["contact_id"]: c for c in run_cli(capsys, "ppp", "contacts", "--seed",
                                                 alice_seed)}
    assert pins["bob"]["pubkey"] == bob.pubkey_hex and pins["bob"]["pending_key"] == \
        bob2.pubkey_hex
    assert pins["carol"]["pubkey"] == carol2.pubkey.hex()
    (approved,) = run_cli(capsys, "ppp", "contacts", "--seed", alice_seed, "approve",
                          "--name", "bob")
    assert approved["pubkey"] == bob2.pubkey_hex and approved["verification_level"] == 0
    # The pins never went to the relay: nothing of them in what it stored.
    stored = b"".join(p.read_bytes() for p in Path(relay.node.settings.data_dir).rglob("*")
                      if p.is_file())
    assert b"signal" not in stored and b"oob-verified" not in stored


# --- TLS on the listener itself ------------------------------------------------------------

def _self_signed(tmp_path) -> tuple[str, str]:
    from relay.bench.push_providers import self_signed    # 127.0.0.1, its own CA
    return tuple(map(str, self_signed(tmp_path)))


def test_listener_serves_wss_and_https_itself(settings, tmp_path, capsys, monkeypatch):
    import websockets
    from relay.ppp_client import PppError
    cert, key = _self_signed(tmp_path)
    settings.ppp.tls_cert_file, settings.ppp.tls_key_file = cert, key
    settings.ppp.notify_window_ms = 0
    monkeypatch.setenv("SSL_CERT_FILE", cert)       # the clients trust this certificate
    node = NodeThread(settings)
    try:
        port = node.node.ppp.bound_port
        wss = f"wss://127.0.0.1:{port}/v1/ws"
        alice_seed, alice = keygen(capsys, tmp_path, "alice")
        bob_seed, bob = keygen(capsys, tmp_path, "bob")
        # over TLS: AUTH, STORE (WebSocket) and a sealed POST (HTTPS) through the CLI
        run_cli(capsys, "ppp", "register-token", "--seed", bob_seed, "--contact",
                alice.pubkey_hex, "--url", wss)
        (ws,) = run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to", bob.pubkey_hex,
                        "--text", "over wss", "--url", wss)
        (sealed,) = run_cli(capsys, "ppp", "send", "--seed", alice_seed, "--to",
                            bob.pubkey_hex, "--text", "over https", "--sealed",
                            "--no-fallback", "--url", wss)
        assert ws["via"] == "ws" and sealed["via"] == "sealed"
        # plain ws:// to a TLS listener gets nowhere (no queueing of a mistake: the CLI
        # queues only when nothing answered, and here TLS bytes answered)
        async def plain():
            with pytest.raises((PppError, websockets.InvalidMessage, OSError, EOFError)):
                await PppClient.connect(f"ws://127.0.0.1:{port}/v1/ws", alice,
                                        open_timeout=5)
        asyncio.run(plain())
        # a certificate nobody trusts is refused by the client
        monkeypatch.delenv("SSL_CERT_FILE")
        async def untrusted():
            import ssl
            with pytest.raises(ssl.SSLCertVerificationError):
                await PppClient.connect(wss, alice, open_timeout=5)
        asyncio.run(untrusted())
    finally:
        node.close()


def test_tls_settings_go_together(settings, tmp_path):
    from ingress.ppp_app import tls_context
    cert, key = _self_signed(tmp_path)
    assert tls_context("", "") is None
    with pytest.raises(ValueError, match="go together"):
        tls_context(cert, "")
    with pytest.raises(ValueError, match="cannot load"):
        tls_context(cert, str(tmp_path / "missing.key"))
    assert tls_context(cert, key) is not None


# --- HTTP polling: a round trip, and a signature bound to its path -------------------------

def test_polling_client_round_trip_and_tampered_path_refused(relay, tmp_path, capsys):
    import urllib.error
    import urllib.request
    from relay.ppp_client import PollingClient, build_presence
    alice, bob = Identity.generate(), Identity.generate()
    bob_seed = str(tmp_path / "bob.seed")
    from relay.ppp_client import write_seed
    write_seed(bob_seed, bob)
    alice_poll, bob_poll = PollingClient(relay.url, alice), PollingClient(relay.url, bob)
    gw = build_presence(alice, bob.pubkey, "by polling")
    assert asyncio.run(alice_poll.store(gw)) == gw.event_id          # POST /v1/events
    got = _until(lambda: run_cli(capsys, "ppp", "receive", "--seed", bob_seed, "--http",
                                 "--ack", "--url", relay.url), "the polled event never came")
    assert [(g["message"], g["acked"]) for g in got] == [("by polling", True)]
    assert asyncio.run(bob_poll.fetch()) == ([], None)               # acknowledged

    def get(target: str, headers: dict) -> int:
        req = urllib.request.Request(bob_poll.base + target, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
    signed_for = bob_poll.headers(b"GET /v1/events?since=0")
    assert get("/v1/events?since=0", signed_for) == 200
    # the same signature on another path or query: refused
    assert get("/v1/events?since=1", signed_for) == 401
    assert get(f"/v1/events/carry?group={'00' * 16}&since=0", signed_for) == 401
    # the spec-literal signature (timestamp only) no longer reads anything
    assert get("/v1/events?since=0", bob_poll.headers(b"")) == 401


# --- room moderation from the CLI ----------------------------------------------------------

def test_room_update_kick_and_ban_from_the_cli(settings, tmp_path, capsys):
    settings.ppp.moderation = True
    node = NodeThread(settings)
    try:
        url = ["--url", node.url]
        admin_seed, _ = keygen(capsys, tmp_path, "admin")
        bob_seed, bob = keygen(capsys, tmp_path, "bob")
        room_file = str(tmp_path / "group.json")
        (made,) = run_cli(capsys, "ppp", "room", "create", "--seed", admin_seed, "--group",
                          "--out", room_file, *url)
        (upd,) = run_cli(capsys, "ppp", "room", "update", "--seed", admin_seed, "--room",
                         room_file, "--no-gated", *url)
        assert upd == {"room_id": made["room_id"], "updated": {"gated": False}}
        with pytest.raises(SystemExit):                     # only the admin moderates
            run_cli(capsys, "ppp", "room", "kick", "--seed", bob_seed, "--room", room_file,
                    "--member", bob.pubkey_hex, *url)
        assert "not room admin" in capsys.readouterr().err
        for act in ("kick", "ban"):
            (out,) = run_cli(capsys, "ppp", "room", act, "--seed", admin_seed, "--room",
                             room_file, "--member", bob.pubkey_hex, "--reason", "spam", *url)
            assert out == {"room_id": made["room_id"], "member": bob.pubkey_hex,
                           ("kicked" if act == "kick" else "banned"): True}
        with pytest.raises(SystemExit):                     # banned: FETCH_ROOM refused
            run_cli(capsys, "ppp", "room", "fetch", "--seed", bob_seed, "--room", room_file,
                    *url)
        assert "banned" in capsys.readouterr().err
    finally:
        node.close()


# --- the courier's hand-over without Bluetooth ----------------------------------------------

def test_courier_loopback_handover_from_the_cli(tmp_path, capsys):
    from engine.ppp import courier as C
    from relay import courier
    from relay.ppp_client import build_presence
    courier_seed, _ = keygen(capsys, tmp_path, "courier")
    alice_seed, alice = keygen(capsys, tmp_path, "alice")
    bob_seed, bob = keygen(capsys, tmp_path, "bob")
    carol_seed, carol = keygen(capsys, tmp_path, "carol")
    store_path = str(tmp_path / "carried.bin")
    store = C.CourierStore()
    now = int(time.time())
    for text in ("carried one", "carried two"):
        store.add(C.CarriedEvent.fetched(build_presence(alice, bob.pubkey, text).encode(), now),
                  now)
    courier.save_store(store_path, store)
    lines = run_cli(capsys, "ppp", "courier", "--seed", courier_seed, "--store", store_path,
                    "--offline", "--loopback", bob_seed, "--loopback", carol_seed)
    *events, report = lines
    got = [e for e in events if e["recipient"] == bob.pubkey_hex]
    assert sorted(e["message"] for e in got) == ["carried one", "carried two"]
    assert all(e["sender"] == alice.pubkey_hex and e["verified"] for e in got)
    assert {"recipient": carol.pubkey_hex, "refused": "nothing carried for it"} in events
    assert report == {"carrying": 2, "delivered": 2, "handed_on": 0}
    assert all(e.delivered for e in courier.load_store(store_path).events.values())


# --- readable output ----------------------------------------------------------------------

def test_output_is_json_with_ids_in_hex(tmp_path, capsys):
    from engine.ppp.wrap import Kind
    from relay.ppp_client import build_event, open_event
    seed, me = keygen(capsys, tmp_path, "me")
    other = Identity.generate()
    assert run_cli(capsys, "ppp", "pubkey", "--seed", seed, "--json") == [
        {"pubkey": me.pubkey_hex}]
    (fp,) = run_cli(capsys, "ppp", "fingerprint", "--seed", seed, "--contact",
                    other.pubkey_hex, "--json")
    assert fp["contact"] == other.pubkey_hex and fp["display"].replace(" ", "") == \
        fp["fingerprint"].rstrip("=")
    # a carry-group invite (or any kind without its own view): JSON, ids and keys in hex
    invite = {"group_id": bytes(range(16)), "group_name": "hikers",
              "members": [me.pubkey], "couriers": [other.pubkey]}
    gw = build_event(other, me.pubkey, Kind.CARRY_GROUP_INVITE, invite)
    shown = open_event(gw.encode(), me).to_json()
    assert shown["kind"] == "CARRY_GROUP_INVITE"
    assert shown["content"] == {"group_id": bytes(range(16)).hex(), "group_name": "hikers",
                                "members": [me.pubkey_hex], "couriers": [other.pubkey.hex()]}
    assert json.loads(json.dumps(shown)) == shown


# --- a spec-literal STORE_ROOM to a gated room ---------------------------------------------

async def _spec_literal_store_room(url: str, me: Identity, room_id: bytes) -> dict:
    """C.1's STORE_ROOM {room_id, nonce, ciphertext} and nothing else, over a WebSocket
    authenticated by hand (§5.1), as a client that knows only the spec would send it."""
    import msgpack
    import websockets
    async with websockets.connect(url) as ws:
        challenge = msgpack.unpackb(await ws.recv(), raw=False)
        await ws.send(msgpack.packb({"cmd": "AUTH", "pubkey": me.pubkey,
                                     "sig": me.sign(challenge["nonce"])}, use_bin_type=True))
        assert msgpack.unpackb(await ws.recv(), raw=False)["cmd"] == "AUTH_OK"
        await ws.send(msgpack.packb({"cmd": "STORE_ROOM", "room_id": room_id,
                                     "nonce": bytes(24), "ciphertext": os.urandom(64)},
                                    use_bin_type=True))
        while True:
            m = msgpack.unpackb(await ws.recv(), raw=False)
            if m["cmd"] not in ("ROOM_NOTIFY", "NOTIFY"):
                return m


def test_spec_literal_gated_store_room_from_an_admitted_member(stream, tmp_path):
    from relay import ppp_rooms as R
    settings = stream
    settings.ppp.moderation = True
    node = NodeThread(settings)
    admin, bob, carol = Identity.generate(), Identity.generate(), Identity.generate()
    try:
        url = node.url

        async def scenario():
            room = await R.create(url, admin, 48.8566, 2.3522, ttl=3600, gated=True,
                                  max_members=10, ble=True, out=tmp_path / "room.json")
            # Carol never joined: refused. Bob knocks and the admin admits him.
            refused = await _spec_literal_store_room(url, carol, room.room_id)
            admitting = asyncio.create_task(R.admit(url, admin, room, wait=30))
            await asyncio.sleep(0.5)
            await R.knock(url, bob, room.room_id, tmp_path / "bob-room.json", wait=30)
            await admitting
            stored = await _spec_literal_store_room(url, bob, room.room_id)
            # kicked: forgotten, refused again
            async with await PppClient.connect(url, admin) as c:
                await c.kick_member(room.room_id, bob.pubkey)
            after_kick = await _spec_literal_store_room(url, bob, room.room_id)
            return refused, stored, after_kick
        refused, stored, after_kick = asyncio.run(scenario())
        assert refused["cmd"] == "STORE_FAIL" and "member" in refused["reason"]
        assert stored["cmd"] == "ROOM_STORED" and stored["sequence_number"] >= 1
        assert after_kick["cmd"] == "STORE_FAIL" and "member" in after_kick["reason"]
    finally:
        node.close()


def test_remembered_members_fold_and_are_forgotten():
    from delta_tables.room_state import RoomState
    from delta_tables.schema_ppp import OP_MEMBER, OP_REVOKE, OP_ROTATE, OP_UNMEMBER
    room, bob, dan = b"r" * 16, b"b" * 32, b"d" * 32
    st = RoomState()
    st.token_row(OP_MEMBER, room, bob, None, 1)
    st.token_row(OP_MEMBER, room, dan, None, 2)
    assert st.known_member(room, bob) and st.known_member(room, dan)
    st.token_row(OP_UNMEMBER, room, dan, None, 3)
    assert not st.known_member(room, dan)
    for op in (OP_ROTATE, OP_REVOKE):
        st.token_row(OP_MEMBER, room, bob, None, 4)
        st.token_row(op, room, None, 10, 5)
        assert not st.known_member(room, bob)


def test_carry_group_invite_and_accept_through_the_cli(relay, tmp_path, capsys):
    url = ["--url", relay.url]
    owner_seed, owner = keygen(capsys, tmp_path, "owner")
    bob_seed, bob = keygen(capsys, tmp_path, "bob")
    courier_seed, courier_id = keygen(capsys, tmp_path, "courier")
    group = os.urandom(16).hex()
    (inv,) = run_cli(capsys, "ppp", "carry", "invite", "--seed", owner_seed, "--group", group,
                     "--name", "hikers", "--member", bob.pubkey_hex, "--courier",
                     courier_id.pubkey_hex, "--to", bob.pubkey_hex, *url)
    assert inv["kind"] == "CARRY_GROUP_INVITE" and inv["via"] == "ws"
    (got,) = _until(lambda: run_cli(capsys, "ppp", "receive", "--seed", bob_seed, "--ack",
                                    *url), "the invite never came")
    assert got["kind"] == "CARRY_GROUP_INVITE" and got["sender"] == owner.pubkey_hex
    assert got["content"] == {"group_id": group, "group_name": "hikers",
                              "members": [bob.pubkey_hex], "couriers": [courier_id.pubkey_hex]}
    run_cli(capsys, "ppp", "carry", "accept", "--seed", bob_seed, "--group", group,
            "--to", owner.pubkey_hex, *url)
    (acc,) = _until(lambda: run_cli(capsys, "ppp", "receive", "--seed", owner_seed, "--ack",
                                    *url), "the accept never came")
    assert acc["kind"] == "CARRY_GROUP_ACCEPT" and acc["sender"] == bob.pubkey_hex
    assert acc["content"] == {"group_id": group, "pubkey": bob.pubkey_hex}


def test_bad_options_are_refused_with_the_range(tmp_path, capsys):
    seed, _ = keygen(capsys, tmp_path, "me")
    to = Identity.generate().pubkey_hex
    for opt, value, says in (("--ttl", "0", "--ttl must be in 1..2592000"),
                             ("--ttl", "2592001", "--ttl must be in 1..2592000"),
                             ("--radius", "9", "--radius must be in 10..50000"),
                             ("--ttl", "1.5", "--ttl must be a whole number")):
        with pytest.raises(SystemExit):
            cli.main(["ppp", "send", "--seed", seed, "--to", to, "--text", "x", opt, value,
                      "--url", "ws://127.0.0.1:9/v1/ws"])
        assert says in capsys.readouterr().err
    assert Device.beside(seed).load("outbox", []) == []      # nothing built, nothing queued
