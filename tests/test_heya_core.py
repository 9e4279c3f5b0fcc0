"""The Heya wire format and session core, byte by byte from the specs, with no server running.

Every line is written out literally from the README (003) and heya-interop.md; the tokens are
fixed test values so the expected bytes can be read in the assertions.
"""

from __future__ import annotations

import hashlib

import pytest

from engine.heya import frames
from engine.heya.events import CloseReason, CommandReceived, ConnectionClosed
from engine.heya.frames import (Auth, CommandParser, Dall, Deau, Extd, Inco, Iosa, Iosd, Iosl,
                                ListTokens, MalformedCommand, Send, Trim, Want)
from engine.heya.session import COMMANDS, HeyaSession, Identity, Phase

T = bytes(range(32))                       # a send token
T_HEX = T.hex().encode()                   # 000102...1f
I = bytes([0xAB]) * 32                     # an inbox token
HELLO_SHA = b"2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"   # sha256("hello")


def ready(mailbox=False, last=(), max_body=1024) -> HeyaSession:
    s = HeyaSession(max_body=max_body)
    s.greet(list(last), mailbox)
    return s


def commands(s: HeyaSession):
    return [e for e in s.events_received() if isinstance(e, CommandReceived)]


# --- wire format -----------------------------------------------------------------------------

def parse_all(data: bytes, max_body=1024):
    p = CommandParser(max_body)
    p.feed(data)
    out = []
    while (c := p.next()) is not None:
        out.append(c)
    return out, p


def test_every_command_parses_as_the_interop_grammar_says():
    data = (b"INCO " + I.hex().upper().encode() + b"\n"        # uppercase hex accepted (§0)
            + b"AUTH 0 2220385707\n"
            + b"DEAU " + T_HEX + b"\n"
            + b"EXTD " + T_HEX + b" 0003\n"                     # leading zeros (§0)
            + b"LIST\n"
            + b"SEND " + T_HEX + b" " + HELLO_SHA + b" 5\nhello\n"
            + b"WANT " + T_HEX + b" 0\n"
            + b"TRIM " + T_HEX + b" 9999999999\n"                # 10 digits: the maximum
            + b"IOSA 1234567812345678123456781234567812345678123456781234567812345678\n"
            + b"IOSD abc\n"                                      # README: "up to 64 characters"
            + b"IOSL\nPING\nDALL\nQUIT\n")
    got, p = parse_all(data)
    assert got == [Inco(I), Auth(0, 2220385707), Deau(T), Extd(T, 3), ListTokens(),
                   Send(T, hashlib.sha256(b"hello").digest(), b"hello"), Want(T, 0),
                   Trim(T, 9999999999),
                   Iosa("1234567812345678123456781234567812345678123456781234567812345678"),
                   Iosd("abc"), Iosl(), frames.Ping(), Dall(), frames.Quit()]
    assert not p.partial


def test_zero_length_body_and_split_delivery():
    empty_sha = hashlib.sha256(b"").hexdigest().encode()
    data = b"SEND " + T_HEX + b" " + empty_sha + b" 0\n\n"
    p = CommandParser(10)
    for i in range(len(data) - 1):             # one byte at a time: never early, never wrong
        p.feed(data[i:i + 1])
        assert p.next() is None and p.partial
    p.feed(data[-1:])
    assert p.next() == Send(T, hashlib.sha256(b"").digest(), b"")


@pytest.mark.parametrize("data, reason", [
    (b"ping\n", "verb"),                            # verbs are case-sensitive (§0)
    (b"PING \n", "verb"),                           # PING then anything but \n
    (b"PINGX", "verb"),
    (b"XY", "verb"),                                # refused before 5 bytes arrive
    (b"INCO " + b"g" * 64 + b"\n", "hex"),
    (b"INCO " + T_HEX[:63] + b"\n", "hex"),         # 63 hex chars then \n
    (b"INCO " + T_HEX + b" \n", "separator"),       # trailing space
    (b"INCO " + T_HEX + b"\r\n", "separator"),      # no \r
    (b"AUTH  1 2\n", "number"),                     # two spaces: an empty field
    (b"AUTH 1 12345678901\n", "number"),            # 11 digits
    (b"AUTH -1 2\n", "number"),
    (b"AUTH 1 2 \n", "separator"),
    (b"WANT " + T_HEX + b" x\n", "number"),
    (b"IOSA \n", "device_token"),
    (b"IOSA a b\n", "separator"),                   # a space inside the token (§5.14)
    (b"IOSA " + b"a" * 65 + b"\n", "device_token"),
    (b"SEND " + T_HEX + b" " + HELLO_SHA + b" 5\nhelloX", "body_terminator"),
    (b"SEND " + T_HEX + b" " + HELLO_SHA + b" 5\nHELLO\n", "digest_mismatch"),
    (b"SEND " + T_HEX + b" " + HELLO_SHA + b" 2000\n", "oversize"),   # before any body byte
])
def test_malformed_commands_are_refused_as_early_as_possible(data, reason):
    p = CommandParser(1024)
    p.feed(data)
    with pytest.raises(MalformedCommand) as exc:
        p.next()
    assert exc.value.reason == reason


def test_server_lines_are_lowercase_hex_and_decimal():
    assert frames.greeting([(T, 3)]) == b"HEYA 0\nLAST " + T_HEX + b" 3\nDONE\n"
    assert frames.greeting([]) == b"HEYA 0\nDONE\n"
    assert frames.recv(hashlib.sha256(b"hello").digest()) == b"RECV " + HELLO_SHA + b"\n"
    assert frames.inco(I) == b"INCO " + b"ab" * 32 + b"\n"
    assert frames.auth(T, 0, 2220385707) == b"AUTH " + T_HEX + b" 0 2220385707\n"
    assert frames.extd(T, 2220386707) == b"EXTD " + T_HEX + b" 2220386707\n"
    assert frames.deau(T) == b"DEAU " + T_HEX + b"\n"
    assert frames.list_tokens([(T, 0, 0, 2220385707)]) == (
        b"LIST 1\n" + T_HEX + b" 0 0 2220385707\n")
    assert frames.list_tokens([]) == b"LIST 0\n"
    assert frames.have(T, 1) == b"HAVE " + T_HEX + b" 1\n"
    assert frames.give(T, 2, b"maxi") == b"GIVE " + T_HEX + b" 2 4\nmaxi\n"
    assert frames.gone(T, 1) == b"GONE " + T_HEX + b" 1\n"
    assert frames.trim(T, 1, 2) == b"TRIM " + T_HEX + b" 1 2\n"
    assert frames.iosl([("abc", 1700000000)]) == b"IOSL 1\nabc 1700000000\n"
    assert frames.pong() == b"PONG\n" and frames.dall() == b"DALL\n"


def test_reprs_show_no_secrets():
    text = repr([Inco(I), Deau(T), Send(T, b"\x01" * 32, b"secret body"), Want(T, 1),
                 Iosa("devicetoken")])
    for secret in (I.hex(), T.hex(), "secret body", "devicetoken", repr(T)[:20]):
        assert secret not in text


# --- session core ----------------------------------------------------------------------------

def test_greeting_then_pipelined_commands_run_after_done():
    s = HeyaSession(max_body=16)
    s.receive_data(b"PING\nLIST\n")            # arrived before the greeting was written
    assert s.data_to_send() == b"" and s.events_received() == []
    s.greet([(T, 3)], mailbox=True)
    assert s.data_to_send() == b"HEYA 0\nLAST " + T_HEX + b" 3\nDONE\nPONG\n"
    (cmd,) = commands(s)
    assert cmd.command == ListTokens()
    s.reply(cmd.request_id, frames.list_tokens([]))
    assert s.data_to_send() == b"LIST 0\n"


def test_last_lines_only_for_a_mailbox():
    s = ready(mailbox=False, last=[(T, 3)])
    assert s.data_to_send() == b"HEYA 0\nDONE\n"


def test_replies_keep_command_order_and_have_never_splits_a_reply():
    s = ready(mailbox=True)
    s.data_to_send()
    s.receive_data(b"SEND " + T_HEX + b" " + HELLO_SHA + b" 5\nhello\n"
                   + b"WANT " + T_HEX + b" 0\nPING\n")
    send, want = commands(s)
    s.reply(want.request_id, frames.give(T, 0, b"hello"))   # finished first, held back
    assert s.data_to_send() == b""
    assert s.have(T, 1)                                    # HAVE at any time, whole
    assert s.data_to_send() == b"HAVE " + T_HEX + b" 1\n"
    s.reply(send.request_id, frames.recv(send.command.digest))
    assert s.data_to_send() == (b"RECV " + HELLO_SHA + b"\nGIVE " + T_HEX + b" 0 5\nhello\n"
                                + b"PONG\n")
    assert not s.have(T, 1), "a HAVE that says nothing new is suppressed"
    assert s.have(T, 2)


def test_have_suppressed_below_last_and_before_done_and_after_quit():
    s = HeyaSession(max_body=16)
    assert not s.have(T, 1)                    # before the greeting
    s.greet([(T, 3)], mailbox=True)
    assert not s.have(T, 3) and s.have(T, 4)
    s.receive_data(b"QUIT\n")
    assert s.closed and s.close_reason is CloseReason.QUIT
    assert not s.have(T, 5)


def test_quit_writes_owed_replies_then_closes_and_ignores_the_rest():
    s = ready()
    s.data_to_send()
    s.receive_data(b"LIST\nQUIT\nPING\n")
    (cmd,) = commands(s)
    assert s.phase is Phase.DRAINING
    s.reply(cmd.request_id, frames.list_tokens([]))
    assert s.data_to_send() == b"LIST 0\n"
    assert s.closed and s.close_reason is CloseReason.QUIT


def test_malformed_command_closes_after_earlier_replies():
    s = ready()
    s.data_to_send()
    s.receive_data(b"LIST\nping\nPING\n")
    (cmd,) = commands(s)
    assert not s.closed
    s.reply(cmd.request_id, frames.list_tokens([]))
    assert s.data_to_send() == b"LIST 0\n"
    assert s.closed and s.close_reason is CloseReason.MALFORMED
    assert [e for e in s.events_received() if isinstance(e, ConnectionClosed)]


def test_wrong_digest_closes_and_nothing_is_reported_to_store():
    s = ready()
    s.data_to_send()
    s.receive_data(b"SEND " + T_HEX + b" " + HELLO_SHA + b" 5\nhellO\n")
    assert s.closed and s.close_reason is CloseReason.DIGEST_MISMATCH
    assert commands(s) == [] and s.data_to_send() == b""


def test_refuse_closes_and_later_commands_are_not_live():
    s = ready(mailbox=True)
    s.data_to_send()
    s.receive_data(b"DEAU " + T_HEX + b"\nLIST\n")
    deau, lst = commands(s)
    s.refuse(deau.request_id)
    assert s.closed and s.close_reason is CloseReason.REFUSED
    assert not s.is_live(lst.request_id)
    s.reply(lst.request_id, b"LIST 0\n")       # a late answer is dropped, not an error
    assert s.data_to_send() == b""


@pytest.mark.parametrize("line", [b"AUTH 0 1\n", b"DALL\n", b"IOSL\n", b"TRIM " + T_HEX + b" 1\n",
                                  b"IOSA abc\n", b"EXTD " + T_HEX + b" 1\n"])
def test_mailbox_commands_from_a_sender_close(line):
    s = ready(mailbox=False)
    s.data_to_send()
    s.receive_data(line)
    assert s.closed and s.close_reason is CloseReason.NOT_ALLOWED and commands(s) == []


def test_identity_follows_inco_and_dall():
    s = ready(mailbox=False)
    s.receive_data(b"INCO " + I.hex().encode() + b"\nAUTH 0 1\nDALL\nINCO " + I.hex().encode()
                   + b"\n")
    assert [type(c.command) for c in commands(s)] == [Inco, Auth, Dall, Inco]
    assert s.identity is Identity.MAILBOX
    s2 = ready(mailbox=True)
    s2.receive_data(b"INCO " + I.hex().encode() + b"\n")   # already a mailbox (interop §3)
    assert s2.closed and s2.close_reason is CloseReason.NOT_ALLOWED


def test_eof_inside_a_command_is_truncated_and_between_commands_drains():
    s = ready()
    s.receive_data(b"LIS")
    s.receive_eof()
    assert s.closed and s.close_reason is CloseReason.TRUNCATED
    s = ready()
    s.receive_data(b"LIST\n")
    (cmd,) = commands(s)
    s.receive_eof()
    assert s.phase is Phase.DRAINING
    s.reply(cmd.request_id, b"LIST 0\n")
    assert s.closed and s.close_reason is CloseReason.EOF


def test_state_table_covers_every_command():
    assert set(COMMANDS) == {Inco, Auth, Deau, Extd, ListTokens, Send, Want, Trim, Iosa, Iosd,
                             Iosl, frames.Ping, Dall, frames.Quit}
