"""Noise responder for the trueseal listeners, sans I/O, over the `noiseprotocol` package.

The relay is always the responder: NK on the push listener, XX on the receive listener
(interop §3). Prologue and handshake payloads are empty; what a client puts in a handshake
payload is read and ignored, as the public relay does. Whole Noise messages go in (already
cut out of the byte stream by `LengthPrefixDeframer`), Noise messages to send come out.

Any failure (a short or garbage handshake message, a wrong relay key, a bad tag) raises
`NoiseFailure`; the caller closes the connection (interop §3). Keys never appear in reprs or
exception messages.
"""

from __future__ import annotations

import hashlib
import hmac

from noise.backends.default import DefaultNoiseBackend
from noise.backends.default.keypairs import KeyPair25519
from noise.connection import NoiseConnection
from noise.functions.hash import Hash

MAX_MESSAGE = 65535          # a Noise message is at most 65,535 bytes (interop §2)
TAG_LEN = 16                 # ChaChaPoly tag on every transport message
MAX_PLAINTEXT = MAX_MESSAGE - TAG_LEN   # 65,519: the largest trueseal frame (interop §2)
LENGTH_PREFIX = 2

PROTOCOL_NAMES = {
    "NK": b"Noise_NK_25519_ChaChaPoly_BLAKE2s",   # push: relay authenticated, client anonymous
    "XX": b"Noise_XX_25519_ChaChaPoly_BLAKE2s",   # receive: mutual; remote static = mailbox
}


class _Blake2s(Hash):
    """BLAKE2s from hashlib: the package builds a `cryptography` hash object per call."""
    fn = "blake2s"          # what `_hmac` gets as its algorithm
    hashlen = 32
    blocklen = 64

    def hash(self, data: bytes) -> bytes:
        return hashlib.blake2s(data).digest()


def _hmac(key: bytes, data: bytes, algorithm: str) -> bytes:
    return hmac.digest(key, data, algorithm)    # OpenSSL's one-shot HMAC, no objects


class _Backend(DefaultNoiseBackend):
    """The package's default backend (X25519 and ChaChaPoly from `cryptography`) with
    HASH and HMAC-HASH from hashlib: the same functions, a relay-side NK handshake in 117
    instead of 132 us here (medians; its three X25519 operations take ~75)."""

    def __init__(self) -> None:
        super().__init__()
        self.hashes = dict(self.hashes, BLAKE2s=_Blake2s)
        self.hmac = _hmac


BACKEND = _Backend()


class NoiseFailure(Exception):
    """The handshake or a transport message did not authenticate; close the connection."""


def fingerprint(key: bytes | None) -> str:
    return "None" if key is None else key[:4].hex() + "…"


class StaticKey:
    """The responder's static X25519 key, prepared once per listener: building the key
    object costs about a quarter of a relay-side NK handshake. Its repr shows no key."""

    __slots__ = ("_keypair", "public")

    def __init__(self, private: bytes):
        if len(private) != 32:
            raise ValueError("the relay static key must be 32 bytes")
        self._keypair = KeyPair25519.from_private_bytes(bytes(private))
        self.public: bytes = self._keypair.public_bytes

    def __repr__(self) -> str:
        return f"StaticKey(public={fingerprint(self.public)})"


class NoiseResponder:
    """One responder handshake, then the transport CipherStates.

    `receive_handshake(msg)` returns the handshake messages to send in answer (NK: one after
    msg 1; XX: one after msg 1, none after msg 3). Once `handshake_complete`, use `encrypt`
    and `decrypt`; nonces are implicit, so messages must be decrypted strictly in order.
    """

    def __init__(self, pattern: str, static: bytes | StaticKey):
        if pattern not in PROTOCOL_NAMES:
            raise ValueError(f"unsupported pattern {pattern!r}")
        if not isinstance(static, StaticKey):
            static = StaticKey(static)
        self.pattern = pattern
        self._conn = NoiseConnection.from_name(PROTOCOL_NAMES[pattern], BACKEND)
        self._conn.set_as_responder()
        # What `set_keypair_from_private_bytes(Keypair.STATIC, ...)` does, minus rebuilding.
        self._conn.noise_protocol.keypairs["s"] = static._keypair
        self._conn.start_handshake()
        # The package deletes its HandshakeState on split, and with it the peer's static key:
        # keep a reference until the handshake is over to read `rs` (XX).
        self._hs = self._conn.noise_protocol.handshake_state
        self.remote_static: bytes | None = None
        self.failed = False

    @property
    def handshake_complete(self) -> bool:
        return self._conn.handshake_finished

    def receive_handshake(self, message: bytes) -> list[bytes]:
        if self.failed or self.handshake_complete:
            raise NoiseFailure("no handshake in progress")
        try:
            self._conn.read_message(bytes(message))   # payload ignored (interop §3)
            out = []
            if not self._conn.handshake_finished:
                out.append(bytes(self._conn.write_message(b"")))
            if self._conn.handshake_finished:
                rs = self._hs.rs
                self.remote_static = getattr(rs, "public_bytes", None)
                self._hs = None   # drop the ephemeral private key with it
                self._conn._next_fn = None   # see close()
            return out
        except Exception as exc:   # noise, cryptography and ValueError alike mean "bad peer"
            self.failed = True
            self.close()
            raise NoiseFailure(f"{self.pattern} handshake failed: {type(exc).__name__}") from None

    def close(self) -> None:
        """Drop the handshake state. The package's connection keeps its next handshake step as
        one of its own bound methods (`_next_fn`), a reference cycle: left in place, every
        connection that ends is freed only by a full collection, and a flood of them that
        leaves at once stops the event loop for as long as that takes."""
        self._hs = None
        self._conn._next_fn = None
        # An unfinished handshake's states and the protocol refer to each other (the package
        # drops them itself only when a handshake completes).
        protocol = self._conn.noise_protocol
        protocol.handshake_state = protocol.symmetric_state = None

    def encrypt(self, plaintext: bytes) -> bytes:
        if len(plaintext) > MAX_PLAINTEXT:
            raise ValueError(f"plaintext of {len(plaintext)} bytes exceeds {MAX_PLAINTEXT}")
        return self._conn.encrypt(bytes(plaintext))

    def decrypt(self, message: bytes) -> bytes:
        if self.failed or not self.handshake_complete:
            raise NoiseFailure("transport message before the handshake completed")
        try:
            return self._conn.decrypt(bytes(message))
        except Exception as exc:
            self.failed = True
            raise NoiseFailure(f"decrypt failed: {type(exc).__name__}") from None

    def __repr__(self) -> str:
        state = "failed" if self.failed else "open" if self.handshake_complete else "handshake"
        return (f"NoiseResponder(pattern={self.pattern}, state={state}, "
                f"remote_static={fingerprint(self.remote_static)})")


def frame_message(message: bytes) -> bytes:
    """`[u16 BE length][noise message]`: how every Noise message travels (interop §2)."""
    if len(message) > MAX_MESSAGE:
        raise ValueError(f"Noise message of {len(message)} bytes exceeds {MAX_MESSAGE}")
    return len(message).to_bytes(LENGTH_PREFIX, "big") + message


class LengthPrefixDeframer:
    """Cuts `[u16 BE length][message]` records out of a TCP byte stream (interop §2).

    It refuses nothing: a u16 cannot announce more than 65,535 bytes, so at most one partial
    message (< 65,537 bytes) is ever held. A zero-length record is passed on as an empty
    message; it is not a valid Noise message in NK or XX, and the Noise layer rejects it,
    which keeps the policy in one place.
    """

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        pos = 0
        buf = self._buf
        while len(buf) - pos >= LENGTH_PREFIX:
            n = int.from_bytes(buf[pos:pos + LENGTH_PREFIX], "big")
            end = pos + LENGTH_PREFIX + n
            if end > len(buf):
                break
            out.append(bytes(buf[pos + LENGTH_PREFIX:end]))
            pos = end
        del buf[:pos]
        return out

    @property
    def pending(self) -> int:
        """Bytes of an incomplete record; non-zero at EOF means the stream was truncated."""
        return len(self._buf)
