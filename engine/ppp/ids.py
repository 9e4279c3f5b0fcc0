"""The two PPP event-id forms (spec §4.5) and the protocol name used in the Delta tables.

Both are unkeyed BLAKE2b with a 32-byte digest over relay-visible fields, so the relay can
deduplicate without decrypting. The spec writes `BLAKE2b(32, a || b || ...)`: the inputs are
concatenated into the message; no key is used (libsodium `crypto_generichash(out, 32, in,
inlen, NULL, 0)`).
"""

from __future__ import annotations

import hashlib
import struct

PROTOCOL = "ppp"
SEALED_NOTE_DOMAIN = b"ppp-note-event-id-v1"


def event_id(ephemeral_pk: bytes, nonce: bytes, ciphertext: bytes) -> bytes:
    """Authenticated path (STORE / FETCH): BLAKE2b-256(ephemeral_pk || nonce || ciphertext)."""
    return hashlib.blake2b(ephemeral_pk + nonce + ciphertext, digest_size=32).digest()


def sealed_event_id(ephemeral_pk: bytes, nonce: bytes, ciphertext: bytes,
                    delivery_token: bytes, created_at: int) -> bytes:
    """Sealed-Note path (POST /v1/note/submit): the domain tag first, then the triple, the
    12-byte delivery token and created_at as a big-endian u64."""
    return hashlib.blake2b(SEALED_NOTE_DOMAIN + ephemeral_pk + nonce + ciphertext
                           + delivery_token + struct.pack(">Q", created_at),
                           digest_size=32).digest()
