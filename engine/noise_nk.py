"""The push listener's Noise NK responder written out, sans I/O.

`Noise_NK_25519_ChaChaPoly_BLAKE2s`, responder side only (interop §3: the relay is always
the responder, prologue and payloads empty, a client's payload read and ignored):

    NK:
      <- s
      ...
      -> e, es
      <- e, ee

The `noiseprotocol` package runs any pattern through generic objects: per connection it
parses the protocol name, builds a NoiseProtocol, HandshakeState, SymmetricState and four
CipherStates, and a ChaCha20Poly1305 object per MixKey. One-push-per-connection clients pay
that on every push, so NK, the pattern they use, is written here as the Noise spec (rev 34)
states it, on the same primitives (X25519 and ChaCha20-Poly1305 from `cryptography`,
BLAKE2s and HMAC from hashlib); the receive listener's XX stays on the package
(`noise_session.NoiseResponder`). The three X25519 operations (a DH per token, one key
generation) are what is left of the handshake's cost.

Same interface and failures as `NoiseResponder`: any bad handshake or transport message
raises `NoiseFailure` and the caller closes the connection. No key appears in a repr or an
exception message.
"""

from __future__ import annotations

import hashlib
import hmac

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from .noise_session import MAX_PLAINTEXT, PROTOCOL_NAMES, NoiseFailure, StaticKey, fingerprint

DHLEN = 32
TAGLEN = 16
MAX_NONCE = 2 ** 64 - 1        # reserved (Noise §5.1): a CipherState never uses it
_ZERO_NONCE = bytes(12)


def _hash(data: bytes) -> bytes:
    return hashlib.blake2s(data).digest()


def _hkdf2(ck: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    """HKDF(ck, ikm) with two outputs (Noise §4.3), HMAC-BLAKE2s."""
    temp = hmac.digest(ck, ikm, "blake2s")
    out1 = hmac.digest(temp, b"\x01", "blake2s")
    return out1, hmac.digest(temp, out1 + b"\x02", "blake2s")


def _nonce(n: int) -> bytes:
    """ChaChaPoly's nonce: 32 zero bits, then n as 64 bits little-endian (Noise §12.3)."""
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


_INITIAL: dict[bytes, tuple[bytes, bytes]] = {}


def _initial(public: bytes) -> tuple[bytes, bytes]:
    """(ck, h) after Initialize (name longer than HASHLEN: h = HASH(name); ck = h),
    MixHash(prologue = empty) and the pre-message MixHash(s): the same for every connection
    to one relay key, so computed once per key."""
    got = _INITIAL.get(public)
    if got is None:
        ck = _hash(PROTOCOL_NAMES["NK"])
        got = _INITIAL[public] = (ck, _hash(_hash(ck) + public))
    return got


class NKResponder:
    """One NK responder handshake, then its two transport CipherStates."""

    __slots__ = ("pattern", "_static", "_recv", "_send", "_n_recv", "_n_send", "failed")

    remote_static = None        # NK: the initiator is anonymous

    def __init__(self, static: bytes | StaticKey):
        if not isinstance(static, StaticKey):
            static = StaticKey(static)
        self.pattern = "NK"
        self._static = static
        self._recv: ChaCha20Poly1305 | None = None   # initiator -> responder
        self._send: ChaCha20Poly1305 | None = None
        self._n_recv = self._n_send = 0
        self.failed = False

    @property
    def handshake_complete(self) -> bool:
        return self._send is not None

    def receive_handshake(self, message: bytes) -> list[bytes]:
        """Message 1 in, message 2 out (`-> e, es` then `<- e, ee`)."""
        if self.failed or self._send is not None or self._static is None:
            raise NoiseFailure("no handshake in progress")
        try:
            message = bytes(message)
            if len(message) < DHLEN + TAGLEN:
                raise ValueError("message 1 too short")
            ck, h = _initial(self._static.public)
            re_bytes = message[:DHLEN]
            h = _hash(h + re_bytes)                                    # e
            re = X25519PublicKey.from_public_bytes(re_bytes)
            ck, k = _hkdf2(ck, self._static._keypair.private.exchange(re))   # es
            payload = message[DHLEN:]
            ChaCha20Poly1305(k).decrypt(_ZERO_NONCE, payload, h)     # DecryptAndHash, ignored
            h = _hash(h + payload)
            e = X25519PrivateKey.generate()
            e_pub = e.public_key().public_bytes_raw()
            h = _hash(h + e_pub)                                       # e
            ck, k = _hkdf2(ck, e.exchange(re))                         # ee
            tag = ChaCha20Poly1305(k).encrypt(_ZERO_NONCE, b"", h)     # EncryptAndHash(empty)
            k1, k2 = _hkdf2(ck, b"")                                   # Split
            self._recv, self._send = ChaCha20Poly1305(k1), ChaCha20Poly1305(k2)
            self._static = None
            return [e_pub + tag]
        except Exception as exc:   # cryptography's InvalidTag and ValueError mean "bad peer"
            self.failed = True
            self.close()
            raise NoiseFailure(f"NK handshake failed: {type(exc).__name__}") from None

    def close(self) -> None:
        self._static = None

    def encrypt(self, plaintext: bytes) -> bytes:
        if len(plaintext) > MAX_PLAINTEXT:
            raise ValueError(f"plaintext of {len(plaintext)} bytes exceeds {MAX_PLAINTEXT}")
        if self._send is None or self._n_send >= MAX_NONCE:
            raise NoiseFailure("no transport to encrypt with")
        out = self._send.encrypt(_nonce(self._n_send), bytes(plaintext), None)
        self._n_send += 1
        return out

    def decrypt(self, message: bytes) -> bytes:
        if self.failed or self._recv is None:
            raise NoiseFailure("transport message before the handshake completed")
        try:
            if self._n_recv >= MAX_NONCE:
                raise ValueError("nonce exhausted")
            out = self._recv.decrypt(_nonce(self._n_recv), bytes(message), None)
        except Exception as exc:
            self.failed = True
            raise NoiseFailure(f"decrypt failed: {type(exc).__name__}") from None
        self._n_recv += 1
        return out

    def __repr__(self) -> str:
        state = "failed" if self.failed else "open" if self.handshake_complete else "handshake"
        return f"NKResponder(pattern=NK, state={state}, remote_static={fingerprint(None)})"
