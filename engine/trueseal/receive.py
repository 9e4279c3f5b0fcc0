"""Receive session core (:7700, Noise XX, relay = responder), sans I/O.

After the handshake the device's static key (`HandshakeComplete.remote_static`) is its
mailbox (interop §3). The shell calls `deliver(blob_id, envelope)` for each blob in order and
`send_heartbeat()` on idle; the client answers with DeliverAck and Heartbeat frames. Only
DeliverAck and Heartbeat are accepted from the client; any other frame closes the session.

Heartbeats: a client Heartbeat is echoed (000 "Heartbeat"), except one that answers a
heartbeat of ours, which is not echoed back, or a client that echoes every heartbeat (the real
one does, interop §7) would ping-pong with us forever. Answers are matched by count: if both
sides start one at the same moment, one of the two is taken as the answer.
"""

from __future__ import annotations

from engine.noise_session import MAX_PLAINTEXT, StaticKey

from .events import DeliverAckReceived, HeartbeatReceived
from .frames import BLOB_ID_LEN, HEADER_LEN, Deliver, DeliverAck, Heartbeat
from .session import LocalProtocolError, SessionCore, State

# 5 + 8 + 65,482 = 65,495 <= 65,519 (interop §4): every storable envelope fits one Deliver.
MAX_DELIVER_ENVELOPE = MAX_PLAINTEXT - HEADER_LEN - BLOB_ID_LEN


class ReceiveSession(SessionCore):
    PATTERN = "XX"
    ACCEPTS = {DeliverAck: "_on_deliver_ack", Heartbeat: "_on_heartbeat"}

    def __init__(self, static: bytes | StaticKey):
        super().__init__(static)
        self.heartbeats_unanswered = 0

    def deliver(self, blob_id: int, envelope: bytes) -> bool:
        """Queue one Deliver frame. False if the session is already closed."""
        if self.state is State.CLOSED:
            return False
        if self.state is not State.OPEN:
            raise LocalProtocolError("deliver before the handshake completed")
        if not 0 <= blob_id < 2**64:
            raise ValueError("blob_id must be a u64")
        if len(envelope) > MAX_DELIVER_ENVELOPE:
            raise ValueError(f"envelope of {len(envelope)} bytes does not fit one Deliver frame")
        self._send(Deliver(blob_id, envelope))
        return True

    def send_heartbeat(self) -> bool:
        """Queue a Heartbeat (interop §7: the relay starts them, the client echoes)."""
        if self.state is not State.OPEN:
            return False
        self._send(Heartbeat())
        self.heartbeats_unanswered += 1
        return True

    def _on_deliver_ack(self, frame: DeliverAck) -> None:
        self._events.append(DeliverAckReceived(frame.blob_id))

    def _on_heartbeat(self, frame: Heartbeat) -> None:
        if self.heartbeats_unanswered:
            self.heartbeats_unanswered -= 1
            self._events.append(HeartbeatReceived(echo=True))
        else:
            self._send(Heartbeat())
            self._events.append(HeartbeatReceived(echo=False))
