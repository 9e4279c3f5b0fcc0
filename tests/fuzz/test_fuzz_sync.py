"""Fuzz cursor-sync messages (`engine.sync.messages`) and their stream framing
(`engine.sync.framing.FrameReader`).

Contract (cursor-sync-interop §1.2-1.3): `decode` returns a message or raises `DecodeError`,
nothing else; a message it returns re-encodes to bytes that decode to the same message, and its
fields have exactly their wire types (bytes for byte arrays and blob ids, int that is not a
bool, str); a message built from the interop layout tables (written out here as MessagePack
arrays and as the map form) decodes to itself, and `decode(encode(m)) == m`. The golden vectors
of interop §1.3 are regression examples. `FrameReader` yields whole bodies or raises
`FrameError`, never buffers past one frame's declared length, and refuses an oversize prefix
before its body arrives.
"""

from __future__ import annotations

import pytest
from hypothesis import example
from hypothesis import strategies as st

from engine.sync import messages as M
from engine.sync.framing import FrameError, FrameReader
from fuzzing import fuzz_target
from mutations import bend_object, msgpack_values, mutated, pack

pytestmark = pytest.mark.fuzz

u8, u32, u64 = st.integers(0, 255), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
blob = st.binary(min_size=16, max_size=16)
small = st.binary(max_size=40)


def arr(b: bytes) -> list[int]:
    """`[u8; N]` / `Vec<u8>`: an array of uints, not bin (interop §1.3)."""
    return list(b)


def fixed(n):
    return st.binary(min_size=n, max_size=n)


# (wire array after the tag, the message) per layout row of interop §1.3 and the extensions
LAYOUTS = {
    M.Hello: st.builds(lambda v, n, g, c: ([v, n, arr(g), c], M.Hello(v, n, g, c)),
                       u8, st.text(max_size=20), fixed(32), u64),
    M.Welcome: st.builds(lambda v, c, p: ([v, c, p], M.Welcome(v, c, p)), u8, u64, u32),
    M.Push: st.builds(lambda b, p, t: ([b, arr(p), t], M.Push(b, p, t)), blob, small, u32),
    M.PushAck: st.builds(lambda b, c: ([b, c], M.PushAck(b, c)), blob, u64),
    M.Pull: st.builds(lambda a, n: ([a, n], M.Pull(a, n)), u64, u32),
    M.PullResponse: st.builds(
        lambda blobs, more, mx: ([[[b, c, arr(p), t] for b, c, p, t in blobs], more, mx],
                                 M.PullResponse([M.PullBlob(*x) for x in blobs], more, mx)),
        st.lists(st.tuples(blob, u64, small, u64), max_size=3), st.booleans(), u64),
    M.Notify: st.builds(lambda c, n: ([c, n], M.Notify(c, n)), u64, u32),
    M.Bye: st.builds(lambda r: ([r], M.Bye(r)), st.none() | st.text(max_size=20)),
    M.ContentRef: st.builds(lambda h, n, a, b: ([arr(h), arr(n), a, b], M.ContentRef(h, n, a, b)),
                            fixed(32), fixed(24), u64, u64),
    M.ContentAck: st.builds(lambda h: ([arr(h)], M.ContentAck(h)), fixed(32)),
    M.Auth: st.builds(lambda v: ([v], M.Auth(v)), u8),
    M.AuthChallenge: st.builds(lambda n: ([arr(n)], M.AuthChallenge(n)), fixed(32)),
    M.AuthProof: st.builds(lambda d, s: ([arr(d), arr(s)], M.AuthProof(d, s)),
                           fixed(32), fixed(64)),
    M.Join: st.builds(lambda g, a, e, s: ([arr(g), arr(a), e, arr(s)], M.Join(g, a, e, s)),
                      fixed(32), fixed(32), u64, fixed(64)),
    M.Done: st.builds(lambda r: ([r], M.Done(r)), st.text(max_size=20)),
    M.Error: st.builds(lambda c, m: ([c, m], M.Error(c, m)), u32, st.text(max_size=20)),
    M.Presence: st.builds(lambda o: ([o], M.Presence(o)), st.booleans()),
    M.PresenceList: st.builds(
        lambda ds: ([[[arr(d), n, o, t] for d, n, o, t in ds]],
                    M.PresenceList([M.PresenceEntry(*x) for x in ds])),
        st.lists(st.tuples(fixed(32), st.text(max_size=10), st.booleans(), u64), max_size=3)),
    M.Ack: st.builds(lambda c: ([c], M.Ack(c)), u64),
    M.Delete: st.builds(lambda b: ([b], M.Delete(b)), blob),
    M.RevokeDevice: st.builds(lambda d: ([arr(d)], M.RevokeDevice(d)), fixed(32)),
    M.DeviceRevoked: st.builds(lambda d: ([arr(d)], M.DeviceRevoked(d)), fixed(32)),
    M.RegisterPush: st.builds(lambda p, t: ([p, t], M.RegisterPush(p, t)),
                              st.text(max_size=10), st.text(max_size=30)),
    M.UnregisterPush: st.builds(lambda p, t: ([p, t], M.UnregisterPush(p, t)),
                                st.text(max_size=10), st.text(max_size=30)),
}
assert set(LAYOUTS) == set(M.BY_TAG.values()) - {M.PullBlob, M.PresenceEntry}


def _tagged(cls, case):
    fields, msg = case
    return [cls.TAG, *fields], msg


def _as_map(cls, case):
    """The map form serde also accepts: {"type": tag, field: value, ...}."""
    fields, msg = case
    names = [f for f in msg.__dataclass_fields__]
    return {"type": cls.TAG, **dict(zip(names, fields))}, msg


def _by_index(cls, case):
    """An integer variant index as the tag (0k-sync's ten variants only)."""
    fields, msg = case
    return [M.ZEROK.index(cls), *fields], msg


valid_objects = st.one_of(*(
    layout.map(lambda c, cls=cls: _tagged(cls, c)) for cls, layout in LAYOUTS.items())).__or__(
    st.one_of(*(layout.map(lambda c, cls=cls: _as_map(cls, c))
                for cls, layout in LAYOUTS.items()))).__or__(
    st.one_of(*(layout.map(lambda c, cls=cls: _by_index(cls, c))
                for cls, layout in LAYOUTS.items() if cls in M.ZEROK)))

# interop §1.3 golden vectors (bytes exactly as rmp_serde writes them)
GOLDEN = {
    "93a450756c6c6432": M.Pull(100, 50),
    "94a757656c636f6d65010000": M.Welcome(1, 0, 0),
    "94a757656c636f6d6501cd012cce00011170": M.Welcome(1, 300, 70000),
    "94a450757368c410000102030405060708090a0b0c0d0e0f940102cc80ccff00":
        M.Push(bytes(range(16)), bytes([1, 2, 0x80, 0xFF]), 0),
    "93a75075736841636bc410000102030405060708090a0b0c0d0e0f01": M.PushAck(bytes(range(16)), 1),
    "94ac50756c6c526573706f6e73659194c410000102030405060708090a0b0c0d0e0f0193010203ce65a03c40c201":
        M.PullResponse([M.PullBlob(bytes(range(16)), 1, b"\x01\x02\x03", 1705000000)], False, 1),
    "93a64e6f74696679" "2a01": M.Notify(42, 1),
    "92a3427965c0": M.Bye(None),
    "92a3427965af636c69656e742073687574646f776e": M.Bye("client shutdown"),
}


GOLDEN_BYTES = {bytes.fromhex(h): m for h, m in GOLDEN.items()}


def _strict_fields(msg: M.Message) -> None:
    for kind, name in zip(msg.KINDS, msg.__dataclass_fields__):
        v = getattr(msg, name)
        if isinstance(kind, (M._ByteArray, M._BlobId)):
            assert type(v) is bytes, (name, type(v))
            if isinstance(kind, M._BlobId):
                assert len(v) == 16
            elif kind.length is not None:
                assert len(v) == kind.length
        elif isinstance(kind, M._Uint):
            assert type(v) is int and 0 <= v <= kind.top, name
        elif isinstance(kind, M._Bool):
            assert type(v) is bool, name
        elif isinstance(kind, M._OptStr):
            assert v is None or type(v) is str, name
        elif isinstance(kind, M._Str):
            assert type(v) is str, name
        elif isinstance(kind, M._List):
            assert type(v) is list and all(type(x) is kind.item for x in v), name
            for x in v:
                _strict_fields(x)


@fuzz_target(case=st.one_of(
    st.sampled_from(sorted(GOLDEN_BYTES.items(), key=lambda kv: kv[0])),
    valid_objects.map(lambda om: (pack(om[0]), om[1])),
    st.binary(max_size=300).map(lambda b: (b, None)),
    msgpack_values.map(lambda v: (pack(v), None)),
    mutated(valid_objects.map(lambda om: pack(om[0]))).map(lambda b: (b, None)),
    valid_objects.flatmap(lambda om: bend_object(om[0])).map(lambda o: (pack(o), None)),
))
@example(case=(bytes.fromhex("93a450756c6c6432"), M.Pull(100, 50)))
@example(case=(bytes.fromhex("9493a450756c6c6432"), None))   # a message inside an array
def test_sync_messages(case):
    data, expected = case
    if data in GOLDEN_BYTES:
        assert M.encode(GOLDEN_BYTES[data]) == data   # byte for byte, as rmp_serde writes it
    try:
        msg = M.decode(data)
    except M.DecodeError as e:
        assert expected is None, e
        return
    assert isinstance(msg, tuple(M.BY_TAG.values())), type(msg)
    assert type(msg) not in (M.PullBlob, M.PresenceEntry)
    _strict_fields(msg)
    again = M.encode(msg)
    assert M.decode(again) == msg
    assert M.encode(M.decode(again)) == again
    if expected is not None:
        assert msg == expected


@fuzz_target(
    bodies=st.lists(st.binary(max_size=64), max_size=5),
    junk=st.binary(max_size=12),
    points=st.lists(st.integers(0, 2000), max_size=6),
    max_size=st.sampled_from((0, 1, 16, 64, 1 << 20)),
)
def test_sync_frame_reader(bodies, junk, points, max_size):
    stream = b"".join(len(b).to_bytes(4, "big") + b for b in bodies) + junk
    points = sorted(p % (len(stream) + 1) for p in points)
    reader = FrameReader(max_size)
    got: list[bytes] = []
    try:
        for a, b in zip([0, *points], [*points, len(stream)]):
            got.extend(reader.feed(stream[a:b]))
            need = reader._need
            assert need is None or need <= max_size
            assert reader.buffered <= max(4, (need or 0))
        reader.end()
    except FrameError:
        assert any(len(b) > max_size for b in bodies) or junk
        return
    fitting = []
    for b in bodies:
        if len(b) > max_size:
            break
        fitting.append(b)
    assert got[:len(fitting)] == fitting
    assert not junk or len(got) > len(bodies)   # junk completed a frame of its own
