"""The BLE courier core (spec 004 §8, engine/ppp/courier.py), pure: the handshake and the
chunk framing byte for byte, every MTU from 23 to 517, reassembly abuse, hop limits, the
bystander rule, and a note from alice reaching offline bob through a courier and a second
courier hop, opened and verified by bob with the PPP client library.
"""

from __future__ import annotations

import os
import struct
import time

import pytest
from nacl.signing import SigningKey

from nacl.public import PrivateKey

from engine.ppp.courier import (AUTH_CONTEXT, MAX_CARRIED_EVENT, CarriedEvent, CourierError,
                                CourierSession, CourierStore, Reassembler, RecipientSession,
                                TransferSession, auth_response, chunk_payload, chunks,
                                _peer_box, from_transfer, verify_auth)
from engine.ppp.giftwrap import GiftWrap
from engine.ppp.keys import Identity
from engine.ppp.wrap import Kind, PresenceContent, Region, Rumor, TimeWindow, unwrap, wrap

NOW = int(time.time())


def note(sender: Identity, recipient: Identity, text: str) -> bytes:
    rumor = Rumor(sender.pubkey, Kind.PRESENCE, PresenceContent(
        b"u" * 16, text, Region(52.52, 13.405, 150), TimeWindow(NOW, NOW + 3600, "UTC"),
        (recipient.pubkey,)), NOW)
    return wrap(rumor, sender, recipient.pubkey, created_at=NOW, expires_at=NOW + 86400).encode()


def test_chunk_bytes_and_every_mtu():
    # byte for byte: sequence u16 BE, total u16 BE, data; at most MTU - 3 bytes in all
    assert chunks(b"abcdefghijklmnopqrstu", 23) == [
        b"\x00\x00\x00\x02" + b"abcdefghijklmnop", b"\x00\x01\x00\x02" + b"qrstu"]
    assert chunk_payload(23) == 16 and chunk_payload(517) == 510
    for bad in (22, 518, 0):
        with pytest.raises(CourierError):
            chunk_payload(bad)
    for size in (1, 100, 4000, 66000):
        event = os.urandom(size)
        for mtu in range(23, 518):
            parts = chunks(event, mtu)
            assert all(len(p) <= mtu - 3 for p in parts)
            r = Reassembler()
            out = [r.feed(p) for p in parts]
            assert out[-1] == event and all(o is None for o in out[:-1])


@pytest.mark.parametrize("name,build", [
    ("gap", lambda p: [p[0], p[2]]),
    ("duplicate", lambda p: [p[0], p[1], p[1]]),
    ("reordered", lambda p: [p[1], p[0]]),
    ("total changed", lambda p: [p[0], struct.pack(">HH", 1, 9) + p[1][4:]]),
    ("zero total", lambda p: [struct.pack(">HH", 0, 0) + b"x"]),
    ("empty", lambda p: [p[0][:4]]),
    ("header only", lambda p: [b"\x00\x00"]),
])
def test_reassembly_refuses(name, build):
    parts = chunks(os.urandom(100), 23)
    r = Reassembler()
    with pytest.raises(CourierError):
        for p in build(parts):
            r.feed(p)
    assert not r.in_progress                         # the partial event is dropped
    assert r.feed(chunks(b"fresh", 23)[0]) == b"fresh"


def test_reassembly_refuses_oversize_and_truncation_leaves_nothing():
    r = Reassembler()
    big = [struct.pack(">HH", i, 0xFFFF) + b"x" * 510 for i in range(200)]
    with pytest.raises(CourierError, match="too large"):
        for p in big:
            r.feed(p)
    with pytest.raises(CourierError):
        chunks(b"x" * (MAX_CARRIED_EVENT + 1), 517)
    parts = chunks(os.urandom(100), 23)
    assert [r.feed(p) for p in parts[:-1]] == [None] * (len(parts) - 1)   # truncated: nothing
    assert r.in_progress


def test_handshake_and_the_bystander_rule():
    courier_store = CourierStore()
    alice, bob, mallory = Identity.generate(), Identity.generate(), Identity.generate()
    e = CarriedEvent.fetched(note(alice, bob, "hi"), NOW)
    assert courier_store.add(e, NOW)
    eph = PrivateKey.generate()
    nonce = bytes(eph.public_key)                 # the nonce is the session's X25519 key
    bob_sk, mallory_sk = SigningKey(bob.seed), SigningKey(mallory.seed)
    resp = auth_response(nonce, bob_sk)
    # §8's layout, pk || sig; the sig is over the context and the nonce, byte for byte
    assert resp[:32] == bob.pubkey and len(resp) == 96
    assert AUTH_CONTEXT == b"PPP-courier-auth-v1\x00"
    assert resp[32:] == bob_sk.sign(b"PPP-courier-auth-v1\x00" + nonce).signature
    assert verify_auth(nonce, resp) == bob.pubkey
    # a signature over the bare nonce (what §5.1's AUTH signs) is refused: a courier cannot
    # pass the relay's CHALLENGE off as its nonce and reuse the answer
    with pytest.raises(CourierError):
        verify_auth(nonce, bob.pubkey + bob_sk.sign(nonce).signature)

    def session():
        return CourierSession(courier_store, 185, NOW, carried_for=frozenset({bob.pubkey}),
                              ephemeral=eph)
    # a bystander: nothing but the nonce; acks refused; a stranger's or a forged
    # AUTH_RESPONSE fails with the same reason and ends the session
    for bad in (auth_response(nonce, mallory_sk),                 # not carried for
                bob.pubkey + auth_response(nonce, mallory_sk)[32:],  # bob's key, forged sig
                auth_response(os.urandom(32), bob_sk),            # another session's nonce
                resp[:95], b""):
        s = session()
        assert s.notifications() == []
        with pytest.raises(CourierError, match="^not authenticated$"):
            s.on_ack(e.event_id)
        with pytest.raises(CourierError, match="^not authenticated$"):
            s.on_auth(bad)
        assert s.closed and s.notifications() == []
        with pytest.raises(CourierError):
            s.on_auth(resp)                                       # no second try
    s = session()
    s.on_auth(resp)
    sent = s.notifications()
    assert sent and s.notifications() == []                      # each event once
    # what anyone else hearing EVENT_STREAM gets: neither bob's key nor the GiftWrap
    heard = b"".join(c[4:] for c in sent)
    assert bob.pubkey not in heard and e.event not in heard
    with pytest.raises(CourierError, match="not sealed for this session"):
        mallory_side = RecipientSession(mallory_sk)
        mallory_side.on_nonce(nonce)
        for c in sent:
            mallory_side.on_notification(c)
    bob_side = RecipientSession(bob_sk)
    bob_side.on_nonce(nonce)
    got = [bob_side.on_notification(c) for c in sent]
    assert got[-1][0].encode() == e.event and got[-1][1] == e.event_id


def test_alice_to_offline_bob_through_two_couriers_and_not_a_third_hop():
    alice, bob = Identity.generate(), Identity.generate()
    carol, dave = SigningKey.generate(), SigningKey.generate()
    bob_sk = SigningKey(bob.seed)
    event = note(alice, bob, "meet at the fountain")
    eid = GiftWrap.decode(event).event_id

    # carol fetched it from the relay (hop 0); she hands it to dave (hop 1)
    carol_store = CourierStore()
    assert carol_store.add(CarriedEvent.fetched(event, NOW), NOW)
    hand = CourierSession(carol_store, 23, NOW,
                          carried_for=frozenset({bob.pubkey}),
                          couriers=frozenset({bytes(dave.verify_key)}))
    dave_store = CourierStore()
    taker = TransferSession(dave, dave_store, NOW)
    hand.on_auth(taker.on_nonce(hand.nonce))
    acks = [a for c in hand.notifications() if (a := taker.on_notification(c)) is not None]
    assert acks == [eid] and hand.on_ack(eid)
    assert dave_store.events[eid].hop_count == 1 and not carol_store.events[eid].delivered

    # dave meets bob: bob gets the plain GiftWrap, opens it, checks alice's signature
    meet = CourierSession(dave_store, 517, NOW,
                          carried_for=frozenset({bob.pubkey}))
    bob_side = RecipientSession(bob_sk)
    meet.on_auth(bob_side.on_nonce(meet.nonce))
    got = [bob_side.on_notification(c) for c in meet.notifications()]
    (gw, ack), = [g for g in got if g[0] is not None]
    opened = unwrap(gw.encode(), bob)
    assert opened.sender == alice.pubkey
    assert opened.rumor.content.message == "meet at the fountain"
    assert meet.on_ack(ack) and dave_store.events[eid].delivered
    assert meet.on_ack(ack) is False                          # once
    assert meet.notifications() == []

    # hops: relayed while hop_count < max_hops, never at it
    e = CarriedEvent.fetched(event, NOW)
    for hop in range(3):
        e = from_transfer(e.transfer_form(), NOW)
        assert e.hop_count == hop + 1
    assert not e.relayable
    with pytest.raises(CourierError, match="hop limit"):
        e.transfer_form()
    at_max = CourierStore()
    at_max.add(e, NOW)
    third = CourierSession(at_max, 23, NOW, carried_for=frozenset(),
                           couriers=frozenset({bytes(carol.verify_key)}))
    third.on_auth(auth_response(third.nonce, carol))
    assert third.notifications() == []


def test_expired_events_and_foreign_events_are_refused():
    alice, bob, eve = Identity.generate(), Identity.generate(), Identity.generate()
    store = CourierStore()
    e = CarriedEvent.fetched(note(alice, bob, "x"), NOW)
    assert not store.add(e, e.expires_at)                     # expired: discarded (§ expiry)
    assert store.add(e, NOW) and store.expire(e.expires_at) == 1
    # bob's session refuses an event addressed to eve
    eve_event = note(alice, eve, "not for bob")
    store.add(CarriedEvent.fetched(eve_event, NOW), NOW)
    # a courier that streams eve's event to bob (a bug or a lie): bob refuses it
    liar = CourierSession(store, 100, NOW, carried_for=frozenset({eve.pubkey, bob.pubkey}))
    bob_side = RecipientSession(SigningKey(bob.seed))
    liar.on_auth(bob_side.on_nonce(liar.nonce))
    liar.peer = eve.pubkey           # streams eve's events, sealed to bob
    liar._box = _peer_box(liar._ephemeral, bob.pubkey)
    with pytest.raises(CourierError, match="someone else"):
        for c in liar.notifications():
            bob_side.on_notification(c)
    with pytest.raises(CourierError):
        from_transfer(eve_event, NOW)                         # no hop keys: not a transfer
