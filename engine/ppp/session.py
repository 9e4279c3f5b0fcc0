"""The PPP WebSocket session core, sans I/O (spec 004 §5.1; h11-style state table).

The shell sends `greeting()` (CHALLENGE) as soon as the socket is accepted, feeds each
received message to `receive_frame(data, now)`, carries out each `CommandReceived` and
answers it with `reply(slot, Reply)`, calls `notify(count)` when events arrive for the
authenticated pubkey, and writes `frames_to_send()`. It owns no socket, clock, task or table:
`now` (seconds) is passed in for the rate limits, the challenge nonce and request ids are
given or drawn by the caller's `token_bytes`.

What is legal when (`RULES`, one place):

* AWAIT_AUTH: only AUTH. A valid Ed25519 signature over the 32-byte nonce (§5.1) -> AUTH_OK,
  READY, unless the shell's `admit(pubkey)` names a reason to refuse (no authenticated slot
  left, issue 19): AUTH_FAIL with it and the session closes with 1013 (try again later).
  A bad signature, a malformed message or any other command -> AUTH_FAIL and the session
  closes (policy violation): nothing is run for an unauthenticated peer, and it gets
  one chance per challenge.
* READY: every C.1 command except AUTH (-> STORE_FAIL "already authenticated"). Each is first
  charged to the pubkey's sliding-window budget of C.3 (shared by all sessions and the HTTP
  transport of that pubkey on this host); past it the command's failure reply says "rate
  limited" and nothing runs. The hourly quotas (`limits.QUOTAS`) are not charged here: the
  shell counts them across hosts (`PppControl.spend`), and a hit this host's memory
  recorded for a command the shared count then refused would refuse the next one wrongly.
  A malformed message is answered with STORE_FAIL and the session stays open.
* CLOSED: nothing is read.

Every authenticated command gets a random 6-byte request id (12 hex chars, §5.x "request
ids"); failure reasons end with it and the shell logs it, so an operator can grep a
client-reported error without any user identifier.

Replies go out in command order whatever order the shell answers in (STORE waits for the
landing commit; later commands may finish first); NOTIFY is unsolicited and goes out at once.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from nacl.exceptions import CryptoError
from nacl.signing import VerifyKey

from engine.ratelimit import KeyedBudgets

from . import protocol as P
from .limits import CHALLENGE_LEN, QUOTAS, REQUEST_ID_LEN


class Phase(Enum):
    AWAIT_AUTH = "await_auth"
    READY = "ready"
    CLOSED = "closed"


# (phase, command kind) -> action. Kinds: "AUTH", "command" (any other decodable C.1 command),
# "malformed".
RULES: dict[tuple[Phase, str], str] = {
    (Phase.AWAIT_AUTH, "AUTH"): "authenticate",
    (Phase.AWAIT_AUTH, "command"): "refuse_and_close",
    (Phase.AWAIT_AUTH, "malformed"): "refuse_and_close",
    (Phase.READY, "AUTH"): "refuse",
    (Phase.READY, "command"): "run",
    (Phase.READY, "malformed"): "refuse",
}


@dataclass(frozen=True)
class Authenticated:
    pubkey: bytes

    def __repr__(self) -> str:
        return "Authenticated()"


@dataclass(frozen=True)
class CommandReceived:
    slot: int
    request_id: str
    command: P.Command


@dataclass(frozen=True)
class Refused:
    """The core answered a message with a failure itself (for the shell's log and metrics)."""
    request_id: str | None
    cmd: str | None
    reason: str


@dataclass(frozen=True)
class Closing:
    """Close the socket once `frames_to_send()` is written. `code`: WebSocket close code."""
    code: int
    reason: str


Event = Authenticated | CommandReceived | Refused | Closing

CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013


def with_request_id(reason: str, request_id: str) -> str:
    return f"{reason} (request {request_id})"


class PppSession:
    def __init__(self, budgets: KeyedBudgets, *, nonce: bytes | None = None,
                 token_bytes: Callable[[int], bytes] = secrets.token_bytes,
                 max_in_flight: int = 64,
                 admit: Callable[[bytes], str | None] | None = None):
        """`admit(pubkey)`: asked once the signature is good; a reason refuses the AUTH."""
        self.budgets = budgets
        self.admit = admit
        self.token_bytes = token_bytes
        self.nonce = nonce if nonce is not None else token_bytes(CHALLENGE_LEN)
        if len(self.nonce) != CHALLENGE_LEN:
            raise ValueError("the challenge nonce is 32 bytes")
        self.max_in_flight = max_in_flight
        self.phase = Phase.AWAIT_AUTH
        self.pubkey: bytes | None = None
        self._slots: OrderedDict[int, bytes | None] = OrderedDict()
        self._next_slot = 0
        self._out: list[bytes] = []
        self._events: list[Event] = []

    def __repr__(self) -> str:
        return f"PppSession({self.phase.value}, owed={len(self._slots)})"

    # --- output ------------------------------------------------------------------------------
    def greeting(self) -> bytes:
        return P.challenge(self.nonce).encode()

    def frames_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def events_received(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    @property
    def outstanding(self) -> int:
        return len(self._slots)

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    def _slot(self) -> int:
        s = self._next_slot
        self._next_slot += 1
        self._slots[s] = None
        return s

    def reply(self, slot: int, reply: P.Reply) -> None:
        if slot not in self._slots:
            return   # closed meanwhile, or answered twice
        self._slots[slot] = reply.encode()
        while self._slots:
            head, frame = next(iter(self._slots.items()))
            if frame is None:
                break
            del self._slots[head]
            self._out.append(frame)

    def notify(self, count: int) -> bool:
        """NOTIFY(count) (§5.1); only to an authenticated, open session."""
        if self.phase is not Phase.READY or count <= 0:
            return False
        self._out.append(P.notify(count).encode())
        return True

    def push(self, reply: P.Reply) -> bool:
        """An unsolicited frame (ROOM_NOTIFY, KEY_ROTATION_NOTIFY), like `notify`."""
        if self.phase is not Phase.READY:
            return False
        self._out.append(reply.encode())
        return True

    def close(self) -> None:
        self.phase = Phase.CLOSED
        self._slots.clear()
        # `admit` is usually a method of the shell that owns this session: a reference cycle
        # that only a full collection would free, thousands at a time after a flood.
        self.admit = None

    # --- input -------------------------------------------------------------------------------
    def receive_frame(self, data: bytes, now: float) -> None:
        if self.phase is Phase.CLOSED:
            return
        try:
            cmd = P.decode_command(data)
            kind = "AUTH" if isinstance(cmd, P.Auth) else "command"
            err = None
        except P.ProtocolError as e:
            cmd, kind, err = None, "malformed", e
        action = RULES[(self.phase, kind)]
        if action == "authenticate":
            self._authenticate(cmd)
        elif action == "refuse_and_close":
            reason = err.reason if err is not None else "authenticate first"
            self._fail(None, P.auth_fail(reason), "AUTH", reason)
            self._close(CLOSE_POLICY, reason)
        elif action == "refuse":
            rid = self.token_bytes(REQUEST_ID_LEN).hex()
            if err is not None:
                # A malformed AUTH after AUTH_OK is not an auth failure: the session stays
                # authenticated, so it gets STORE_FAIL like a well-formed one, not AUTH_FAIL.
                fail_as = None if err.cmd == "AUTH" else err.cmd
                self._fail(rid, P.failure(fail_as, with_request_id(err.reason, rid)),
                           err.cmd, err.reason)
            else:
                self._fail(rid, P.store_fail(with_request_id("already authenticated", rid)),
                           "AUTH", "already authenticated")
        else:
            rid = self.token_bytes(REQUEST_ID_LEN).hex()
            if cmd.name not in QUOTAS and not self.budgets.allow(cmd.name, self.pubkey, now):
                self._fail(rid, P.failure(cmd.name, with_request_id("rate limited", rid)),
                           cmd.name, "rate_limited")
                return
            self._events.append(CommandReceived(self._slot(), rid, cmd))

    def _authenticate(self, cmd: P.Auth) -> None:
        try:
            VerifyKey(cmd.pubkey).verify(self.nonce, cmd.sig)
        except (CryptoError, ValueError, TypeError):
            self._fail(None, P.auth_fail("bad signature"), "AUTH", "bad_signature")
            self._close(CLOSE_POLICY, "bad signature")
            return
        why = self.admit(cmd.pubkey) if self.admit is not None else None
        if why is not None:
            self._fail(None, P.auth_fail(why), "AUTH", why)
            self._close(CLOSE_TRY_AGAIN, why)
            return
        self.pubkey = cmd.pubkey
        self.phase = Phase.READY
        self._out.append(P.auth_ok().encode())
        self._events.append(Authenticated(cmd.pubkey))

    def _fail(self, rid: str | None, reply: P.Reply, cmd: str | None, reason: str) -> None:
        self.reply(self._slot(), reply)
        self._events.append(Refused(rid, cmd, reason))

    def _close(self, code: int, reason: str) -> None:
        self.phase = Phase.CLOSED
        self._events.append(Closing(code, reason))
