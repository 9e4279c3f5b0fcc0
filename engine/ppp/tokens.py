"""Tokens and fingerprints derived with BLAKE2b (spec §6.2, §7.3, §9.7).

Argument roles follow libsodium's `crypto_generichash(out, outlen, in, inlen, key, keylen)`;
where the spec names them (`key:` / `input:`) we use exactly those:

    delivery_token = BLAKE2b(12, in = recipient_pk || "ppp-note-delivery-v1",
                             key = X25519(my_x25519_sk, their_x25519_pk))          §6.2
    member_token   = BLAKE2b(12, in = member_signing_pk || room_id || "ppp-room-member-v1",
                             key = room_key)                                         §7.3
    room seed      = BLAKE2b(32, in = room_id || "ppp-room-sign-v1",
                             key = ed25519_sk[0..32])  -> Ed25519 key pair           §7.3
    fingerprint    = base64(BLAKE2b(16, in = min(a, b) || max(a, b)))  (unkeyed)     §9.7

- The delivery-token key is the raw X25519 output (not the §2 KDF), identical on both sides
  (Alice with Bob's public key, Bob with Alice's); `recipient_pk` is the recipient's Ed25519
  public key, so Bob registers the token with his own key and Alice derives it with Bob's.
- ed25519_sk[0..32] in libsodium's 64-byte secret key is the seed.
- `sort(alice_pk, bob_pk)` is byte-wise ascending order of the two 32-byte Ed25519 keys.
  `base64` is RFC 4648 standard alphabet with '=' padding (24 characters). The display form
  groups the unpadded 22 characters in fours ("aBc1 dEf2 ... 12"); the spec's 16-character
  example would drop a quarter of the hash, so we show all of it.
"""

from __future__ import annotations

import base64
import hashlib

from .keys import Identity

DELIVERY_DOMAIN = b"ppp-note-delivery-v1"
MEMBER_DOMAIN = b"ppp-room-member-v1"
ROOM_SIGN_DOMAIN = b"ppp-room-sign-v1"
TOKEN_LEN = 12
FINGERPRINT_LEN = 16


def delivery_token_from_secret(shared_secret: bytes, recipient_pk: bytes) -> bytes:
    if len(shared_secret) != 32 or len(recipient_pk) != 32:
        raise ValueError("shared secret and recipient key must be 32 bytes")
    return hashlib.blake2b(recipient_pk + DELIVERY_DOMAIN, digest_size=TOKEN_LEN,
                           key=shared_secret).digest()


def delivery_token(me: Identity, contact_pk: bytes, recipient_pk: bytes) -> bytes:
    """The token of the pair (me, contact) for notes to `recipient_pk` (one of the two)."""
    if recipient_pk not in (me.pubkey, contact_pk):
        raise ValueError("recipient must be one of the pair")
    return delivery_token_from_secret(me.dh(contact_pk), recipient_pk)


def sender_delivery_token(sender: Identity, recipient_pk: bytes) -> bytes:
    """What the sender puts in POST /v1/note/submit."""
    return delivery_token(sender, recipient_pk, recipient_pk)


def recipient_delivery_token(recipient: Identity, contact_pk: bytes) -> bytes:
    """What the recipient registers (REGISTER_DELIVERY_TOKEN) for one contact."""
    return delivery_token(recipient, contact_pk, recipient.pubkey)


def room_signing_identity(me: Identity, room_id: bytes) -> Identity:
    """The per-room Ed25519 key (unlinkable to the long-term key without the secret)."""
    seed = hashlib.blake2b(room_id + ROOM_SIGN_DOMAIN, digest_size=32,
                           key=me.ed25519_sk[:32]).digest()
    return Identity.from_seed(seed)


def member_token(room_key: bytes, member_signing_pk: bytes, room_id: bytes) -> bytes:
    if len(room_key) != 32 or len(member_signing_pk) != 32 or len(room_id) != 16:
        raise ValueError("room_key and member_signing_pk are 32 bytes, room_id 16")
    return hashlib.blake2b(member_signing_pk + room_id + MEMBER_DOMAIN, digest_size=TOKEN_LEN,
                           key=room_key).digest()


def fingerprint_bytes(pk_a: bytes, pk_b: bytes) -> bytes:
    if len(pk_a) != 32 or len(pk_b) != 32:
        raise ValueError("public keys must be 32 bytes")
    lo, hi = sorted((pk_a, pk_b))
    return hashlib.blake2b(lo + hi, digest_size=FINGERPRINT_LEN).digest()


def fingerprint(pk_a: bytes, pk_b: bytes) -> str:
    """Order-independent: both parties compute the same string."""
    return base64.b64encode(fingerprint_bytes(pk_a, pk_b)).decode("ascii")


def display_fingerprint(fp: str) -> str:
    s = fp.rstrip("=")
    return " ".join(s[i:i + 4] for i in range(0, len(s), 4))
