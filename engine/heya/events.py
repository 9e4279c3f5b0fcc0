"""What the Heya session core reports to its shell: small immutable events (h11 style).

Commands come out as `CommandReceived(request_id, command)`; the shell carries each out and
answers with `HeyaSession.reply(request_id, line)` or `refuse(request_id)`. Reprs show no
tokens, digests or bodies (see `frames.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .frames import Command


class CloseReason(str, Enum):
    EOF = "eof"                        # peer closed between commands
    QUIT = "quit"                      # QUIT (README "Closing")
    TRUNCATED = "truncated"            # peer closed inside a command
    MALFORMED = "malformed"            # bytes that are not a command (interop §0)
    DIGEST_MISMATCH = "digest_mismatch"
    OVERSIZE = "oversize"              # SEND length over the configured cap
    NOT_ALLOWED = "not_allowed"        # the state table refuses the command (see session.py)
    REFUSED = "refused"                # the shell could not carry the command out
    LOCAL = "local"                    # the shell closed (timeout, shutdown)


@dataclass(frozen=True)
class CommandReceived:
    request_id: int
    command: Command


@dataclass(frozen=True)
class ConnectionClosed:
    reason: CloseReason


Event = CommandReceived | ConnectionClosed
