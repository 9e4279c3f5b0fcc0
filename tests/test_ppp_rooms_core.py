"""PPP rooms below the sockets: S2 tokens and the discovery rule against cells computed from
real coordinates with `s2sphere`, the room command codec's strictness, room message crypto,
and the room control plane on real Delta tables (a restart folds the same state;
compaction purges an expired room's rows and keeps a live one's).
"""

from __future__ import annotations

import asyncio
import math
import os
import time

import msgpack
import pytest
import s2sphere
from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.ppp_control import PppControl
from delta_tables.ppp_state import load_state, table_paths
from delta_tables.schema_ppp import PPP_ROOM_TOKENS, PPP_ROOMS
from engine.ppp import protocol as P
from engine.ppp import rooms as R
from engine.ppp.keys import Identity
from engine.ppp.room_crypto import (RoomMessageError, decrypt_message, encrypt_message,
                                    my_member_token, new_room_key)
from jobs.compact import run_compaction

ALEX = (52.5219, 13.4132)


def cell(lat, lon, level) -> s2sphere.CellId:
    return s2sphere.CellId.from_lat_lng(s2sphere.LatLng.from_degrees(lat, lon)).parent(level)


def km(a, b) -> float:
    (la1, lo1), (la2, lo2) = (map(math.radians, p) for p in (a, b))
    h = (math.sin((la2 - la1) / 2) ** 2
         + math.cos(la1) * math.cos(la2) * math.sin((lo2 - lo1) / 2) ** 2)
    return 2 * 6371.0 * math.asin(math.sqrt(h))


# --- S2 ----------------------------------------------------------------------------------------

def test_tokens_parse_strictly_and_round_trip():
    c = cell(*ALEX, 16)
    assert R.parse_cell(c.to_token()).id() == c.id()
    assert R.parse_cell(c.to_token().upper()).id() == c.id()
    assert R.cell_token(*ALEX, 16) == c.to_token()
    for bad in ("", "X", "zz", "0", c.to_token() + "0", "1" * 17, str(c.id()), 5, None,
                " " + c.to_token()):
        with pytest.raises(R.CellError):
            R.parse_cell(bad)


def test_discovery_rule_on_real_places():
    fine, coarse = cell(*ALEX, 16), cell(*ALEX, 10)
    assert R.check_placement(fine, coarse) is None
    assert R.check_placement(coarse, fine) is not None                 # coarse inside fine
    assert R.check_placement(fine, cell(48.8566, 2.3522, 10)) is not None   # Paris
    assert R.check_placement(fine, cell(*ALEX, 5)) is not None          # too coarse to find
    # Same fine cell, same coarse cell, a cell in between, a finer cell inside: found.
    for q in (fine, coarse, cell(*ALEX, 13), cell(*ALEX, 20)):
        assert R.matches(q, fine, coarse)
    # 50 km north, and a sibling fine cell just outside the coarse cell: not found.
    far = (52.97, 13.4132)
    assert 49 < km(ALEX, far) < 51
    for level in (8, 10, 12, 16):
        assert not R.matches(cell(*far, level), fine, coarse)
    outside = next(n for n in coarse.get_edge_neighbors())
    assert not R.matches(outside, fine, coarse)


# --- codec -------------------------------------------------------------------------------------

def _frame(**m) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


GOOD = dict(cmd="CREATE_ROOM", room_id=b"r" * 16, s2_cell_id="47a851dff",
            s2_coarse_id="47a851", gated=True, proximity_required=False, ble_enabled=False,
            max_members=10, expires_at=2_000_000_000)


def test_room_commands_decode_and_refuse_wrong_types():
    cmd = P.decode_command(_frame(**GOOD))
    assert isinstance(cmd, P.CreateRoom) and cmd.max_members == 10
    for bad in ({"room_id": b"r" * 15}, {"gated": 1}, {"max_members": -1},
                {"max_members": 1 << 32}, {"s2_cell_id": b"47a851dff"},
                {"expires_at": 1.5}, {"s2_cell_id": "a" * 65}):
        with pytest.raises(P.ProtocolError):
            P.decode_command(_frame(**(GOOD | bad)))
    fetch = P.decode_command(_frame(cmd="FETCH_ROOM", room_id=b"r" * 16, since_id=-1))
    assert fetch.since_id == -1
    with pytest.raises(P.ProtocolError):
        P.decode_command(_frame(cmd="FETCH_ROOM", room_id=b"r" * 16, since_id=True))
    with pytest.raises(P.ProtocolError):
        P.decode_command(_frame(cmd="STORE_ROOM", room_id=b"r" * 16, nonce=b"n" * 23,
                                ciphertext=b"c"))
    with pytest.raises(P.ProtocolError):
        P.decode_command(_frame(cmd="REGISTER_TOKEN", room_id=b"r" * 16,
                                member_token=b"t" * 12, admin_signature=b"s" * 63))
    up = P.decode_command(_frame(cmd="UPDATE_ROOM", room_id=b"r" * 16, gated=None))
    assert up.gated is None and up.proximity_required is None
    with pytest.raises(P.ProtocolError):     # REGISTER_PUSH is served now: fields required
        P.decode_command(_frame(cmd="REGISTER_PUSH"))
    with pytest.raises(P.ProtocolError):
        P.decode_sealed_room(_frame(room_id=b"r" * 16, member_token=b"t" * 11,
                                    nonce=b"n" * 24, ciphertext=b"c"))


# --- room message crypto -----------------------------------------------------------------------

def test_room_messages_open_only_in_their_room_under_their_key():
    me, key, room = Identity.generate(), new_room_key(), os.urandom(16)
    nonce, ct = encrypt_message(me, key, room, "hello \u2603", 1_700_000_000)
    assert len(ct) - 16 in (256, 1024)                  # padded to a bucket, + tag
    p = decrypt_message(key, room, nonce, ct)
    assert (p.body, p.sent_at) == ("hello \u2603", 1_700_000_000)
    assert p.sender != me.pubkey                        # the per-room key, not the identity
    for args in ((new_room_key(), room, nonce, ct), (key, os.urandom(16), nonce, ct),
                 (key, room, nonce, ct[:-1] + bytes([ct[-1] ^ 1]))):
        with pytest.raises(RoomMessageError):
            decrypt_message(*args)
    assert my_member_token(me, key, room) != my_member_token(me, new_room_key(), room)


# --- control plane on Delta --------------------------------------------------------------------

def _room(room_id: bytes, admin: bytes, expires_at: int, max_members: int = 3) -> R.Room:
    return R.Room(room_id, admin, R.TYPE_ROOM, cell(*ALEX, 16).to_token(),
                  cell(*ALEX, 10).to_token(), True, False, False, max_members,
                  int(time.time()), expires_at)


def test_room_control_plane_survives_a_restart_and_compaction_purges_expired_rooms(settings):
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    admin = os.urandom(32)
    live, brief = os.urandom(16), os.urandom(16)
    t1, t2, t3 = (os.urandom(12) for _ in range(3))
    now = time.time()

    async def control_plane():
        c = PppControl(layout, fsync=False)
        await c.load()
        room = _room(live, admin, int(now) + 3600)
        assert await c.create_room(room, now) is None
        assert await c.create_room(room, now) == "room exists"
        assert await c.register_member(room, t1) is None
        assert await c.register_member(room, t1) is None       # idempotent
        assert await c.revoke_members(live) == 1
        assert await c.register_member(room, t2) is None
        assert await c.rotate_members(live, int((now + 60) * 1e6)) == 1
        assert await c.register_member(room, t3) is None
        await c.update_room(_room(live, admin, int(now) + 3600, max_members=2))
        short = _room(brief, admin, int(now) + 1)
        assert await c.create_room(short, now) is None
        assert await c.register_member(short, t1) is None
        return c.state

    state = asyncio.run(control_plane())
    fresh = load_state(table_paths(layout))
    assert fresh.rooms.rooms == state.rooms.rooms
    assert {r: t.valid_until for r, t in fresh.rooms.tokens.items()} == \
        {r: t.valid_until for r, t in state.rooms.tokens.items()}
    assert not fresh.rooms.token_valid(live, t1, int(now * 1e6))          # revoked
    assert fresh.rooms.token_valid(live, t2, int(now * 1e6))              # in grace
    assert not fresh.rooms.token_valid(live, t2, int((now + 61) * 1e6))   # after it
    assert fresh.rooms.members(live) == 1 and fresh.rooms.rooms[live].max_members == 2
    assert [r.room_id for r in fresh.rooms.discover(cell(*ALEX, 12), now, 10)] in (
        [live, brief], [brief, live])

    time.sleep(1.2)                       # `brief` expires
    run_compaction(settings)
    after = load_state(table_paths(layout))
    assert brief not in after.rooms.rooms and brief not in after.rooms.tokens
    assert after.rooms.rooms[live] == state.rooms.rooms[live]
    assert after.rooms.tokens[live].valid_until == state.rooms.tokens[live].valid_until
    rows = DeltaTable(str(table_paths(layout)[PPP_ROOMS.name])).to_pyarrow_table()
    assert rows.column("room_id").to_pylist() == [live]           # its newest row only
    tok = DeltaTable(str(table_paths(layout)[PPP_ROOM_TOKENS.name])).to_pyarrow_table()
    assert brief not in tok.column("room_id").to_pylist()
    assert t1 not in tok.column("token").to_pylist()                # before the revoke


def test_discovery_sets_of_a_past_pepper_are_compacted_away(settings):
    """A set filed under a pepper older than the newest any publisher used matches nothing:
    compaction deletes its rows; the rest folds back the same."""
    settings.compaction.vacuum_retention_seconds = 0
    layout = Layout.of(settings)
    layout.ensure_shared_tables()
    a, b, c = os.urandom(32), os.urandom(32), os.urandom(32)
    h1, h2, h3 = os.urandom(32), os.urandom(32), os.urandom(32)

    async def publish():
        ctl = PppControl(layout, fsync=False)
        await ctl.load()
        assert await ctl.publish_hashes(a, [h1, h1, h2], 7) == 2   # duplicates once
        await ctl.publish_hashes(a, [h1], 7)                        # replaces a's set
        await ctl.publish_hashes(b, [h2], 7)
        await ctl.publish_hashes(c, [h3], 8)                        # the pepper moved on
        return ctl.state.discovery
    st = asyncio.run(publish())
    assert st.matches([h1, h2, h3], 7) == [(h1, a), (h2, b)]
    assert st.matches([h3], 8) == [(h3, c)]
    run_compaction(settings)
    after = load_state(table_paths(layout)).discovery
    assert after.matches([h1, h2], 7) == [] and after.matches([h3], 8) == [(h3, c)]
    from delta_tables.schema_ppp import PPP_DISCOVERY
    rows = DeltaTable(str(table_paths(layout)[PPP_DISCOVERY.name])).to_pyarrow_table()
    assert set(rows.column("pubkey").to_pylist()) == {c}


def test_the_discovery_index_answers_exactly_the_rule():
    """`RoomState.discover` (range scan + ancestor lookups) returns exactly the live rooms
    `rooms.matches` accepts, for query cells of every level around real places."""
    from delta_tables.room_state import RoomState
    from delta_tables.schema_ppp import OP_CREATE
    rng = __import__("random").Random(5)
    places = [ALEX, (52.53, 13.38), (48.8566, 2.3522), (52.97, 13.4132)]
    st = RoomState()
    now = time.time()
    for i in range(60):
        lat, lon = places[i % len(places)]
        lat, lon = lat + rng.uniform(-0.2, 0.2), lon + rng.uniform(-0.3, 0.3)
        fine_level, coarse_level = rng.choice((14, 16, 20)), rng.choice((8, 10, 12))
        st.room_row(OP_CREATE, R.Room(os.urandom(16), b"a" * 32, R.TYPE_ROOM,
                                      cell(lat, lon, fine_level).to_token(),
                                      cell(lat, lon, coarse_level).to_token(), False, False,
                                      False, 10, i, int(now) + (3600 if i % 7 else -1)), i)
    found = 0
    for lat, lon in places:
        for level in range(8, 21, 2):
            q = cell(lat + rng.uniform(-0.1, 0.1), lon + rng.uniform(-0.1, 0.1), level)
            want = {r.room_id for r in st.rooms.values() if not r.expired(now)
                    and R.matches(q, R.parse_cell(r.fine), R.parse_cell(r.coarse))}
            assert {r.room_id for r in st.discover(q, now, 1000)} == want
            found += len(want)
    assert found > 20          # the queries did find rooms, by both kinds of match
