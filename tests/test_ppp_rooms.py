"""PPP rooms end to end, all real (spec 004 §7, appendix C): the ingress node (uvicorn on
loopback), Spark Structured Streaming numbering room messages into the inbox, the PPP
listener's room view, WebSocket and sealed HTTP clients whose frames are built here from
C.1 / C.6 (`ppp_wire`), S2 cells computed with `s2sphere` from real coordinates.

An admin creates a gated room at Alexanderplatz; a user 500 m away discovers it from the
cells of their own position (their level-10 cell and its neighbours, as a map view asks), a
user 50 km away does not. The admin registers the member's token (derived from the room key
and the member's per-room signing key), both send (the member sealed, the admin
authenticated), fetch gap-free ids the stream assigned, decrypt and check senders; the
member, subscribed by its FETCH_ROOM, gets ROOM_NOTIFY and KEY_ROTATION_NOTIFY; the old
token works during the grace period and is refused after it; REVOKE_TOKENS; room expiry;
every admin command from a non-admin; bad signatures; the member cap.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import s2sphere
from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables.layout import Layout
from delta_tables.schema import C
from engine.ppp.keys import Identity, x25519_public
from engine.ppp.room_crypto import (ble_grant_decrypt, ble_grant_encrypt, decrypt_message,
                                    encrypt_message, my_member_token, new_knock_key,
                                    new_room_id, new_room_key)
from engine.ppp.tokens import room_signing_identity
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream

from ppp_wire import Ws, ahttp, pack, unpack

ALEX = (52.5219, 13.4132)          # Alexanderplatz, Berlin
NEAR = (52.5255, 13.4170)          # ~500 m north-east
FAR = (52.9700, 13.4132)           # ~50 km north
TIMEOUT = 60.0


def cell(latlon, level: int) -> s2sphere.CellId:
    return s2sphere.CellId.from_lat_lng(s2sphere.LatLng.from_degrees(*latlon)).parent(level)


def map_view(latlon, level: int = 10) -> list[str]:
    """The cells a client asks about: its own and the 8 around it (§C.3's "~9 cells")."""
    c = cell(latlon, level)
    return [c.to_token()] + [n.to_token() for n in c.get_all_neighbors(level)]


def identity(sk: SigningKey) -> Identity:
    return Identity.from_seed(bytes(sk))


async def discover(ws: Ws, tokens: list[str]) -> set[bytes]:
    found = set()
    for t in tokens:
        r = await ws.call({"cmd": "DISCOVER_ROOMS", "s2_cell_id": t})
        assert r["cmd"] == "ROOMS", r
        found |= {info["room_id"] for info in r["rooms"]}
    return found


async def sealed(port: int, room_id: bytes, token: bytes, nonce: bytes, ct: bytes):
    body = pack({"room_id": room_id, "member_token": token, "nonce": nonce, "ciphertext": ct})
    status, resp, _ = await ahttp(port, "POST", "/v1/room/submit", body,
                                  {"Content-Type": "application/msgpack"})
    return status, (unpack(resp) if resp else None)


UNSOLICITED = {"ROOM_NOTIFY", "KEY_ROTATION_NOTIFY", "NOTIFY", "KNOCK_NOTIFY", "ADMITTED",
               "KICKED"}


class RoomWs(Ws):
    """Replies in order; unsolicited frames (C.4 notifications) kept aside in `heard`."""

    def __init__(self, conn):
        super().__init__(conn)
        self.heard: list[dict] = []

    async def call(self, m: dict) -> dict:
        await self.send(m)
        while True:
            r = await self.recv()
            if r["cmd"] not in UNSOLICITED:
                return r
            self.heard.append(r)


async def recv_cmd(ws: RoomWs, cmd: str) -> dict:
    """The first unsolicited frame named `cmd`, heard already or next."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        for i, h in enumerate(ws.heard):
            if h["cmd"] == cmd:
                return ws.heard.pop(i)
        ws.heard.append(await ws.recv(timeout=max(0.1, deadline - time.monotonic())))


def create_room(room_id: bytes, *, gated=True, max_members=10, expires_in=3600) -> dict:
    return {"cmd": "CREATE_ROOM", "room_id": room_id,
            "s2_cell_id": cell(ALEX, 16).to_token(), "s2_coarse_id": cell(ALEX, 10).to_token(),
            "gated": gated, "proximity_required": False, "ble_enabled": True,
            "max_members": max_members, "expires_at": int(time.time()) + expires_in,
            "name": "ignored", "description_public": False}


@pytest.fixture(scope="module")
def rooms_run(spark, tmp_path_factory):
    from runtime import config
    s = config.load(None, env={}, data_dir=str(tmp_path_factory.mktemp("rooms") / "data"))
    for sect, attr in (("trueseal", "push_port"), ("trueseal", "receive_port"),
                       ("heya", "port"), ("ppp", "port"), ("sync", "port"),
                       ("sync", "iroh_port")):
        setattr(getattr(s, sect), attr, 0)
    s.stream.trigger_interval_ms = 100
    s.heya.enabled = False
    s.ppp.notify_window_ms = 100
    query, _ = start_inbox_stream(spark, s, fsync=False)
    try:
        out = asyncio.run(_scenario(s))
    finally:
        query.stop()
    return s, out


async def _scenario(settings) -> dict:
    admin_sk, member_sk, stranger_sk, far_sk = (SigningKey.generate() for _ in range(4))
    admin, member = identity(admin_sk), identity(member_sk)
    out: dict = {}
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.ppp.bound_port
        a = await RoomWs.login(port, admin_sk)
        m = await RoomWs.login(port, member_sk)
        x = await RoomWs.login(port, stranger_sk)
        far = await RoomWs.login(port, far_sk)
        room_id, room_key = new_room_id(), new_room_key()

        out["create"] = await a.call(create_room(room_id))
        out["create_again"] = await x.call(create_room(room_id))
        out["near_found"] = room_id in await discover(m, map_view(NEAR))
        out["far_found"] = room_id in await discover(far, map_view(FAR))
        out["fine_query"] = room_id in await discover(m, [cell(ALEX, 16).to_token()])
        r = await m.call({"cmd": "DISCOVER_ROOMS", "s2_cell_id": cell(ALEX, 10).to_token()})
        out["info"] = next(i for i in r["rooms"] if i["room_id"] == room_id)

        # Membership: the member's token from the room key (shared out of band here: knock /
        # admit is not served yet), signed by the admin over member_token || room_id.
        token = my_member_token(member, room_key, room_id)
        sig = admin_sk.sign(token + room_id).signature
        reg = {"cmd": "REGISTER_TOKEN", "room_id": room_id, "member_token": token,
               "admin_signature": sig}
        out["register"] = await a.call(reg)
        out["register_again"] = await a.call(reg)
        out["register_by_member"] = await m.call(reg)
        out["register_bad_sig"] = await a.call({**reg, "admin_signature": bytes(64)})
        out["members"] = (await m.call({"cmd": "DISCOVER_ROOMS",
                                        "s2_cell_id": cell(ALEX, 10).to_token()}))["rooms"]

        # Messages: the member sealed, the admin over the WebSocket, the stranger refused.
        n1, c1 = encrypt_message(member, room_key, room_id, "hello from the fountain",
                                 int(time.time()))
        out["sealed1"] = await sealed(port, room_id, token, n1, c1)
        n2, c2 = encrypt_message(admin, room_key, room_id, "welcome", int(time.time()))
        store2 = {"cmd": "STORE_ROOM", "room_id": room_id, "nonce": n2, "ciphertext": c2}
        out["store2"] = await a.call(store2)
        out["store2_again"] = await a.call(store2)
        out["stranger_store"] = await x.call(store2 | {"nonce": bytes(24)})
        out["stranger_sealed"] = await sealed(port, room_id, bytes(12), n1, c1)
        out["fetch"] = await m.call({"cmd": "FETCH_ROOM", "room_id": room_id, "since_id": 0})
        out["fetch_since_1"] = await m.call({"cmd": "FETCH_ROOM", "room_id": room_id,
                                             "since_id": 1})
        out["plain"] = [decrypt_message(room_key, room_id, msg["nonce"], msg["ciphertext"])
                        for msg in out["fetch"]["messages"]]
        out["senders"] = (room_signing_identity(member, room_id).pubkey,
                          room_signing_identity(admin, room_id).pubkey)

        # ROOM_NOTIFY: the member subscribed by fetching.
        n3, c3 = encrypt_message(admin, room_key, room_id, "third", int(time.time()))
        out["store3"] = await a.call({"cmd": "STORE_ROOM", "room_id": room_id, "nonce": n3,
                                      "ciphertext": c3})
        out["room_notify"] = await recv_cmd(m, "ROOM_NOTIFY")

        # Admin commands from others.
        out["non_admin"] = [await x.call(c) for c in (
            {"cmd": "UPDATE_ROOM", "room_id": room_id, "gated": False},
            {"cmd": "REVOKE_TOKENS", "room_id": room_id},
            {"cmd": "ROTATE_ROOM_KEY", "room_id": room_id, "grace_seconds": 0})]
        out["update"] = await a.call({"cmd": "UPDATE_ROOM", "room_id": room_id,
                                      "gated": True, "proximity_required": True})

        # Rotation with a 6 s grace: the old token works until grace_until, not after.
        out["rotate"] = await a.call({"cmd": "ROTATE_ROOM_KEY", "room_id": room_id,
                                      "grace_seconds": 6})
        assert out["rotate"]["cmd"] == "KEY_ROTATED", out["rotate"]
        out["rotation_notify"] = await recv_cmd(m, "KEY_ROTATION_NOTIFY")
        n4, c4 = encrypt_message(member, room_key, room_id, "in grace", int(time.time()))
        out["sealed_in_grace"] = await sealed(port, room_id, token, n4, c4)
        await asyncio.sleep(max(0.0, out["rotate"]["grace_until"] - time.time()) + 0.2)
        n5, c5 = encrypt_message(member, room_key, room_id, "too late", int(time.time()))
        out["sealed_after_grace"] = await sealed(port, room_id, token, n5, c5)
        new_key = new_room_key()
        token2 = my_member_token(member, new_key, room_id)
        out["register_new"] = await a.call({
            "cmd": "REGISTER_TOKEN", "room_id": room_id, "member_token": token2,
            "admin_signature": admin_sk.sign(token2 + room_id).signature})
        out["revoke"] = await a.call({"cmd": "REVOKE_TOKENS", "room_id": room_id})
        n6, c6 = encrypt_message(member, new_key, room_id, "revoked", int(time.time()))
        out["sealed_revoked"] = await sealed(port, room_id, token2, n6, c6)

        # The member cap: a room for one.
        small = new_room_id()
        await a.call(create_room(small, max_members=1))
        toks = [my_member_token(identity(SigningKey.generate()), room_key, small)
                for _ in range(2)]
        out["cap"] = [await a.call({"cmd": "REGISTER_TOKEN", "room_id": small,
                                    "member_token": t,
                                    "admin_signature": admin_sk.sign(t + small).signature})
                      for t in toks]

        # Expiry: a room that lives 2 s.
        brief = new_room_id()
        out["brief"] = await a.call(create_room(brief, gated=False, expires_in=2))
        await asyncio.sleep(2.2)
        out["expired"] = [await a.call(c) for c in (
            {"cmd": "FETCH_ROOM", "room_id": brief, "since_id": 0},
            {"cmd": "STORE_ROOM", "room_id": brief, "nonce": n1, "ciphertext": c1})]
        out["expired_sealed"] = await sealed(port, brief, token, n1, c1)
        out["expired_found"] = brief in await discover(m, map_view(NEAR))
        out["unknown"] = await m.call({"cmd": "FETCH_ROOM", "room_id": bytes(16),
                                       "since_id": 0})
        out["kick_off"] = await a.call({"cmd": "KICK_MEMBER", "room_id": room_id,
                                        "member_pubkey": bytes(x_pk := bytes(
                                            stranger_sk.verify_key))})
        for w in (a, m, x, far):
            await w.close()
    finally:
        await node.close()
    # A restart with moderation on: the room, its tokens and messages are read back.
    settings.ppp.moderation = True
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        out.update(await _phase_two(node.ppp.bound_port, room_id, room_key, admin_sk,
                                    stranger_sk))
    finally:
        settings.ppp.moderation = False
        await node.close()
    return out


async def _phase_two(port, room_id, room_key, admin_sk, knocker_sk) -> dict:
    out: dict = {}
    admin = identity(admin_sk)
    a = await RoomWs.login(port, admin_sk)
    k = await RoomWs.login(port, knocker_sk)
    out["after_restart"] = await k.call({"cmd": "FETCH_ROOM", "room_id": room_id,
                                         "since_id": 0})
    # Knock / admit (§7.4) with the grant of the client library.
    eph_sk, eph_pk = new_knock_key()
    rid = os.urandom(16)
    out["knock"] = await k.call({"cmd": "KNOCK", "room_id": room_id,
                                 "knocker_eph_x25519_pk": eph_pk, "request_id": rid,
                                 "handle": "carol"})
    out["knock_again"] = await k.call({"cmd": "KNOCK", "room_id": room_id,
                                       "knocker_eph_x25519_pk": eph_pk, "request_id": rid})
    note = await recv_cmd(a, "KNOCK_NOTIFY")
    out["knock_notify"] = note
    out["admit_by_knocker"] = await k.call({"cmd": "ADMIT", "room_id": room_id,
                                            "request_id": rid})
    grant = ble_grant_encrypt(admin.x25519_sk, note["knocker_eph_x25519_pk"], room_id,
                              room_key)
    out["admit"] = await a.call({"cmd": "ADMIT", "room_id": room_id, "request_id": rid,
                                 "encrypted_grant": grant})
    out["admit_twice"] = await a.call({"cmd": "ADMIT", "room_id": room_id, "request_id": rid})
    got = await recv_cmd(k, "ADMITTED")
    out["admitted"] = got
    out["grant_opened"] = ble_grant_decrypt(eph_sk, x25519_public(got["admin_pubkey"]),
                                            got["encrypted_grant"])
    knocker = identity(knocker_sk)
    token = my_member_token(knocker, out["grant_opened"][1], room_id)
    out["register_knocker"] = await a.call({
        "cmd": "REGISTER_TOKEN", "room_id": room_id, "member_token": token,
        "admin_signature": admin_sk.sign(token + room_id).signature})
    n, c = encrypt_message(knocker, room_key, room_id, "admitted!", int(time.time()))
    out["knocker_sealed"] = await sealed(port, room_id, token, n, c)
    # Groups (§7.6): never discovered; deleted all at once.
    gid = new_room_id()
    out["group"] = await a.call({"cmd": "CREATE_GROUP", "room_id": gid, "gated": False,
                                 "max_members": 20, "description_public": False})
    out["group_found"] = gid in await discover(k, map_view(NEAR))
    n, c = encrypt_message(admin, room_key, gid, "group hello", int(time.time()))
    out["group_store"] = await k.call({"cmd": "STORE_ROOM", "room_id": gid, "nonce": n,
                                       "ciphertext": c})
    out["group_fetch"] = await k.call({"cmd": "FETCH_ROOM", "room_id": gid, "since_id": 0})
    out["group_knock"] = await k.call({"cmd": "KNOCK", "room_id": gid,
                                       "knocker_eph_x25519_pk": eph_pk})
    out["delete_by_other"] = await k.call({"cmd": "DELETE_GROUP", "room_id": gid})
    out["delete_room"] = await a.call({"cmd": "DELETE_GROUP", "room_id": room_id})
    out["delete"] = await a.call({"cmd": "DELETE_GROUP", "room_id": gid})
    out["after_delete"] = [await k.call(cmd) for cmd in (
        {"cmd": "FETCH_ROOM", "room_id": gid, "since_id": 0},
        {"cmd": "STORE_ROOM", "room_id": gid, "nonce": n, "ciphertext": c})]
    # Moderation on (§7.7).
    kp = bytes(knocker_sk.verify_key)
    out["kick_by_member"] = await k.call({"cmd": "KICK_MEMBER", "room_id": room_id,
                                          "member_pubkey": admin.pubkey})
    out["kick"] = await a.call({"cmd": "KICK_MEMBER", "room_id": room_id, "member_pubkey": kp})
    out["kicked"] = await recv_cmd(k, "KICKED")
    out["ban"] = await a.call({"cmd": "BAN_MEMBER", "room_id": room_id, "member_pubkey": kp})
    out["banned"] = [await k.call(cmd) for cmd in (
        {"cmd": "KNOCK", "room_id": room_id, "knocker_eph_x25519_pk": eph_pk},
        {"cmd": "FETCH_ROOM", "room_id": room_id, "since_id": 0},
        {"cmd": "STORE_ROOM", "room_id": room_id, "nonce": n, "ciphertext": c})]
    for w in (a, k):
        await w.close()
    return out


def _fail(r: dict, reason: str) -> bool:
    return r["cmd"] == "STORE_FAIL" and r["reason"].startswith(reason + " (request ")


def test_create_and_discover_by_real_coordinates(rooms_run):
    _, out = rooms_run
    assert out["create"]["cmd"] == "ROOM_CREATED"
    assert _fail(out["create_again"], "room exists")
    assert out["near_found"] and not out["far_found"] and out["fine_query"]
    info = out["info"]
    assert info["s2_cell_id"] == cell(ALEX, 16).to_token()
    assert info["gated"] is True and info["ble_enabled"] is True
    assert info["member_count"] == 0 and info["expires_at"] > info["created_at"]
    assert not out["expired_found"]


def test_membership_tokens(rooms_run):
    _, out = rooms_run
    assert out["register"] == {"cmd": "TOKEN_REGISTERED"}
    assert out["register_again"] == {"cmd": "TOKEN_REGISTERED"}     # idempotent
    assert _fail(out["register_by_member"], "not room admin")
    assert _fail(out["register_bad_sig"], "bad admin signature")
    assert [r["member_count"] for r in out["members"] if r["gated"]] == [1]
    assert out["cap"][0] == {"cmd": "TOKEN_REGISTERED"}
    assert _fail(out["cap"][1], "room full")


def test_messages_sealed_and_authenticated_are_numbered_by_the_stream(rooms_run):
    settings, out = rooms_run
    room_stored = out["sealed1"]
    assert room_stored[0] == 200 and room_stored[1]["cmd"] == "ROOM_STORED"
    assert room_stored[1]["sequence_number"] == 1
    assert out["store2"]["cmd"] == "ROOM_STORED" and out["store2"]["sequence_number"] == 2
    assert out["store2_again"] == out["store2"]          # the same bytes: the same message
    assert _fail(out["stranger_store"], "member token required")
    assert out["stranger_sealed"] == (401, None)
    msgs = out["fetch"]["messages"]
    assert [m["id"] for m in msgs] == [1, 2]
    assert all(abs(m["stored_at"] - time.time()) < 600 for m in msgs)
    assert [m["id"] for m in out["fetch_since_1"]["messages"]] == [2]
    assert [p.body for p in out["plain"]] == ["hello from the fountain", "welcome"]
    assert tuple(p.sender for p in out["plain"]) == out["senders"]
    assert out["store3"]["sequence_number"] == 3
    assert out["room_notify"]["count"] >= 1

    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    rows = [r for r in inbox if r[C.PROTOCOL] == "ppp_room"]
    by_room: dict[bytes, list[int]] = {}
    for r in rows:
        by_room.setdefault(r[C.MAILBOX], []).append(r[C.CURSOR])
    for cursors in by_room.values():          # gap-free from 1, once each
        assert sorted(cursors) == list(range(1, len(cursors) + 1))
    # 3 messages + "in grace" + the knocker's after the restart; the group's one
    assert sorted(len(c) for c in by_room.values()) == [1, 5]
    audit = DeltaTable(str(Layout.of(settings).padding_audit)).to_pyarrow_table()
    room_audit = [r for r in audit.to_pylist() if r[C.PROTOCOL] == "ppp_room"]
    assert sum(r[C.ENVELOPES] for r in room_audit) == 6
    assert all(r[C.CONFORMING] for r in room_audit)


def test_rotation_grace_and_revocation(rooms_run):
    _, out = rooms_run
    assert [_fail(r, "not room admin") for r in out["non_admin"]] == [True] * 3
    assert out["update"]["cmd"] == "ROOM_UPDATED"
    rot = out["rotate"]
    assert rot["cmd"] == "KEY_ROTATED" and rot["revoked_count"] == 1
    assert out["rotation_notify"]["grace_until"] == rot["grace_until"]
    assert out["sealed_in_grace"][0] == 200
    assert out["sealed_after_grace"] == (401, None)
    assert out["register_new"] == {"cmd": "TOKEN_REGISTERED"}
    assert out["revoke"] == {"cmd": "TOKENS_REVOKED", "count": 1}
    assert out["sealed_revoked"] == (401, None)


def test_knock_admit_grant_after_a_restart(rooms_run):
    _, out = rooms_run
    assert [m["id"] for m in out["after_restart"]["messages"]] == [1, 2, 3, 4]
    rid = out["knock"]["request_id"]
    assert out["knock"]["cmd"] == "KNOCK_OK" and len(rid) == 16
    assert _fail(out["knock_again"], "duplicate request id")
    note = out["knock_notify"]
    assert (note["request_id"], note["handle"]) == (rid, "carol")
    assert _fail(out["admit_by_knocker"], "not room admin")
    assert out["admit"]["cmd"] == "ADMIT_OK" and out["admit"]["request_id"] == rid
    assert _fail(out["admit_twice"], "unknown knock")
    assert out["admitted"]["request_id"] == rid
    assert out["grant_opened"][0] == out["admitted"]["room_id"]
    assert out["register_knocker"] == {"cmd": "TOKEN_REGISTERED"}
    assert out["knocker_sealed"][0] == 200
    assert out["knocker_sealed"][1]["sequence_number"] == 5


def test_groups_are_hidden_and_deleted_whole(rooms_run):
    _, out = rooms_run
    assert out["group"]["cmd"] == "GROUP_CREATED" and not out["group_found"]
    assert out["group_store"]["sequence_number"] == 1
    assert [m["id"] for m in out["group_fetch"]["messages"]] == [1]
    assert out["group_knock"]["cmd"] == "KNOCK_OK"       # a group takes knocks (§7.6)
    assert _fail(out["delete_by_other"], "not room admin")
    assert _fail(out["delete_room"], "not a group")
    assert out["delete"]["cmd"] == "GROUP_DELETED"
    assert [_fail(r, "unknown room") for r in out["after_delete"]] == [True, True]


def test_moderation_off_then_on(rooms_run):
    _, out = rooms_run
    assert _fail(out["kick_off"], "feature disabled")
    assert _fail(out["kick_by_member"], "not room admin")
    assert out["kick"]["cmd"] == "MEMBER_KICKED"
    assert out["kicked"]["room_id"] == out["kick"]["room_id"]
    assert out["ban"]["cmd"] == "MEMBER_BANNED"
    assert [_fail(r, "banned") for r in out["banned"]] == [True] * 3


def test_expired_and_unknown_rooms_refuse(rooms_run):
    _, out = rooms_run
    assert out["brief"]["cmd"] == "ROOM_CREATED"
    assert [_fail(r, "room expired") for r in out["expired"]] == [True, True]
    assert out["expired_sealed"] == (410, None)
    assert _fail(out["unknown"], "unknown room")


def test_cli_walks_the_room_flow(spark, settings, tmp_path, capsys):
    """`relay ppp room ...` as a person runs it, against the real relay and stream: create
    at a position, discover from nearby, hand the member's token to the admin, send
    authenticated and sealed, fetch decrypted, rotate, revoke."""
    from jobs.inbox_stream import start_inbox_stream
    from relay import cli
    from relay import ppp_rooms as R
    from test_ppp_client import NodeThread

    def run(*argv) -> list[dict]:
        cli.main(list(argv))
        return [__import__("json").loads(x) for x in capsys.readouterr().out.splitlines()]

    settings.stream.trigger_interval_ms = 100
    settings.ppp.notify_window_ms = 0
    query, _ = start_inbox_stream(spark, settings, fsync=False)
    node = NodeThread(settings)
    try:
        url = ["--url", node.url]
        admin, member = str(tmp_path / "admin.seed"), str(tmp_path / "member.seed")
        cli.main(["ppp", "keygen", "--out", admin])
        cli.main(["ppp", "keygen", "--out", member])
        capsys.readouterr()
        room = str(tmp_path / "room.json")
        (made,) = run("ppp", "room", "create", "--seed", admin, "--lat", str(ALEX[0]),
                      "--lon", str(ALEX[1]), "--out", room, "--max-members", "5", "--ble", *url)
        assert oct(os.stat(room).st_mode & 0o777) == "0o600"
        found = run("ppp", "room", "discover", "--seed", member, "--lat", str(NEAR[0]),
                    "--lon", str(NEAR[1]), *url)
        assert made["room_id"] in [f["room_id"] for f in found]
        assert run("ppp", "room", "discover", "--seed", member, "--lat", str(FAR[0]),
                   "--lon", str(FAR[1]), *url) == []
        (tok,) = run("ppp", "room", "token", "--seed", member, "--room", room, *url)
        assert run("ppp", "room", "register", "--seed", admin, "--room", room, "--token",
                   tok["member_token"], *url) == [{"registered": True}]
        (s1,) = run("ppp", "room", "send", "--seed", admin, "--room", room, "--text", "hi", *url)
        (s2,) = run("ppp", "room", "send", "--seed", member, "--room", room, "--text",
                    "sealed \u2603", "--sealed", *url)
        assert (s1["sequence_number"], s2["sequence_number"]) == (1, 2)
        got = run("ppp", "room", "fetch", "--seed", member, "--room", room, *url)
        assert [(g["id"], g["text"]) for g in got] == [(1, "hi"), (2, "sealed \u2603")]
        new_room = str(tmp_path / "room2.json")
        (rot,) = run("ppp", "room", "rotate", "--seed", admin, "--room", room, "--grace", "0",
                     "--out", new_room, *url)
        assert rot["revoked_count"] == 2          # the admin's own token and the member's
        with pytest.raises(SystemExit):           # the old token: refused (grace 0)
            run("ppp", "room", "send", "--seed", member, "--room", room, "--text", "x",
                "--sealed", *url)
        assert "HTTP 401" in capsys.readouterr().err
        (s3,) = run("ppp", "room", "send", "--seed", admin, "--room", new_room, "--text",
                    "new key", "--sealed", *url)
        assert s3["sequence_number"] == 3
        assert run("ppp", "room", "revoke", "--seed", admin, "--room", room, *url) == [
            {"revoked": 1}]

        # Knock / admit from two terminals: the admin waits, a newcomer knocks.
        import threading
        from relay.ppp_client import read_seed
        newcomer = str(tmp_path / "new.seed")
        cli.main(["ppp", "keygen", "--out", newcomer])
        capsys.readouterr()
        admin_pk = read_seed(admin).pubkey
        waiter = threading.Thread(target=cli.main, args=([
            "ppp", "room", "admit", "--seed", admin, "--room", new_room, "--wait", "60",
            *url],))
        waiter.start()
        deadline = time.monotonic() + 30
        while admin_pk not in node.node.ppp.inbox.sessions:    # the admin is listening
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got_room = str(tmp_path / "knocked.json")
        cli.main(["ppp", "room", "knock", "--seed", newcomer, "--room-id", made["room_id"],
                  "--handle", "dora", "--out", got_room, *url])
        waiter.join(60)
        lines = [__import__("json").loads(x) for x in capsys.readouterr().out.splitlines()]
        admitted = next(x for x in lines if "handle" in x)
        knocked = next(x for x in lines if "member_token" in x)
        assert admitted["handle"] == "dora"
        assert R.RoomFile.read(got_room) == R.RoomFile.read(new_room)   # the current key
        assert run("ppp", "room", "register", "--seed", admin, "--room", new_room, "--token",
                   knocked["member_token"], *url) == [{"registered": True}]
        (s4,) = run("ppp", "room", "send", "--seed", newcomer, "--room", got_room, "--text",
                    "knocked in", "--sealed", *url)
        assert s4["sequence_number"] == 4

        # A group by invitation (§7.6): GroupInvite Gift Wrap, join, register, send.
        group = str(tmp_path / "group.json")
        (g,) = run("ppp", "room", "create", "--group", "--seed", admin, "--out", group, *url)
        member_pk = read_seed(member).pubkey.hex()
        (inv,) = run("ppp", "room", "invite", "--seed", admin, "--room", group, "--to",
                     member_pk, "--name", "climbers", *url)
        deadline = time.monotonic() + 60
        while True:                           # the invite reaches the inbox via the stream
            joined = run("ppp", "room", "join", "--seed", member, "--out-dir", str(tmp_path),
                         *url)
            if joined or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [(j["room_id"], j["group_name"]) for j in joined] == [(g["room_id"], "climbers")]
        assert R.RoomFile.read(joined[0]["room_file"]) == R.RoomFile.read(group)
        run("ppp", "room", "register", "--seed", admin, "--room", group, "--token",
            joined[0]["member_token"], *url)
        (s5,) = run("ppp", "room", "send", "--seed", member, "--room", joined[0]["room_file"],
                    "--text", "hello group", "--sealed", *url)
        assert s5["sequence_number"] == 1
    finally:
        node.close()
        query.stop()


def test_compaction_empties_the_deleted_group_and_keeps_the_room(rooms_run):
    """Last in this module: it compacts the run's tables."""
    from jobs.compact import run_compaction
    settings, out = rooms_run
    lines: list[str] = []
    run_compaction(settings, progress=lines.append)
    assert any("1 messages of deleted groups emptied" in line for line in lines), lines
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    rows = [r for r in inbox if r[C.PROTOCOL] == "ppp_room"]
    group = [r for r in rows if r[C.MAILBOX] == out["group"]["room_id"]]
    room = [r for r in rows if r[C.MAILBOX] == out["create"]["room_id"]]
    assert len(group) == 1 and group[0][C.ENVELOPE] is None     # the stream's tombstone
    assert len(room) == 5 and all(r[C.ENVELOPE] for r in room)
