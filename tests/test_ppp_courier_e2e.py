"""The offline last mile end to end (spec 004 §8): the real relay (PPP listener, the Spark stream
into the inbox), the `relay ppp carry` / `courier` commands, and the BLE shells
(`relay/courier_ble.py`) over the loopback link, which carries the exact GATT reads, writes
and notifications in memory.

This machine has no Bluetooth adapter (CI machines neither): the shells' bless and bleak
paths import but cannot reach the air here, and `relay ppp courier` says so and exits 3 after
fetching. Everything on either side of the air is the code a phone would run.

Alice sends Bob a note while he is offline; courier Carol (of Bob's carry group) fetches it;
Carol hands it to Dave (a second hop), Dave meets Bob; Bob receives, unwraps, verifies
Alice's signature and ACKs over BLE; Dave reconnects and reports; the relay stops offering
it to Carol; a hop past max_hops is refused; Bob's own ACK later empties his mailbox.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import pytest
from nacl.signing import SigningKey

from engine.ppp import courier as C
from engine.ppp.giftwrap import GiftWrap
from engine.ppp.keys import Identity
from relay import courier, courier_ble
from relay.courier_ble import CourierGatt, GattRefused, LoopbackLink, receive
from relay.ppp_client import PppClient, build_presence, open_event, write_seed
from test_ppp_client import NodeThread, run_cli

WAIT = 90.0


def sk(ident: Identity) -> SigningKey:
    return SigningKey(ident.seed)


async def hand_over(store: C.CourierStore, side, *, carried_for=frozenset(),
                    couriers=frozenset(), mtu=23) -> tuple[CourierGatt, int]:
    gatt = CourierGatt(store, carried_for=frozenset(carried_for), couriers=frozenset(couriers),
                       mtu=mtu)
    got = await receive(LoopbackLink(gatt), side, idle=0.3)
    return gatt, got


def test_note_to_offline_bob_through_two_couriers(spark, settings, tmp_path, capsys):
    from jobs.inbox_stream import start_inbox_stream
    settings.ppp.port = 0
    settings.stream.trigger_interval_ms = 100
    alice, bob, carol, dave = (Identity.generate() for _ in range(4))
    seeds = {}
    for name, ident in (("bob", bob), ("carol", carol), ("dave", dave)):
        seeds[name] = str(tmp_path / f"{name}.seed")
        write_seed(seeds[name], ident)
    node = NodeThread(settings)
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    url = ["--url", node.url]
    try:
        # bob's carry group: bob owns it (his consent), carol and dave carry
        (line,) = run_cli(capsys, "ppp", "carry", "register", "--seed", seeds["bob"],
                          "--member", bob.pubkey_hex, "--courier", carol.pubkey_hex,
                          "--courier", dave.pubkey_hex, *url)
        group = json.loads(line)["registered"]

        async def alice_sends():
            async with await PppClient.connect(node.url, alice) as a:
                gw = build_presence(alice, bob.pubkey, "meet at the fountain")
                return await a.store(gw)
        eid = asyncio.run(alice_sends())
        deadline = time.monotonic() + WAIT
        while node.node.ppp.inbox.pending_count(bob.pubkey) != 1:
            assert time.monotonic() < deadline, "the stream did not put the note in the inbox"
            time.sleep(0.2)

        # carol, online, fetches for her group; serving needs Bluetooth, which is not here
        carol_file = str(tmp_path / "carol.carried")
        (line,) = run_cli(capsys, "ppp", "courier", "--seed", seeds["carol"], "--group", group,
                          "--store", carol_file, "--no-serve", *url)
        assert json.loads(line) == {"fetched": 1, "reported": 0, "carrying": 1}
        assert os.stat(carol_file).st_mode & 0o777 == 0o600
        if courier_ble.bluetooth_absent() is not None:
            with pytest.raises(SystemExit) as e:
                run_cli(capsys, "ppp", "courier", "--seed", seeds["carol"], "--store",
                        carol_file, "--offline")
            assert e.value.code == 3
            assert "no Bluetooth adapter" in capsys.readouterr().err
            with pytest.raises(SystemExit) as e:
                run_cli(capsys, "ppp", "courier-receive", "--seed", seeds["bob"])
            assert e.value.code == 3

        async def offline_meetings():
            carol_store = courier.load_store(carol_file)
            (carried,) = carol_store.events.values()
            assert carried.event_id == eid and carried.hop_count == 0
            # carol meets dave, another courier of the group: he takes it on (hop 1)
            dave_store = C.CourierStore()
            gatt, got = await hand_over(carol_store, C.TransferSession(sk(dave), dave_store,
                                                                       int(time.time())),
                                        carried_for={bob.pubkey}, couriers={dave.pubkey})
            assert got == 1 and gatt.handed_on == [eid] and gatt.delivered == []
            assert dave_store.events[eid].hop_count == 1
            # a bystander meeting dave learns nothing, and dave pauses after the failure
            mallory = SigningKey.generate()
            gatt = CourierGatt(dave_store, carried_for=frozenset({bob.pubkey}))
            link = LoopbackLink(gatt)
            with pytest.raises(GattRefused):
                await receive(link, C.RecipientSession(mallory), idle=0.3)
            assert link.notifications == 0
            with pytest.raises(GattRefused, match="busy"):
                await link.read_gatt_char(C.HANDSHAKE_NONCE_UUID)
            # dave meets bob at the largest MTU: bob gets the note, opens it, acks it
            bob_side = C.RecipientSession(sk(bob))
            gatt, got = await hand_over(dave_store, bob_side, carried_for={bob.pubkey}, mtu=517)
            assert got == 1 and gatt.delivered == [eid]
            (gw,) = bob_side.received.values()
            opened = open_event(gw.encode(), bob)
            assert opened.error is None and opened.opened.sender == alice.pubkey
            assert opened.opened.rumor.content.message == "meet at the fountain"
            assert dave_store.events[eid].delivered
            courier.save_store(tmp_path / "dave.carried", dave_store)
            return dave_store
        dave_store = asyncio.run(offline_meetings())

        # dave is online again: his report ends carrying; carol is offered nothing more
        (line,) = run_cli(capsys, "ppp", "courier", "--seed", seeds["dave"], "--group", group,
                          "--store", str(tmp_path / "dave.carried"), "--no-serve", *url)
        assert json.loads(line) == {"fetched": 0, "reported": 1, "carrying": 0}
        (line,) = run_cli(capsys, "ppp", "courier", "--seed", seeds["carol"], "--group", group,
                          "--store", str(tmp_path / "carol2.carried"), "--no-serve", *url)
        assert json.loads(line)["fetched"] == 0

        # bob online later: his own FETCH still has it (the relay never deletes on a
        # courier's word); he ACKs what he got over BLE and his mailbox is empty
        async def bob_online():
            async with await PppClient.connect(node.url, bob) as b:
                assert [GiftWrap.decode(e).event_id for e in await b.fetch_all()] == [eid]
                assert await b.ack([eid]) == 1
                assert await b.fetch_all() == []
        asyncio.run(bob_online())
        assert dave_store is not None
    finally:
        query.stop()
        node.close()


def test_hops_every_mtu_and_expiry_over_the_loopback_link():
    """Offline only: hop counts through a chain of couriers, max_hops, several MTUs."""
    alice, bob = Identity.generate(), Identity.generate()
    now = int(time.time())
    event = build_presence(alice, bob.pubkey, "far away").encode()
    couriers = [SigningKey.generate() for _ in range(5)]
    keys = frozenset(bytes(k.verify_key) for k in couriers)

    async def chain():
        store = C.CourierStore()
        store.add(C.CarriedEvent.fetched(event, now), now)
        hops = []
        for mtu, nxt in zip((23, 64, 185, 517), couriers[1:]):
            taker = C.CourierStore()
            _, got = await hand_over(store, C.TransferSession(nxt, taker, now), couriers=keys,
                                     mtu=mtu)
            hops.append((got, [e.hop_count for e in taker.events.values()]))
            store = taker
        return hops, store
    hops, last = asyncio.run(chain())
    # hops 1, 2, 3 travel; at hop_count 3 (= max_hops) nothing is handed on
    assert hops == [(1, [1]), (1, [2]), (1, [3]), (0, [])]

    async def expired():
        store = C.CourierStore()
        e = C.CarriedEvent.fetched(event, now)
        store.events[e.event_id] = e
        e.expires_at = now - 1                       # past its expiry: never streamed
        bob_side = C.RecipientSession(SigningKey(bob.seed))
        return await hand_over(store, bob_side, carried_for={bob.pubkey})
    _, got = asyncio.run(expired())
    assert got == 0
