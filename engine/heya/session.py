"""The Heya connection core, sans I/O (python-websockets `protocol.py`, h11 `_state.py`).

The shell calls `greet(...)` once the TLS handshake is done, feeds `receive_data` /
`receive_eof`, carries out each `CommandReceived` and answers it with `reply(request_id,
line)` or `refuse(request_id)`, pushes `have(token, next_seq)` whenever a message lands, and
writes `data_to_send()`. The core owns no socket, clock, task or table.

Order (README "Protocol"): replies go out in the order the commands came in, whatever order
the shell answers them in (a SEND is answered only after its landing commit, and later
commands may finish first). HAVE may go out at any time, but only between two whole replies:
a GIVE header and its body are one unit of `data_to_send()` and nothing is ever inserted in
between (the public server can split them, interop §3 HAVE / §5.8). PING is answered by the
core in its turn.

Two state tables decide what may happen, each in one place:

* `TRANSITIONS`: the connection's phase. Nothing is read or written before the greeting;
  bytes that arrive before it are kept and run after `DONE` (interop §0: the public server
  executes them; we always write the greeting before reading, so a client cannot have sent
  them "before DONE is received" in any way we could tell apart). QUIT and EOF drain: the
  replies already owed are written, then the connection closes; after QUIT nothing else is
  read or sent (README "Closing").
* `COMMANDS`: which commands a certificate may issue before and after INCO, and what the
  command does to that. A mailbox command from a certificate without a mailbox (AUTH, IOSA,
  DALL, ... : README "IOSA to a non-mailbox will close the connection", interop §5.12) and a
  second INCO (interop §3 INCO) close the connection. INCO and DALL change the identity at
  once: if the shell then fails them, it refuses them, which closes the connection anyway.

Closing: a malformed command, a wrong digest, an oversized SEND, a command the state table
refuses, or a `refuse()` from the shell all close the connection (README "SEND", "INCO";
interop §5.5: the public server leaves such sockets hanging). The replies owed for the
commands before it are still written first; nothing after it is read or run.
"""

from __future__ import annotations

from collections import deque
from enum import Enum

from engine.sans_io import SansIOOutput

from . import frames
from .events import CloseReason, CommandReceived, ConnectionClosed, Event
from .frames import (Auth, BodyTooLarge, CommandParser, Dall, Deau, DigestMismatch, Extd, Inco,
                     Iosa, Iosd, Iosl, ListTokens, MalformedCommand, Ping, Quit, Send, Trim,
                     Want)


class Phase(Enum):
    GREETING = "greeting"   # TLS is up, the greeting is not written yet
    READY = "ready"         # after DONE: commands are read and run
    DRAINING = "draining"   # QUIT or EOF: owed replies are written, nothing else is read
    CLOSED = "closed"


TRANSITIONS: dict[Phase, dict[str, Phase]] = {
    Phase.GREETING: {"greeted": Phase.READY, "close": Phase.CLOSED},
    Phase.READY: {"quit": Phase.DRAINING, "eof": Phase.DRAINING, "close": Phase.CLOSED},
    Phase.DRAINING: {"drained": Phase.CLOSED, "close": Phase.CLOSED},
    Phase.CLOSED: {},
}


class Identity(Enum):
    SENDER = "sender"     # any certificate: SEND, WANT (GONE), LIST (empty), PING, QUIT
    MAILBOX = "mailbox"   # the certificate did INCO


_S, _M = Identity.SENDER, Identity.MAILBOX
_EITHER = {_S: _S, _M: _M}
_MAILBOX_ONLY = {_M: _M}

# command -> {identity it may be issued from: identity afterwards}
COMMANDS: dict[type, dict[Identity, Identity]] = {
    Inco: {_S: _M},
    Dall: {_M: _S},
    Auth: _MAILBOX_ONLY, Deau: _MAILBOX_ONLY, Extd: _MAILBOX_ONLY, Trim: _MAILBOX_ONLY,
    Iosa: _MAILBOX_ONLY, Iosd: _MAILBOX_ONLY, Iosl: _MAILBOX_ONLY,
    ListTokens: _EITHER, Send: _EITHER, Want: _EITHER, Ping: _EITHER, Quit: _EITHER,
}


class LocalProtocolError(RuntimeError):
    """The shell asked for something the state table does not allow (a bug in the shell)."""


class _Fail:
    """A reply slot that closes the connection once the replies before it are written."""
    __slots__ = ("reason",)

    def __init__(self, reason: CloseReason):
        self.reason = reason


def _reason(exc: MalformedCommand) -> CloseReason:
    if isinstance(exc, DigestMismatch):
        return CloseReason.DIGEST_MISMATCH
    if isinstance(exc, BodyTooLarge):
        return CloseReason.OVERSIZE
    return CloseReason.MALFORMED


class HeyaSession(SansIOOutput[Event]):
    def __init__(self, *, max_body: int):
        """`max_body` is the largest SEND body accepted; a larger length closes the connection
        as soon as the SEND header is complete, so no more than that is ever buffered."""
        self._parser = CommandParser(max_body)
        self.phase = Phase.GREETING
        self.identity = Identity.SENDER
        self.close_reason: CloseReason | None = None
        super().__init__()
        # Reply slots in command order: [request_id | None, bytes | None (owed) | _Fail].
        self._replies: deque[list] = deque()
        self._awaiting: dict[int, list] = {}
        self._next_id = 0
        self._cutoff: int | None = None       # request ids >= this are never run or answered
        self._announced: dict[bytes, int] = {}  # token -> highest next_seq told (LAST/HAVE)
        self._drain_reason = CloseReason.EOF

    # --- the shell's side ------------------------------------------------------------------
    def greet(self, last: list[tuple[bytes, int]], mailbox: bool) -> None:
        """Write `HEYA 0`, `LAST` per send token if the certificate is a mailbox (interop §2),
        `DONE`; then run whatever was received meanwhile."""
        self._move("greeted")
        self.identity = Identity.MAILBOX if mailbox else Identity.SENDER
        last = last if mailbox else []
        for token, next_seq in last:
            self._announced[token] = next_seq
        self._out += frames.greeting(last)
        self._parse()

    def receive_data(self, data: bytes) -> None:
        if self.phase not in (Phase.GREETING, Phase.READY) or self._cutoff is not None:
            return
        self._parser.feed(data)
        self._parse()

    def receive_eof(self) -> None:
        if self.phase not in (Phase.GREETING, Phase.READY) or self._cutoff is not None:
            return
        if self._parser.partial:
            self._fail_next(CloseReason.TRUNCATED)
        elif self.phase is Phase.READY and self._replies:
            self._move("eof")
            self._drain_reason = CloseReason.EOF
        else:
            self._close(CloseReason.EOF)

    def reply(self, request_id: int, line: bytes) -> None:
        """The command is done: `line` (a whole reply from `frames`) goes out in its turn."""
        self._answer(request_id, line)

    def refuse(self, request_id: int) -> None:
        """The command cannot be carried out: once the replies before it are written the
        connection closes; no later command runs (`is_live` turns False for them)."""
        self._cutoff = request_id if self._cutoff is None else min(self._cutoff, request_id)
        self._answer(request_id, _Fail(CloseReason.REFUSED))

    def is_live(self, request_id: int) -> bool:
        """False for a command after a refused or malformed one: the shell skips it."""
        return (self.phase is not Phase.CLOSED
                and (self._cutoff is None or request_id < self._cutoff))

    def have(self, token: bytes, next_seq: int) -> bool:
        """Tell the client that `token` now has messages up to `next_seq - 1`. Written only
        after DONE and before QUIT/EOF, and only if higher than what it was last told (LAST
        or HAVE) for that token (interop §3 HAVE: consecutive duplicates are suppressed)."""
        if self.phase is not Phase.READY or next_seq <= self._announced.get(token, 0):
            return False
        self._announced[token] = next_seq
        self._out += frames.have(token, next_seq)
        return True

    def set_mailbox(self, mailbox: bool) -> None:
        """Another connection of the same certificate did INCO or DALL."""
        self.identity = Identity.MAILBOX if mailbox else Identity.SENDER
        if not mailbox:
            self._announced.clear()

    def close(self) -> None:
        """The shell gave up on the connection (timeout, shutdown, write failure)."""
        if self.phase is not Phase.CLOSED:
            self._close(CloseReason.LOCAL)

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def buffered_output(self) -> int:
        """Bytes waiting in `data_to_send()`."""
        return len(self._out)

    @property
    def outstanding(self) -> int:
        """Replies owed and not yet written: what one connection holds."""
        return len(self._replies)

    @property
    def partial(self) -> bool:
        """A command has started arriving and is not complete (the command deadline runs)."""
        return self._parser.partial

    @property
    def body_remaining(self) -> int:
        return self._parser.body_remaining

    @property
    def commands_completed(self) -> int:
        """Commands parsed so far: tells the shell a new command started within one read."""
        return self._parser.completed

    @property
    def body_length(self) -> int:
        """Length of the SEND body being received (0 if none): the shell's deadline grows
        with it."""
        return self._parser.body_length

    # --- inside -------------------------------------------------------------------------------
    def _move(self, trigger: str) -> None:
        try:
            self.phase = TRANSITIONS[self.phase][trigger]
        except KeyError:
            raise LocalProtocolError(
                f"{trigger!r} is not allowed in phase {self.phase.name}") from None

    def _close(self, reason: CloseReason, trigger: str = "close") -> None:
        self._move(trigger)
        self.close_reason = reason
        self._replies.clear()
        self._awaiting.clear()
        self._events.append(ConnectionClosed(reason))

    def _drained(self) -> None:
        if self.phase is Phase.DRAINING and not self._replies:
            self._close(self._drain_reason, "drained")

    def _parse(self) -> None:
        while self.phase is Phase.READY and self._cutoff is None:
            try:
                command = self._parser.next()
            except MalformedCommand as exc:
                self._fail_next(_reason(exc))
                return
            if command is None:
                return
            self._on_command(command)

    def _on_command(self, command) -> None:
        after = COMMANDS[type(command)].get(self.identity)
        if after is None:
            self._fail_next(CloseReason.NOT_ALLOWED)
            return
        self.identity = after
        if isinstance(command, Ping):
            self._queue(None, frames.pong())       # README "Pinging"
        elif isinstance(command, Quit):
            self._move("quit")                     # README "Closing": nothing after it
            self._drain_reason = CloseReason.QUIT
            self._drained()
        else:
            request_id = self._next_id
            self._next_id += 1
            self._queue(request_id, None)
            self._events.append(CommandReceived(request_id, command))

    def _fail_next(self, reason: CloseReason) -> None:
        self._cutoff = self._next_id
        self._queue(None, _Fail(reason))

    def _queue(self, request_id: int | None, reply) -> None:
        entry = [request_id, reply]
        self._replies.append(entry)
        if reply is None:
            self._awaiting[request_id] = entry
        self._flush()

    def _answer(self, request_id: int, reply) -> None:
        entry = self._awaiting.pop(request_id, None)
        if entry is None:
            if self.phase is Phase.CLOSED or (self._cutoff is not None
                                              and request_id >= self._cutoff):
                return   # dropped with the connection, or after a refused command
            raise LocalProtocolError(f"request {request_id} is not awaiting a reply")
        entry[1] = reply
        self._flush()

    def _flush(self) -> None:
        while self._replies and self._replies[0][1] is not None:
            reply = self._replies.popleft()[1]
            if isinstance(reply, _Fail):
                self._close(reason=reply.reason)
                return
            self._out += reply
        self._drained()

    def __repr__(self) -> str:
        return (f"HeyaSession(phase={self.phase.name}, identity={self.identity.name}, "
                f"outstanding={self.outstanding}, close_reason={self.close_reason})")
