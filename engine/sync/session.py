"""One connection's protocol state, as a table (what is legal when), and how a refusal looks.

    AWAIT_AUTH --Auth/AuthProof ok--> AWAIT_HELLO --Hello ok--> ACTIVE --Bye--> CLOSING

A connection whose identity the transport already proved (a future iroh gateway) starts in
AWAIT_HELLO. Everything not in the table for the current state is refused and changes nothing,
as 0k-sync does (`session.rs:147-174`: NotAuthenticated before HELLO, UnexpectedMessage after).

Refusals: 0k-sync has no error message, every refusal is the response stream finished with
zero bytes (interop §2.7), and 0k-sync clients depend on that. This relay answers
`Error{code, message}` instead only where the client asked for it: a session whose HELLO said
version 2, any request that is itself an extension message (0k-sync never sends those), and
every request in the seed spec's Envelope form, whatever its version (engine/sync/envelope.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from . import messages as m


class State(Enum):
    AWAIT_AUTH = "await_auth"
    AWAIT_HELLO = "await_hello"
    ACTIVE = "active"
    CLOSING = "closing"


# HELLO versions: 1 is 0k-sync (empty-FIN refusals); 2 also asks for ERROR messages.
SUPPORTED_VERSIONS = (1, 2)
ERROR_VERSION = 2


class Code:
    """ERROR codes, in the seed's ranges (1xxx request, 2xxx limits and state, 3xxx relay)."""
    INVALID_MESSAGE = 1000
    UNSUPPORTED_VERSION = 1001
    UNEXPECTED_MESSAGE = 1002
    NOT_AUTHENTICATED = 1003
    NOT_A_MEMBER = 1004
    DEVICE_REVOKED = 1005
    BAD_ADMISSION = 1006
    RATE_LIMITED = 2000
    QUOTA_EXCEEDED = 2001
    BLOB_TOO_LARGE = 2002
    NOT_FOUND = 2003
    NOT_ACKNOWLEDGED = 2004
    CONTENT_TOO_LARGE = 2005
    INTERNAL = 3000
    RELAY_SHUTTING_DOWN = 3001


# Connection close codes (0k-sync `protocol.rs:38-58` for 1 and 2; 3 and 4 are ours).
CLOSE_RATE_LIMITED = 1            # b"rate limited"
CLOSE_TOO_MANY_SESSIONS = 2       # b"too many sessions"
CLOSE_AUTH_FAILED = 3             # b"auth failed" / hello timeout
CLOSE_DEVICE_REVOKED = 4          # b"device revoked"

# state -> request type -> handler name (the shell has one `_on_<name>` per handler)
TABLE: dict[State, dict[type, str]] = {
    State.AWAIT_AUTH: {m.Auth: "auth"},
    State.AWAIT_HELLO: {m.Hello: "hello", m.Join: "join"},
    State.ACTIVE: {m.Push: "push", m.Pull: "pull", m.Bye: "bye", m.Presence: "presence",
                   m.Ack: "ack", m.Delete: "delete", m.RevokeDevice: "revoke",
                   m.RegisterPush: "register_push", m.UnregisterPush: "unregister_push",
                   m.ContentRef: "content", m.ContentAck: "content"},
    State.CLOSING: {},
}
# 0k-sync refuses these as UnexpectedMessage; only a version-2 session may use them.
V2_ONLY = (m.ContentRef, m.ContentAck)
# Requests counted by the rate limiters (0k-sync limits Push and Pull only).
RATE_LIMITED = (m.Push, m.Pull)
# Our extension requests have a per-device bucket of their own: each one writes a durable
# Delta row (Join, Ack, Delete, Revoke, push registrations) or fans out to the group (Presence,
# ContentRef/Ack), so unmetered they would be a cheap way to make the relay commit or send.
CONTROL_LIMITED = (m.Join, m.Ack, m.Delete, m.RevokeDevice, m.RegisterPush, m.UnregisterPush,
                   m.Presence, m.ContentRef, m.ContentAck)


class Refused(Exception):
    """A request the relay does not carry out. `code` for clients that take ERROR."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Session:
    state: State = State.AWAIT_AUTH
    device_id: bytes | None = None
    group_id: bytes | None = None
    version: int = 1
    device_name: str = ""
    last_cursor: int = 0
    # The HELLO came as the seed spec's Envelope (engine/sync/envelope.py): replies take the
    # spec's form, refusals are ERROR whatever the version, CONTENT_REF is the spec's message.
    spec: bool = False

    def __repr__(self) -> str:   # ids identify people's devices and groups: not shown
        return f"Session(state={self.state.value}, version={self.version})"

    @classmethod
    def identified(cls, device_id: bytes) -> "Session":
        """The transport proved the identity (gateway): skip the challenge."""
        return cls(state=State.AWAIT_HELLO, device_id=device_id)

    def route(self, msg: m.Message) -> str:
        """The handler for `msg` in this state, or `Refused`."""
        handler = TABLE[self.state].get(type(msg))
        if handler is None or (isinstance(msg, V2_ONLY) and self.version < ERROR_VERSION
                               and not self.spec):
            if self.state in (State.AWAIT_AUTH, State.AWAIT_HELLO):
                raise Refused(Code.NOT_AUTHENTICATED, f"{msg.TAG} before HELLO")
            raise Refused(Code.UNEXPECTED_MESSAGE, f"{msg.TAG} not expected now")
        return handler

    def wants_error(self, request: m.Message | None, spec: bool = False) -> bool:
        """ERROR for this refusal, or the 0k-sync empty FIN. `spec`: the request came as an
        Envelope (002 §5.3 defines ERROR for every session; only 0k-sync's tagged form,
        whose clients depend on it, keeps the empty FIN)."""
        if spec or self.spec:
            return True
        if isinstance(request, m.Hello):
            return request.version >= ERROR_VERSION   # the HELLO that asks for it
        return self.version >= ERROR_VERSION or isinstance(request, m.EXTENSIONS)

    # --- transitions the shell makes once the effect succeeded ------------------------------
    def authenticated(self, device_id: bytes) -> None:
        assert self.state is State.AWAIT_AUTH
        self.device_id = device_id
        self.state = State.AWAIT_HELLO

    def check_hello(self, hello: m.Hello) -> None:
        if hello.version not in SUPPORTED_VERSIONS:
            raise Refused(Code.UNSUPPORTED_VERSION, "unsupported version")

    def activate(self, hello: m.Hello, device_name: str, spec: bool = False) -> None:
        assert self.state is State.AWAIT_HELLO
        self.spec = spec
        self.group_id = hello.group_id
        self.version = hello.version
        self.device_name = device_name
        self.last_cursor = hello.last_cursor
        self.state = State.ACTIVE

    def close(self) -> None:
        self.state = State.CLOSING
