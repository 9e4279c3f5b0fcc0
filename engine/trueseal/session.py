"""What the push and receive session cores share: the state table and the byte plumbing.

Sans I/O (python-websockets `protocol.py`): the shell feeds `receive_data`/`receive_eof`,
reads `events_received()` and writes `data_to_send()`; the core owns no socket, clock or
task. Inbound bytes are cut into u16-prefixed Noise messages (interop §2), run through the
responder handshake, then decrypted and parsed as exactly one frame each (interop §4).

Every way a connection can go wrong (bad or truncated handshake, decrypt failure, malformed
frame or unknown tag, a frame the session type does not accept) moves the core to CLOSED with
a reason; the shell then writes what is left in `data_to_send()` and closes the socket.
Bytes received after that are ignored.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

from engine.noise_nk import NKResponder
from engine.noise_session import (LengthPrefixDeframer, NoiseFailure, NoiseResponder, StaticKey,
                                  frame_message)
from engine.sans_io import SansIOOutput

from .events import CloseReason, ConnectionClosed, Event, HandshakeComplete
from .frames import Frame, MalformedFrame, parse, serialize


class State(Enum):
    HANDSHAKE = "handshake"
    OPEN = "open"
    DRAINING = "draining"   # the peer sent EOF while replies were still owed (push sessions)
    CLOSED = "closed"


# The legal moves, in one place (h11 `_state.py`); anything else is a bug in the core.
TRANSITIONS: dict[State, dict[str, State]] = {
    State.HANDSHAKE: {"handshake_done": State.OPEN, "close": State.CLOSED},
    State.OPEN: {"eof_owing_replies": State.DRAINING, "close": State.CLOSED},
    State.DRAINING: {"drained": State.CLOSED, "close": State.CLOSED},
    State.CLOSED: {},
}


class LocalProtocolError(RuntimeError):
    """The shell or the core asked for a move the state table does not allow."""


class SessionCore(SansIOOutput[Event]):
    """Base of PushSession and ReceiveSession.

    Subclasses set `PATTERN` (Noise handshake) and `ACCEPTS`: the frames a peer may send
    while OPEN, each with its handler. A known frame missing from `ACCEPTS` closes the
    connection: the issue treats it like a malformed one (the public relay drops it silently
    and the real client then waits forever, interop §6).
    """

    PATTERN: ClassVar[str]
    ACCEPTS: ClassVar[dict[type, str]]

    def __init__(self, static: bytes | StaticKey):
        """`static` is the relay's 32-byte X25519 private key, or a StaticKey made from it
        once per listener (cheaper per connection)."""
        # NK (push, one connection per push) runs on the written-out responder; XX on the
        # noiseprotocol package (engine/noise_nk.py says why)
        self._noise = NKResponder(static) if self.PATTERN == "NK" \
            else NoiseResponder(self.PATTERN, static)
        self._deframer = LengthPrefixDeframer()
        super().__init__()
        self.state = State.HANDSHAKE
        self.close_reason: CloseReason | None = None

    # --- the shell's side ----------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        if self.state not in (State.HANDSHAKE, State.OPEN):
            return
        for message in self._deframer.feed(data):
            if self.state is State.HANDSHAKE:
                self._receive_handshake(message)
            elif self.state is State.OPEN:
                self._receive_transport(message)
            else:
                break

    def receive_eof(self) -> None:
        if self.state not in (State.HANDSHAKE, State.OPEN):
            return
        if self._deframer.pending:
            self._close(CloseReason.TRUNCATED)
        elif self.state is State.OPEN and self._owes_replies():
            self._move("eof_owing_replies")
        else:
            self._close(CloseReason.EOF)

    def close(self) -> None:
        """The shell gave up on the connection (timeout, shutdown)."""
        if self.state is not State.CLOSED:
            self._close(CloseReason.LOCAL)

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    @property
    def remote_static(self) -> bytes | None:
        return self._noise.remote_static

    # --- for subclasses --------------------------------------------------------------------
    def _owes_replies(self) -> bool:
        return False

    def _send(self, frame: Frame) -> None:
        # Encrypt and queue in one step: nonce order is queue order (interop §3, §7).
        self._out += frame_message(self._noise.encrypt(serialize(frame)))

    def _move(self, trigger: str) -> None:
        try:
            self.state = TRANSITIONS[self.state][trigger]
        except KeyError:
            raise LocalProtocolError(f"{trigger!r} is not allowed in state {self.state.name}") from None

    def _close(self, reason: CloseReason, trigger: str = "close") -> None:
        self._noise.close()
        self._move(trigger)
        self.close_reason = reason
        self._events.append(ConnectionClosed(reason))

    # --- inbound ----------------------------------------------------------------------------
    def _receive_handshake(self, message: bytes) -> None:
        try:
            replies = self._noise.receive_handshake(message)
        except NoiseFailure:
            self._close(CloseReason.HANDSHAKE_FAILED)
            return
        for reply in replies:
            self._out += frame_message(reply)
        if self._noise.handshake_complete:
            self._move("handshake_done")
            self._events.append(HandshakeComplete(self._noise.remote_static))

    def _receive_transport(self, message: bytes) -> None:
        try:
            plaintext = self._noise.decrypt(message)
        except NoiseFailure:
            self._close(CloseReason.DECRYPT_FAILED)
            return
        try:
            frame = parse(plaintext)
        except MalformedFrame:
            self._close(CloseReason.MALFORMED_FRAME)
            return
        handler = self.ACCEPTS.get(type(frame))
        if handler is None:
            self._close(CloseReason.UNEXPECTED_FRAME)
            return
        getattr(self, handler)(frame)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(state={self.state.name}, "
                f"noise={self._noise!r}, close_reason={self.close_reason})")
