"""A PPP identity: one Ed25519 key pair from a 32-byte seed, and its X25519 twin (spec §1.x).

    (pk, sk)   = crypto_sign_ed25519_seed_keypair(seed)      # sk = seed || pk (64 bytes)
    x25519_pk  = crypto_sign_ed25519_pk_to_curve25519(pk)
    x25519_sk  = crypto_sign_ed25519_sk_to_curve25519(sk)

The Ed25519 public key is the protocol address; the X25519 pair is only ever used for
Diffie-Hellman. Pure: no files, no clock; the caller supplies the seed (`generate` is the one
place that draws randomness). Secrets never appear in `repr`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import nacl.exceptions
import nacl.utils
from nacl import bindings

SEED_LEN = 32
PUBKEY_LEN = 32
SIG_LEN = 64


class KeyMaterialError(ValueError):
    """A key or signature has the wrong size or does not verify."""


def x25519_public(ed25519_pk: bytes) -> bytes:
    """The X25519 public key of an Ed25519 public key (another user's, or an ephemeral one)."""
    if len(ed25519_pk) != PUBKEY_LEN:
        raise KeyMaterialError("ed25519 public key must be 32 bytes")
    try:
        return bindings.crypto_sign_ed25519_pk_to_curve25519(ed25519_pk)
    except nacl.exceptions.RuntimeError as e:   # not a point on the curve
        raise KeyMaterialError("not a valid ed25519 public key") from e


def verify(pubkey: bytes, message: bytes, sig: bytes) -> bool:
    """Detached Ed25519 verification (crypto_sign_verify_detached); False on any mismatch."""
    if len(pubkey) != PUBKEY_LEN or len(sig) != SIG_LEN:
        return False
    try:
        bindings.crypto_sign_open(sig + message, pubkey)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError,
            nacl.exceptions.TypeError, nacl.exceptions.RuntimeError):
        return False
    return True


@dataclass(frozen=True, repr=False)
class Identity:
    seed: bytes = field(repr=False)
    ed25519_pk: bytes
    ed25519_sk: bytes = field(repr=False)
    x25519_pk: bytes
    x25519_sk: bytes = field(repr=False)

    @classmethod
    def from_seed(cls, seed: bytes) -> "Identity":
        if not isinstance(seed, (bytes, bytearray)) or len(seed) != SEED_LEN:
            raise KeyMaterialError("seed must be 32 bytes")
        seed = bytes(seed)
        pk, sk = bindings.crypto_sign_seed_keypair(seed)
        return cls(seed, pk, sk, bindings.crypto_sign_ed25519_pk_to_curve25519(pk),
                   bindings.crypto_sign_ed25519_sk_to_curve25519(sk))

    @classmethod
    def generate(cls) -> "Identity":
        return cls.from_seed(nacl.utils.random(SEED_LEN))

    @property
    def pubkey(self) -> bytes:
        """The protocol address (Ed25519 public key)."""
        return self.ed25519_pk

    @property
    def pubkey_hex(self) -> str:
        return self.ed25519_pk.hex()

    def sign(self, message: bytes) -> bytes:
        """crypto_sign_detached(message, ed25519_sk): 64 bytes, deterministic."""
        return bindings.crypto_sign(message, self.ed25519_sk)[:SIG_LEN]

    def dh(self, their_ed25519_pk: bytes) -> bytes:
        """crypto_scalarmult(my_x25519_sk, their_x25519_pk), their key given as Ed25519."""
        return x25519(self.x25519_sk, x25519_public(their_ed25519_pk))

    def __repr__(self) -> str:
        return f"Identity(pubkey={self.ed25519_pk.hex()[:16]}…, secrets=<redacted>)"

    __str__ = __repr__


def x25519(x25519_sk: bytes, x25519_pk: bytes) -> bytes:
    """Raw X25519 shared secret; libsodium refuses an all-zero result (low-order point)."""
    try:
        return bindings.crypto_scalarmult(x25519_sk, x25519_pk)
    except nacl.exceptions.RuntimeError as e:
        raise KeyMaterialError("x25519 produced a low-order result") from e
