"""PPP client crypto, pure (engine/ppp: keys, crypto, padding, wrap, tokens).

Events are also built here by hand from the spec's layouts with nacl.bindings, hashlib and
msgpack directly (not our encoder), and our unwrap must open them; and ours must open with the
same by-hand steps. Tampering, a wrong recipient, a forged sender and bad padding are refused.
"""

from __future__ import annotations

import hashlib
import os

import msgpack
import nacl.public
import nacl.signing
import pytest
from nacl import bindings

from engine.ppp import crypto, padding, tokens
from engine.ppp.giftwrap import GiftWrap
from engine.ppp.keys import Identity, KeyMaterialError, verify
from engine.ppp.wrap import (Kind, PresenceContent, Region, Rumor, Seal, TimeWindow, WrapError,
                             unwrap, wrap)

NOW = 1_750_000_000
ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(32, 64)))
MALLORY = Identity.from_seed(bytes(range(64, 96)))


def presence(sender=ALICE, recipient=BOB, message="hi") -> Rumor:
    content = PresenceContent(os.urandom(16), message, Region(48.8584, 2.2945, 100),
                              TimeWindow(NOW, NOW + 3600, "Europe/Paris"), (recipient.pubkey,))
    return Rumor(sender.pubkey, Kind.PRESENCE, content, NOW)


# --- keys -----------------------------------------------------------------------------------

def test_identity_matches_libsodium_and_pynacl():
    sk = nacl.signing.SigningKey(ALICE.seed)
    assert ALICE.ed25519_pk == bytes(sk.verify_key)
    assert ALICE.ed25519_sk == ALICE.seed + ALICE.ed25519_pk   # libsodium layout
    assert ALICE.x25519_pk == bytes(sk.verify_key.to_curve25519_public_key())
    assert ALICE.x25519_sk == bytes(sk.to_curve25519_private_key())
    assert bytes(nacl.public.PrivateKey(ALICE.x25519_sk).public_key) == ALICE.x25519_pk
    assert ALICE.sign(b"m") == sk.sign(b"m").signature
    assert verify(ALICE.pubkey, b"m", ALICE.sign(b"m"))
    assert not verify(ALICE.pubkey, b"n", ALICE.sign(b"m"))
    assert not verify(BOB.pubkey, b"m", ALICE.sign(b"m"))
    assert ALICE.dh(BOB.pubkey) == BOB.dh(ALICE.pubkey)


def test_identity_repr_has_no_secret():
    text = repr(ALICE) + str(ALICE)
    for secret in (ALICE.seed, ALICE.ed25519_sk, ALICE.x25519_sk):
        assert secret.hex()[:16] not in text
    with pytest.raises(KeyMaterialError):
        Identity.from_seed(b"short")


# --- KDF and AEAD -----------------------------------------------------------------------------

def test_kdf_is_blake2b_keyed_by_the_context():
    shared = os.urandom(32)
    assert crypto.kdf(shared, b"ppp-seal-v1") == hashlib.blake2b(
        shared, digest_size=32, key=b"ppp-seal-v1").digest()
    # libsodium's own crypto_generichash(out, in=shared, key=context) agrees.
    assert crypto.kdf(shared, b"ppp-wrap-v1") == bindings.crypto_generichash_blake2b_salt_personal(
        shared, digest_size=32, key=b"ppp-wrap-v1")
    assert crypto.kdf(shared, b"ppp-seal-v1") != crypto.kdf(shared, b"ppp-wrap-v1")


def test_aead_round_trip_and_tamper():
    key, nonce = os.urandom(32), os.urandom(24)
    ct = crypto.encrypt(b"payload", nonce, key)
    assert len(ct) == len(b"payload") + 16
    assert crypto.decrypt(ct, nonce, key) == b"payload"
    for bad in (ct[:-1] + bytes([ct[-1] ^ 1]), ct[:5]):
        with pytest.raises(crypto.DecryptError):
            crypto.decrypt(bad, nonce, key)
    with pytest.raises(crypto.DecryptError):
        crypto.decrypt(ct, os.urandom(24), key)


# --- padding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("length,bucket", [(3, 256), (254, 256), (255, 1024), (1022, 1024),
                                           (1023, 4096), (4094, 4096), (4095, 16384),
                                           (16382, 16384)])
def test_pad_picks_the_smallest_bucket(length, bucket):
    pt = msgpack.packb(b"\x01" * (length - (2 if length - 2 < 256 else 3)))
    assert len(pt) == length
    padded = padding.pad(pt, lambda n: b"\x01" * n)     # worst case: padding full of 0x01
    assert len(padded) == bucket
    assert padded[:length] == pt and padded[length] == 1 and padded[-1] == 0
    assert padding.unpad(padded) == pt


def test_pad_refuses_above_the_largest_bucket():
    with pytest.raises(padding.PaddingError):
        padding.pad(b"x" * (16384 - 1))


def test_unpad_is_strict():
    pt = msgpack.packb({"a": 1})
    good = padding.pad(pt)
    assert padding.unpad(good) == pt
    bad = [good[:-1],                                      # not a bucket size
           good[:-1] + b"\x07",                            # no terminator
           pt + b"\x02" + good[len(pt) + 1:],              # no delimiter
           pt + b"\x01" + bytes(1024 - len(pt) - 1),       # larger bucket than needed
           b"\xc1" + good[1:]]                             # not MessagePack
    for b in bad:
        with pytest.raises(padding.PaddingError):
            padding.unpad(b)


# --- the three layers -------------------------------------------------------------------------

def test_wrap_unwrap_round_trip_and_sizes():
    rumor = presence()
    gw = wrap(rumor, ALICE, BOB.pubkey, created_at=NOW, expires_at=NOW + 60)
    assert len(gw.ciphertext) - 16 in padding.BUCKETS   # the relay sees a bucket size only
    opened = unwrap(GiftWrap.decode(gw.encode()).encode(), BOB)
    assert opened.rumor == rumor and opened.sender == ALICE.pubkey
    assert opened.rumor.content.region.contains(48.8590, 2.2945)
    assert not opened.rumor.content.region.contains(48.87, 2.2945)


def test_each_wrap_is_fresh():
    rumor = presence()
    a = wrap(rumor, ALICE, BOB.pubkey, created_at=NOW, expires_at=NOW + 60)
    b = wrap(rumor, ALICE, BOB.pubkey, created_at=NOW, expires_at=NOW + 60)
    assert a.ephemeral_pk != b.ephemeral_pk and a.event_id != b.event_id


def test_unwrap_refuses_wrong_recipient_and_tampering():
    gw = wrap(presence(), ALICE, BOB.pubkey, created_at=NOW, expires_at=NOW + 60)
    with pytest.raises(WrapError, match="another recipient"):
        unwrap(gw, MALLORY)
    # Readdressed to Mallory: the wrap key is Bob's, so it does not decrypt.
    with pytest.raises(WrapError, match="does not decrypt"):
        unwrap(GiftWrap(MALLORY.pubkey, *[getattr(gw, f) for f in
                                          ("ephemeral_pk", "nonce", "ciphertext", "created_at",
                                           "expires_at")]), MALLORY)
    flipped = gw.ciphertext[:10] + bytes([gw.ciphertext[10] ^ 0x80]) + gw.ciphertext[11:]
    with pytest.raises(WrapError, match="does not decrypt"):
        unwrap(GiftWrap(gw.recipient, gw.ephemeral_pk, gw.nonce, flipped, gw.created_at,
                        gw.expires_at), BOB)
    with pytest.raises(WrapError):
        unwrap(b"\x81\x01\x02", BOB)
    with pytest.raises(WrapError, match="ephemeral key unusable"):   # not a curve point
        unwrap(GiftWrap(BOB.pubkey, b"\xff" * 32, gw.nonce, gw.ciphertext, NOW, NOW), BOB)
    with pytest.raises(WrapError, match="recipient key unusable"):
        wrap(presence(), ALICE, b"\xff" * 32, created_at=NOW, expires_at=NOW)


def _hand_wrap(rumor_map: dict, signer: Identity, recipient: Identity, pad=True,
               sig: bytes | None = None) -> bytes:
    """The spec's §3 steps with libsodium calls and msgpack only."""
    b = bindings
    r_x = b.crypto_sign_ed25519_pk_to_curve25519(recipient.pubkey)
    e1_pk, e1_sk = b.crypto_sign_seed_keypair(os.urandom(32))
    seal_key = hashlib.blake2b(b.crypto_scalarmult(b.crypto_sign_ed25519_sk_to_curve25519(e1_sk),
                                                   r_x), digest_size=32, key=b"ppp-seal-v1").digest()
    n1 = os.urandom(24)
    ct1 = b.crypto_aead_xchacha20poly1305_ietf_encrypt(msgpack.packb(rumor_map), None, n1,
                                                       seal_key)
    sig = sig if sig is not None else b.crypto_sign(ct1, signer.ed25519_sk)[:64]
    seal = msgpack.packb({2: e1_pk, 3: n1, 4: ct1, 10: sig})
    if pad:
        bucket = next(x for x in (256, 1024, 4096, 16384) if len(seal) + 2 <= x)
        seal = seal + b"\x01" + os.urandom(bucket - len(seal) - 2) + b"\x00"
    e2_pk, e2_sk = b.crypto_sign_seed_keypair(os.urandom(32))
    wrap_key = hashlib.blake2b(b.crypto_scalarmult(b.crypto_sign_ed25519_sk_to_curve25519(e2_sk),
                                                   r_x), digest_size=32, key=b"ppp-wrap-v1").digest()
    n2 = os.urandom(24)
    ct2 = b.crypto_aead_xchacha20poly1305_ietf_encrypt(seal, None, n2, wrap_key)
    return msgpack.packb({1: recipient.pubkey, 2: e2_pk, 3: n2, 4: ct2, 5: NOW, 6: NOW + 60})


def _rumor_map(sender: bytes, message="by hand") -> dict:
    return {7: sender, 8: 1, 9: {"event_id": b"\x11" * 16, "message": message,
                                 "region": {14: 0, "latitude": 1.5, "longitude": -2.25,
                                            "radius_m": 10},
                                 "time_window": {"starts_at": NOW, "ends_at": NOW + 1,
                                                 "timezone": "UTC"},
                                 "recipients": [BOB.pubkey]}, 5: NOW}


def test_unwrap_opens_an_event_built_by_hand_from_the_spec():
    opened = unwrap(_hand_wrap(_rumor_map(ALICE.pubkey), ALICE, BOB), BOB)
    c = opened.rumor.content
    assert opened.sender == ALICE.pubkey and c.message == "by hand"
    assert (c.region.latitude, c.region.longitude, c.region.radius_m) == (1.5, -2.25, 10)


def test_our_wrap_opens_by_hand():
    gw = wrap(presence(message="ours"), ALICE, BOB.pubkey, created_at=NOW, expires_at=NOW + 9)
    b = bindings
    m = msgpack.unpackb(gw.encode(), strict_map_key=False)
    assert set(m) == {1, 2, 3, 4, 5, 6} and m[1] == BOB.pubkey
    x_sk = b.crypto_sign_ed25519_sk_to_curve25519(BOB.ed25519_sk)
    key = hashlib.blake2b(b.crypto_scalarmult(x_sk, b.crypto_sign_ed25519_pk_to_curve25519(m[2])),
                          digest_size=32, key=b"ppp-wrap-v1").digest()
    padded = b.crypto_aead_xchacha20poly1305_ietf_decrypt(m[4], None, m[3], key)
    unpacker = msgpack.Unpacker(strict_map_key=False)
    unpacker.feed(padded)
    seal = unpacker.unpack()
    assert padded[unpacker.tell()] == 1 and padded[-1] == 0
    key = hashlib.blake2b(b.crypto_scalarmult(x_sk, b.crypto_sign_ed25519_pk_to_curve25519(
        seal[2])), digest_size=32, key=b"ppp-seal-v1").digest()
    rumor = msgpack.unpackb(b.crypto_aead_xchacha20poly1305_ietf_decrypt(seal[4], None, seal[3],
                                                                          key), strict_map_key=False)
    assert rumor[7] == ALICE.pubkey and rumor[8] == 1 and rumor[9]["message"] == "ours"
    assert rumor[9]["region"][14] == 0
    nacl.signing.VerifyKey(rumor[7]).verify(seal[4], seal[10])


def test_forged_sender_and_bad_shapes_are_refused():
    # Mallory claims to be Alice but can only sign with her own key.
    with pytest.raises(WrapError, match="signature"):
        unwrap(_hand_wrap(_rumor_map(ALICE.pubkey), MALLORY, BOB), BOB)
    with pytest.raises(WrapError, match="signature"):
        unwrap(_hand_wrap(_rumor_map(ALICE.pubkey), ALICE, BOB, sig=bytes(64)), BOB)
    with pytest.raises(WrapError, match="padding"):
        unwrap(_hand_wrap(_rumor_map(ALICE.pubkey), ALICE, BOB, pad=False), BOB)
    bad_region = _rumor_map(ALICE.pubkey)
    bad_region[9]["region"]["radius_m"] = 9            # below the 10 m minimum
    with pytest.raises(WrapError, match="radius"):
        unwrap(_hand_wrap(bad_region, ALICE, BOB), BOB)
    unknown_type = _rumor_map(ALICE.pubkey)
    unknown_type[9]["region"][14] = 1                    # no bounding circle: discarded
    with pytest.raises(WrapError, match="region_type"):
        unwrap(_hand_wrap(unknown_type, ALICE, BOB), BOB)
    extra = _rumor_map(ALICE.pubkey)
    extra[99] = 1
    with pytest.raises(WrapError, match="rumor"):
        unwrap(_hand_wrap(extra, ALICE, BOB), BOB)
    with pytest.raises(WrapError):
        wrap(presence(sender=ALICE), MALLORY, BOB.pubkey, created_at=NOW, expires_at=NOW)


def test_seal_codec_is_strict():
    s = Seal(b"\x01" * 32, b"\x02" * 24, b"\x03" * 20, b"\x04" * 64)
    assert Seal.decode(s.encode()) == s
    with pytest.raises(WrapError):
        Seal.decode(msgpack.packb({2: b"\x01" * 32, 3: b"\x02" * 24, 4: b"\x03" * 20}))
    with pytest.raises(WrapError):
        Seal.decode(msgpack.packb({2: b"\x01" * 31, 3: b"\x02" * 24, 4: b"x" * 20, 10: b"s" * 64}))


# --- tokens and fingerprint ---------------------------------------------------------------------

def test_delivery_token_is_the_same_on_both_sides():
    t_send = tokens.sender_delivery_token(ALICE, BOB.pubkey)
    t_reg = tokens.recipient_delivery_token(BOB, ALICE.pubkey)
    assert t_send == t_reg and len(t_send) == 12
    shared = bindings.crypto_scalarmult(ALICE.x25519_sk, BOB.x25519_pk)
    assert t_send == hashlib.blake2b(BOB.pubkey + b"ppp-note-delivery-v1", digest_size=12,
                                     key=shared).digest()
    # Notes the other way use the other recipient key: a different token.
    assert tokens.sender_delivery_token(BOB, ALICE.pubkey) != t_send
    assert tokens.sender_delivery_token(MALLORY, BOB.pubkey) != t_send


def test_member_token_and_room_key():
    room_id, room_key = os.urandom(16), os.urandom(32)
    r1 = tokens.room_signing_identity(ALICE, room_id)
    assert r1.pubkey != ALICE.pubkey
    assert r1 == tokens.room_signing_identity(ALICE, room_id)
    assert r1.pubkey != tokens.room_signing_identity(ALICE, os.urandom(16)).pubkey
    t = tokens.member_token(room_key, r1.pubkey, room_id)
    assert t == hashlib.blake2b(r1.pubkey + room_id + b"ppp-room-member-v1", digest_size=12,
                                key=room_key).digest()


def test_fingerprint_is_order_independent():
    fp = tokens.fingerprint(ALICE.pubkey, BOB.pubkey)
    assert fp == tokens.fingerprint(BOB.pubkey, ALICE.pubkey)
    assert len(fp) == 24 and fp.endswith("==")
    assert tokens.display_fingerprint(fp).replace(" ", "") == fp.rstrip("=")
    assert fp != tokens.fingerprint(ALICE.pubkey, MALLORY.pubkey)
