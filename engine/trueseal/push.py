"""Push session core (:7701, Noise NK, relay = responder), sans I/O.

The client may pipeline Push frames; the shell stores each one concurrently and answers with
`accept(push_id)` / `reject(push_id)` in whatever order the stores finish. The core holds the
replies back so that the client hears exactly one Ack or Error per Push, in the order the
Pushes arrived (001 "Push Sessions"; interop §6).

Rejections the core can decide alone (body < 32 bytes, envelope over `max_envelope`) are
answered with Error in their turn and reported as PushRejected (000 "Error").

Heartbeat on a push session: echoed. 000 lists Heartbeat for both directions and says the
receiver must answer it; the echo takes its place in the reply order, so a client that counts
replies per Push still sees them in Push order. The core never starts one here: push
sessions are short-lived (001), and the real client never sends one (interop §6).

EOF with replies still owed moves to DRAINING: the stores already under way finish, their
replies are still written (the client may only have half-closed), then CLOSED.
"""

from __future__ import annotations

from collections import deque

from engine.noise_session import StaticKey

from .events import CloseReason, HeartbeatReceived, PushReceived, PushRejected
from .frames import Ack, Error, Frame, Heartbeat, Push, ShortPush
from .session import SessionCore, State

# interop §4/§5: 65,535 - 16 (tag) - 5 (header) - 32 (recipient); larger is unreachable.
MAX_ENVELOPE = 65482



_FAIL = object()  # reply slot of a Push whose store failed: close instead of answering

class PushSession(SessionCore):
    PATTERN = "NK"
    ACCEPTS = {Push: "_on_push", ShortPush: "_on_short_push", Heartbeat: "_on_heartbeat"}

    def __init__(self, static: bytes | StaticKey, *, max_envelope: int = MAX_ENVELOPE):
        """`max_envelope` is the relay's limit on the bytes after the recipient key (000
        "Envelope Size Limit"); a bigger envelope is answered with Error, never stored."""
        super().__init__(static)
        self.max_envelope = max_envelope
        self._next_push_id = 0
        # Replies in arrival order; an entry is [push_id | None, reply frame | None until known].
        self._replies: deque[list] = deque()
        self._awaiting: dict[int, list] = {}

    @property
    def outstanding(self) -> int:
        """Replies owed and not yet written (Pushes being stored, and the replies queued
        behind them): what one connection holds; the shell stops reading past a bound."""
        return len(self._replies)

    def accept(self, push_id: int) -> None:
        """The Push is durably stored: its Ack goes out once every earlier reply has."""
        self._answer(push_id, Ack())

    def reject(self, push_id: int) -> None:
        """The Push will not be stored: Error, in its turn (000: non-retryable)."""
        self._answer(push_id, Error())

    def fail(self, push_id: int) -> None:
        """Storing the Push failed (a transient fault, not the blob's): once the replies before
        it are written, close without answering it. Error would tell the client never to retry
        (000); a closed connection is a retryable PushFailed, and the retry is deduplicated."""
        self._answer(push_id, _FAIL)

    def _answer(self, push_id: int, reply: Frame) -> None:
        if self.state is State.CLOSED:
            return   # the connection is gone; nobody is left to tell
        try:
            entry = self._awaiting.pop(push_id)
        except KeyError:
            raise ValueError(f"push {push_id} is not awaiting an answer") from None
        entry[1] = reply
        self._flush_replies()

    def _owes_replies(self) -> bool:
        return bool(self._replies)

    def _queue(self, push_id: int | None, reply: Frame | None) -> None:
        entry = [push_id, reply]
        self._replies.append(entry)
        if reply is None:
            self._awaiting[push_id] = entry
        self._flush_replies()

    def _flush_replies(self) -> None:
        while self._replies and self._replies[0][1] is not None:
            reply = self._replies.popleft()[1]
            if reply is _FAIL:
                self._replies.clear()
                self._awaiting.clear()
                self._close(CloseReason.STORE_FAILED)
                return
            self._send(reply)
        if self.state is State.DRAINING and not self._replies:
            self._close(CloseReason.EOF, "drained")

    def _take_id(self) -> int:
        push_id, self._next_push_id = self._next_push_id, self._next_push_id + 1
        return push_id

    # --- frames accepted while OPEN -------------------------------------------------------
    def _on_push(self, frame: Push) -> None:
        push_id = self._take_id()
        if len(frame.envelope) > self.max_envelope:
            self._events.append(PushRejected(push_id, "oversize", len(frame.envelope)))
            self._queue(push_id, Error())
            return
        self._events.append(PushReceived(push_id, frame.recipient, frame.envelope))
        self._queue(push_id, None)

    def _on_short_push(self, frame: ShortPush) -> None:
        push_id = self._take_id()   # 000: a body < 32 bytes is answered Error, never Acked
        self._events.append(PushRejected(push_id, "short_body", frame.body_len))
        self._queue(push_id, Error())

    def _on_heartbeat(self, frame: Heartbeat) -> None:
        self._events.append(HeartbeatReceived(echo=False))
        self._queue(None, Heartbeat())
