"""The PPP client library and `relay ppp` CLI against the real relay: the ingress node (PPP
listener, landing group commit) on loopback, and for the receive path the Spark stream into the
inbox. The node runs on its own event loop in a thread so the CLI (which calls asyncio.run)
runs in-process exactly as a person would run it.

Skipped only if the PPP listener is absent from IngressNode (`ingress/ppp_app.py`).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading

import msgpack
import pytest
import websockets

from engine.ppp.ids import sealed_event_id
from engine.ppp.keys import Identity
from engine.ppp.tokens import recipient_delivery_token, sender_delivery_token
from relay import cli
from relay.ppp_client import (PppClient, PppRefused, build_presence, http_base, read_seed,
                              submit_sealed)

pytest.importorskip("ingress.ppp_app", reason="PPP listener not built yet")

RECEIVE_TIMEOUT = 90.0    # one stream micro-batch normally; generous on a loaded 2-core box


class NodeThread:
    """IngressNode on its own loop in a daemon thread."""

    def __init__(self, settings):
        from ingress.service import IngressNode
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.node = self._run(self._make(IngressNode, settings))
        if getattr(self.node, "ppp", None) is None:
            self.close()
            pytest.skip("IngressNode has no PPP listener")
        self._run(self.node.start())
        self.url = f"ws://127.0.0.1:{self.node.ppp.bound_port}/v1/ws"

    @staticmethod
    async def _make(cls, settings):
        return cls(settings, fsync=False)

    def _run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        if getattr(self, "node", None) is not None and getattr(self.node, "ppp", None):
            self._run(self.node.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def relay_node(settings):
    settings.ppp.port = 0
    settings.ppp.notify_window_ms = 0     # NOTIFY at once (the default batches for 30 s)
    node = NodeThread(settings)
    try:
        yield node
    finally:
        node.close()


def run_cli(capsys, *argv) -> list[str]:
    cli.main(list(argv))
    return capsys.readouterr().out.splitlines()


def test_client_store_register_and_sealed_submit(relay_node):
    alice, bob = Identity.generate(), Identity.generate()
    url = relay_node.url

    async def scenario():
        async with await PppClient.connect(url, alice) as a:
            gw = build_presence(alice, bob.pubkey, "over the socket")
            assert await a.store(gw) == gw.event_id
            with pytest.raises(PppRefused) as e:            # §4.5: a stored id again
                await a.store(gw)
            assert e.value.cmd == "STORE_FAIL"
        # Sealed before Bob registered the pair's token: 401.
        gw2 = build_presence(alice, bob.pubkey, "sealed")
        token = sender_delivery_token(alice, bob.pubkey)
        with pytest.raises(PppRefused) as e:
            await submit_sealed(http_base(url), token, gw2)
        assert e.value.status == 401
        async with await PppClient.connect(url, bob) as b:
            await b.register_delivery_token(recipient_delivery_token(bob, alice.pubkey))
        eid = await submit_sealed(http_base(url), token, gw2)
        assert eid == sealed_event_id(gw2.ephemeral_pk, gw2.nonce, gw2.ciphertext, token,
                                      gw2.created_at)

    asyncio.run(scenario())


def test_auth_by_hand_from_the_spec(relay_node):
    """§5.1 frames written here: CHALLENGE {nonce} -> AUTH {pubkey, sig}; a wrong signature
    gets AUTH_FAIL, a right one AUTH_OK."""
    me = Identity.generate()

    async def handshake(good: bool) -> str:
        async with websockets.connect(relay_node.url) as ws:
            ch = msgpack.unpackb(await ws.recv())
            assert ch["cmd"] == "CHALLENGE" and len(ch["nonce"]) == 32
            sig = me.sign(ch["nonce"] if good else b"not the nonce")
            await ws.send(msgpack.packb({"cmd": "AUTH", "pubkey": me.pubkey, "sig": sig}))
            return msgpack.unpackb(await ws.recv())["cmd"]

    assert asyncio.run(handshake(False)) == "AUTH_FAIL"
    assert asyncio.run(handshake(True)) == "AUTH_OK"


def test_cli_keygen_send_register(relay_node, tmp_path, capsys):
    a_seed, b_seed = str(tmp_path / "alice.seed"), str(tmp_path / "bob.seed")
    (a_pk,) = run_cli(capsys, "ppp", "keygen", "--out", a_seed)
    (b_pk,) = run_cli(capsys, "ppp", "keygen", "--out", b_seed)
    assert stat.S_IMODE(os.stat(a_seed).st_mode) == 0o600
    assert read_seed(a_seed).pubkey_hex == a_pk and len(b_pk) == 64
    assert run_cli(capsys, "ppp", "pubkey", "--seed", b_seed) == [b_pk]
    with pytest.raises(SystemExit):                         # never overwrite a seed silently
        run_cli(capsys, "ppp", "keygen", "--out", a_seed)
    fp_a = run_cli(capsys, "ppp", "fingerprint", "--seed", a_seed, "--contact", b_pk)
    assert fp_a == run_cli(capsys, "ppp", "fingerprint", "--seed", b_seed, "--contact", a_pk)

    url = ["--url", relay_node.url]
    (out,) = run_cli(capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text", "hi", *url)
    assert json.loads(out)["via"] == "ws"
    with pytest.raises(SystemExit):                         # no token registered yet: 401
        run_cli(capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text", "x",
                "--sealed", "--no-fallback", *url)
    assert "401" in capsys.readouterr().err
    (out,) = run_cli(capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text", "x",
                     "--sealed", *url)                      # §6.3: fall back to STORE
    assert json.loads(out)["via"] == "ws-fallback"
    assert json.loads(out)["fallback_reason"] == "sealed HTTP 401"
    run_cli(capsys, "ppp", "register-token", "--seed", b_seed, "--contact", a_pk, *url)
    (out,) = run_cli(capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text", "x",
                     "--sealed", "--lat", "1", "--lon", "2", "--radius", "10", *url)
    assert json.loads(out)["via"] == "sealed"
    with pytest.raises(SystemExit):                         # §4.4 radius bounds
        run_cli(capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text", "x",
                "--radius", "9", *url)


def test_send_and_receive_through_the_stream(spark, settings, relay_node, tmp_path, capsys):
    """Alice sends over the socket and sealed while Bob is connected; Bob gets NOTIFY once the
    stream has moved them into the inbox; `relay ppp receive` unwraps and verifies both, acks
    them, and they are gone."""
    from jobs.inbox_stream import start_inbox_stream
    settings.stream.trigger_interval_ms = 100
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        a_seed, b_seed = str(tmp_path / "a.seed"), str(tmp_path / "b.seed")
        (a_pk,) = run_cli(capsys, "ppp", "keygen", "--out", a_seed)
        (b_pk,) = run_cli(capsys, "ppp", "keygen", "--out", b_seed)
        url = ["--url", relay_node.url]
        bob = read_seed(b_seed)

        async def bob_online():
            async with await PppClient.connect(relay_node.url, bob) as c:
                await asyncio.to_thread(
                    run_cli, capsys, "ppp", "send", "--seed", a_seed, "--to", b_pk, "--text",
                    "one", "--lat", "52.52", "--lon", "13.405", "--radius", "200", *url)
                await asyncio.to_thread(run_cli, capsys, "ppp", "register-token", "--seed",
                                        b_seed, "--contact", a_pk, *url)
                await asyncio.to_thread(run_cli, capsys, "ppp", "send", "--seed", a_seed,
                                        "--to", b_pk, "--text", "two \u2603", "--sealed", *url)
                while c.notified < 2:                       # §5.1 NOTIFY, then FETCH
                    await c.wait_notify(RECEIVE_TIMEOUT)
                assert len(await c.fetch_all()) == 2

        asyncio.run(bob_online())

        lines = run_cli(capsys, "ppp", "receive", "--seed", b_seed, "--ack", "--here", "52.5205",
                        "13.405", *url)
        got = sorted((json.loads(x) for x in lines), key=lambda r: r["message"])
        assert [r["message"] for r in got] == ["one", "two \u2603"]
        for r in got:
            assert r["sender"] == a_pk and r["kind"] == "PRESENCE"
            assert r["verified"] and r["acked"]
        assert got[0]["region"] == {"latitude": 52.52, "longitude": 13.405, "radius_m": 200}
        assert got[0]["inside"] is True and got[1]["inside"] is False   # default: 0,0 50 km
        assert run_cli(capsys, "ppp", "receive", "--seed", b_seed, *url) == []
        # Not Alice's to read: her mailbox is empty, Bob's events never reach her.
        assert run_cli(capsys, "ppp", "receive", "--seed", a_seed, *url) == []
    finally:
        query.stop()
