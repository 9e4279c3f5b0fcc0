"""PPP on two hosts at once, all real: two `relay ingress --protocol ppp` processes with their
own data directories and node ids over one tables directory (`hosts_harness.py`), clients
written from spec 004 (`ppp_wire.py`). A delivery token registered on host A takes a sealed
Note on host B; backups stored on both hosts, one after the other and at once, get versions
that never repeat, and the newest is fetched on either; a restarted host folds the same."""

from __future__ import annotations

import asyncio

from nacl.signing import SigningKey

from engine.ppp.keys import Identity
from engine.ppp.tokens import recipient_delivery_token, sender_delivery_token

from hosts_harness import Host
from ppp_wire import Ws, ahttp, pack, unpack
from test_ppp_end_to_end import presence


def test_ppp_served_by_two_hosts_at_once(tmp_path):
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    a_sk, b_sk = SigningKey(alice.seed), SigningKey(bob.seed)
    a, b = Host(tmp_path, "a", "ppp"), Host(tmp_path, "b", "ppp")
    await asyncio.gather(a.start(), b.start())
    try:
        # Bob registers his delivery token for Alice on A; Alice's sealed Note goes to B.
        bob_a = await Ws.login(a.port(), b_sk)
        r = await bob_a.call({"cmd": "REGISTER_DELIVERY_TOKEN",
                              "delivery_token": recipient_delivery_token(bob, alice.pubkey)})
        assert r == {"cmd": "DELIVERY_TOKEN_REGISTERED"}
        gw = presence(alice, bob, "sealed, across hosts")
        body = pack({"delivery_token": sender_delivery_token(alice, bob.pubkey),
                     "ephemeral_pk": gw.ephemeral_pk, "nonce": gw.nonce,
                     "ciphertext": gw.ciphertext, "created_at": gw.created_at,
                     "expires_at": gw.expires_at})
        status, resp, _ = await ahttp(b.port(), "POST", "/v1/note/submit", body,
                                      {"Content-Type": "application/msgpack"})
        assert status == 200 and unpack(resp)["cmd"] == "STORED"
        # An unknown token is still refused on B (looked for, not found).
        token_len = len(sender_delivery_token(alice, bob.pubkey))
        unknown = pack({**unpack(body), "delivery_token": bytes(token_len)})
        status, _, _ = await ahttp(b.port(), "POST", "/v1/note/submit", unknown,
                                   {"Content-Type": "application/msgpack"})
        assert status == 401

        # Backups: v1 on A, v2 on B, the newest fetched on A; then one on each at once.
        alice_a, alice_b = await Ws.login(a.port(), a_sk), await Ws.login(b.port(), a_sk)
        assert (await alice_a.call({"cmd": "STORE_BACKUP", "ciphertext": b"one"}))[
            "version"] == 1
        assert (await alice_b.call({"cmd": "STORE_BACKUP", "ciphertext": b"two"}))[
            "version"] == 2
        got = await alice_a.call({"cmd": "FETCH_BACKUP"})
        assert got["cmd"] == "BACKUP" and got["ciphertext"] == b"two" and got["version"] == 2
        r3, r4 = await asyncio.gather(
            alice_a.call({"cmd": "STORE_BACKUP", "ciphertext": b"from a"}),
            alice_b.call({"cmd": "STORE_BACKUP", "ciphertext": b"from b"}))
        assert sorted((r3["version"], r4["version"])) == [3, 4]
        newest = b"from a" if r3["version"] == 4 else b"from b"
        for c in (alice_a, alice_b):
            got = await c.call({"cmd": "FETCH_BACKUP"})
            assert got["version"] == 4 and got["ciphertext"] == newest
        for c in (bob_a, alice_a, alice_b):
            await c.close()

        # A restarted folds both hosts' rows.
        assert await a.stop() == 0
        await a.start()
        alice_a = await Ws.login(a.port(), a_sk)
        got = await alice_a.call({"cmd": "FETCH_BACKUP"})
        assert got["version"] == 4 and got["ciphertext"] == newest
        bob_a = await Ws.login(a.port(), b_sk)
        r = await bob_a.call({"cmd": "DEREGISTER_DELIVERY_TOKEN",
                              "delivery_token": recipient_delivery_token(bob, alice.pubkey)})
        assert r["cmd"] == "DELIVERY_TOKEN_DEREGISTERED", r
        for c in (alice_a, bob_a):
            await c.close()
    finally:
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
