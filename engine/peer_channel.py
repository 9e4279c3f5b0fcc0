"""The host-to-host peer channel, sans I/O: a Noise IK handshake, then a stream of messages.

Hosts of one relay hand each other just-landed envelopes (`runtime/peer_link.py`), so a
receiver connected to egress on one host gets a push made to ingress on another in
milliseconds instead of a micro-batch. Each host has a static X25519 key of its own
(`<data>/keys/peer_static.key`) whose public half is listed in the store beside its lease
(`delta_tables/peer_registry.py`); a peer is who the store says is live.

Why Noise IK (`Noise_IK_25519_ChaChaPoly_BLAKE2s`) and not mutual TLS: both ends are
authenticated by raw 32-byte keys the store lists, so there is no CA, certificate or
expiry to run; the dialling host knows the listener's key from the store (IK's pre-message
`<- s`), and its own static key travels encrypted in the first message, which the
listener checks against the store before it answers. One round trip, forward secrecy from
the ephemeral keys, and the same library and primitives as trueseal's own Noise.

    IK:
      <- s
      ...
      -> e, es, s, ss
      <- e, ee, se

Prologue `relay-peer/1`: a handshake meant for another protocol or version fails.

Wire: every Noise message is `[u16 BE length][noise bytes]`, as trueseal's (interop §2).
After the handshake the decrypted payloads form one ordered byte stream carrying messages
as `[u32 BE length][payload]`, so a message may span several Noise transport messages
(each at most 65,535 bytes: an envelope of up to `runtime.handoff.MESSAGE_MAX` does not fit
one) and several small ones share one (a burst costs one encryption).

Events out: `PeerIdentified` (the listener learnt the dialler's static key: the shell asks
the store, then calls `accept` or `reject`; nothing is answered before that), `ChannelOpen`,
`MessageReceived`, `ChannelClosed`. Any failure closes the channel; no key is in a repr.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from noise.connection import Keypair, NoiseConnection

from .noise_session import (BACKEND, MAX_PLAINTEXT, LengthPrefixDeframer, fingerprint,
                            frame_message)

PROTOCOL_NAME = b"Noise_IK_25519_ChaChaPoly_BLAKE2s"
PROLOGUE = b"relay-peer/1"
_LENGTH = struct.Struct(">I")
# The largest message either side accepts: a hand-off of the largest envelope and its fields.
MESSAGE_MAX = 128 * 1024


class State(enum.Enum):
    HANDSHAKE = "handshake"
    IDENTIFIED = "identified"      # listener: waiting for accept/reject
    OPEN = "open"
    CLOSED = "closed"


@dataclass(frozen=True)
class PeerIdentified:
    remote_static: bytes

    def __repr__(self) -> str:
        return f"PeerIdentified({fingerprint(self.remote_static)})"


@dataclass(frozen=True)
class ChannelOpen:
    pass


@dataclass(frozen=True)
class MessageReceived:
    payload: bytes

    def __repr__(self) -> str:
        return f"MessageReceived(size={len(self.payload)})"


@dataclass(frozen=True)
class ChannelClosed:
    reason: str     # handshake_failed, decrypt_failed, oversized, rejected, eof, local


class PeerChannel:
    """One end of a channel. `initiator`: the dialling host, which must know the listener's
    static key (`remote_static`, from the store)."""

    def __init__(self, static_private: bytes, *, initiator: bool,
                 remote_static: bytes | None = None, max_message: int = MESSAGE_MAX):
        if initiator and (remote_static is None or len(remote_static) != 32):
            raise ValueError("the dialling side needs the listener's 32-byte static key")
        self.initiator = initiator
        self.max_message = max_message
        self.state = State.HANDSHAKE
        self.remote_static: bytes | None = remote_static
        self._conn = NoiseConnection.from_name(PROTOCOL_NAME, BACKEND)
        if initiator:
            self._conn.set_as_initiator()
            self._conn.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, remote_static)
        else:
            self._conn.set_as_responder()
        self._conn.set_keypair_from_private_bytes(Keypair.STATIC, bytes(static_private))
        self._conn.set_prologue(PROLOGUE)
        self._conn.start_handshake()
        self._deframer = LengthPrefixDeframer()
        self._plain = bytearray()       # decrypted stream not yet cut into messages
        self._out = bytearray()         # framed Noise messages to write
        self._queued = bytearray()      # messages waiting to be encrypted
        self._events: list = []
        if initiator:
            self._write_handshake()

    # -- input ---------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        if self.state is State.CLOSED:
            return
        for msg in self._deframer.feed(data):
            if self.state is State.CLOSED:
                return
            if self.state is State.OPEN:
                self._transport(msg)
            elif self.state is State.HANDSHAKE:
                self._handshake(msg)
            else:       # IDENTIFIED: the dialler may not speak before it is answered
                self._close("handshake_failed")

    def receive_eof(self) -> None:
        self._close("eof")

    def _handshake(self, msg: bytes) -> None:
        try:
            self._conn.read_message(msg)
        except Exception:   # noise, cryptography and ValueError alike mean "bad peer"
            self._close("handshake_failed")
            return
        if self.initiator:
            self._opened()
        else:
            rs = self._conn.noise_protocol.handshake_state.rs
            self.remote_static = rs.public_bytes
            self.state = State.IDENTIFIED
            self._events.append(PeerIdentified(self.remote_static))

    def _transport(self, msg: bytes) -> None:
        try:
            self._plain += self._conn.decrypt(msg)
        except Exception:
            self._close("decrypt_failed")
            return
        buf, pos = self._plain, 0
        while len(buf) - pos >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(buf, pos)
            if n > self.max_message:
                self._close("oversized")
                return
            end = pos + _LENGTH.size + n
            if end > len(buf):
                break
            self._events.append(MessageReceived(bytes(buf[pos + _LENGTH.size:end])))
            pos = end
        del buf[:pos]

    # -- decisions (listener) ---------------------------------------------------------------
    def accept(self) -> None:
        """The dialler's key is listed for a live host: answer, and the channel is open."""
        if self.state is not State.IDENTIFIED:
            raise RuntimeError(f"accept in state {self.state.value}")
        self._write_handshake()
        self._opened()

    def reject(self) -> None:
        """Not listed: close without answering (the dialler learns nothing)."""
        self._close("rejected")

    # -- output ---------------------------------------------------------------------------
    def send(self, payload: bytes) -> None:
        """Queue one message (before the channel is open it waits for it)."""
        if len(payload) > self.max_message:
            raise ValueError(f"message of {len(payload)} bytes exceeds {self.max_message}")
        if self.state is State.CLOSED:
            return
        self._queued += _LENGTH.pack(len(payload))
        self._queued += payload

    @property
    def queued(self) -> int:
        """Bytes of messages not yet handed to `data_to_send`."""
        return len(self._queued)

    def data_to_send(self) -> bytes:
        if self.state is State.OPEN and self._queued:
            q = self._queued
            for i in range(0, len(q), MAX_PLAINTEXT):
                self._out += frame_message(self._conn.encrypt(bytes(q[i:i + MAX_PLAINTEXT])))
            self._queued = bytearray()
        out, self._out = bytes(self._out), bytearray()
        return out

    def events_received(self) -> list:
        out, self._events = self._events, []
        return out

    def close(self) -> None:
        self._close("local")

    # -- internals ------------------------------------------------------------------------
    def _write_handshake(self) -> None:
        self._out += frame_message(bytes(self._conn.write_message(b"")))

    def _opened(self) -> None:
        self.state = State.OPEN
        self._conn._next_fn = None      # a reference cycle of the package (noise_session.py)
        self._events.append(ChannelOpen())

    def _close(self, reason: str) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        self._queued = bytearray()
        self._conn._next_fn = None
        protocol = self._conn.noise_protocol
        protocol.handshake_state = protocol.symmetric_state = None
        self._events.append(ChannelClosed(reason))

    def __repr__(self) -> str:
        side = "initiator" if self.initiator else "responder"
        return (f"PeerChannel({side}, state={self.state.value}, "
                f"remote_static={fingerprint(self.remote_static)})")
