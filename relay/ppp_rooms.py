"""PPP rooms from a terminal: the flows `relay ppp room ...` runs (spec 004 §7).

A room file holds what a member needs: the room id and the symmetric room key, as JSON,
created 0600 (the key reads every message of the room: handle it like a seed file). The
admin's `create` writes it (`--group`: a group, §7.6). A newcomer gets it one of three ways:
`knock` (§7.4: an ephemeral X25519 key to the relay; the admin, running `admit`, answers
with the key encrypted to it), `join` (§7.6: a GroupInvite Gift Wrap the admin sent with
`invite`), or out of band. The member prints its member token (`token`, also printed by
`knock` and `join`) for the admin, who registers it (`register`); then the member can send
sealed (`send --sealed`: anonymous, only the token identifies it) or over its authenticated
WebSocket, and `fetch` decrypts.

`discover` asks about the cell of a position and its eight neighbours at the discovery level
(a map view's ~9 cells, appendix C.3), so a room just across a cell border is found too.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import s2sphere

from engine.ppp.keys import Identity, x25519_public
from engine.ppp.room_crypto import (RoomMessageError, ble_grant_decrypt, ble_grant_encrypt,
                                    decrypt_message, encrypt_message, my_member_token,
                                    new_knock_key, new_room_id, new_room_key)
from engine.ppp.knocks import REQUEST_ID_LEN
from engine.ppp.wrap import GroupInviteContent, Kind, Rumor, WrapError, unwrap, wrap

from .ppp_client import DEFAULT_TTL, PppClient, http_base, submit_room_sealed

FINE_LEVEL = 16      # ~150 m: where the room is
COARSE_LEVEL = 10    # ~10 km: the area it is found from
DISCOVER_LEVEL = COARSE_LEVEL


@dataclass(frozen=True)
class RoomFile:
    room_id: bytes
    room_key: bytes

    def __repr__(self) -> str:
        return f"RoomFile({self.room_id.hex()}, key=<redacted>)"

    def write(self, path: str | Path, *, force: bool = False) -> None:
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
        fd = os.open(path, flags, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"room_id": self.room_id.hex(), "room_key": self.room_key.hex()}, f)
            f.write("\n")

    @classmethod
    def read(cls, path: str | Path) -> "RoomFile":
        try:
            m = json.loads(Path(path).read_text())
            room_id, key = bytes.fromhex(m["room_id"]), bytes.fromhex(m["room_key"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a room file") from e
        if len(room_id) != 16 or len(key) != 32:
            raise ValueError(f"{path}: not a room file")
        return cls(room_id, key)


def cells(lat: float, lon: float, level: int) -> list[str]:
    c = s2sphere.CellId.from_lat_lng(s2sphere.LatLng.from_degrees(lat, lon)).parent(level)
    return [c.to_token()] + [n.to_token() for n in c.get_all_neighbors(level)]


def room_info_json(info: dict) -> dict:
    return {k: (v.hex() if isinstance(v, bytes) else v) for k, v in info.items()}


async def create(url: str, admin: Identity, lat: float, lon: float, *, ttl: int, gated: bool,
                 max_members: int, ble: bool, out: str | Path) -> RoomFile:
    point = s2sphere.CellId.from_lat_lng(s2sphere.LatLng.from_degrees(lat, lon))
    return await _new_room(url, admin, out, lambda c, room: c.create_room(
        room.room_id, point.parent(FINE_LEVEL).to_token(), point.parent(COARSE_LEVEL).to_token(),
        expires_at=int(time.time()) + ttl, gated=gated, ble_enabled=ble,
        max_members=max_members))


async def create_group(url: str, admin: Identity, *, gated: bool, max_members: int,
                       out: str | Path) -> RoomFile:
    return await _new_room(url, admin, out, lambda c, room: c.create_group(
        room.room_id, gated=gated, max_members=max_members))


async def _new_room(url: str, admin: Identity, out: str | Path, create) -> RoomFile:
    """A fresh id and key, the room file first (a room the relay has but nobody holds the
    key of is useless), then `create(client, room)` and the admin's own member token (so it
    can send sealed too); the file goes again if the relay refused."""
    room = RoomFile(new_room_id(), new_room_key())
    room.write(out)
    try:
        async with await PppClient.connect(url, admin) as c:
            await create(c, room)
            await c.register_member_token(room.room_id,
                                          my_member_token(admin, room.room_key, room.room_id))
    except BaseException:
        Path(out).unlink(missing_ok=True)
        raise
    return room


async def knock(url: str, me: Identity, room_id: bytes, out: str | Path, *,
                handle: str | None = None, wait: float = 120.0) -> RoomFile:
    """KNOCK, wait for ADMITTED, open the grant, write the room file."""
    eph_sk, eph_pk = new_knock_key()
    async with await PppClient.connect(url, me) as c:
        rid = await c.knock(room_id, eph_pk, os.urandom(REQUEST_ID_LEN), handle)
        while True:
            m = await c.wait_room_news("ADMITTED", wait)
            if m.get("request_id") == rid:
                break
    if not isinstance(m.get("encrypted_grant"), bytes):
        raise ValueError("admitted without a grant: ask the admin for the room key")
    got_id, key = ble_grant_decrypt(eph_sk, x25519_public(m["admin_pubkey"]),
                                    m["encrypted_grant"])
    if got_id != room_id:
        raise ValueError("the grant names another room")
    room = RoomFile(room_id, key)
    room.write(out)
    return room


async def admit(url: str, admin: Identity, room: RoomFile, *, count: int = 1,
                wait: float = 120.0) -> list[dict]:
    """Answer the next `count` knocks on the room (each: the room key encrypted to the
    knock's ephemeral key); returns what each knock said (request id, handle)."""
    done = []
    async with await PppClient.connect(url, admin) as c:
        while len(done) < count:
            m = await c.wait_room_news("KNOCK_NOTIFY", wait)
            if m.get("room_id") != room.room_id:
                continue
            grant = ble_grant_encrypt(admin.x25519_sk, m["knocker_eph_x25519_pk"],
                                      room.room_id, room.room_key)
            await c.admit(room.room_id, m["request_id"], grant)
            done.append({"request_id": m["request_id"].hex(), "handle": m.get("handle")})
    return done


async def invite(url: str, admin: Identity, room: RoomFile, to: bytes, name: str) -> bytes:
    """A GroupInvite (0x09) Gift Wrap to `to` (§7.6); returns its event id."""
    now = int(time.time())
    gw = wrap(Rumor(admin.pubkey, Kind.GROUP_INVITE,
                    GroupInviteContent(room.room_id, room.room_key, name), now),
              admin, to, created_at=now, expires_at=now + DEFAULT_TTL)
    async with await PppClient.connect(url, admin) as c:
        return await c.store(gw)


async def join(url: str, me: Identity, out_dir: str | Path) -> list[dict]:
    """Room files from the GroupInvites waiting for me (`<out_dir>/<room id>.json`); those
    events are acked, everything else is left for `relay ppp receive`."""
    out = []
    async with await PppClient.connect(url, me) as c:
        acks = []
        for data in await c.fetch_all():
            try:
                opened = unwrap(data, me)
            except WrapError:
                continue
            inv = opened.rumor.content
            if not isinstance(inv, GroupInviteContent):
                continue
            path = Path(out_dir) / f"{inv.room_id.hex()}.json"
            RoomFile(inv.room_id, inv.room_key).write(path, force=True)
            acks.append(opened.giftwrap.event_id)
            out.append({"room_id": inv.room_id.hex(), "group_name": inv.group_name,
                        "from": opened.sender.hex(), "room_file": str(path),
                        "member_token": my_member_token(me, inv.room_key, inv.room_id).hex()})
        if acks:
            await c.ack(acks)
    return out


async def discover(url: str, me: Identity, lat: float, lon: float) -> list[dict]:
    found: dict[bytes, dict] = {}
    async with await PppClient.connect(url, me) as c:
        for token in cells(lat, lon, DISCOVER_LEVEL):
            for info in await c.discover_rooms(token):
                found[info["room_id"]] = info
    return sorted(found.values(), key=lambda i: -i.get("created_at", 0))


async def register(url: str, admin: Identity, room: RoomFile, member_token: bytes) -> None:
    async with await PppClient.connect(url, admin) as c:
        await c.register_member_token(room.room_id, member_token)


async def send(url: str, me: Identity, room: RoomFile, text: str, *, sealed: bool) -> int:
    nonce, ct = encrypt_message(me, room.room_key, room.room_id, text, int(time.time()))
    token = my_member_token(me, room.room_key, room.room_id)
    if sealed:
        return await submit_room_sealed(http_base(url), room.room_id, token, nonce, ct)
    async with await PppClient.connect(url, me) as c:
        return await c.store_room(room.room_id, nonce, ct, member_token=token)


async def fetch(url: str, me: Identity, room: RoomFile, since_id: int = 0) -> list[dict]:
    """Every message after `since_id` (pages of 100), decrypted: JSON-ready dicts."""
    out = []
    async with await PppClient.connect(url, me) as c:
        while True:
            page = await c.fetch_room(room.room_id, since_id)
            for m in page:
                line = {"id": m["id"], "stored_at": m["stored_at"]}
                try:
                    p = decrypt_message(room.room_key, room.room_id, m["nonce"],
                                        m["ciphertext"])
                    line.update(sender=p.sender.hex(), sent_at=p.sent_at, text=p.body)
                except RoomMessageError as e:
                    line["error"] = str(e)
                out.append(line)
            if len(page) < 100:
                return out
            since_id = page[-1]["id"]


async def rotate(url: str, admin: Identity, room: RoomFile, grace: int,
                 out: str | Path) -> tuple[RoomFile, dict]:
    """A new key in a new room file (`out`), then ROTATE_ROOM_KEY: the old tokens stay
    valid for the grace period, while members re-register tokens of the new key."""
    new = RoomFile(room.room_id, new_room_key())
    new.write(out)
    async with await PppClient.connect(url, admin) as c:
        reply = await c.rotate_room_key(room.room_id, grace)
        await c.register_member_token(room.room_id,
                                      my_member_token(admin, new.room_key, room.room_id))
    return new, reply


async def revoke(url: str, admin: Identity, room: RoomFile) -> int:
    async with await PppClient.connect(url, admin) as c:
        return await c.revoke_tokens(room.room_id)
