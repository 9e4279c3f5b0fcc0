"""Heya wire format alone: client commands parsed byte by byte, server lines serialised.

Our contract is the Heya README (003) where it is explicit and the public server's code where
the README is silent or contradicts itself (`heya-interop.md`, cited "interop §"):

* A command starts with exactly 5 bytes: a verb and its space (`SEND `, `INCO `, `AUTH `,
  `DEAU `, `WANT `, `IOSA `, `IOSD `, `TRIM `, `EXTD `) or a whole argument-less command
  (`DALL\\n`, `PING\\n`, `LIST\\n`, `IOSL\\n`, `QUIT\\n`). Verbs are case-sensitive (interop §0).
* Tokens and digests are exactly 64 hex characters, upper- or lowercase on input; everything
  written is lowercase (interop §0).
* Numbers are 1 to 10 ASCII digits, leading zeros allowed, echoed as parsed (`0003` -> 3).
* Exactly one space between fields, `\\n` after the last one; no `\\r`, no trailing space.
* SEND is `SEND <token> <sha256> <len>\\n<len bytes>\\n`: no feature-flags field, and a `\\n`
  after the body, as the code and the README's diagram say (interop §4 #1, #2). GIVE likewise
  ends its body with `\\n`.
* IOSA / IOSD take 1-64 visible ASCII bytes (0x21-0x7e), the README's "up to 64 characters"
  (README "iOS Push notifications"); the public server's exactly-64-any-bytes single read is a
  bug (interop §5.14), and a real APNs token (64 hex characters) is accepted either way.

Anything else is malformed, and the parser says so as early as the bytes allow (a bad verb
prefix, a non-hex character, an 11th digit), so the shell closes at once instead of waiting.
A SEND whose length is over the configured cap is refused as soon as its header is complete,
before any body byte is buffered (interop §5.3).

Reprs never show tokens, digests or bodies: only sizes and numbers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

VERSION = 0                       # interop §2: `HEYA 0`
HEX_LEN = 64
TOKEN_LEN = 32
MAX_DIGITS = 10                   # interop §0: readUint(10, ...)
MAX_UINT = 10 ** MAX_DIGITS - 1   # 9,999,999,999
MAX_DEVICE_TOKEN = 64
SP, NL = 0x20, 0x0A

VERBS_WITH_ARGS = (b"SEND ", b"INCO ", b"AUTH ", b"DEAU ", b"WANT ", b"IOSA ", b"IOSD ",
                   b"TRIM ", b"EXTD ")
BARE_COMMANDS = (b"DALL\n", b"PING\n", b"LIST\n", b"IOSL\n", b"QUIT\n")
VERB_LEN = 5
_VERBS = VERBS_WITH_ARGS + BARE_COMMANDS
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")


class MalformedCommand(ValueError):
    """The bytes are not a Heya command; the connection is closed (README "SEND": "the server
    will close the connection"; interop §5.5)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class DigestMismatch(MalformedCommand):
    """A SEND body whose SHA-256 is not the digest it announced (README "Sending a message")."""

    def __init__(self) -> None:
        super().__init__("digest_mismatch")


class BodyTooLarge(MalformedCommand):
    """A SEND length over the configured cap (interop §5.3: the public server has none)."""

    def __init__(self, length: int):
        super().__init__("oversize")
        self.length = length


# --- client commands ---------------------------------------------------------------------------

@dataclass(frozen=True, repr=False)
class Inco:
    token: bytes                  # inbox token (32 bytes)

    def __repr__(self) -> str:
        return "Inco()"


@dataclass(frozen=True)
class Auth:
    start: int                    # unix seconds
    end: int


@dataclass(frozen=True, repr=False)
class Deau:
    token: bytes

    def __repr__(self) -> str:
        return "Deau()"


@dataclass(frozen=True, repr=False)
class Extd:
    token: bytes
    seconds: int

    def __repr__(self) -> str:
        return f"Extd(seconds={self.seconds})"


@dataclass(frozen=True)
class ListTokens:
    pass


@dataclass(frozen=True, repr=False)
class Send:
    token: bytes
    digest: bytes                 # 32 bytes, already checked against the body
    body: bytes

    def __repr__(self) -> str:
        return f"Send(body=<{len(self.body)} bytes>)"


@dataclass(frozen=True, repr=False)
class Want:
    token: bytes
    seq: int

    def __repr__(self) -> str:
        return f"Want(seq={self.seq})"


@dataclass(frozen=True, repr=False)
class Trim:
    token: bytes
    seq: int

    def __repr__(self) -> str:
        return f"Trim(seq={self.seq})"


@dataclass(frozen=True, repr=False)
class Iosa:
    device_token: str

    def __repr__(self) -> str:
        return f"Iosa(len={len(self.device_token)})"


@dataclass(frozen=True, repr=False)
class Iosd:
    device_token: str

    def __repr__(self) -> str:
        return f"Iosd(len={len(self.device_token)})"


@dataclass(frozen=True)
class Iosl:
    pass


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Dall:
    pass


@dataclass(frozen=True)
class Quit:
    pass


Command = (Inco | Auth | Deau | Extd | ListTokens | Send | Want | Trim | Iosa | Iosd | Iosl
           | Ping | Dall | Quit)

_BARE = {b"DALL\n": Dall(), b"PING\n": Ping(), b"LIST\n": ListTokens(), b"IOSL\n": Iosl(),
         b"QUIT\n": Quit()}


# --- parsing -------------------------------------------------------------------------------------

class _Incomplete(Exception):
    """Not enough bytes yet; nothing is consumed."""


class _Cursor:
    def __init__(self, buf: bytearray):
        self.buf = buf
        self.pos = 0

    def verb(self) -> bytes:
        head = bytes(self.buf[:VERB_LEN])
        if not any(v.startswith(head) for v in _VERBS):
            raise MalformedCommand("verb")
        if len(head) < VERB_LEN:
            raise _Incomplete
        self.pos = VERB_LEN
        return head

    def expect(self, byte: int) -> None:
        if self.pos >= len(self.buf):
            raise _Incomplete
        if self.buf[self.pos] != byte:
            raise MalformedCommand("separator")
        self.pos += 1

    def hex32(self, term: int) -> bytes:
        chunk = self.buf[self.pos:self.pos + HEX_LEN]
        if not _HEX.issuperset(chunk):
            raise MalformedCommand("hex")
        if len(chunk) < HEX_LEN:
            raise _Incomplete
        self.pos += HEX_LEN
        self.expect(term)
        return bytes.fromhex(chunk.decode("ascii"))

    def uint(self, term: int) -> int:
        start = i = self.pos
        n = len(self.buf)
        while i < n and self.buf[i] in _DIGITS:
            i += 1
            if i - start > MAX_DIGITS:
                raise MalformedCommand("number")
        if i == n:
            raise _Incomplete
        if i == start:
            raise MalformedCommand("number")
        value = int(self.buf[start:i])
        self.pos = i
        self.expect(term)
        return value

    def device_token(self) -> str:
        start = i = self.pos
        n = len(self.buf)
        while i < n and 0x21 <= self.buf[i] <= 0x7E:
            i += 1
            if i - start > MAX_DEVICE_TOKEN:
                raise MalformedCommand("device_token")
        if i == n:
            raise _Incomplete
        if i == start:
            raise MalformedCommand("device_token")
        value = self.buf[start:i].decode("ascii")
        self.pos = i
        self.expect(NL)
        return value


class CommandParser:
    """Incremental: `feed` bytes, then `next()` until it returns None (need more bytes).
    `next()` raises `MalformedCommand` for bytes that can never become a valid command; the
    parser is then unusable (the connection closes)."""

    def __init__(self, max_body: int):
        self.max_body = max_body
        self._buf = bytearray()
        self.body_remaining = 0   # bytes of a SEND body (and its `\n`) still to come
        self.body_length = 0      # length of the SEND body being received, 0 if none
        self.completed = 0        # commands parsed so far

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def partial(self) -> bool:
        """A command has started and is not complete (the shell's command deadline runs)."""
        return bool(self._buf)

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def next(self) -> Command | None:
        if not self._buf:
            return None
        c = _Cursor(self._buf)
        try:
            cmd = self._parse(c)
        except _Incomplete:
            return None
        del self._buf[:c.pos]
        self.body_remaining = self.body_length = 0
        self.completed += 1
        return cmd

    def _parse(self, c: _Cursor) -> Command:
        verb = c.verb()
        if verb in _BARE:
            return _BARE[verb]
        if verb == b"SEND ":
            token = c.hex32(SP)
            digest = c.hex32(SP)
            length = c.uint(NL)
            if length > self.max_body:
                raise BodyTooLarge(length)
            end = c.pos + length
            if len(self._buf) < end + 1:
                self.body_remaining = end + 1 - len(self._buf)
                self.body_length = length
                raise _Incomplete
            if self._buf[end] != NL:
                raise MalformedCommand("body_terminator")
            body = bytes(self._buf[c.pos:end])
            if hashlib.sha256(body).digest() != digest:
                raise DigestMismatch()
            c.pos = end + 1
            return Send(token, digest, body)
        if verb == b"INCO ":
            return Inco(c.hex32(NL))
        if verb == b"AUTH ":
            start = c.uint(SP)
            return Auth(start, c.uint(NL))
        if verb == b"DEAU ":
            return Deau(c.hex32(NL))
        if verb == b"EXTD ":
            token = c.hex32(SP)
            return Extd(token, c.uint(NL))
        if verb == b"WANT ":
            token = c.hex32(SP)
            return Want(token, c.uint(NL))
        if verb == b"TRIM ":
            token = c.hex32(SP)
            return Trim(token, c.uint(NL))
        if verb == b"IOSA ":
            return Iosa(c.device_token())
        if verb == b"IOSD ":
            return Iosd(c.device_token())
        raise AssertionError(verb)   # every verb in _VERBS is handled above


# --- server lines --------------------------------------------------------------------------------

def _line(*fields: bytes | str | int) -> bytes:
    parts = []
    for f in fields:
        if isinstance(f, bytes):
            parts.append(f.hex().encode("ascii"))   # tokens and digests: lowercase hex
        elif isinstance(f, int):
            parts.append(b"%d" % f)
        else:
            parts.append(f.encode("ascii"))
    return b" ".join(parts) + b"\n"


def greeting(last: list[tuple[bytes, int]]) -> bytes:
    """`HEYA 0`, one `LAST <token> <next_seq>` per send token of a mailbox (interop §2: the
    value is next_seq, i.e. newest seq + 1, 0 for an empty token), then `DONE`."""
    return (_line("HEYA", VERSION) + b"".join(_line("LAST", t, n) for t, n in last)
            + _line("DONE"))


def have(token: bytes, next_seq: int) -> bytes:
    """interop §3 HAVE: the value is newest seq + 1 (the README's `HAVE [seq]` is garbled)."""
    return _line("HAVE", token, next_seq)


def recv(digest: bytes) -> bytes:
    return _line("RECV", digest)


def inco(token: bytes) -> bytes:
    return _line("INCO", token)


def auth(token: bytes, start: int, end: int) -> bytes:
    return _line("AUTH", token, start, end)


def deau(token: bytes) -> bytes:
    return _line("DEAU", token)


def extd(token: bytes, new_end: int) -> bytes:
    return _line("EXTD", token, new_end)


def list_tokens(entries: list[tuple[bytes, int, int, int]]) -> bytes:
    """`LIST <n>` then n x `<token> <next_seq> <start> <end>` (interop §3 LIST)."""
    return _line("LIST", len(entries)) + b"".join(_line(*e) for e in entries)


def give(token: bytes, seq: int, body: bytes) -> bytes:
    return _line("GIVE", token, seq, len(body)) + body + b"\n"


def gone(token: bytes, seq: int) -> bytes:
    return _line("GONE", token, seq)


def trim(token: bytes, seq: int, count: int) -> bytes:
    return _line("TRIM", token, seq, count)


def iosa(device_token: str) -> bytes:
    return _line("IOSA", device_token)


def iosd(device_token: str) -> bytes:
    return _line("IOSD", device_token)


def iosl(entries: list[tuple[str, int]]) -> bytes:
    """`IOSL <n>` then n x `<device-token> <registered unix seconds>` (interop §3 IOSL)."""
    return _line("IOSL", len(entries)) + b"".join(_line(t, at) for t, at in entries)


def pong() -> bytes:
    return _line("PONG")


def dall() -> bytes:
    return _line("DALL")
