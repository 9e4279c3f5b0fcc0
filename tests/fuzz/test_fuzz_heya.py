"""Fuzz Heya: the command parser (`engine.heya.frames.CommandParser`) and the connection core
(`engine.heya.session.HeyaSession`) fed bytes, cut at random places.

Contract (003 and heya-interop §0): the parser returns whole commands or raises
`MalformedCommand` (its subclasses `DigestMismatch`, `BodyTooLarge` included) and nothing else;
it never holds more than one SEND header plus `max_body` bytes of an unfinished command; a
stream of valid commands, written here from the README's byte layout and cut anywhere, parses
to exactly those commands. The session core never raises on any bytes, whatever order its
shell answers in: it reports commands and at most one ConnectionClosed (the last event),
answers in command order, and goes silent once closed.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import strategies as st

from engine.heya import frames as F
from engine.heya.events import CommandReceived, ConnectionClosed
from engine.heya.session import HeyaSession
from fuzzing import fuzz_target
from mutations import mutated

pytestmark = pytest.mark.fuzz

MAX_BODY = 512
# the longest command head the parser may hold before refusing or completing it:
# "SEND " + token + " " + digest + " " + 10 digits + "\n"
MAX_HEAD = 5 + 64 + 1 + 64 + 1 + 10 + 1

hex32 = st.binary(min_size=32, max_size=32)
uint = st.integers(0, F.MAX_UINT)
device_token = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1,
                       max_size=64)


@st.composite
def hex_text(draw, raw: bytes) -> bytes:
    """Hex in either case, per character (interop §0: accepted either way)."""
    text = raw.hex()
    upper = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if u else c for c, u in zip(text, upper)).encode()


@st.composite
def number(draw, value: int) -> bytes:
    """1 to 10 digits, leading zeros allowed (interop §0 readUint(10, ...))."""
    digits = str(value)
    pad = draw(st.integers(0, F.MAX_DIGITS - len(digits)))
    return ("0" * pad + digits).encode()


@st.composite
def valid_command(draw) -> tuple[bytes, F.Command]:
    kind = draw(st.sampled_from(("SEND", "INCO", "AUTH", "DEAU", "EXTD", "WANT", "TRIM", "IOSA",
                                 "IOSD", "DALL", "PING", "LIST", "IOSL", "QUIT")))
    if kind == "SEND":
        token, body = draw(hex32), draw(st.binary(max_size=MAX_BODY))
        digest = hashlib.sha256(body).digest()
        return (b"SEND %s %s %s\n" % (draw(hex_text(token)), draw(hex_text(digest)),
                                      draw(number(len(body)))) + body + b"\n",
                F.Send(token, digest, body))
    if kind in ("INCO", "DEAU"):
        token = draw(hex32)
        cls = F.Inco if kind == "INCO" else F.Deau
        return b"%s %s\n" % (kind.encode(), draw(hex_text(token))), cls(token)
    if kind == "AUTH":
        start, end = draw(uint), draw(uint)
        return b"AUTH %s %s\n" % (draw(number(start)), draw(number(end))), F.Auth(start, end)
    if kind in ("EXTD", "WANT", "TRIM"):
        token, n = draw(hex32), draw(uint)
        cls = {"EXTD": F.Extd, "WANT": F.Want, "TRIM": F.Trim}[kind]
        return b"%s %s %s\n" % (kind.encode(), draw(hex_text(token)), draw(number(n))), cls(
            token, n)
    if kind in ("IOSA", "IOSD"):
        tok = draw(device_token)
        cls = F.Iosa if kind == "IOSA" else F.Iosd
        return b"%s %s\n" % (kind.encode(), tok.encode()), cls(tok)
    bare = {"DALL": F.Dall(), "PING": F.Ping(), "LIST": F.ListTokens(), "IOSL": F.Iosl(),
            "QUIT": F.Quit()}
    return kind.encode() + b"\n", bare[kind]


valid_stream = st.lists(valid_command(), max_size=6).map(
    lambda cmds: (b"".join(b for b, _ in cmds), [c for _, c in cmds]))

streams = st.one_of(
    valid_stream,
    st.binary(max_size=400).map(lambda b: (b, None)),
    mutated(valid_stream.map(lambda s: s[0])).map(lambda b: (b, None)),
    # a SEND header announcing a body over the cap, then some of it
    st.tuples(hex32, st.integers(MAX_BODY + 1, F.MAX_UINT), st.binary(max_size=64)).map(
        lambda t: (b"SEND %s %s %d\n" % (t[0].hex().encode(), t[0].hex().encode(), t[1])
                   + t[2], None)),
)


def cuts(data: bytes):
    """The same bytes cut into chunks at drawn places (a TCP stream may split anywhere)."""
    return st.lists(st.integers(0, len(data)), max_size=8).map(
        lambda points: [data[a:b] for a, b in zip([0, *sorted(points)],
                                                  [*sorted(points), len(data)])])


@fuzz_target(case=streams.flatmap(lambda s: st.tuples(st.just(s), cuts(s[0]))))
def test_heya_command_parser(case):
    (data, expected), chunks = case
    parser = F.CommandParser(MAX_BODY)
    got: list = []
    failed = None
    for chunk in chunks:
        parser.feed(chunk)
        try:
            while (cmd := parser.next()) is not None:
                assert isinstance(cmd, F.Command.__args__), type(cmd)
                got.append(cmd)
        except F.MalformedCommand as e:
            assert isinstance(e.reason, str) and e.reason
            failed = e
            break
        # only the unfinished command is held, and it is bounded
        assert parser.buffered <= MAX_HEAD + MAX_BODY + 1, parser.buffered
    if expected is not None:
        assert failed is None, failed
        assert got == expected
        assert parser.buffered == 0
    for cmd in got:
        if isinstance(cmd, F.Send):
            assert hashlib.sha256(cmd.body).digest() == cmd.digest
            assert len(cmd.body) <= MAX_BODY


# --- the session core --------------------------------------------------------------------------

@st.composite
def session_script(draw):
    """Bytes for the session, cut into chunks, and the shell's choices: when to greet, whether
    the certificate is a mailbox, which commands to answer in which order, EOF at the end."""
    data, _ = draw(streams)
    chunks = draw(cuts(data))
    return {
        "chunks": chunks,
        "greet_after": draw(st.integers(0, len(chunks))),
        "mailbox": draw(st.booleans()),
        "answers": draw(st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=30)),
        "haves": draw(st.lists(st.tuples(hex32, st.integers(0, 5)), max_size=3)),
        "eof": draw(st.booleans()),
    }


@fuzz_target(script=session_script())
def test_heya_session(script):
    s = HeyaSession(max_body=MAX_BODY)
    events: list = []
    owed: list[int] = []
    answers = iter(script["answers"])
    out = bytearray()

    def drain():
        for ev in s.events_received():
            assert isinstance(ev, (CommandReceived, ConnectionClosed)), ev
            assert not any(isinstance(e, ConnectionClosed) for e in events), "event after close"
            events.append(ev)
            if isinstance(ev, CommandReceived):
                assert isinstance(ev.command, F.Command.__args__)
                owed.append(ev.request_id)
        out.extend(s.data_to_send())

    def shell_turn():
        # answer some owed commands, in an order the script picks
        for pick, ok in answers:
            if not owed:
                return
            rid = owed.pop(pick % len(owed))
            if not s.is_live(rid):
                continue
            if ok:
                s.reply(rid, b"R %d\n" % rid)
            else:
                s.refuse(rid)
            drain()
            if len(owed) % 2:
                break

    for i, chunk in enumerate(script["chunks"]):
        if i == script["greet_after"]:
            s.greet([], script["mailbox"])
            drain()
        s.receive_data(chunk)
        drain()
        shell_turn()
        for token, n in script["haves"]:
            s.have(token, n)
        drain()
    if s.phase.name == "GREETING" and not s.closed:
        s.greet([], script["mailbox"])
        drain()
    if script["eof"]:
        s.receive_eof()
        drain()
    shell_turn()
    for rid in list(owed):   # a shell answers everything in the end
        if s.is_live(rid):
            s.reply(rid, b"R %d\n" % rid)
        drain()

    closed = [e for e in events if isinstance(e, ConnectionClosed)]
    assert len(closed) <= 1
    if s.closed:
        before = len(events)
        s.receive_data(b"PING\n")
        s.receive_eof()
        drain()
        assert len(events) == before and not s.data_to_send()
    # replies in command order, whatever order the shell answered in
    if out:
        assert out.startswith(b"HEYA 0\n"), bytes(out[:20])
    replied = [int(line.split()[1]) for line in bytes(out).split(b"\n")
               if line.startswith(b"R ")]
    assert replied == sorted(replied)
