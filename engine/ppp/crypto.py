"""PPP symmetric primitives (spec §2): the BLAKE2b KDF and XChaCha20-Poly1305.

KDF. The spec writes `crypto_generichash(32, shared_secret, "ppp-event-key-v1")` positionally.
In libsodium's argument order, `crypto_generichash(out, outlen, in, inlen, key, keylen)`, the
shared secret is the hashed INPUT and the context string is the BLAKE2b KEY:

    kdf(shared, ctx) = BLAKE2b-256(message=shared, key=ctx)

libsodium accepts keys shorter than crypto_generichash_KEYBYTES_MIN (16; advisory), so the
11-byte contexts "ppp-seal-v1" / "ppp-wrap-v1" are fine. The shared secret is always the raw
X25519 output (crypto_scalarmult), never hashed first.

AEAD. crypto_aead_xchacha20poly1305_ietf_encrypt with a 24-byte nonce, 32-byte key and no
associated data (the spec's `encrypt(plaintext, nonce, key)` has none); the 16-byte tag is
appended to the ciphertext.
"""

from __future__ import annotations

import hashlib

import nacl.exceptions
from nacl import bindings

KEY_LEN = 32
NONCE_LEN = 24
TAG_LEN = 16

CTX_EVENT = b"ppp-event-key-v1"   # §2 generic example
CTX_SEAL = b"ppp-seal-v1"         # §3 layer 2
CTX_WRAP = b"ppp-wrap-v1"         # §3 layer 3


class DecryptError(ValueError):
    """Authentication failed: wrong key, wrong nonce or tampered ciphertext."""


def kdf(shared_secret: bytes, context: bytes) -> bytes:
    """BLAKE2b-256(in=shared_secret, key=context): libsodium crypto_generichash order."""
    return hashlib.blake2b(shared_secret, digest_size=KEY_LEN, key=context).digest()


def encrypt(plaintext: bytes, nonce: bytes, key: bytes) -> bytes:
    """ciphertext || tag."""
    if len(nonce) != NONCE_LEN or len(key) != KEY_LEN:
        raise ValueError("nonce must be 24 bytes and key 32 bytes")
    return bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, None, nonce, key)


def decrypt(ciphertext: bytes, nonce: bytes, key: bytes) -> bytes:
    if len(nonce) != NONCE_LEN or len(key) != KEY_LEN or len(ciphertext) < TAG_LEN:
        raise DecryptError("bad nonce, key or ciphertext length")
    try:
        return bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(ciphertext, None, nonce, key)
    except nacl.exceptions.CryptoError as e:
        raise DecryptError("authentication failed") from e
