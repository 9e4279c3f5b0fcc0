"""Blinded daily mailboxes (spec 004 metadata section; `engine/ppp/blinded.py`), all real:
the ingress node (uvicorn), the Spark stream, the client library over WebSockets and sealed
HTTP. Two users over two simulated days (the client's clock moved by a day; the relay's is
real): Alice writes to Bob's mailbox of each day, authenticated and sealed; Bob fetches each
day's mailbox in a session authenticated as that mailbox.

What is checked: messages arrive under each day's id; neither user's pubkey is anywhere in
what the relay stores (every file under the data directory) or logs; the two days' ids, and
the delivery tokens, share nothing; and the spec's own formula, by contrast, is computed by
the relay from its key and Bob's pubkey for any day. A plain mailbox keeps working beside it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from deltalake import DeltaTable
from nacl import bindings

from delta_tables.layout import Layout
from delta_tables.schema import C
from engine.ppp import blinded as B
from engine.ppp.giftwrap import GiftWrap
from engine.ppp.keys import Identity
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream
from relay.ppp_client import (PppClient, receive, receive_blinded, send_blinded,
                              send_presence)
from runtime.keys import load_or_create

TIMEOUT = 90.0


def test_two_users_two_days(spark, settings, caplog):
    settings.stream.trigger_interval_ms = 100
    settings.heya.enabled = False
    settings.ppp.notify_window_ms = 100
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    caplog.set_level(logging.INFO)
    alice, bob = Identity.generate(), Identity.generate()
    try:
        out = asyncio.run(_scenario(settings, alice, bob))
    finally:
        query.stop()
    day1, day2 = out["days"]
    assert B.epoch_of(day2) == B.epoch_of(day1) + 1
    for day in (day1, day2):
        assert out[("notified", day)] >= 1
        got = out[day]
        assert sorted(r.opened.rumor.content.message for r in got) == [
            f"sealed {day}", f"ws {day}"]
        assert all(r.opened.sender == alice.pubkey and r.acked for r in got)
    assert [r.opened.rumor.content.message for r in out["plain"]] == ["plain"]

    ids = {B.epoch_of(d): B.my_mailbox(bob, alice.pubkey, B.epoch_of(d)).pubkey
           for d in (day1, day2)}
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    boxes = {r[C.MAILBOX] for r in inbox if r[C.PROTOCOL] == "ppp"}
    assert boxes == set(ids.values()) | {bob.pubkey}          # the plain one is Bob's key
    for r in inbox:
        if r[C.MAILBOX] in ids.values():                       # routed, not addressed to Bob
            assert GiftWrap.decode(r[C.ENVELOPE]).recipient == r[C.MAILBOX]

    # Nothing of either user's identity in what the relay stored of two days of blinded
    # traffic (every file, read before the plain event), or in what it logged.
    for pk in (alice.pubkey, bob.pubkey):
        assert pk not in out["stored_blinded"]
    assert bob.pubkey in _stored(settings)                    # the plain event names Bob
    logged = "\n".join(rec.getMessage() + str(rec.__dict__) for rec in caplog.records)
    for pk in (alice.pubkey, bob.pubkey):
        assert pk.hex() not in logged

    # The two days are unlinkable from the relay's side: ids and tokens share nothing, and
    # no key the relay holds derives one day's id from another's.
    tokens = DeltaTable(str(Layout.of(settings).tables / "ppp_delivery_tokens")) \
        .to_pyarrow_table().to_pylist()
    by_box = {t["recipient"]: t["token"] for t in tokens}
    assert set(by_box) == set(ids.values()) and len(set(by_box.values())) == 2
    e1, e2 = sorted(ids)
    relay_key = load_or_create(settings.data_dir).private_bytes
    relay_pk = bindings.crypto_scalarmult_base(relay_key)
    for secret in (relay_key, bindings.crypto_scalarmult(relay_key, bob.x25519_pk)):
        assert B._blind_point(B._blinding(secret, bob.pubkey, e2), bob.pubkey) != ids[e2]
    # The spec's formula: the relay computes Bob's seed from its key and his pubkey.
    bob_seed = bindings.crypto_scalarmult(bob.x25519_sk, relay_pk)
    relay_seed = bindings.crypto_scalarmult(relay_key, bob.x25519_pk)
    assert bob_seed == relay_seed
    assert [B.spec_mailbox_id(relay_seed, e) for e in (e1, e2)] == \
        [B.spec_mailbox_id(bob_seed, e) for e in (e1, e2)]


def _stored(settings) -> bytes:
    return b"".join(p.read_bytes() for p in Path(settings.data_dir).rglob("*") if p.is_file())


async def _scenario(settings, alice: Identity, bob: Identity) -> dict:
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        url = f"ws://127.0.0.1:{node.ppp.bound_port}/v1/ws"
        day1 = int(time.time())
        day2 = day1 + B.EPOCH_SECONDS
        out: dict = {"days": (day1, day2)}
        for day in (day1, day2):
            # Bob's session of that day registers its sealed token first (empty fetch).
            assert await receive_blinded(url, bob, [alice.pubkey], now=day, max_ttl=0,
                                         tokens_ahead=0) == []
            # ... and stays online as that day's mailbox: NOTIFY comes to the blinded id.
            box = B.my_mailbox(bob, alice.pubkey, B.epoch_of(day))
            online = await PppClient.connect(url, box)
            await send_blinded(url, alice, bob.pubkey, f"ws {day}", now=day)
            out[("notified", day)] = await online.wait_notify(TIMEOUT)
            await online.close()
            await send_blinded(url, alice, bob.pubkey, f"sealed {day}", now=day, sealed=True)
            got: list = []
            deadline = time.monotonic() + TIMEOUT
            while len(got) < 2:
                assert time.monotonic() < deadline, "the day's messages never arrived"
                got += await receive_blinded(url, bob, [alice.pubkey], now=day, max_ttl=0,
                                             tokens_ahead=0, ack=True)
                await asyncio.sleep(0.2)
            out[day] = got
        out["stored_blinded"] = _stored(settings)
        await send_presence(url, alice, bob.pubkey, "plain")
        deadline = time.monotonic() + TIMEOUT
        out["plain"] = []
        while not out["plain"]:
            assert time.monotonic() < deadline
            out["plain"] = await receive(url, bob, ack=True)
            await asyncio.sleep(0.2)
        return out
    finally:
        await node.close()
