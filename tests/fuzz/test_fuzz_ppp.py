"""Fuzz the PPP codecs: client command frames (`engine.ppp.protocol`: WebSocket commands and
the sealed Note body) and the GiftWrap (`engine.ppp.giftwrap`).

Contract (004 §5.1, appendix C.1, the §3.x GiftWrap key table): any bytes either decode to a
command / GiftWrap whose every field has exactly the spec's type and size, or raise the codec's
own error (`ProtocolError`, `GiftWrapError`); nothing else escapes, nothing hangs, and a valid
message decodes to what was encoded. Inputs: random bytes, random MessagePack values, valid
messages built here from the spec's field tables (not with the relay's encoder), and those
valid messages bent at the byte level and at the MessagePack structure level.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import example
from hypothesis import strategies as st

from engine.ppp import protocol as P
from engine.ppp.giftwrap import GiftWrap, GiftWrapError
from fuzzing import fuzz_target
from mutations import bend_object, msgpack_values, mutated, pack, strictly_equal

pytestmark = pytest.mark.fuzz

U64 = 2**64 - 1

# --- valid commands, from the C.1 table: (map, the command it must decode to) ---------------

b12, b16, b24, b32, b64 = (st.binary(min_size=n, max_size=n) for n in (12, 16, 24, 32, 64))
u64 = st.integers(0, U64) | st.sampled_from((0, 1, 127, 128, 2**32, U64))

valid_commands = st.one_of(
    st.builds(lambda pk, sig: ({"cmd": "AUTH", "pubkey": pk, "sig": sig}, P.Auth(pk, sig)),
              b32, b64),
    st.builds(lambda ev: ({"cmd": "STORE", "event": ev}, P.Store(ev)), st.binary(max_size=200)),
    st.builds(lambda since: ({"cmd": "FETCH", "since": since}, P.Fetch(since, None)), u64),
    st.builds(lambda since, cur: ({"cmd": "FETCH", "since": since, "cursor": cur},
                                  P.Fetch(since, cur)), u64, u64),
    st.builds(lambda ids: ({"cmd": "ACK", "event_ids": ids}, P.Ack(tuple(ids))),
              st.lists(b32, max_size=5)),
    st.builds(lambda t: ({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": t},
                         P.RegisterDeliveryToken(t)), b12),
    st.builds(lambda t: ({"cmd": "DEREGISTER_DELIVERY_TOKEN", "delivery_token": t},
                         P.DeregisterDeliveryToken(t)), b12),
    st.builds(lambda ct: ({"cmd": "STORE_BACKUP", "ciphertext": ct}, P.StoreBackup(ct)),
              st.binary(max_size=200)),
    st.just(({"cmd": "FETCH_BACKUP"}, P.FetchBackup())),
    st.just(({"cmd": "DELETE_BACKUP"}, P.DeleteBackup())),
    st.builds(lambda p, t: ({"cmd": "REGISTER_PUSH", "platform": p, "token": t},
                            P.RegisterPush(p, t)), st.text(max_size=16), st.text(max_size=200)),
    # rooms (§7, C.1)
    st.builds(lambda r, n, ct: ({"cmd": "STORE_ROOM", "room_id": r, "nonce": n,
                                 "ciphertext": ct}, P.StoreRoom(r, n, ct)),
              b16, b24, st.binary(max_size=200)),
    st.builds(lambda r, since: ({"cmd": "FETCH_ROOM", "room_id": r, "since_id": since},
                                P.FetchRoom(r, since)), b16, st.integers(0, 2**63 - 1)),
    st.builds(lambda r, t, sig: ({"cmd": "REGISTER_TOKEN", "room_id": r, "member_token": t,
                                  "admin_signature": sig}, P.RegisterToken(r, t, sig)),
              b16, b12, b64),
    st.builds(lambda r, g: ({"cmd": "ROTATE_ROOM_KEY", "room_id": r, "grace_seconds": g},
                            P.RotateRoomKey(r, g)), b16, st.integers(0, 2**32 - 1)),
    st.builds(lambda r, cell, coarse, g, p, b, mm, exp: (
        {"cmd": "CREATE_ROOM", "room_id": r, "s2_cell_id": cell, "s2_coarse_id": coarse,
         "gated": g, "proximity_required": p, "ble_enabled": b, "max_members": mm,
         "expires_at": exp}, P.CreateRoom(r, cell, coarse, g, p, b, mm, exp)),
        b16, st.text(max_size=16), st.text(max_size=16), st.booleans(), st.booleans(),
        st.booleans(), st.integers(0, 2**32 - 1), u64),
    st.builds(lambda c: ({"cmd": "DISCOVER_ROOMS", "s2_cell_id": c}, P.DiscoverRooms(c)),
              st.text(max_size=16)),
    st.builds(lambda r, e, q: ({"cmd": "KNOCK", "room_id": r, "knocker_eph_x25519_pk": e,
                                "request_id": q}, P.Knock(r, e, q)), b16, b32, b16),
    st.builds(lambda r, q, g: ({"cmd": "ADMIT", "room_id": r, "request_id": q,
                                "encrypted_grant": g}, P.Admit(r, q, g)),
              b16, b16, st.binary(max_size=88)),
    st.builds(lambda r, pk: ({"cmd": "BAN_MEMBER", "room_id": r, "member_pubkey": pk},
                             P.BanMember(r, pk)), b16, b32),
    st.builds(lambda hs: ({"cmd": "DISCOVERY_QUERY", "hashes": hs},
                          P.DiscoveryQuery(tuple(hs))), st.lists(b32, max_size=5)),
    st.builds(lambda hs, pk, pid: ({"cmd": "DISCOVERY_PUBLISH", "hashes": hs, "pubkey": pk,
                                    "pepper_id": pid}, P.DiscoveryPublish(tuple(hs), pk, pid)),
              st.lists(b32, max_size=5), b32, u64),
    # carry groups (§8)
    st.builds(lambda g, ms, cs, sig: ({"cmd": "REGISTER_CARRY_GROUP", "group_id": g,
                                       "members": ms, "couriers": cs, "sig": sig},
                                      P.RegisterCarryGroup(g, tuple(ms), tuple(cs), sig)),
              b16, st.lists(b32, max_size=4), st.lists(b32, max_size=3), b64),
    st.builds(lambda g, sig: ({"cmd": "LEAVE_CARRY_GROUP", "group_id": g, "sig": sig},
                              P.LeaveCarryGroup(g, sig)), b16, b64),
    st.builds(lambda g, since, sig: ({"cmd": "FETCH_CARRY", "group_id": g, "since": since,
                                      "sig": sig}, P.FetchCarry(g, since, sig)), b16, u64, b64),
    st.builds(lambda g, ids: ({"cmd": "ACK_CARRY", "group_id": g, "event_ids": ids},
                              P.AckCarry(g, tuple(ids))), b16, st.lists(b32, max_size=4)),
)

valid_notes = st.builds(
    lambda tok, epk, nonce, ct, created, expires: (
        {"delivery_token": tok, "ephemeral_pk": epk, "nonce": nonce, "ciphertext": ct,
         "created_at": created, "expires_at": expires},
        P.SealedNoteSubmit(tok, epk, nonce, ct, created, expires)),
    b12, b32, st.binary(min_size=24, max_size=24), st.binary(max_size=200), u64, u64)


def wire_map_len(data: bytes) -> int:
    """Entries in the map header on the wire (duplicates included)."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    return unpacker.read_map_header()


def _inputs(valid):
    """(frame bytes, expected object or None when the input is not known to be valid)."""
    return st.one_of(
        valid.map(lambda mv: (pack(mv[0]), mv[1])),
        st.binary(max_size=300).map(lambda b: (b, None)),
        msgpack_values.map(lambda v: (pack(v), None)),
        mutated(valid.map(lambda mv: pack(mv[0]))).map(lambda b: (b, None)),
        valid.flatmap(lambda mv: bend_object(mv[0])).map(lambda m: (pack(m), None)),
    )


_FIELD_TYPES = {   # C.1 / C.6: field -> (type, exact size or None)
    P.Auth: {"pubkey": (bytes, 32), "sig": (bytes, 64)},
    P.Store: {"event": (bytes, None)},
    P.Fetch: {"since": (int, None), "cursor": (int, None)},
    P.RegisterDeliveryToken: {"delivery_token": (bytes, 12)},
    P.DeregisterDeliveryToken: {"delivery_token": (bytes, 12)},
    P.RegisterPush: {"platform": (str, None), "token": (str, None)},
    P.StoreBackup: {"ciphertext": (bytes, None)},
    P.StoreRoom: {"room_id": (bytes, 16), "nonce": (bytes, 24), "ciphertext": (bytes, None)},
    P.FetchRoom: {"room_id": (bytes, 16)},
    P.RegisterToken: {"room_id": (bytes, 16), "member_token": (bytes, 12),
                      "admin_signature": (bytes, 64)},
    P.RotateRoomKey: {"room_id": (bytes, 16), "grace_seconds": (int, None)},
    P.CreateRoom: {"room_id": (bytes, 16), "s2_cell_id": (str, None),
                   "s2_coarse_id": (str, None), "gated": (bool, None),
                   "proximity_required": (bool, None), "ble_enabled": (bool, None),
                   "max_members": (int, None), "expires_at": (int, None)},
    P.DiscoverRooms: {"s2_cell_id": (str, None)},
    P.UpdateRoom: {"room_id": (bytes, 16)},
    P.RevokeTokens: {"room_id": (bytes, 16)},
    P.Knock: {"room_id": (bytes, 16), "knocker_eph_x25519_pk": (bytes, 32)},
    P.Admit: {"room_id": (bytes, 16), "request_id": (bytes, 16)},
    P.BanMember: {"room_id": (bytes, 16), "member_pubkey": (bytes, 32)},
    P.KickMember: {"room_id": (bytes, 16), "member_pubkey": (bytes, 32)},
    P.RegisterCarryGroup: {"group_id": (bytes, 16), "sig": (bytes, 64)},
    P.LeaveCarryGroup: {"group_id": (bytes, 16), "sig": (bytes, 64)},
    P.FetchCarry: {"group_id": (bytes, 16), "since": (int, None), "sig": (bytes, 64),
                   "cursor": (int, None)},
    P.AckCarry: {"group_id": (bytes, 16)},
    P.SealedNoteSubmit: {"delivery_token": (bytes, 12), "ephemeral_pk": (bytes, 32),
                         "nonce": (bytes, 24), "ciphertext": (bytes, None),
                         "created_at": (int, None), "expires_at": (int, None)},
}


def _assert_strict(obj, raw_map):
    """Every field of a decoded object has exactly its C.1 type (an int is not a bool) and the
    map it came from holds that field under the same key with a value of the same type."""
    for name, (typ, size) in _FIELD_TYPES.get(type(obj), {}).items():
        value = getattr(obj, name)
        if value is None and name == "cursor":
            continue
        assert type(value) is typ, (name, type(value))
        if size is not None:
            assert len(value) == size, (name, len(value))
        if typ is int:
            assert 0 <= value <= U64, name
        assert strictly_equal(raw_map[name], value), name
    if isinstance(obj, (P.Ack, P.AckCarry)):   # §5.1 / §4.5: event ids are 32 bytes
        assert all(type(i) is bytes and len(i) == 32 for i in obj.event_ids)
    if isinstance(obj, P.RegisterCarryGroup):
        assert all(type(k) is bytes and len(k) == 32 for k in obj.members + obj.couriers)
    # string keys only, none twice (a map that is equal in Python is not the same message)
    assert all(type(k) is str for k in raw_map), list(raw_map)


# Regressions (issue 19 item 4, fixed): a non-string key, the same key twice, a short ACK id.
FLOAT_KEY_COMMAND = pack({"cmd": "FETCH", "since": 1, 1.0: b"x"})
TWICE_CMD = b"\x83" + b"".join(pack(k) + pack(v) for k, v in (
    ("cmd", "FETCH"), ("since", 1), ("cmd", "STORE_BACKUP")))
SHORT_ACK_ID = pack({"cmd": "ACK", "event_ids": [b"i" * 31]})


@fuzz_target(case=_inputs(valid_commands), implied=st.sampled_from(
    (None, None, None, "STORE", "FETCH", "ACK")))
@example(case=(FLOAT_KEY_COMMAND, None), implied=None)
@example(case=(TWICE_CMD, None), implied=None)
@example(case=(SHORT_ACK_ID, None), implied=None)
def test_ppp_command_frames(case, implied):
    """WebSocket command frames (and the same maps on an HTTP endpoint that implies the
    command): a C.1 command or ProtocolError."""
    data, expected = case
    try:
        if implied is None:
            cmd = P.decode_command(data)
        else:
            cmd = P.decode_map(P.unpack_map(data), implied)
    except P.ProtocolError as e:
        assert isinstance(e.reason, str) and e.reason
        assert e.cmd is None or isinstance(e.cmd, str)
        assert expected is None or (implied is not None
                                    and pack_name(expected) != implied), e.reason
        return
    assert isinstance(cmd, (P.Auth, P.Store, P.Fetch, P.Ack, P.RegisterDeliveryToken,
                            P.DeregisterDeliveryToken, P.RegisterPush, P.StoreBackup, P.FetchBackup,
                            P.DeleteBackup, P.Unsupported, P.CreateRoom, P.UpdateRoom,
                            P.DiscoverRooms, P.RegisterToken, P.RevokeTokens, P.RotateRoomKey,
                            P.StoreRoom, P.FetchRoom, P.Knock, P.Admit, P.CreateGroup,
                            P.DeleteGroup, P.KickMember, P.BanMember, P.DiscoveryPepper,
                            P.DiscoveryPublish, P.DiscoveryQuery, P.RegisterCarryGroup,
                            P.LeaveCarryGroup, P.FetchCarry, P.AckCarry)), type(cmd)
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert type(raw) is dict
    assert wire_map_len(data) == len(raw), "a key twice accepted"
    assert type(raw.get("cmd", implied)) is str and cmd.name == raw.get("cmd", implied)
    _assert_strict(cmd, raw)
    if expected is not None:
        assert cmd == expected


def pack_name(cmd) -> str:
    return cmd.name


@fuzz_target(case=_inputs(valid_notes))
def test_ppp_sealed_note_body(case):
    """`POST /v1/note/submit` bodies (C.6 SealedNoteSubmit): decoded or ProtocolError."""
    data, expected = case
    try:
        note = P.decode_sealed_note(data)
    except P.ProtocolError as e:
        assert expected is None, e.reason
        return
    assert isinstance(note, P.SealedNoteSubmit)
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert wire_map_len(data) == len(raw), "a key twice accepted"
    _assert_strict(note, raw)
    if expected is not None:
        assert note == expected


# --- GiftWrap ----------------------------------------------------------------------------------

valid_wraps = st.builds(GiftWrap, b32, b32, st.binary(min_size=24, max_size=24),
                        st.binary(min_size=1, max_size=300), u64, u64)


def _spec_map(gw: GiftWrap) -> dict:
    """§3.x key table, written out here rather than with GiftWrap.to_map."""
    return {1: gw.recipient, 2: gw.ephemeral_pk, 3: gw.nonce, 4: gw.ciphertext,
            5: gw.created_at, 6: gw.expires_at}


_R, _E, _N, _C = b"r" * 32, b"e" * 32, b"n" * 24, b"c" * 16
# Issue 19 (4): keys 1.0-6.0 as floats, or `true` in place of key 1, were STORED as sent.
FLOAT_KEYS = pack({1.0: _R, 2.0: _E, 3.0: _N, 4.0: _C, 5.0: 1, 6.0: 2})
TRUE_KEY = pack({True: _R, 2: _E, 3: _N, 4: _C, 5: 1, 6: 2})
# Found by this target: key 1 twice (a 7-entry map). msgpack keeps the last value, so the relay
# filed the event under the second recipient while the bytes it landed also named the first.
# All three are refused since 7ab5329 ("PPP strict input").
DUPLICATE_KEY = b"\x87" + b"".join(pack(k) + pack(v) for k, v in (
    (1, b"x" * 32), (1, _R), (2, _E), (3, _N), (4, _C), (5, 1), (6, 2)))



@fuzz_target(case=st.one_of(
    valid_wraps.map(lambda gw: (pack(_spec_map(gw)), gw)),
    st.binary(max_size=300).map(lambda b: (b, None)),
    msgpack_values.map(lambda v: (pack(v), None)),
    mutated(valid_wraps.map(lambda gw: pack(_spec_map(gw)))).map(lambda b: (b, None)),
    valid_wraps.flatmap(lambda gw: bend_object(_spec_map(gw))).map(lambda m: (pack(m), None)),
))
@example(case=(FLOAT_KEYS, None))
@example(case=(TRUE_KEY, None))
@example(case=(DUPLICATE_KEY, None))
def test_ppp_giftwrap(case):
    """A GiftWrap decodes only if its map is exactly the six integer keys of the §3.x table with
    exactly their types (bin 32 / 32 / 24 / non-empty bin / u64 / u64), because the relay
    lands the bytes as sent: a map that merely compares equal in Python is refused."""
    data, expected = case
    try:
        gw = GiftWrap.decode(data)
    except GiftWrapError as e:
        assert expected is None, e
        return
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert type(raw) is dict
    assert all(type(k) is int for k in raw), f"GiftWrap with keys {list(raw)!r} accepted"
    assert wire_map_len(data) == 6, f"GiftWrap map of {wire_map_len(data)} entries accepted"
    assert strictly_equal(raw, _spec_map(gw)), "decoded fields differ in type from the wire"
    assert GiftWrap.decode(gw.encode()) == gw
    if expected is not None:
        assert gw == expected
