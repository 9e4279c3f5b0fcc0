"""The committed test-vectors/*.json: equal to a fresh generation, and every vector recomputed
independently with libsodium (nacl.bindings), hashlib and msgpack directly, so a mistake in
our modules cannot hide behind vectors produced by the same modules."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from pathlib import Path

import msgpack
import pytest
from nacl import bindings as b

from engine.ppp import padding, vectors
from engine.ppp.keys import Identity
from engine.ppp.wrap import unwrap

DIR = Path(__file__).resolve().parents[1] / "test-vectors"
H = bytes.fromhex


def load(name: str) -> dict:
    return json.loads((DIR / name).read_text(encoding="utf-8"))


def test_committed_files_equal_a_fresh_generation():
    fresh = vectors.generate()
    assert sorted(p.name for p in DIR.glob("*.json")) == sorted(fresh)
    for name, doc in fresh.items():
        assert (DIR / name).read_text(encoding="utf-8") == vectors.render(doc), (
            f"{name} is stale: run python -m engine.ppp.vectors")


def test_keys():
    for v in load("keys.json")["vectors"]:
        pk, sk = b.crypto_sign_seed_keypair(H(v["seed"]))
        assert (pk.hex(), sk.hex()) == (v["ed25519_pk"], v["ed25519_sk"])
        assert b.crypto_sign_ed25519_pk_to_curve25519(pk).hex() == v["x25519_pk"]
        assert b.crypto_sign_ed25519_sk_to_curve25519(sk).hex() == v["x25519_sk"]
        assert b.crypto_scalarmult_base(H(v["x25519_sk"])).hex() == v["x25519_pk"]
        assert b.crypto_sign(H(v["sig_message"]), sk)[:64].hex() == v["sig"]


def test_kdf():
    for v in load("kdf.json")["vectors"]:
        shared = b.crypto_scalarmult(H(v["alice_x25519_sk"]), H(v["bob_x25519_pk"]))
        assert shared.hex() == v["shared_secret"]
        assert v["context"].encode().hex() == v["context_hex"]
        key = b.crypto_generichash_blake2b_salt_personal(shared, digest_size=32,
                                                         key=v["context"].encode())
        assert key.hex() == v["key"]


def _x(seed_hex: str) -> tuple[bytes, bytes, bytes]:
    pk, sk = b.crypto_sign_seed_keypair(H(seed_hex))
    return pk, b.crypto_sign_ed25519_sk_to_curve25519(sk), sk


def test_seal():
    (v,) = load("seal.json")["vectors"]
    sender_pk, _, sender_sk = _x(v["sender_seed"])
    recipient_pk, r_xsk, _ = _x(v["recipient_seed"])
    assert recipient_pk.hex() == v["recipient_pk"]
    rumor = msgpack.unpackb(H(v["rumor_msgpack"]), strict_map_key=False)
    r = v["rumor"]
    assert list(rumor) == [7, 8, 9, 5]
    assert rumor[7] == sender_pk == H(r["sender"]) and rumor[8] == r["kind"] == 1
    assert rumor[5] == r["created_at"]
    c = rumor[9]
    assert c["event_id"].hex() == r["content"]["event_id"]
    assert c["message"] == r["content"]["message"]
    assert c["region"] == {14: 0, "latitude": r["content"]["region"]["latitude"],
                           "longitude": r["content"]["region"]["longitude"],
                           "radius_m": r["content"]["region"]["radius_m"]}
    assert c["time_window"] == r["content"]["time_window"]
    assert [x.hex() for x in c["recipients"]] == r["content"]["recipients"]
    # Sender side: the ephemeral key, DH, KDF, AEAD and the signature.
    e_pk, e_xsk, _ = _x(v["seal_ephemeral_seed"])
    assert e_pk.hex() == v["seal_ephemeral_pk"]
    shared = b.crypto_scalarmult(e_xsk, b.crypto_sign_ed25519_pk_to_curve25519(recipient_pk))
    assert shared.hex() == v["seal_shared"]
    key = hashlib.blake2b(shared, digest_size=32, key=b"ppp-seal-v1").digest()
    assert key.hex() == v["seal_key"]
    ct = b.crypto_aead_xchacha20poly1305_ietf_encrypt(H(v["rumor_msgpack"]), None,
                                                      H(v["seal_nonce"]), key)
    assert ct.hex() == v["seal_ciphertext"]
    assert b.crypto_sign(ct, sender_sk)[:64].hex() == v["sender_sig"]
    assert msgpack.packb({2: e_pk, 3: H(v["seal_nonce"]), 4: ct, 10: H(v["sender_sig"])}
                         ).hex() == v["seal_msgpack"]
    # Recipient side: the same shared secret from the other end.
    assert b.crypto_scalarmult(r_xsk, b.crypto_sign_ed25519_pk_to_curve25519(e_pk)) == shared


def test_wrap():
    doc = load("wrap.json")
    (v,) = doc["vectors"]
    recipient_pk, r_xsk, _ = _x(v["recipient_seed"])
    draws = [H(d) for d in v["random_draws_in_order"]]
    assert [len(d) for d in draws] == [32, 24, len(H(v["padding_bytes"])), 32, 24]
    seal = H(v["seal_msgpack"])
    padded = seal + b"\x01" + H(v["padding_bytes"]) + b"\x00"
    assert padded.hex() == v["padded_seal"] and len(padded) == v["bucket"]
    assert v["bucket"] == min(x for x in (256, 1024, 4096, 16384) if len(seal) + 2 <= x)
    e_pk, e_xsk, _ = _x(v["wrap_ephemeral_seed"])
    assert e_pk.hex() == v["wrap_ephemeral_pk"] and draws[3].hex() == v["wrap_ephemeral_seed"]
    shared = b.crypto_scalarmult(e_xsk, b.crypto_sign_ed25519_pk_to_curve25519(recipient_pk))
    assert shared.hex() == v["wrap_shared"]
    key = hashlib.blake2b(shared, digest_size=32, key=b"ppp-wrap-v1").digest()
    assert key.hex() == v["wrap_key"]
    ct = b.crypto_aead_xchacha20poly1305_ietf_encrypt(padded, None, H(v["wrap_nonce"]), key)
    assert ct.hex() == v["wrap_ciphertext"]
    gw = msgpack.packb({1: recipient_pk, 2: e_pk, 3: H(v["wrap_nonce"]), 4: ct,
                        5: v["created_at"], 6: v["expires_at"]})
    assert gw.hex() == v["giftwrap_msgpack"]
    assert hashlib.blake2b(e_pk + H(v["wrap_nonce"]) + ct, digest_size=32).hexdigest() \
        == v["event_id"]
    # The recipient opens it with its own key: decrypt, then our unwrap agrees.
    assert b.crypto_aead_xchacha20poly1305_ietf_decrypt(
        ct, None, H(v["wrap_nonce"]),
        hashlib.blake2b(b.crypto_scalarmult(r_xsk, b.crypto_sign_ed25519_pk_to_curve25519(e_pk)),
                        digest_size=32, key=b"ppp-wrap-v1").digest()) == padded
    opened = unwrap(gw, Identity.from_seed(H(v["recipient_seed"])))
    assert opened.rumor.encode().hex() == v["rumor_msgpack"]


def test_event_ids():
    for v in load("event_id.json")["vectors"]:
        assert hashlib.blake2b(H(v["ephemeral_pk"]) + H(v["nonce"]) + H(v["ciphertext"]),
                               digest_size=32).hexdigest() == v["event_id"]
    for v in load("sealed_event_id.json")["vectors"]:
        assert struct.pack(">Q", v["created_at"]).hex() == v["created_at_be64"]
        data = (v["domain"].encode() + H(v["ephemeral_pk"]) + H(v["nonce"]) + H(v["ciphertext"])
                + H(v["delivery_token"]) + H(v["created_at_be64"]))
        assert b.crypto_generichash_blake2b_salt_personal(data, digest_size=32).hex() \
            == v["event_id"]


def test_delivery_tokens():
    vs = load("delivery_token.json")["vectors"]
    for v in vs:
        a_pk, a_xsk, _ = _x(v["alice_seed"])
        b_pk, b_xsk, _ = _x(v["bob_seed"])
        shared = b.crypto_scalarmult(a_xsk, b.crypto_sign_ed25519_pk_to_curve25519(b_pk))
        assert shared == b.crypto_scalarmult(b_xsk, b.crypto_sign_ed25519_pk_to_curve25519(a_pk))
        assert shared.hex() == v["shared_secret"]
        rec = {"bob": b_pk, "alice": a_pk}[v["note_to"]]
        assert rec.hex() == v["recipient_pk"]
        assert (rec + b"ppp-note-delivery-v1").hex() == v["input"]
        assert b.crypto_generichash_blake2b_salt_personal(
            rec + b"ppp-note-delivery-v1", digest_size=12, key=shared).hex() == v["delivery_token"]
    assert vs[0]["delivery_token"] != vs[1]["delivery_token"]


def test_member_tokens():
    for v in load("member_token.json")["vectors"]:
        _, _, sk = _x(v["member_seed"])
        assert sk[:32].hex() == v["member_ed25519_sk_first32"]
        seed = hashlib.blake2b(H(v["room_id"]) + b"ppp-room-sign-v1", digest_size=32,
                               key=sk[:32]).digest()
        assert seed.hex() == v["room_signing_seed"]
        pk, _ = b.crypto_sign_seed_keypair(seed)
        assert pk.hex() == v["member_signing_pk"]
        assert hashlib.blake2b(pk + H(v["room_id"]) + b"ppp-room-member-v1", digest_size=12,
                               key=H(v["room_key"])).hexdigest() == v["member_token"]


def test_padding():
    doc = load("padding.json")
    assert doc["buckets"] == [256, 1024, 4096, 16384]
    for v in doc["vectors"]:
        pt, pad = H(v["plaintext"]), H(v["padding"])
        assert len(pt) == v["plaintext_length"]
        assert v["bucket"] == min(x for x in doc["buckets"] if len(pt) + 2 <= x)
        assert len(pad) == v["bucket"] - len(pt) - 2
        assert pt + b"\x01" + pad + b"\x00" == H(v["padded"])
        assert padding.unpad(H(v["padded"])) == pt
    assert doc["too_large"]["plaintext_length"] == 16383
    with pytest.raises(padding.PaddingError):
        padding.pad(b"\x00" * doc["too_large"]["plaintext_length"])
    for v in doc["invalid"]:
        with pytest.raises(padding.PaddingError):
            padding.unpad(H(v["padded"]))


def test_fingerprints():
    for v in load("fingerprint.json")["vectors"]:
        lo, hi = sorted((H(v["pk_a"]), H(v["pk_b"])))
        assert (lo + hi).hex() == v["sorted_concat"]
        digest = b.crypto_generichash_blake2b_salt_personal(lo + hi, digest_size=16)
        assert digest.hex() == v["blake2b_16"]
        assert base64.b64encode(digest).decode() == v["fingerprint"]
        assert v["display"].replace(" ", "") == v["fingerprint"].rstrip("=")


def test_room_grant():
    (v,) = load("room_grant.json")["vectors"]
    _, _, admin_sk = _x(v["admin_seed"])
    admin_x_sk = b.crypto_sign_ed25519_sk_to_curve25519(admin_sk)
    assert b.crypto_scalarmult_base(admin_x_sk).hex() == v["admin_x25519_pk"]
    assert b.crypto_scalarmult_base(H(v["knocker_eph_x25519_sk"])).hex() == \
        v["knocker_eph_x25519_pk"]
    shared = b.crypto_scalarmult(admin_x_sk, H(v["knocker_eph_x25519_pk"]))
    # the knocker's side of the same secret
    assert b.crypto_scalarmult(H(v["knocker_eph_x25519_sk"]), H(v["admin_x25519_pk"])) == shared
    assert shared.hex() == v["shared_secret"]
    key = hashlib.blake2b(shared, digest_size=32, key=b"ppp-ble-grant-v1").digest()
    assert key.hex() == v["grant_key"]
    grant = H(v["grant"])
    assert len(grant) == 88 and grant[:24].hex() == v["nonce"]
    plain = b.crypto_aead_xchacha20poly1305_ietf_decrypt(grant[24:], None, grant[:24], key)
    assert plain == H(v["room_id"]) + H(v["room_key"])


def test_room_message():
    (v,) = load("room_message.json")["vectors"]
    pt = b.crypto_aead_xchacha20poly1305_ietf_decrypt(H(v["ciphertext"]), None, H(v["nonce"]),
                                                      H(v["room_key"]))
    assert len(pt) in (256, 1024) and pt[-1] == 0
    m = msgpack.Unpacker(raw=False, strict_map_key=False)
    m.feed(pt)
    obj = next(m)
    assert set(obj) == {1, 2, 3, 4}
    assert obj[1].hex() == v["member_signing_pk"] and obj[2] == v["sent_at"]
    assert obj[3] == v["body"]
    signed = (b"ppp-room-msg-v1" + H(v["room_id"]) + struct.pack(">Q", v["sent_at"])
              + v["body"].encode())
    assert b.crypto_sign_open(obj[4] + signed, obj[1]) == signed
    assert H(v["draws"][0]) == H(v["nonce"])
    assert pt[len(pt) - 1 - len(H(v["draws"][1])):-1] == H(v["draws"][1])   # the padding


def test_discovery():
    doc = load("discovery.json")
    pepper = hashlib.blake2b(b"ppp-discovery-pepper-v1" + struct.pack(">Q", doc["pepper_id"]),
                             digest_size=32, key=H(doc["pepper_seed"])).digest()
    assert pepper.hex() == doc["pepper"]
    expected = {"+49 (30) 1234-5678": "+493012345678", " +1 415.555.0100 ": "+14155550100",
                "Alice.Liddell@Example.org": "aliceliddell@example.org",
                "a.b+tag@x.org": "ab+tag@x.org"}
    for v in doc["vectors"]:
        assert v["normalized"] == expected[v["identifier"]]
        assert hashlib.blake2b(v["normalized"].encode(), digest_size=32,
                               key=pepper).hexdigest() == v["hash"]


def test_blinded_mailbox():
    doc = load("blinded_mailbox.json")
    bob_pk, bob_x, bob_sk = _x(doc["recipient_seed"])
    alice_pk, _, alice_sk = _x(doc["sender_seed"])
    alice_x_pk = b.crypto_sign_ed25519_pk_to_curve25519(alice_pk)
    shared = b.crypto_scalarmult(bob_x, alice_x_pk)
    # Alice's side gives the same secret
    assert b.crypto_scalarmult(b.crypto_sign_ed25519_sk_to_curve25519(alice_sk),
                               b.crypto_sign_ed25519_pk_to_curve25519(bob_pk)) == shared
    assert shared.hex() == doc["shared"]
    ids = set()
    for v in doc["vectors"]:
        wide = hashlib.blake2b(b"ppp-blinded-mailbox-v2" + bob_pk + struct.pack(">Q", v["epoch"]),
                               digest_size=64, key=shared).digest()
        h = b.crypto_core_ed25519_scalar_reduce(wide)
        assert h.hex() == v["blinding_scalar"]
        # what Alice computes from Bob's public key alone
        mailbox = b.crypto_scalarmult_ed25519_noclamp(h, bob_pk)
        assert mailbox.hex() == v["mailbox_id"]
        # what only Bob can: the blinded scalar's public point is the same id ...
        a = bytearray(hashlib.sha512(bob_sk[:32]).digest()[:32])
        a[0] &= 248
        a[31] = (a[31] & 127) | 64
        blinded_sk = b.crypto_core_ed25519_scalar_mul(h, b.crypto_core_ed25519_scalar_reduce(
            bytes(a) + bytes(32)))
        assert b.crypto_scalarmult_ed25519_base_noclamp(blinded_sk) == mailbox
        # ... and his AUTH signature verifies as plain Ed25519 under it
        sig = H(v["auth_sig"])
        assert b.crypto_sign_open(sig + H(v["challenge"]), mailbox) == H(v["challenge"])
        assert hashlib.blake2b(mailbox + b"ppp-note-delivery-v1", digest_size=12,
                               key=shared).hexdigest() == v["delivery_token"]
        ids.add(mailbox)
    assert len(ids) == 2
