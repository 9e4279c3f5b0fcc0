"""What the trueseal session cores report to their shells: small immutable events (h11 style).

Reprs show sizes and key fingerprints only: an event may be logged, an envelope never is.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .frames import fingerprint


class CloseReason(str, Enum):
    EOF = "eof"                            # peer closed at a message boundary
    TRUNCATED = "truncated"                # peer closed inside a length-prefixed message
    HANDSHAKE_FAILED = "handshake_failed"  # garbage, short message, wrong relay key
    DECRYPT_FAILED = "decrypt_failed"      # interop §3: a bad transport message ends the session
    MALFORMED_FRAME = "malformed_frame"    # 000: includes unknown tags
    UNEXPECTED_FRAME = "unexpected_frame"  # a known frame this session type does not accept
    LOCAL = "local"                        # the shell closed (timeout, shutdown, ...)
    STORE_FAILED = "store_failed"          # a Push could not be stored: the client must retry


@dataclass(frozen=True)
class HandshakeComplete:
    remote_static: bytes | None   # XX: the device key, i.e. the mailbox; NK: None (anonymous)

    def __repr__(self) -> str:
        return f"HandshakeComplete(remote_static={fingerprint(self.remote_static)})"


@dataclass(frozen=True)
class PushReceived:
    """Store it, then call `accept(push_id)` (or `reject` if the store failed)."""
    push_id: int
    recipient: bytes
    envelope: bytes

    def __repr__(self) -> str:
        return (f"PushReceived(push_id={self.push_id}, recipient={fingerprint(self.recipient)}, "
                f"envelope=<{len(self.envelope)} bytes>)")


@dataclass(frozen=True)
class PushRejected:
    """The core already answered Error in its turn; nothing is to be stored."""
    push_id: int
    reason: str      # "short_body" | "oversize"
    size: int        # body size (short_body) or envelope size (oversize)


@dataclass(frozen=True)
class DeliverAckReceived:
    blob_id: int


@dataclass(frozen=True)
class HeartbeatReceived:
    echo: bool       # True: it answered one of ours; False: the peer started it and we echoed


@dataclass(frozen=True)
class ConnectionClosed:
    reason: CloseReason


Event = (HandshakeComplete | PushReceived | PushRejected | DeliverAckReceived
         | HeartbeatReceived | ConnectionClosed)
