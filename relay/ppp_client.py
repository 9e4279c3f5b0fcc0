"""PPP client: the I/O half of the client library (the pure half is engine/ppp).

    async with await PppClient.connect("ws://127.0.0.1:8780/v1/ws", identity) as c:
        event_id = await c.store(giftwrap)                 # STORE -> STORED
        events, cursor = await c.fetch(since=0)             # FETCH -> EVENTS
        await c.ack([GiftWrap.decode(e).event_id for e in events])   # ACK -> ACKED
        await c.register_delivery_token(token)               # -> DELIVERY_TOKEN_REGISTERED
    event_id = await submit_sealed(http_base(url), token, giftwrap)   # POST /v1/note/submit

WebSocket (spec §5.1): every frame is a binary MessagePack map with a `cmd` field; on connect
the relay sends CHALLENGE {nonce}, we answer AUTH {pubkey, sig = Ed25519(nonce)}. Replies come
back in command order; an unsolicited NOTIFY {count} may arrive between them and is counted
(`notified`) and can be awaited (`wait_notify`); ROOM_NOTIFY and KEY_ROTATION_NOTIFY (§7) are
kept in `room_news`. A `*_FAIL` reply raises `PppRefused`. Room commands (§7) are methods
here too; `relay/ppp_rooms.py` has the flows the CLI runs.

Sealed submit (§6.3, appendix C.6): an anonymous HTTP POST of SealedNoteSubmit as
application/msgpack; no AUTH, the delivery token is the only identifier. Done with stdlib
urllib in a worker thread (httpx is not a dependency of this project).

Also here: the seed file (64 hex characters, mode 0600) and the two flows the CLI runs,
`send_presence` and `receive`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import websockets

from engine.ppp import carry
from engine.ppp.giftwrap import GiftWrap, GiftWrapError
from engine.ppp.ids import sealed_event_id
from engine.ppp.keys import Identity
from engine.ppp.tokens import recipient_delivery_token, sender_delivery_token
from engine.ppp.wrap import (GroupInviteContent, Kind, Opened, PresenceContent, Region,
                             Rumor, TimeWindow, WrapError, unwrap, wrap)

WS_PATH = "/v1/ws"
NOTE_SUBMIT_PATH = "/v1/note/submit"
DEFAULT_TTL = 7 * 86_400


class PppError(Exception):
    """Transport-level failure: connection closed, unexpected reply, HTTP error."""


class PppRefused(PppError):
    """The relay answered with a failure (AUTH_FAIL, STORE_FAIL, BACKUP_FAIL, HTTP 4xx)."""

    def __init__(self, cmd: str, reason: str, status: int | None = None):
        super().__init__(f"{cmd}: {reason}")
        self.cmd, self.reason, self.status = cmd, reason, status


def _pack(cmd: str, **fields: Any) -> bytes:
    return msgpack.packb({"cmd": cmd, **fields}, use_bin_type=True)


def ws_url(host: str, port: int, *, tls: bool = False) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'wss' if tls else 'ws'}://{host}:{port}{WS_PATH}"


def http_base(url: str) -> str:
    """ws://h:p/v1/ws -> http://h:p (wss -> https); an http(s) URL passes through."""
    u = urllib.parse.urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(u.scheme, u.scheme)
    return f"{scheme}://{u.netloc}"


# Unsolicited room frames (C.4): kept in `PppClient.room_news`, never taken for a reply.
ROOM_NEWS = frozenset({"ROOM_NOTIFY", "KEY_ROTATION_NOTIFY", "KNOCK_NOTIFY", "ADMITTED",
                       "KICKED"})


class PppClient:
    def __init__(self, ws, identity: Identity):
        self._ws = ws
        self.identity = identity
        self.notified = 0                    # sum of NOTIFY counts seen so far
        self._notify = asyncio.Event()
        self.room_news: list[dict] = []      # ROOM_NOTIFY / KEY_ROTATION_NOTIFY heard

    def __repr__(self) -> str:
        return f"PppClient({self.identity!r})"

    @classmethod
    async def connect(cls, url: str, identity: Identity, *, open_timeout: float = 10.0,
                      max_size: int = 1 << 24) -> "PppClient":
        """Open the WebSocket and authenticate; raises PppRefused on AUTH_FAIL."""
        ws = await websockets.connect(url, open_timeout=open_timeout, max_size=max_size)
        client = cls(ws, identity)
        try:
            challenge = await client._recv()
            if challenge.get("cmd") != "CHALLENGE" or not isinstance(challenge.get("nonce"),
                                                                     bytes):
                raise PppError(f"expected CHALLENGE, got {challenge.get('cmd')!r}")
            await client._send(_pack("AUTH", pubkey=identity.pubkey,
                                     sig=identity.sign(challenge["nonce"])))
            await client._expect("AUTH_OK")
        except BaseException:
            await ws.close()
            raise
        return client

    async def __aenter__(self) -> "PppClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._ws.close()

    async def _send(self, frame: bytes) -> None:
        await self._ws.send(frame)

    async def _recv(self, *, until_notify: bool = False, until_news: bool = False) -> dict:
        """The next reply; NOTIFY frames on the way are counted, and returned only
        `until_notify`."""
        while True:
            try:
                data = await self._ws.recv()
            except websockets.ConnectionClosed as e:
                raise PppError(f"connection closed ({e.rcvd.code if e.rcvd else 'no close frame'}"
                               f"{': ' + e.rcvd.reason if e.rcvd and e.rcvd.reason else ''})") from e
            if isinstance(data, str):
                data = data.encode()
            try:
                m = msgpack.unpackb(data, raw=False, strict_map_key=False)
            except Exception as e:   # msgpack raises several unrelated types
                raise PppError("relay sent malformed MessagePack") from e
            if not isinstance(m, dict) or not isinstance(m.get("cmd"), str):
                raise PppError("relay sent a frame without cmd")
            if m["cmd"] in ROOM_NEWS:
                self.room_news.append(m)
                if until_news:
                    return m
                continue
            if m["cmd"] == "NOTIFY":
                count = m.get("count", 0)
                self.notified += count if isinstance(count, int) else 0
                self._notify.set()
                if not until_notify:
                    continue
            return m

    async def _expect(self, cmd: str) -> dict:
        m = await self._recv()
        if m["cmd"] == cmd:
            return m
        if m["cmd"].endswith("_FAIL"):
            raise PppRefused(m["cmd"], str(m.get("reason", "")))
        raise PppError(f"expected {cmd}, got {m['cmd']}")

    async def _call(self, frame: bytes, reply: str) -> dict:
        await self._send(frame)
        return await self._expect(reply)

    async def store(self, event: GiftWrap | bytes) -> bytes:
        """STORE one GiftWrap; returns the event id the relay assigned (§4.5)."""
        data = event.encode() if isinstance(event, GiftWrap) else event
        return (await self._call(_pack("STORE", event=data), "STORED"))["event_id"]

    async def _page(self, cmd: str, reply: str, fields: dict[str, Any], cursor: int | None
                    ) -> tuple[list[bytes], int | None]:
        if cursor is not None:
            fields["cursor"] = cursor
        m = await self._call(_pack(cmd, **fields), reply)
        events = m.get("events")
        if not isinstance(events, list) or not all(isinstance(e, bytes) for e in events):
            raise PppError(f"{reply}.events must be a list of bytes")
        return events, m.get("cursor")

    @staticmethod
    async def _pages(page, max_pages: int) -> list[bytes]:
        """Every page of `page(cursor)` (FETCH, FETCH_CARRY), until the relay says none is left."""
        out, cursor = [], None
        for _ in range(max_pages):
            events, next_cursor = await page(cursor)
            out.extend(events)
            if next_cursor is None or not events or next_cursor == cursor:
                break
            cursor = next_cursor
        return out

    async def fetch(self, since: int = 0, cursor: int | None = None
                    ) -> tuple[list[bytes], int | None]:
        """One FETCH page: encoded GiftWraps and the cursor of the next page (None: last)."""
        return await self._page("FETCH", "EVENTS", {"since": since}, cursor)

    async def fetch_all(self, since: int = 0, max_pages: int = 1000) -> list[bytes]:
        return await self._pages(lambda c: self.fetch(since, c), max_pages)

    async def ack(self, event_ids: list[bytes]) -> int:
        return int((await self._call(_pack("ACK", event_ids=list(event_ids)), "ACKED"))["count"])

    async def register_delivery_token(self, token: bytes) -> None:
        await self._call(_pack("REGISTER_DELIVERY_TOKEN", delivery_token=token),
                         "DELIVERY_TOKEN_REGISTERED")

    async def register_push(self, platform: str, token: str) -> None:
        """REGISTER_PUSH: wake this identity's device through `platform` when it is offline."""
        await self._call(_pack("REGISTER_PUSH", platform=platform, token=token),
                         "PUSH_REGISTERED")

    async def deregister_delivery_token(self, token: bytes) -> None:
        await self._call(_pack("DEREGISTER_DELIVERY_TOKEN", delivery_token=token),
                         "DELIVERY_TOKEN_DEREGISTERED")

    # --- backups (§6 backups, C.1) -------------------------------------------------------------
    async def store_backup(self, ciphertext: bytes) -> dict:
        """STORE_BACKUP (upsert): {version, stored_at}."""
        m = await self._call(_pack("STORE_BACKUP", ciphertext=ciphertext), "BACKUP_STORED")
        return {"version": m["version"], "stored_at": m["stored_at"]}

    async def fetch_backup(self) -> dict | None:
        """FETCH_BACKUP: {ciphertext, version, stored_at}, or None (BACKUP_EMPTY)."""
        await self._send(_pack("FETCH_BACKUP"))
        m = await self._recv()
        if m["cmd"] == "BACKUP_EMPTY":
            return None
        if m["cmd"] == "BACKUP_FAIL":
            raise PppRefused(m["cmd"], str(m.get("reason", "")))
        if m["cmd"] != "BACKUP" or not isinstance(m.get("ciphertext"), bytes):
            raise PppError(f"expected BACKUP, got {m['cmd']}")
        return {k: m[k] for k in ("ciphertext", "version", "stored_at")}

    async def delete_backup(self) -> None:
        await self._call(_pack("DELETE_BACKUP"), "BACKUP_DELETED")

    # --- carry groups (§8, engine/ppp/carry.py) ----------------------------------------------
    async def register_carry_group(self, group_id: bytes, members, couriers) -> None:
        """REGISTER_CARRY_GROUP signed by this identity: as the group's owner the first time,
        else this member's consent to exactly that group."""
        d = carry.Definition.of(members, couriers)
        await self._call(_pack("REGISTER_CARRY_GROUP", group_id=group_id,
                               members=list(d.members), couriers=list(d.couriers),
                               sig=self.identity.sign(carry.register_message(group_id, d))),
                         "CARRY_GROUP_REGISTERED")

    async def leave_carry_group(self, group_id: bytes) -> None:
        await self._call(_pack("LEAVE_CARRY_GROUP", group_id=group_id,
                               sig=self.identity.sign(carry.leave_message(group_id))),
                         "CARRY_GROUP_LEFT")

    async def fetch_carry(self, group_id: bytes, since: int = 0, cursor: int | None = None
                          ) -> tuple[list[bytes], int | None]:
        """One FETCH_CARRY page (a courier of the group): GiftWraps and the next cursor."""
        return await self._page("FETCH_CARRY", "CARRY_EVENTS", {
            "group_id": group_id, "since": since,
            "sig": self.identity.sign(carry.fetch_message(group_id, since))}, cursor)

    async def fetch_carry_all(self, group_id: bytes, since: int = 0,
                              max_pages: int = 1000) -> list[bytes]:
        return await self._pages(lambda c: self.fetch_carry(group_id, since, c), max_pages)

    async def ack_carry(self, group_id: bytes, event_ids: list[bytes]) -> int:
        """ACK_CARRY: events this courier handed over; the relay stops offering them."""
        return int((await self._call(_pack("ACK_CARRY", group_id=group_id,
                                           event_ids=list(event_ids)), "ACKED"))["count"])

    # --- rooms (§7) ------------------------------------------------------------------------------
    async def create_room(self, room_id: bytes, s2_cell_id: str, s2_coarse_id: str, *,
                          expires_at: int, gated: bool = True, ble_enabled: bool = False,
                          max_members: int = 100) -> None:
        await self._call(_pack("CREATE_ROOM", room_id=room_id, s2_cell_id=s2_cell_id,
                               s2_coarse_id=s2_coarse_id, gated=gated, proximity_required=False,
                               ble_enabled=ble_enabled, max_members=max_members,
                               expires_at=expires_at, description_public=False),
                         "ROOM_CREATED")

    async def discover_rooms(self, s2_cell_id: str) -> list[dict]:
        m = await self._call(_pack("DISCOVER_ROOMS", s2_cell_id=s2_cell_id), "ROOMS")
        rooms = m.get("rooms")
        if not isinstance(rooms, list):
            raise PppError("ROOMS.rooms must be a list")
        return rooms

    async def register_member_token(self, room_id: bytes, member_token: bytes) -> None:
        """Admin only: signs member_token || room_id with this identity (§7.3)."""
        await self._call(_pack("REGISTER_TOKEN", room_id=room_id, member_token=member_token,
                               admin_signature=self.identity.sign(member_token + room_id)),
                         "TOKEN_REGISTERED")

    async def revoke_tokens(self, room_id: bytes) -> int:
        return int((await self._call(_pack("REVOKE_TOKENS", room_id=room_id),
                                     "TOKENS_REVOKED"))["count"])

    async def rotate_room_key(self, room_id: bytes, grace_seconds: int) -> dict:
        return await self._call(_pack("ROTATE_ROOM_KEY", room_id=room_id,
                                      grace_seconds=grace_seconds), "KEY_ROTATED")

    async def store_room(self, room_id: bytes, nonce: bytes, ciphertext: bytes,
                         member_token: bytes | None = None) -> int:
        """STORE_ROOM; returns the sequence number the relay's stream assigned."""
        fields: dict[str, Any] = {"room_id": room_id, "nonce": nonce, "ciphertext": ciphertext}
        if member_token is not None:
            fields["member_token"] = member_token
        return int((await self._call(_pack("STORE_ROOM", **fields),
                                     "ROOM_STORED"))["sequence_number"])

    async def fetch_room(self, room_id: bytes, since_id: int = 0) -> list[dict]:
        """One FETCH_ROOM page (up to 100): RoomMessageWire maps {id, nonce, ciphertext,
        stored_at}."""
        m = await self._call(_pack("FETCH_ROOM", room_id=room_id, since_id=since_id),
                             "ROOM_MESSAGES")
        msgs = m.get("messages")
        if not isinstance(msgs, list):
            raise PppError("ROOM_MESSAGES.messages must be a list")
        return msgs

    async def knock(self, room_id: bytes, eph_pk: bytes, request_id: bytes,
                    handle: str | None = None) -> bytes:
        fields: dict[str, Any] = {"room_id": room_id, "knocker_eph_x25519_pk": eph_pk,
                                  "request_id": request_id}
        if handle is not None:
            fields["handle"] = handle
        return (await self._call(_pack("KNOCK", **fields), "KNOCK_OK"))["request_id"]

    async def admit(self, room_id: bytes, request_id: bytes, grant: bytes | None) -> None:
        fields: dict[str, Any] = {"room_id": room_id, "request_id": request_id}
        if grant is not None:
            fields["encrypted_grant"] = grant
        await self._call(_pack("ADMIT", **fields), "ADMIT_OK")

    async def update_room(self, room_id: bytes, *, gated: bool | None = None,
                          proximity_required: bool | None = None) -> None:
        """UPDATE_ROOM (admin only, §7.1): flags left None are unchanged."""
        await self._call(_pack("UPDATE_ROOM", room_id=room_id, gated=gated,
                               proximity_required=proximity_required), "ROOM_UPDATED")

    async def kick_member(self, room_id: bytes, member: bytes, reason: str | None = None
                          ) -> None:
        """KICK_MEMBER (admin, §7.7): temporary, the member may knock again. A relay with
        moderation off answers STORE_FAIL "feature disabled" (PppRefused)."""
        fields: dict[str, Any] = {"room_id": room_id, "member_pubkey": member}
        if reason is not None:
            fields["reason"] = reason
        await self._call(_pack("KICK_MEMBER", **fields), "MEMBER_KICKED")

    async def ban_member(self, room_id: bytes, member: bytes, reason: str | None = None
                         ) -> None:
        """BAN_MEMBER (admin, §7.7): permanent for the room."""
        fields: dict[str, Any] = {"room_id": room_id, "member_pubkey": member}
        if reason is not None:
            fields["reason"] = reason
        await self._call(_pack("BAN_MEMBER", **fields), "MEMBER_BANNED")

    async def create_group(self, room_id: bytes, *, gated: bool = True,
                           max_members: int = 100) -> None:
        await self._call(_pack("CREATE_GROUP", room_id=room_id, gated=gated,
                               max_members=max_members, description_public=False),
                         "GROUP_CREATED")

    async def delete_group(self, room_id: bytes) -> None:
        await self._call(_pack("DELETE_GROUP", room_id=room_id), "GROUP_DELETED")

    async def wait_room_news(self, cmd: str, timeout: float | None = None) -> dict:
        """The first unsolicited `cmd` frame (KNOCK_NOTIFY, ADMITTED, ...), heard already or
        next. Only call it with no command outstanding."""
        async def until():
            while True:
                for i, m in enumerate(self.room_news):
                    if m["cmd"] == cmd:
                        return self.room_news.pop(i)
                m = await self._recv(until_news=True)
                if m["cmd"] not in ROOM_NEWS:
                    raise PppError(f"unexpected {m['cmd']} while waiting for {cmd}")
        return await asyncio.wait_for(until(), timeout)

    # --- contact discovery (§9) ----------------------------------------------------------------
    async def discovery_pepper(self) -> dict:
        """{pepper, pepper_id, rotates_at}."""
        return await self._call(_pack("DISCOVERY_PEPPER"), "DISCOVERY_PEPPER")

    async def discovery_publish(self, hashes: list[bytes], pepper_id: int) -> int:
        return int((await self._call(_pack("DISCOVERY_PUBLISH", hashes=list(hashes),
                                           pubkey=self.identity.pubkey, pepper_id=pepper_id),
                                     "DISCOVERY_PUBLISHED"))["count"])

    async def discovery_query(self, hashes: list[bytes], pepper_id: int) -> list[dict]:
        m = await self._call(_pack("DISCOVERY_QUERY", hashes=list(hashes), pepper_id=pepper_id),
                             "DISCOVERY_MATCHES")
        matches = m.get("matches")
        if not isinstance(matches, list):
            raise PppError("DISCOVERY_MATCHES.matches must be a list")
        return matches

    async def wait_notify(self, timeout: float | None = None) -> int:
        """Wait for a NOTIFY (reads frames until one comes); returns the total seen so far.
        Only call it with no command outstanding."""
        async def until():
            m = await self._recv(until_notify=True)
            if m["cmd"] != "NOTIFY":
                raise PppError(f"unexpected {m['cmd']} while waiting for NOTIFY")
        if not self._notify.is_set():
            await asyncio.wait_for(until(), timeout)
        self._notify.clear()
        return self.notified


# --- HTTP polling (§5.2): for devices without a persistent connection ------------------------

class PollingClient:
    """STORE / FETCH / ACK over plain HTTP requests, each signed on its own:
    `Authorization: PPP-Ed25519 <pubkey_hex>:<sig_hex>` with `X-PPP-Timestamp`, the
    signature over body || timestamp for a POST and over `GET <path?query>` || timestamp
    for a GET (engine/ppp/protocol.py `http_get_signed_body`: the path is covered, so a
    captured signature reads nothing else). §5.2: poll every `DEFAULT_INTERVAL` (30 s);
    a refusal carries the relay's Retry-After (`PppRefused.retry_after`) for the caller's
    next poll."""

    DEFAULT_INTERVAL = 30.0

    def __init__(self, url: str, identity: Identity, *, timeout: float = 10.0,
                 clock=time.time):
        self.base = http_base(url).rstrip("/")
        self.identity = identity
        self.timeout = timeout
        self.clock = clock

    def headers(self, signed: bytes) -> dict[str, str]:
        from engine.ppp.protocol import http_signed_message
        ts = str(int(self.clock()))
        sig = self.identity.sign(http_signed_message(signed, ts))
        return {"Authorization": f"PPP-Ed25519 {self.identity.pubkey_hex}:{sig.hex()}",
                "X-PPP-Timestamp": ts, "Content-Type": "application/msgpack"}

    def _request(self, method: str, target: str, body: bytes | None) -> tuple[int, bytes, dict]:
        from engine.ppp.protocol import http_get_signed_body
        signed = body if method == "POST" else http_get_signed_body(target.encode())
        req = urllib.request.Request(self.base + target, data=body, method=method,
                                     headers=self.headers(signed or b""))
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    async def _call(self, method: str, target: str, body: bytes | None, reply: str) -> dict:
        status, raw, headers = await asyncio.to_thread(self._request, method, target, body)
        try:
            m = msgpack.unpackb(raw, raw=False) if raw else {}
        except Exception:   # msgpack raises several unrelated types
            m = {}
        if status == 200 and isinstance(m, dict) and m.get("cmd") == reply:
            return m
        reason = m.get("reason") if isinstance(m, dict) else None
        err = PppRefused(f"HTTP {method} {target.split('?')[0]}",
                         f"HTTP {status} {reason or 'refused'}", status)
        err.retry_after = headers.get("Retry-After")
        raise err

    async def store(self, gw: GiftWrap) -> bytes:
        body = msgpack.packb({"event": gw.encode()}, use_bin_type=True)
        return (await self._call("POST", "/v1/events", body, "STORED"))["event_id"]

    async def fetch(self, since: int = 0, cursor: int | None = None
                    ) -> tuple[list[bytes], int | None]:
        target = f"/v1/events?since={int(since)}" + (f"&cursor={int(cursor)}"
                                                      if cursor is not None else "")
        m = await self._call("GET", target, None, "EVENTS")
        return list(m.get("events", [])), m.get("cursor")

    async def fetch_all(self, since: int = 0, max_pages: int = 1000) -> list[bytes]:
        return await PppClient._pages(lambda c: self.fetch(since, c), max_pages)

    async def ack(self, event_ids: list[bytes]) -> int:
        body = msgpack.packb({"event_ids": list(event_ids)}, use_bin_type=True)
        return int((await self._call("POST", "/v1/events/ack", body, "ACKED"))["count"])


async def receive_polling(url: str, me: Identity, *, since: int = 0, ack: bool = False
                          ) -> list[Received]:
    """`receive` over HTTP polling (§5.2) instead of the WebSocket."""
    c = PollingClient(url, me)
    got = [open_event(e, me) for e in await c.fetch_all(since)]
    ids = [r.event_id for r in got if r.opened is not None]
    if ack and ids:
        await c.ack(ids)
        for r in got:
            r.acked = r.opened is not None
    return got


# --- sealed sender over HTTP (§6.3) -------------------------------------------------------------

def sealed_note_body(token: bytes, gw: GiftWrap) -> bytes:
    """SealedNoteSubmit (appendix C.6): the GiftWrap minus its recipient, plus the token."""
    return msgpack.packb({"delivery_token": token, "ephemeral_pk": gw.ephemeral_pk,
                          "nonce": gw.nonce, "ciphertext": gw.ciphertext,
                          "created_at": gw.created_at, "expires_at": gw.expires_at},
                         use_bin_type=True)


def _post(url: str, body: bytes, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/msgpack"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


_HTTP_REASONS = {400: "malformed or expired", 401: "unknown delivery token",
                 409: "duplicate event", 413: "body too large", 429: "rate limited",
                 503: "storage unavailable"}


async def submit_sealed(base_url: str, token: bytes, gw: GiftWrap, *,
                        timeout: float = 10.0) -> bytes:
    """POST /v1/note/submit; returns the sealed-path event id (§4.5): the relay's STORED
    reply if it sent one, else computed locally. Raises PppRefused with the HTTP status on
    4xx/5xx (401 unknown token, 409 duplicate, 429 rate limited)."""
    status, body = await asyncio.to_thread(_post, base_url.rstrip("/") + NOTE_SUBMIT_PATH,
                                           sealed_note_body(token, gw), timeout)
    if not 200 <= status < 300:
        reason = _reason(body) or _HTTP_REASONS.get(status, "refused")
        raise PppRefused("note/submit", f"HTTP {status} {reason}", status)
    local = sealed_event_id(gw.ephemeral_pk, gw.nonce, gw.ciphertext, token, gw.created_at)
    try:
        reply = msgpack.unpackb(body, raw=False) if body else None
    except Exception:   # msgpack raises several unrelated types; the local id stands
        reply = None
    if isinstance(reply, dict) and isinstance(reply.get("event_id"), bytes):
        return reply["event_id"]
    return local


ROOM_SUBMIT_PATH = "/v1/room/submit"
_ROOM_HTTP_REASONS = {202: "stored, not numbered yet: send the same message again",
                      400: "malformed", 401: "member token not valid for this room",
                      404: "unknown room", 410: "room expired", 413: "body too large",
                      429: "rate limited", 503: "storage unavailable"}


async def submit_room_sealed(base_url: str, room_id: bytes, member_token: bytes, nonce: bytes,
                             ciphertext: bytes, *, timeout: float = 30.0) -> int:
    """POST /v1/room/submit (C.6 SealedRoomSubmit); returns the sequence number. Anything
    but 200 raises PppRefused with the status."""
    body = msgpack.packb({"room_id": room_id, "member_token": member_token, "nonce": nonce,
                          "ciphertext": ciphertext}, use_bin_type=True)
    status, resp = await asyncio.to_thread(_post, base_url.rstrip("/") + ROOM_SUBMIT_PATH,
                                           body, timeout)
    if status != 200:
        raise PppRefused("room/submit", f"HTTP {status} "
                         f"{_reason(resp) or _ROOM_HTTP_REASONS.get(status, 'refused')}", status)
    try:
        return int(msgpack.unpackb(resp, raw=False)["sequence_number"])
    except Exception as e:   # msgpack's errors, KeyError, TypeError
        raise PppError("relay sent no ROOM_STORED") from e


async def discover_contacts(url: str, me: Identity, contacts: list[str],
                            publish: list[str] = ()) -> list[dict]:
    """§9's discovery cycle: fetch the pepper, (re-)publish my own identifiers under it,
    ask about my contacts' (normalised and hashed here: nothing plain leaves this process),
    and map the matches back to the identifiers I asked about."""
    from engine.ppp.discovery import (MAX_QUERY_HASHES, IdentifierError, identifier_hash,
                                      normalize)
    asked: dict[bytes, str] = {}
    out = []
    async with await PppClient.connect(url, me) as c:
        p = await c.discovery_pepper()
        pepper, pid = p["pepper"], p["pepper_id"]
        if publish:
            await c.discovery_publish([identifier_hash(normalize(i), pepper) for i in publish],
                                      pid)
        for ident in contacts:
            try:
                asked[identifier_hash(normalize(ident), pepper)] = ident
            except IdentifierError as e:
                out.append({"identifier": ident, "error": str(e)})
        hashes = list(asked)
        for i in range(0, len(hashes), MAX_QUERY_HASHES):
            for m in await c.discovery_query(hashes[i:i + MAX_QUERY_HASHES], pid):
                out.append({"identifier": asked.get(m["hash"], "?"), "pubkey": m["pubkey"].hex()})
    return out


def _reason(body: bytes) -> str:
    for decode in (lambda b: msgpack.unpackb(b, raw=False), json.loads):
        try:
            m = decode(body)
        except Exception:   # either decoder's errors
            continue
        if isinstance(m, dict):
            for k in ("reason", "detail", "error"):
                if isinstance(m.get(k), str):
                    return m[k]
    return body[:200].decode("utf-8", "replace") if body else ""


# --- seed file ------------------------------------------------------------------------------

def write_seed(path: str | Path, identity: Identity, *, force: bool = False) -> None:
    """64 hex characters and a newline, created 0600 (never widened by umask)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (identity.seed.hex() + "\n").encode())
    finally:
        os.close(fd)


def read_seed(path: str | Path) -> Identity:
    raw = Path(path).read_bytes()
    text = raw.strip()
    try:
        seed = bytes.fromhex(text.decode("ascii")) if len(text) == 64 else raw
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a PPP seed file (64 hex characters)") from e
    if len(seed) != 32:
        raise ValueError(f"{path}: not a PPP seed file (64 hex characters)")
    return Identity.from_seed(seed)


def seed_file_too_open(path: str | Path) -> bool:
    return bool(os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO))


# --- the flows the CLI runs -------------------------------------------------------------------

def build_presence(sender: Identity, recipient_pk: bytes, text: str, *, lat: float = 0.0,
                   lon: float = 0.0, radius_m: int = 50_000, ttl: int = DEFAULT_TTL,
                   now: int | None = None, timezone: str = "UTC",
                   route_to: bytes | None = None,
                   presence_id: bytes | None = None) -> GiftWrap:
    """A PRESENCE event to one recipient, discoverable from now until now + ttl (routed to
    a blinded mailbox with `route_to`)."""
    now = int(time.time()) if now is None else now
    content = PresenceContent(presence_id or uuid.uuid4().bytes, text,
                              Region(float(lat), float(lon), radius_m),
                              TimeWindow(now, now + ttl, timezone), (recipient_pk,))
    rumor = Rumor(sender.pubkey, Kind.PRESENCE, content, now)
    return wrap(rumor, sender, recipient_pk, created_at=now, expires_at=now + ttl,
                route_to=route_to)


@dataclass
class SendResult:
    event_id: bytes
    via: str                 # "ws", "sealed" or "ws-fallback" (sealed failed, then STORE)
    size: int                # bytes of the GiftWrap ciphertext the relay sees
    note: str | None = None  # why a sealed send fell back

    def to_json(self) -> dict:
        out = {"event_id": self.event_id.hex(), "via": self.via, "ciphertext_bytes": self.size}
        if self.note:
            out["fallback_reason"] = self.note
        return out


async def send_presence(url: str, sender: Identity, recipient_pk: bytes, text: str, *,
                        sealed: bool = False, token: bytes | None = None,
                        **presence) -> SendResult:
    """Build and deliver one PRESENCE event (`deliver`: sealed falls back to STORE)."""
    gw = build_presence(sender, recipient_pk, text, **presence)
    if sealed:
        token = token or sender_delivery_token(sender, recipient_pk)
    return await deliver(url, sender, gw, token=token if sealed else None)


# --- delivery that never blocks: sealed first, authenticated STORE as fallback, and the
# --- offline queue (§6.3 fallback, §12 offline creation; relay/ppp_device.py keeps it) ----

class PppUnreachable(PppError):
    """No relay answered (connection refused, timed out, DNS): the event can be queued."""


def _unreachable(e: BaseException) -> bool:
    return isinstance(e, (OSError, asyncio.TimeoutError, PppUnreachable)) or (
        isinstance(e, PppError) and not isinstance(e, PppRefused)
        and "connection closed" in str(e))


# Sealed answers worth retrying before falling back (§6.3 "SHOULD retry sealed
# submission"), and those that mean it will not work for this pair now (fallback at once).
_SEALED_RETRY = frozenset({429, 500, 502, 503, 504})
_SEALED_NO_TOKEN = frozenset({401, 404, 405})


async def deliver(url: str, sender: Identity, gw: GiftWrap, *, token: bytes | None = None,
                  sealed_tries: int = 2, backoff: float = 0.5,
                  fallback: bool = True) -> SendResult:
    """Deliver one GiftWrap: sealed with `token` if given, retried `sealed_tries` times on a
    rate limit or a server error, then (or at once on 401, the token not registered) by
    authenticated STORE: fallback degrades privacy (the relay learns the sender) but never
    blocks delivery (§6.3). A duplicate refusal means the relay already holds these exact
    bytes (an earlier try whose answer was lost): that is delivered. Raises PppUnreachable
    when no relay answered at all, PppRefused when the relay refused the event itself.
    `fallback=False`: a sealed send that fails raises instead (the sender stays hidden or
    nothing is sent)."""
    fallback_reason = None
    if token is not None:
        for attempt in range(max(1, sealed_tries)):
            try:
                return SendResult(await submit_sealed(http_base(url), token, gw), "sealed",
                                  len(gw.ciphertext))
            except PppRefused as e:
                if e.status == 409:
                    return SendResult(sealed_event_id(gw.ephemeral_pk, gw.nonce, gw.ciphertext,
                                                      token, gw.created_at), "sealed",
                                      len(gw.ciphertext))
                if not fallback or (e.status not in _SEALED_NO_TOKEN
                                    and e.status not in _SEALED_RETRY):
                    raise                         # the event itself is refused (400, 413)
                fallback_reason = f"sealed HTTP {e.status}"
                if e.status in _SEALED_NO_TOKEN:
                    break
            except (OSError, asyncio.TimeoutError) as e:
                if not fallback:
                    raise PppUnreachable(f"relay unreachable: {e}") from e
                fallback_reason = f"sealed unreachable ({e.__class__.__name__})"
            if attempt + 1 < sealed_tries:
                await asyncio.sleep(backoff * (2 ** attempt))
    try:
        async with await PppClient.connect(url, sender) as c:
            try:
                event_id = await c.store(gw)
            except PppRefused as e:
                if "duplicate" not in e.reason.lower():
                    raise
                event_id = gw.event_id
    except (OSError, asyncio.TimeoutError) as e:
        raise PppUnreachable(f"relay unreachable: {e.__class__.__name__}: {e}") from e
    via = "ws" if token is None else "ws-fallback"
    result = SendResult(event_id, via, len(gw.ciphertext))
    if fallback_reason:
        result.note = fallback_reason
    return result


class Outbox:
    """Events waiting for a relay (§12: created and queued offline, delivered when the relay
    is reachable again), kept in the device's outbox.json. Each entry holds the encrypted
    GiftWrap itself, so every retry sends the same bytes: idempotent at the relay."""

    def __init__(self, device):
        self.device = device

    def entries(self) -> list[dict]:
        return self.device.load("outbox", [])

    def add(self, gw: GiftWrap, *, token: bytes | None, error: str, now: int,
            blinded_for: bytes | None = None) -> dict:
        """Queue `gw`; `blinded_for` (the recipient) marks an event routed to a blinded
        mailbox: it is re-routed to the mailbox of the day it is finally sent, because the
        recipient stops walking a day's mailbox once that day is over and emptied."""
        entry = {"event": gw.encode().hex(), "event_id": gw.event_id.hex(),
                 "token": token.hex() if token else None, "queued_at": now,
                 "expires_at": gw.expires_at, "attempts": 1, "last_error": error,
                 "blinded_for": blinded_for.hex() if blinded_for else None}
        self.device.save("outbox", self.entries() + [entry])
        return entry

    async def flush(self, url: str, sender: Identity, *, now: int | None = None
                    ) -> list[dict]:
        """Try every queued event once; delivered and refused ones leave the queue, those
        still unreachable stay (attempts counted). Returns one report per entry tried."""
        now = int(time.time()) if now is None else now
        keep, report = [], []
        for e in self.entries():
            gw = GiftWrap.decode(bytes.fromhex(e["event"]))
            token = bytes.fromhex(e["token"]) if e["token"] else None
            if gw.expires_at <= now:
                report.append({"event_id": e["event_id"], "dropped": "expired"})
                continue
            if e.get("blinded_for"):
                from engine.ppp.blinded import (epoch_of, mailbox_delivery_token,
                                                their_mailbox_id)
                rk = bytes.fromhex(e["blinded_for"])
                box = their_mailbox_id(sender, rk, epoch_of(now))
                gw = dataclasses.replace(gw, recipient=box)   # the layers do not bind the route
                token = mailbox_delivery_token(sender, rk, box) if token else None
            try:
                r = await deliver(url, sender, gw, token=token)
            except PppRefused as err:
                report.append({"event_id": e["event_id"], "dropped": str(err)})
                continue
            except (PppError, OSError, asyncio.TimeoutError) as err:
                if not _unreachable(err):
                    raise
                e["attempts"] += 1
                e["last_error"] = str(err)
                keep.append(e)
                report.append({"event_id": e["event_id"], "queued": True,
                               "attempts": e["attempts"]})
                continue
            report.append({**r.to_json(), "queued_at": e["queued_at"]})
        self.device.save("outbox", keep)
        return report

    async def flush_until_empty(self, url: str, sender: Identity, *, wait: float,
                                first_delay: float = 1.0, max_delay: float = 60.0
                                ) -> list[dict]:
        """Retry with exponential backoff until the queue is empty or `wait` seconds pass."""
        deadline = time.monotonic() + wait
        delay, done = first_delay, []
        while True:
            done += [r for r in await self.flush(url, sender) if not r.get("queued")]
            if not self.entries() or time.monotonic() + delay > deadline:
                return done + [{"event_id": e["event_id"], "queued": True,
                                "attempts": e["attempts"]} for e in self.entries()]
            await asyncio.sleep(delay)
            delay = min(max_delay, delay * 2)


# --- backups from the client (§6 backups; engine/ppp/backup.py) ---------------------------

async def backup_create(url: str, me: Identity, phrase: str, snapshot: dict, *,
                        passphrase: str = "") -> dict:
    """Encrypt the device's state under the phrase's backup key and STORE_BACKUP it."""
    from engine.ppp.backup import backup_key, identity_from_mnemonic, seal_backup
    if identity_from_mnemonic(phrase).pubkey != me.pubkey:
        raise ValueError("that recovery phrase belongs to another identity")
    blob = seal_backup(snapshot, backup_key(phrase, passphrase))
    async with await PppClient.connect(url, me) as c:
        return {**await c.store_backup(blob), "bytes": len(blob)}


async def backup_show(url: str, me: Identity) -> dict | None:
    """What the relay holds: {version, stored_at, bytes}, or None."""
    async with await PppClient.connect(url, me) as c:
        b = await c.fetch_backup()
    return None if b is None else {"version": b["version"], "stored_at": b["stored_at"],
                                   "bytes": len(b["ciphertext"])}


async def backup_restore(url: str, phrase: str, *, passphrase: str = ""
                         ) -> tuple[Identity, dict | None, dict | None]:
    """A new device from the phrase alone: the identity, the relay's backup opened (None if
    there is none), and its {version, stored_at}."""
    from engine.ppp.backup import backup_key, identity_from_mnemonic, open_backup
    me = identity_from_mnemonic(phrase)
    async with await PppClient.connect(url, me) as c:
        b = await c.fetch_backup()
    if b is None:
        return me, None, None
    return (me, open_backup(b["ciphertext"], backup_key(phrase, passphrase)),
            {"version": b["version"], "stored_at": b["stored_at"]})


# --- the other event kinds (§4.2-4.3): REVOKE, KEY_ROTATION, KEY_EXCHANGE_RETURN ----------

def build_event(sender: Identity, recipient_pk: bytes, kind: int, content: Any, *,
                ttl: int = DEFAULT_TTL, now: int | None = None) -> GiftWrap:
    """Any rumor kind, gift-wrapped to one recipient (content as §4.3 gives it)."""
    now = int(time.time()) if now is None else now
    return wrap(Rumor(sender.pubkey, int(kind), content, now), sender, recipient_pk,
                created_at=now, expires_at=now + ttl)


def revoke_content(presence_id: bytes) -> dict:
    return {"event_id": presence_id}              # §4.3 RevokeContent


def key_exchange_return_content(me: Identity, initiator_pk: bytes) -> dict:
    return {"initiator_pubkey": initiator_pk, "responder_pubkey": me.pubkey}


def apply_received(device, me: Identity, got: list[Received], *, now: int | None = None
                   ) -> list[dict]:
    """What a received event changes on the device, after it opened and its seal verified:
    REVOKE removes the revoked message from the kept mail (only if the same sender sent
    it); KEY_ROTATION from a pinned contact is a key change (alerted per its verification
    level, `engine/ppp/verify.py`); KEY_EXCHANGE_RETURN bound to me pins the responder at
    level 0 (TOFU). Returns one notice per change, for the user."""
    from engine.ppp import verify as V
    now = int(time.time()) if now is None else now
    contacts = device.load("contacts", {})
    notices: list[dict] = []
    for r in got:
        if r.opened is None:
            continue
        rumor = r.opened.rumor
        try:
            if rumor.kind == Kind.REVOKE:
                pid = rumor.content.get("event_id") if isinstance(rumor.content, dict) else None
                if not isinstance(pid, bytes):
                    raise V.VerifyError("malformed REVOKE content")
                n = device.remove_mail(pid.hex(), rumor.sender.hex())
                notices.append({"revoked": pid.hex(), "removed": n})
            elif rumor.kind == Kind.KEY_ROTATION:
                new_pk = V.check_key_rotation(rumor.sender, rumor.content)
                cid = V.by_pubkey(contacts, rumor.sender)
                if cid is None:
                    notices.append({"key_rotation": "from an unknown sender: ignored"})
                    continue
                change = V.observe_key(contacts, cid, new_pk, now=now)
                if change is not None:
                    notices.append({"key_change": dataclasses.asdict(change)})
            elif rumor.kind == Kind.KEY_EXCHANGE_RETURN:
                pk = V.check_key_exchange_return(me, rumor.sender, rumor.content)
                cid = V.by_pubkey(contacts, pk) or pk.hex()[:16]
                change = V.pin(contacts, cid, pk, level=0, via="key exchange return",
                               now=now)
                notices.append({"contact_added": cid, "pubkey": pk.hex(), "level": 0}
                               if change is None else {"key_change": dataclasses.asdict(change)})
        except V.VerifyError as e:
            notices.append({"event_id": r.event_id.hex(), "refused": str(e)})
    device.save("contacts", contacts)
    return notices


async def register_token(url: str, me: Identity, contact_pk: bytes) -> bytes:
    """Register the delivery token of (me, contact) for notes the contact sends me."""
    token = recipient_delivery_token(me, contact_pk)
    async with await PppClient.connect(url, me) as c:
        await c.register_delivery_token(token)
    return token


async def register_push(url: str, me: Identity, platform: str, token: str) -> None:
    async with await PppClient.connect(url, me) as c:
        await c.register_push(platform, token)


@dataclass
class Received:
    event_id: bytes
    opened: Opened | None = None
    error: str | None = None
    acked: bool = False
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"event_id": self.event_id.hex()}
        if self.opened is None:
            out["error"] = self.error
            return out
        r = self.opened.rumor
        out.update(sender=r.sender.hex(), kind=_kind_name(r.kind), created_at=r.created_at,
                   verified=True)
        if isinstance(r.content, PresenceContent):
            c = r.content
            out.update(presence_id=c.event_id.hex(), message=c.message,
                       region={"latitude": c.region.latitude, "longitude": c.region.longitude,
                               "radius_m": c.region.radius_m},
                       time_window={"starts_at": c.time_window.starts_at,
                                    "ends_at": c.time_window.ends_at,
                                    "timezone": c.time_window.timezone})
        elif isinstance(r.content, GroupInviteContent):   # the key stays in the event
            out.update(room_id=r.content.room_id.hex(), group_name=r.content.group_name)
        else:
            out["content"] = jsonable(r.content)
        out["expires_at"] = self.opened.giftwrap.expires_at
        out.update(self.extra)
        if self.acked:
            out["acked"] = True
        return out


def jsonable(v: Any) -> Any:
    """A decoded MessagePack value as JSON: bytes in hex (ids, keys), never a Python repr."""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def _kind_name(kind: int) -> str:
    try:
        return Kind(kind).name
    except ValueError:
        return f"0x{kind:02x}"


def open_event(data: bytes, me: Identity, mailbox: bytes | None = None) -> Received:
    """Unwrap and verify one fetched event; failures become a Received with `error`."""
    try:
        gw = GiftWrap.decode(data)
    except GiftWrapError as e:
        return Received(b"", error=f"giftwrap: {e}")
    try:
        return Received(gw.event_id, unwrap(gw, me, mailbox=mailbox))
    except WrapError as e:
        return Received(gw.event_id, error=str(e))


def build_blinded(sender: Identity, recipient_pk: bytes, text: str, *,
                  now: int | None = None, **presence) -> tuple[GiftWrap, bytes]:
    """A PRESENCE event routed to the recipient's blinded mailbox of `now`'s day
    (`engine/ppp/blinded.py`), and that mailbox's sealed delivery token of the pair."""
    from engine.ppp.blinded import epoch_of, mailbox_delivery_token, their_mailbox_id
    now = int(time.time()) if now is None else now
    mailbox_id = their_mailbox_id(sender, recipient_pk, epoch_of(now))
    gw = build_presence(sender, recipient_pk, text, now=now, route_to=mailbox_id, **presence)
    return gw, mailbox_delivery_token(sender, recipient_pk, mailbox_id)


async def send_blinded(url: str, sender: Identity, recipient_pk: bytes, text: str, *,
                       sealed: bool = False, now: int | None = None,
                       **presence) -> SendResult:
    """A PRESENCE event routed to the recipient's blinded mailbox for today (or `now`'s
    day). Sealed: that mailbox's delivery token of the pair, falling back to STORE."""
    gw, token = build_blinded(sender, recipient_pk, text, now=now, **presence)
    return await deliver(url, sender, gw, token=token if sealed else None)


async def receive_blinded(url: str, me: Identity, contacts: list[bytes], *,
                          now: int | None = None, ack: bool = False,
                          max_ttl: int | None = None, state: dict | None = None,
                          tokens_ahead: int = 7) -> list[Received]:
    """Every blinded mailbox of each contact that may still hold mail: each day back to the
    longest lifetime a sender may give an event (`max_ttl`, default 004 C.2's 30 days) and
    tomorrow, one session each, authenticated as the mailbox (only I can: blinded.py).

    `state` (a dict, kept by the caller between runs: `ppp_device.Device.blinded`) makes it
    cheap without missing anything: per contact, `drained_before` (days before it were
    emptied and acknowledged: the walk starts there) and `tokens_through` (the last day
    whose sealed delivery token is registered: today's and the next `tokens_ahead` days' are
    registered from their own sessions, so a contact can send sealed while I am offline)."""
    from engine.ppp.blinded import (MAX_EVENT_TTL_SECS, epoch_of, epochs_to_walk,
                                    mailbox_delivery_token, my_mailbox)
    now = int(time.time()) if now is None else now
    max_ttl = MAX_EVENT_TTL_SECS if max_ttl is None else max_ttl
    today = epoch_of(now)
    state = {} if state is None else state
    out: list[Received] = []
    for contact in contacts:
        st = state.setdefault(contact.hex(), {})
        tokens_through = st.get("tokens_through", today - 1)
        all_opened = True
        days = list(epochs_to_walk(now, max_ttl=max_ttl,
                                   drained_before=st.get("drained_before")))
        days += [e for e in range(tokens_through + 1, today + tokens_ahead + 1)
                 if e > days[-1]]
        for ep in days:
            box = my_mailbox(me, contact, ep)
            async with await PppClient.connect(url, box) as c:
                if tokens_through < ep and today <= ep <= today + tokens_ahead:
                    await c.register_delivery_token(
                        mailbox_delivery_token(me, contact, box.pubkey))
                    st["tokens_through"] = max(st.get("tokens_through", ep), ep)
                got = [open_event(e, me, box.pubkey) for e in await c.fetch_all()]
                ids = [r.event_id for r in got if r.opened is not None]
                all_opened &= len(ids) == len(got)
                if ack and ids:
                    await c.ack(ids)
                    for r in got:
                        r.acked = r.opened is not None
                for r in got:
                    r.extra["mailbox_epoch"] = ep
                out.extend(got)
        if ack and all_opened:
            # A sender writes to the mailbox of its own day; a day back covers its clock
            # running behind ours.
            st["drained_before"] = max(st.get("drained_before", 0), today - 1)
    return out


async def receive(url: str, me: Identity, *, since: int = 0, ack: bool = False
                  ) -> list[Received]:
    """FETCH every page, unwrap and verify each event; with `ack`, ACK those that opened.
    Events that fail to open are reported and left on the relay."""
    async with await PppClient.connect(url, me) as c:
        got = [open_event(e, me) for e in await c.fetch_all(since)]
        if ack:
            ids = [r.event_id for r in got if r.opened is not None]
            if ids:
                await c.ack(ids)
                for r in got:
                    r.acked = r.opened is not None
    return got
