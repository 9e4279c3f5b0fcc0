"""PPP contact discovery (spec 004 §9) through real uvicorn and WebSockets, frames built from
§9's maps (`ppp_wire`): normalisation, publish and query with the relay's pepper, a pepper
rotation invalidating what was published under the old one, the budgets hit exactly, and
every file under the data directory scanned for the identifiers and the pepper (none)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from pathlib import Path

import pytest
from nacl.signing import SigningKey

from engine.ppp import discovery as D
from ingress.service import IngressNode
from relay import cli

from ppp_wire import Ws

ALICE_PHONE, ALICE_MAIL = "+49 (30) 1234-5678", "Alice.Liddell@Example.org"
BOB_PHONE = "+44 20 7946 0018"


def test_normalisation_as_section_9_says():
    assert D.normalize("+49 (30) 1234-5678") == "+493012345678"
    assert D.normalize(" +1 415.555.0100 ") == "+14155550100"
    assert D.normalize("Alice.Liddell@Example.org") == "aliceliddell@example.org"
    assert D.normalize(" a.b+tag@x.org") == "ab+tag@x.org"
    for bad in ("030 1234 5678", "+0301234", "+12", "+1234567890123456", "alice@", "@x.org",
                "a@b", "phone"):
        with pytest.raises(D.IdentifierError):
            D.normalize(bad)
    pepper = bytes(range(32))
    # libsodium crypto_generichash(32, in, key = pepper), computed with hashlib
    assert D.identifier_hash("+493012345678", pepper) == hashlib.blake2b(
        b"+493012345678", digest_size=32, key=pepper).digest()


def h(identifier: str, pepper: bytes) -> bytes:
    return hashlib.blake2b(D.normalize(identifier).encode(), digest_size=32,
                           key=pepper).digest()


def test_publish_query_rotation_budgets_and_nothing_plain_on_disk(settings, tmp_path, capsys):
    settings.ppp.discovery_pepper_rotation_hours = 6 / 3600       # 6 s
    settings.heya.enabled = False
    out = asyncio.run(_scenario(settings))
    assert out["pepper"]["cmd"] == "DISCOVERY_PEPPER" and len(out["pepper"]["pepper"]) == 32
    assert out["published"] == {"cmd": "DISCOVERY_PUBLISHED", "count": 2,
                                "pepper_id": out["pepper"]["pepper_id"]}
    assert out["not_mine"]["reason"].startswith("pubkey must be the caller's")
    assert [(m["hash"], m["pubkey"]) for m in out["matches"]["matches"]] == [
        (out["alice_phone_hash"], out["alice_pk"])]
    assert out["stale"]["reason"].startswith("stale pepper")
    assert out["too_many"]["reason"].startswith("at most 500 hashes")
    # After the rotation the old set matches nothing; re-published, it matches again.
    assert out["new_pepper"]["pepper_id"] == out["pepper"]["pepper_id"] + 1
    assert out["new_pepper"]["pepper"] != out["pepper"]["pepper"]
    assert out["after_rotation"]["matches"] == []
    assert len(out["after_republish"]["matches"]) == 1
    # Budgets: 20 queries per pubkey per hour, then refused; 60 per address per hour.
    assert out["per_pubkey"] == ["DISCOVERY_MATCHES"] * 20 + ["STORE_FAIL"]
    assert out["per_address"] == ["DISCOVERY_MATCHES"] * (60 - out["used"]) + ["STORE_FAIL"]
    assert out["sybil"]["reason"].startswith("rate limited") and out["sybil_hits"] == 0
    # Nothing plain on disk: no identifier (as typed or normalised), no pepper.
    data = b"".join(p.read_bytes() for p in Path(settings.data_dir).rglob("*")
                    if p.is_file() and "keys" not in p.parts)
    for secret in (ALICE_PHONE, ALICE_MAIL, D.normalize(ALICE_PHONE), D.normalize(ALICE_MAIL),
                   "3012345678"):
        assert secret.encode() not in data, secret
    assert out["pepper"]["pepper"] not in data and out["new_pepper"]["pepper"] not in data
    seed = Path(settings.data_dir, "keys", "discovery_pepper.key")
    assert oct(seed.stat().st_mode & 0o777) == "0o600"


async def _scenario(settings) -> dict:
    out: dict = {}
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.ppp.bound_port
        a_sk, b_sk = SigningKey.generate(), SigningKey.generate()
        a, b = await Ws.login(port, a_sk), await Ws.login(port, b_sk)
        out["alice_pk"] = bytes(a_sk.verify_key)
        # Publish right after a rotation, so the whole scenario fits in one pepper period.
        rot = settings.ppp.discovery_pepper_rotation_hours * 3600
        await asyncio.sleep(rot - time.time() % rot + 0.05)
        out["pepper"] = p = await a.call({"cmd": "DISCOVERY_PEPPER"})
        pepper, pid = p["pepper"], p["pepper_id"]
        mine = [h(ALICE_PHONE, pepper), h(ALICE_MAIL, pepper)]
        out["alice_phone_hash"] = mine[0]
        out["published"] = await a.call({"cmd": "DISCOVERY_PUBLISH", "hashes": mine,
                                         "pubkey": out["alice_pk"], "pepper_id": pid})
        out["not_mine"] = await b.call({"cmd": "DISCOVERY_PUBLISH", "hashes": mine,
                                        "pubkey": out["alice_pk"]})
        out["matches"] = await b.call({"cmd": "DISCOVERY_QUERY", "pepper_id": pid, "hashes": [
            h("+49 30 12345678", pepper), h(BOB_PHONE, pepper), os.urandom(32)]})
        out["stale"] = await b.call({"cmd": "DISCOVERY_QUERY", "pepper_id": pid - 1,
                                     "hashes": [mine[0]]})
        out["too_many"] = await b.call({"cmd": "DISCOVERY_QUERY",
                                        "hashes": [os.urandom(32) for _ in range(501)]})
        await asyncio.sleep(rot - time.time() % rot + 0.05)          # the pepper rotates
        out["new_pepper"] = q = await b.call({"cmd": "DISCOVERY_PEPPER"})
        out["after_rotation"] = await b.call({"cmd": "DISCOVERY_QUERY", "hashes": [
            h(ALICE_PHONE, q["pepper"])]})
        await a.call({"cmd": "DISCOVERY_PUBLISH", "pubkey": out["alice_pk"],
                      "hashes": [h(ALICE_PHONE, q["pepper"])]})
        out["after_republish"] = await b.call({"cmd": "DISCOVERY_QUERY", "hashes": [
            h(ALICE_PHONE, q["pepper"])]})
        # b's pubkey budget has paid for 4 queries (the stale one too: the session charges a
        # well-formed command before it runs; the 501-hash one was malformed), the address
        # budget for the 3 that reached the index.
        got = [(await b.call({"cmd": "DISCOVERY_QUERY", "hashes": [os.urandom(32)]}))["cmd"]
               for _ in range(20 - 4 + 1)]
        out["per_pubkey"] = ["DISCOVERY_MATCHES"] * 4 + got
        out["used"] = 3 + 16
        rest = []
        while len(rest) < 60 - out["used"] + 1:     # fresh pubkeys, same address
            c = await Ws.login(port, SigningKey.generate())
            for _ in range(min(15, 60 - out["used"] + 1 - len(rest))):
                rest.append((await c.call({"cmd": "DISCOVERY_QUERY",
                                           "hashes": [os.urandom(32)]}))["cmd"])
            await c.close()
        out["per_address"] = rest
        # A fresh pubkey from the spent address is refused before its quota is charged: no
        # hit row, no commit.
        hits = node.ppp.control.state.budget
        before = sum(len(v) for v in hits.hits.values())
        c = await Ws.login(port, SigningKey.generate())
        out["sybil"] = await c.call({"cmd": "DISCOVERY_QUERY", "hashes": [os.urandom(32)]})
        out["sybil_hits"] = sum(len(v) for v in hits.hits.values()) - before
        await c.close()
        for w in (a, b):
            await w.close()
        return out
    finally:
        await node.close()


def test_cli_discovers_contacts(settings, tmp_path, capsys):
    """`relay ppp discover-contacts`: Alice publishes, Bob finds her among his contacts."""
    from test_ppp_client import NodeThread
    node = NodeThread(settings)
    try:
        url = ["--url", node.url]
        alice, bob = str(tmp_path / "a.seed"), str(tmp_path / "b.seed")
        cli.main(["ppp", "keygen", "--out", alice])
        (alice_pk,) = capsys.readouterr().out.split()
        cli.main(["ppp", "keygen", "--out", bob])
        capsys.readouterr()
        cli.main(["ppp", "discover-contacts", "--seed", alice, "--publish", ALICE_PHONE,
                  "--publish", ALICE_MAIL, *url])
        contacts = tmp_path / "contacts.txt"
        contacts.write_text(f"{BOB_PHONE}\nalice.liddell@example.org\n030 5555\n")
        capsys.readouterr()
        cli.main(["ppp", "discover-contacts", "--seed", bob, "--contacts", str(contacts), *url])
        import json
        lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert {"identifier": "alice.liddell@example.org", "pubkey": alice_pk} in lines
        assert any(x.get("identifier") == "030 5555" and "error" in x for x in lines)
        assert not any(x.get("identifier") == BOB_PHONE and "pubkey" in x for x in lines)
    finally:
        node.close()
