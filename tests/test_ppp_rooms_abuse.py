"""PPP rooms under abuse and crashes, without the stream: the ingress node on loopback with
real WebSocket / HTTP clients (frames from C.1 / C.6), the knock queue's TTL with a moved
clock, and DELETE_GROUP's commit point under kill -9.

* DISCOVER_ROOMS: C.3's 120 per minute, exactly.
* Sealed room submission: the per-IP budget (120 / 60 s) and the per-token budget (2 / 1 s)
  hit exactly; a body over 128 KiB refused before parsing (413); malformed MessagePack,
  wrong sizes, an unknown room, a bad token: refused, and nothing lands. Accepted messages
  with no stream to number them: 202 (durable in `landing`, numbered later).
* DELETE_GROUP: a child process creates groups with members and deletes them one after
  another; it is killed with SIGKILL mid-way. After it, every group is either whole (its
  record and all its tokens) or gone (nothing of it), never half.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.ppp_state import load_state, table_paths
from engine.ppp.knocks import Knock, KnockBook
from engine.ppp.limits import KNOCK_TTL_SECS
from engine.ppp.room_crypto import my_member_token, new_room_id, new_room_key
from engine.ppp.keys import Identity
from ingress.service import IngressNode

from ppp_wire import Ws, ahttp, pack

ROOT = Path(__file__).resolve().parents[1]


def test_knocks_live_120_seconds_and_are_answered_once():
    book = KnockBook()
    k = Knock(b"r" * 16, b"q" * 16, b"k" * 32, b"e" * 32, None, 1000.0)
    assert book.add(k) and not book.add(k)                 # the same request id, live
    assert book.take(b"r" * 16, b"q" * 16, 1000.0 + KNOCK_TTL_SECS) is None   # too late
    assert book.add(Knock(b"r" * 16, b"q" * 16, b"k" * 32, b"e" * 32, None, 2000.0))
    assert book.take(b"r" * 16, b"q" * 16, 2000.0 + KNOCK_TTL_SECS - 1) is not None
    assert book.take(b"r" * 16, b"q" * 16, 2001.0) is None       # answered once
    for i in range(150):                                     # the oldest give way
        book.add(Knock(b"r" * 16, i.to_bytes(16, "big"), b"k" * 32, b"e" * 32, None, 3000.0))
    assert book.waiting(b"r" * 16) == 100
    assert book.sweep(3000.0 + KNOCK_TTL_SECS) == 100 and book.waiting(b"r" * 16) == 0


def _landing_rows(settings) -> int:
    return sum(DeltaTable(str(p)).to_pyarrow_table().num_rows
               for p in Layout.of(settings).landing_tables().values())


def test_sealed_room_budgets_sizes_and_malformed_input(settings):
    settings.ppp.room_sequence_timeout_seconds = 0.5    # no stream runs here
    settings.heya.enabled = False
    asyncio.run(_abuse(settings))


async def _abuse(settings):
    admin_sk = SigningKey.generate()
    admin = Identity.from_seed(bytes(admin_sk))
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.ppp.bound_port
        a = await Ws.login(port, admin_sk)
        room_id, key = new_room_id(), new_room_key()
        r = await a.call({"cmd": "CREATE_GROUP", "room_id": room_id, "gated": True,
                          "max_members": 5})
        assert r == {"cmd": "GROUP_CREATED", "room_id": room_id}
        token = my_member_token(admin, key, room_id)
        assert (await a.call({"cmd": "REGISTER_TOKEN", "room_id": room_id,
                              "member_token": token,
                              "admin_signature": admin_sk.sign(token + room_id).signature})
                ) == {"cmd": "TOKEN_REGISTERED"}
        before = _landing_rows(settings)

        def post(body: bytes, ip: str):
            return ahttp(port, "POST", "/v1/room/submit", body,
                         {"Content-Type": "application/msgpack", "X-Forwarded-For": ip})

        def msg(**over) -> bytes:
            m = {"room_id": room_id, "member_token": token, "nonce": os.urandom(24),
                 "ciphertext": os.urandom(1040)}
            return pack({**m, **over})

        # Malformed, wrong sizes, unknown room, bad token, oversize: refused, nothing lands.
        ip = "198.51.100.7"
        statuses = [(await post(body, ip))[0] for body in (
            b"\xc1", b"\x81\xa1x", pack([1, 2]), msg(nonce=b"n" * 23),
            msg(room_id=b"r" * 15), msg(member_token=b"t" * 11), msg(ciphertext=b""),
            msg(ciphertext=os.urandom(64 * 1024 + 1)), msg(room_id=os.urandom(16)),
            msg(member_token=os.urandom(12)))]
        assert statuses == [400] * 8 + [404, 401]
        big = (await post(b"\x00" * (128 * 1024 + 1), ip))[0]
        assert big == 413
        # The per-IP budget: 120 in 60 s, counted from the first of these (the oversize
        # body was refused before it was counted), so 110 more pass and the next is 429.
        results = [(await post(b"\xc1", ip))[0] for _ in range(111)]
        assert results == [400] * 110 + [429]
        assert _landing_rows(settings) == before

        # The per-token budget: 2 in 1 s. Three at once from a fresh address.
        got = await asyncio.gather(*(post(msg(), "198.51.100.8") for _ in range(3)))
        assert sorted(s for s, _, _ in got) == [202, 202, 429], [(s, h) for s, _, h in got]
        assert _landing_rows(settings) == before + 2          # durable, not numbered yet

        # WebSocket: sizes and bytes the codec refuses; the session stays usable.
        big_ct = await a.call({"cmd": "STORE_ROOM", "room_id": room_id,
                               "nonce": os.urandom(24), "ciphertext": os.urandom(65537)})
        assert big_ct["cmd"] == "STORE_FAIL" and big_ct["reason"].startswith(
            "ciphertext too large")
        await a.send_raw(b"\xc1")
        assert (await a.recv())["cmd"] == "STORE_FAIL"
        bad = await a.call({"cmd": "CREATE_ROOM", "room_id": os.urandom(16),
                            "s2_cell_id": "zz", "s2_coarse_id": "47a85",
                            "gated": False, "proximity_required": False, "ble_enabled": False,
                            "max_members": 5, "expires_at": int(time.time()) + 60})
        assert bad["reason"].startswith("s2 cell must be an S2 token")
        for over, reason in (({"max_members": 0}, "max_members must be 1-100"),
                             ({"max_members": 101}, "max_members must be 1-100"),
                             ({"expires_at": int(time.time()) - 1},
                              "expires_at must be in the future"),
                             ({"s2_coarse_id": "47a851dff"},
                              "s2 coarse cell must contain the fine cell"),
                             ({"s2_coarse_id": "47"}, "s2 coarse cell coarser than level 8")):
            r = await a.call({"cmd": "CREATE_ROOM", "room_id": os.urandom(16),
                              "s2_cell_id": "47a851dff", "s2_coarse_id": "47a851",
                              "gated": False, "proximity_required": False,
                              "ble_enabled": False, "max_members": 5,
                              "expires_at": int(time.time()) + 60, **over})
            assert r["reason"].startswith(reason), (over, r)
        r = await a.call({"cmd": "DISCOVER_ROOMS", "s2_cell_id": "47"})
        assert r["reason"].startswith("s2 cell coarser than level 8")
        assert (await a.call({"cmd": "FETCH_ROOM", "room_id": room_id, "since_id": 0}))[
            "cmd"] == "ROOM_MESSAGES"
        # DISCOVER_ROOMS: 120 per minute per pubkey (C.3), exactly; the refused one says so.
        d = await Ws.login(port, SigningKey.generate())
        got = [(await d.call({"cmd": "DISCOVER_ROOMS", "s2_cell_id": "47a851"}))["cmd"]
               for _ in range(121)]
        assert got == ["ROOMS"] * 120 + ["STORE_FAIL"]
        await d.close()
        await a.close()
    finally:
        await node.close()


_CHILD = textwrap.dedent("""
    import asyncio, os, sys, time
    from delta_tables.layout import Layout
    from delta_tables.ppp_control import PppControl
    from engine.ppp.rooms import GROUP_EXPIRES_AT, TYPE_GROUP, Room

    async def main(data_dir, n):
        layout = Layout(data_dir)
        layout.ensure_shared_tables()
        c = PppControl(layout, fsync=True)
        await c.load()
        admin = os.urandom(32)
        groups = []
        for i in range(n):
            g = Room(os.urandom(16), admin, TYPE_GROUP, None, None, True, False, False, 10,
                     int(time.time()), GROUP_EXPIRES_AT)
            await c.create_room(g, time.time())
            for _ in range(3):
                await c.register_member(g, os.urandom(12))
            groups.append(g)
        print("ready", flush=True)
        for i, g in enumerate(groups):
            await c.delete_room(g)
            print("deleted", i, flush=True)
        print("done", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


@pytest.mark.parametrize("kill_after", [3, 9])
def test_delete_group_is_all_or_nothing_under_kill_9(tmp_path, kill_after):
    data = tmp_path / "data"
    n = 12
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(data), str(n)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deleted = -1
        for line in child.stdout:
            if line.startswith("deleted"):
                deleted = int(line.split()[1])
                if deleted + 1 >= kill_after:
                    break
        child.send_signal(signal.SIGKILL)     # mid-way: maybe inside the next delete
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    state = load_state(table_paths(Layout(str(data))))
    rooms = state.rooms
    assert len(rooms.rooms) + len(rooms.deleted) == n
    assert len(rooms.deleted) >= kill_after          # every acknowledged delete stands
    for room_id in rooms.deleted:
        assert room_id not in rooms.rooms and room_id not in rooms.tokens
    for room_id in rooms.rooms:                      # the others whole
        assert rooms.members(room_id) == 3
