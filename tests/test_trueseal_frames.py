"""trueseal frames byte by byte against the tables of 000 "Wire Format" and interop §4."""

import hashlib

import pytest

from engine.noise_session import LengthPrefixDeframer, frame_message
from engine.trueseal import frames as F
from engine.trueseal.ids import event_id

R = bytes(range(32))


def hdr(tag: int, n: int) -> bytes:
    return bytes([tag]) + n.to_bytes(4, "big")


# --- parse ------------------------------------------------------------------------------------
def test_tags_match_the_spec_table():
    assert [(t.name, t.value) for t in F.Tag] == [
        ("PUSH", 1), ("DELIVER", 2), ("HEARTBEAT", 3), ("ACK", 4), ("ERROR", 5), ("DELIVER_ACK", 6)]


def test_parse_push():
    env = b"\xde\xad\xbe\xef" * 10
    f = F.parse(bytes([0x01]) + (32 + len(env)).to_bytes(4, "big") + R + env)
    assert f == F.Push(R, env)


def test_parse_push_with_empty_envelope():
    assert F.parse(hdr(1, 32) + R) == F.Push(R, b"")


@pytest.mark.parametrize("n", [0, 1, 31])
def test_push_body_under_32_is_a_short_push_not_a_parse_error(n):
    # 000: "A Push body shorter than 32 bytes is malformed. The relay must reject it with an Error"
    assert F.parse(hdr(1, n) + R[:n]) == F.ShortPush(n)


def test_parse_deliver():
    f = F.parse(hdr(2, 8 + 3) + (2**64 - 2).to_bytes(8, "big") + b"abc")
    assert f == F.Deliver(2**64 - 2, b"abc")


def test_parse_deliver_needs_a_blob_id():
    with pytest.raises(F.MalformedFrame):
        F.parse(hdr(2, 7) + b"\x00" * 7)


def test_parse_deliver_ack():
    assert F.parse(bytes([6, 0, 0, 0, 8]) + bytes([0, 0, 0, 0, 0, 0, 1, 2])) == F.DeliverAck(258)


@pytest.mark.parametrize("n", [0, 7, 9])
def test_deliver_ack_body_must_be_exactly_8(n):
    with pytest.raises(F.MalformedFrame):
        F.parse(hdr(6, n) + b"\x01" * n)


@pytest.mark.parametrize("tag,cls", [(3, F.Heartbeat), (4, F.Ack), (5, F.Error)])
def test_parse_empty_frames(tag, cls):
    assert F.parse(bytes([tag, 0, 0, 0, 0])) == cls()


@pytest.mark.parametrize("tag", [3, 4, 5])
def test_empty_frames_with_a_body_are_malformed(tag):
    with pytest.raises(F.MalformedFrame):
        F.parse(hdr(tag, 1) + b"x")


@pytest.mark.parametrize("data", [b"", b"\x03", b"\x03\x00\x00\x00"])
def test_fewer_than_5_bytes_is_malformed(data):
    with pytest.raises(F.MalformedFrame):
        F.parse(data)


@pytest.mark.parametrize("tag", [0x00, 0x07, 0x7F, 0xFF])
def test_unknown_tag_is_malformed(tag):
    with pytest.raises(F.UnknownTag):
        F.parse(bytes([tag, 0, 0, 0, 0]))
    assert issubclass(F.UnknownTag, F.MalformedFrame)


def test_body_shorter_than_len_is_malformed():
    with pytest.raises(F.MalformedFrame):
        F.parse(hdr(1, 100) + R + b"x" * 67)   # 99 of 100 bytes
    with pytest.raises(F.MalformedFrame):
        F.parse(bytes([1, 0xFF, 0xFF, 0xFF, 0xFF]) + R)


def test_trailing_bytes_after_5_plus_len_are_ignored():
    # interop §4: the real parsers ignore them, so a second frame in one message is lost.
    data = hdr(1, 33) + R + b"a" + bytes([0x03, 0, 0, 0, 0])
    assert F.parse(data) == F.Push(R, b"a")
    assert F.parse(bytes([3, 0, 0, 0, 0]) + b"junk") == F.Heartbeat()


# --- serialize -------------------------------------------------------------------------------
def test_serialize_matches_the_spec_bytes():
    assert F.serialize(F.Ack()) == b"\x04\x00\x00\x00\x00"
    assert F.serialize(F.Error()) == b"\x05\x00\x00\x00\x00"
    assert F.serialize(F.Heartbeat()) == b"\x03\x00\x00\x00\x00"
    assert F.serialize(F.Deliver(1, b"xy")) == (
        b"\x02\x00\x00\x00\x0a" + b"\x00\x00\x00\x00\x00\x00\x00\x01" + b"xy")
    assert F.serialize(F.DeliverAck(2**64 - 1)) == b"\x06\x00\x00\x00\x08" + b"\xff" * 8
    assert F.serialize(F.Push(R, b"e")) == b"\x01\x00\x00\x00\x21" + R + b"e"


def test_serialize_refuses_what_cannot_be_on_the_wire():
    with pytest.raises(ValueError):
        F.serialize(F.Push(b"short", b""))
    with pytest.raises(TypeError):
        F.serialize(F.ShortPush(3))


def test_reprs_show_no_envelope_bytes():
    env = b"SECRETSECRET"
    for f in (F.Push(R, env), F.Deliver(9, env)):
        assert "SECRET" not in repr(f) and env.hex() not in repr(f)
        assert "12 bytes" in repr(f)
    assert R.hex() not in repr(F.Push(R, env))


# --- u16 length prefix (interop §2) -------------------------------------------------------------
def test_frame_message_prefix():
    assert frame_message(b"abc") == b"\x00\x03abc"
    assert frame_message(b"x" * 65535)[:2] == b"\xff\xff"
    with pytest.raises(ValueError):
        frame_message(b"x" * 65536)


def test_deframer_handles_any_split():
    stream = b"\x00\x03abc" + b"\x00\x00" + b"\x01\x00" + b"z" * 256
    for cut in range(len(stream) + 1):
        d = LengthPrefixDeframer()
        got = d.feed(stream[:cut]) + d.feed(stream[cut:])
        assert got == [b"abc", b"", b"z" * 256]
        assert d.pending == 0


def test_deframer_one_byte_at_a_time_and_pending():
    d = LengthPrefixDeframer()
    out = []
    for b in b"\x00\x02hi\x00\x05wor":
        out += d.feed(bytes([b]))
    assert out == [b"hi"]
    assert d.pending == 5     # a truncated record is visible at EOF


# --- event ids ----------------------------------------------------------------------------------
def test_event_id_is_blake2b_256_with_person():
    ref = hashlib.blake2b(R + b"env", digest_size=32, person=b"trueseal.evt.v1").digest()
    assert event_id(R, b"env") == ref
    assert len(ref) == 32
    assert event_id(R, b"env") == event_id(bytes(R), bytearray(b"env"))   # a retry is a duplicate
    assert event_id(R, b"env") != event_id(R, b"env2")
    assert event_id(R, b"env") != event_id(bytes(31) + b"\x01", b"env")
    assert event_id(R, b"env") != hashlib.blake2b(R + b"env", digest_size=32).digest()
    with pytest.raises(ValueError):
        event_id(b"short", b"")
