"""The cursor-sync iroh endpoint on loopback, driven as a stock 0k-sync client drives it: an
iroh client on the same bindings (tests/sync_iroh_client.py), frames built byte by byte from
the interop notes (tests/sync_client.py) and the answers compared with the notes' golden
vectors; the real ingress node, real Delta tables, the stream's real sink (tests/sync_stream.py).

HELLO / WELCOME, PUSH / PUSH_ACK, NOTIFY on a uni stream, PULL, the device id from iroh's TLS,
refusals as empty FINs, the close codes (1 rate limited, 2 too many sessions, 3 hello
timeout), the frame cap, one group across both transports, and the endpoint id across a
restart. iroh's relays and discovery are off (loopback only).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import struct
import time

import iroh
import pytest

from ingress.sync_iroh import endpoint_id
from sync_client import (Device, SyncClient, arr, byte_arr, content_ref, frame, group_id, hello,
                         msg, parse, pull, push, s, uint)
from sync_iroh_client import IrohSyncClient, bind
from test_sync_shell import relay as quic_relay

GROUP = group_id(b"test")
BLOB = bytes(range(16))


@contextlib.asynccontextmanager
async def relay(settings, stream: bool = True):
    """test_sync_shell's relay (ingress node, sink driver); yields the iroh endpoint too."""
    async with quic_relay(settings, stream) as (_port, node, _driver):
        yield node.sync.iroh, node


async def dial(ep, endpoint=None) -> IrohSyncClient:
    return await IrohSyncClient.connect(ep.id, ep.addresses, endpoint)


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


# interop §1.3 golden vectors
HELLO_TEST = h("95 a5 48656c6c6f 01 a8 4d792050686f6e65 dc 00 20 cc88 2b cc82 ccff cc8d 66 cccd"
               " cc95 36 09 ccbe 43 ccf7 cc8d 76 56 cc84 ccbf 5d ccb7 ccb0 5f 44 ccf9 66 31 ccd6"
               " 32 00 57 cc86 cce8 00")
WELCOME_EMPTY = h("0000000c 94 a7 57656c636f6d65 01 00 00")
PUSH_VEC = h("94 a4 50757368 c410 000102030405060708090a0b0c0d0e0f 94 01 02 cc80 ccff 00")
PUSH_ACK_1 = h("93 a7 5075736841636b c410 000102030405060708090a0b0c0d0e0f 01")


def test_vectors_are_the_notes(settings):
    """The builders of the test client produce the notes' bytes (so the tests below speak
    the interop notes' wire, not the relay's encoder)."""
    assert hello(1, "My Phone", GROUP, 0) == HELLO_TEST
    assert push(BLOB, bytes([1, 2, 0x80, 0xFF]), 0) == PUSH_VEC


def test_stock_session_hello_push_notify_pull(settings):
    settings.sync.open_groups = True          # 0k-sync semantics: no Join (stock clients)
    asyncio.run(_stock_session(settings))


async def _stock_session(settings):
    async with relay(settings) as (ep, node):
        a, b = await dial(ep), await dial(ep)
        try:
            assert a.id != b.id
            # HELLO -> WELCOME{1, 0, 0}, byte for byte
            assert await a.send_raw(frame(HELLO_TEST)) == WELCOME_EMPTY
            assert await b.request(hello(1, "tablet", GROUP)) == ["Welcome", 1, 0, 0]
            # PUSH -> PUSH_ACK{blob, 1} after the inbox commit; NOTIFY{1, 1} to B only
            assert await a.send_raw(frame(PUSH_VEC)) == frame(PUSH_ACK_1)
            assert await b.next_uni_raw() == frame(h("93 a6 4e6f74696679 01 01"))
            # PULL after 0 -> PullResponse [[blob, 1, payload, ts]], has_more false, max 1
            out = await b.send_raw(frame(pull(0, 100)))
            body = out[4:]
            assert struct.unpack(">I", out[:4])[0] == len(body)
            assert body.startswith(h("94 ac 50756c6c526573706f6e7365 91 94 c410") + BLOB
                                   + h("01 94 01 02 cc80 ccff ce"))
            assert body.endswith(h("c2 01"))
            # the sender is the connection's iroh id, never a message field: B's own
            # push is not NOTIFYed back to B but to A
            assert (await b.request(push(bytes(16), b"\x07", 0)))[:3] == \
                ["PushAck", bytes(16), 2]
            assert await a.next_uni_raw() == frame(h("93 a6 4e6f74696679 02 01"))
            # a new connection of A's key sees both pending-free; WELCOME max_cursor 2
            c = await dial(ep, a.endpoint)
            assert await c.request(hello(1, "again", GROUP, 2)) == ["Welcome", 1, 2, 0]
        finally:
            await a.close()
            await b.close()


def test_refusals_are_empty_fins(settings):
    settings.sync.open_groups = True
    asyncio.run(_refusals(settings))


async def _refusals(settings):
    cap = settings.sync.max_message_size
    async with relay(settings, stream=False) as (ep, node):
        c = await dial(ep)
        try:
            # interop §2.7: anything before HELLO, a bad HELLO version, bad msgpack, an
            # unknown tag, a wrong element count: empty FIN, the connection stays open
            assert await c.send_raw(frame(pull(0, 100))) == b""
            assert await c.send_raw(frame(hello(0, "x", GROUP))) == b""
            assert await c.send_raw(frame(b"\xc1")) == b""
            assert await c.send_raw(frame(msg("Nope", uint(1)))) == b""
            assert await c.send_raw(frame(msg("Hello", uint(1), byte_arr(GROUP)))) == b""
            # ST-001: a prefix over the cap is refused before its body (none sent here)
            assert await c.send_raw(struct.pack(">I", cap + 1)) == b""
            # a frame with no FIN-terminated body: stream ended inside the frame
            assert await c.send_raw(struct.pack(">I", 10) + b"\x93") == b""
            assert await c.request(hello(1, "ok", GROUP)) == ["Welcome", 1, 0, 0]
            # a second HELLO is unexpected; ContentRef from a version-1 session too
            assert await c.send_raw(frame(hello(1, "ok", GROUP))) == b""
            # the frame cap itself: len == MAX is read (and refused as a message only)
            big = push(BLOB, b"\x01" * (cap - 40), 0)
            big += b"\x00" * (cap - len(big))
            assert len(big) == cap
            assert await c.send_raw(frame(big)) == b""
        finally:
            await c.close()
        assert node.sync.rejected["malformed"] >= 5


def test_close_codes(settings):
    settings.sync.open_groups = True
    settings.sync.connections_per_minute = 2
    settings.sync.hello_timeout_seconds = 0.5
    asyncio.run(_close_codes(settings))


async def _close_codes(settings):
    async with relay(settings, stream=False) as (ep, node):
        key = iroh.SecretKey.generate().to_bytes()
        dev = await bind(key)
        try:
            first = await dial(ep, dev)
            # F-006: no HELLO within the timeout -> closed, code 3
            assert "3" in await first.closed(5)
            second = await dial(ep, dev)
            assert await second.request(hello(1, "x", GROUP)) == ["Welcome", 1, 0, 0]
            # third connection of the same device id within the minute: code 1
            third = await dial(ep, dev)
            reason = await third.closed(5)
            assert "1" in reason and "rate limited" in reason
            # F-007: the session cap reached -> code 2 for the next device
            settings.sync.max_concurrent_sessions = len(node.sync.conns) + len(ep.conns)
            other = await dial(ep)
            reason = await other.closed(5)
            assert "2" in reason and "too many sessions" in reason
            await other.close()
        finally:
            await dev.close()
        assert node.sync.rejected["hello_timeout"] == 1
        assert node.sync.rejected["rate_limited"] == 1


def test_one_group_across_both_transports(settings):
    """A device on the aioquic listener (Auth challenge) and one on the iroh endpoint share
    the group, its cursors and NOTIFYs: one request core behind both."""
    settings.sync.open_groups = True
    asyncio.run(_both(settings))


async def _both(settings):
    async with relay(settings) as (ep, node):
        quic = await SyncClient.connect(node.sync.bound_port)
        dev = Device()
        assert await quic.authenticate(dev) == ["Done", "AuthProof"]
        assert await quic.request(hello(1, "laptop", GROUP)) == ["Welcome", 1, 0, 0]
        i = await dial(ep)
        try:
            assert await i.request(hello(1, "phone", GROUP)) == ["Welcome", 1, 0, 0]
            assert await i.request(push(BLOB, b"hi", 0)) == ["PushAck", BLOB, 1]
            assert await quic.next_uni() == ["Notify", 1, 1]
            assert (await quic.request(push(bytes(16), b"yo", 0))) == ["PushAck", bytes(16), 2]
            assert await i.next_uni_raw() == frame(h("93 a6 4e6f74696679 02 01"))
            got = await i.request(pull(0, 0))
            assert [e[1] for e in got[1]] == [1, 2] and got[3] == 2
        finally:
            await i.close()
            await quic.close()


def test_endpoint_id_survives_restart(settings):
    settings.sync.open_groups = True
    asyncio.run(_restart(settings))


async def _restart(settings):
    async with relay(settings) as (ep, node):
        first = ep.id
        c = await dial(ep)
        assert await c.request(hello(1, "x", GROUP)) == ["Welcome", 1, 0, 0]
        assert await c.request(push(BLOB, b"kept", 0)) == ["PushAck", BLOB, 1]
        await c.close()
    path = os.path.join(settings.data_dir, "keys", "sync_iroh.key")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    async with relay(settings) as (ep, node):
        assert ep.id == first == endpoint_id(settings)            # what `relay keys` prints
        assert node.listening()["sync_iroh"] == f"{first}@{ep.addresses[0]}"
        c = await dial(ep)
        try:
            assert await c.request(hello(1, "x", GROUP)) == ["Welcome", 1, 1, 1]
            got = await c.request(pull(0, 100))
            assert got[1][0][:2] == [BLOB, 1] and bytes(got[1][0][2]) == b"kept"
        finally:
            await c.close()


# --- the seed spec's form: Envelope{version, msg_type, ...} with the spec's structs ----------

def envelope(msg_type: int, payload: bytes, version: int = 1) -> bytes:
    """002 §5.1 by hand: [version, msg_type, sender_id, group_id, cursor, timestamp, nonce,
    payload], byte arrays as arrays of uints (rmp_serde), payload the spec struct's bytes."""
    return (arr(8) + uint(version) + uint(msg_type) + byte_arr(bytes(32)) + byte_arr(bytes(32))
            + uint(0) + uint(0) + byte_arr(bytes(24)) + byte_arr(payload))


def spec_hello(name: str, group: bytes, last: int = 0) -> bytes:
    return envelope(0x01, arr(4) + uint(1) + s(name) + byte_arr(group) + uint(last))


def spec_push(blob_id: bytes, payload: bytes, ttl: int = 0) -> bytes:
    return envelope(0x10, arr(3) + byte_arr(blob_id) + byte_arr(payload) + uint(ttl))


def spec_pull(after: int, limit: int) -> bytes:
    return envelope(0x20, arr(2) + uint(after) + uint(limit))


def opened(out: list) -> tuple[int, list]:
    """A relay Envelope -> (msg_type, the spec struct's fields)."""
    assert len(out) == 8 and out[0] == 1
    return out[1], parse(bytes(out[7]))


def test_spec_envelope_form(settings):
    settings.sync.open_groups = True
    asyncio.run(_spec_form(settings))


async def _spec_form(settings):
    async with relay(settings) as (ep, node):
        a, b = await dial(ep), await dial(ep)
        try:
            # ERROR for a version-1 session in the spec's form: PULL before HELLO -> 1003
            t, f = opened(await a.request(spec_pull(0, 10)))
            assert (t, f) == (0xFF, [1003, "Pull before HELLO"])
            # WELCOME{version, relay_id, max_cursor, pending_count}: relay_id = endpoint id
            t, f = opened(await a.request(spec_hello("spec-a", GROUP)))
            assert (t, f) == (0x02, [1, ep.id, 0, 0])
            assert opened(await b.request(spec_hello("spec-b", GROUP)))[1][2] == 0
            # PUSH_ACK{blob_id, cursor, timestamp}: the relay's clock
            before = int(time.time())
            t, f = opened(await a.request(spec_push(BLOB, b"\x01\x02\x03")))
            assert t == 0x11 and bytes(f[0]) == BLOB and f[1] == 1
            assert before - 1 <= f[2] <= int(time.time()) + 1
            # NOTIFY{blob_id, cursor, sender_id, timestamp, size} to B
            out = await b.next_uni_raw()
            t, f = opened(parse(out[4:]))
            assert t == 0x31 and bytes(f[0]) == BLOB and f[1] == 1 and bytes(f[2]) == a.id
            assert f[4] == 3
            # PULL_RESPONSE{[BlobEntry{blob_id, cursor, sender_id, payload, timestamp}], ...}
            t, f = opened(await b.request(spec_pull(0, 10)))
            assert t == 0x21 and f[1:] == [False, 1]
            entry = f[0][0]
            assert (bytes(entry[0]), entry[1], bytes(entry[2]), bytes(entry[3])) == \
                (BLOB, 1, a.id, b"\x01\x02\x03")
            # a tagged (0k-sync) device in the same group still gets 0k-sync's shapes
            c = await dial(ep)
            assert await c.request(hello(1, "stock", GROUP)) == ["Welcome", 1, 1, 1]
            got = await c.request(pull(0, 10))
            assert got[0] == "PullResponse" and len(got[1][0]) == 4     # no sender_id
            await c.close()
            # REVOKE_DEVICE (0x50, payload [device_id]) -> Done; B hears DEVICE_REVOKED (0x51)
            # as an Envelope, then is closed with code 4
            assert await a.request(envelope(0x50, arr(1) + byte_arr(b.id))) == \
                ["Done", "RevokeDevice"]
            t, f = opened(parse((await b.next_uni_raw())[4:]))
            assert (t, bytes(f[0])) == (0x51, b.id)
            assert "4" in await b.closed(5)
        finally:
            await a.close()
            await b.close()


def test_content_ref_reaches_offline_devices(settings):
    settings.sync.open_groups = True
    asyncio.run(_content_offline(settings))


async def _content_offline(settings):
    ref = content_ref(bytes(range(32)), bytes(24), 1000, 1016)
    async with relay(settings, stream=False) as (ep, node):
        later = await bind()
        a, b = await dial(ep), await dial(ep, later)
        try:
            assert (await a.request(hello(2, "a", GROUP)))[0] == "Welcome"
            assert (await b.request(hello(2, "b", GROUP)))[0] == "Welcome"
            await b.close()                                  # B goes offline (a member)
            await asyncio.sleep(0.2)
            assert await a.request(ref) == ["Done", "ContentRef"]
            b = await dial(ep, later)                        # B comes back: WELCOME, then it
            assert (await b.request(hello(2, "b", GROUP)))[0] == "Welcome"
            got = await b.next_uni_raw(10)
            assert parse(got[4:])[0] == "ContentRef" and got[4:] == ref
            # handed over once
            c = await dial(ep, later)
            assert (await c.request(hello(2, "b", GROUP)))[0] == "Welcome"
            with pytest.raises(asyncio.TimeoutError):
                await c.next_uni_raw(1)
            await c.close()
        finally:
            await a.close()
            await later.close()


# --- hostile clients, small: idle connections, handshake floods --------------------------------

def test_idle_connections_are_closed_and_forgotten(settings):
    settings.sync.hello_timeout_seconds = 0.5
    asyncio.run(_idle(settings))


async def _idle(settings):
    async with relay(settings, stream=False) as (ep, node):
        clients = [await dial(ep) for _ in range(20)]
        # held: in the sync listener's sessions gauge, and a wave the heap trimmer watches
        assert ep.wave in node.sync.admissions() and ep.wave.total == ep.wave.peak == 20
        for _ in range(50):
            if node.sync.connections == 20:
                break
            await asyncio.sleep(0.02)
        assert node.sync.connections == 20
        reasons = await asyncio.gather(*(c.closed(10) for c in clients))
        assert all("3" in r and "hello timeout" in r for r in reasons)
        await asyncio.sleep(0.2)
        assert not ep.conns and not ep._pending            # nothing held for them
        assert node.sync.rejected["hello_timeout"] == 20
        assert node.sync.connections == 0
        assert (ep.wave.total, ep.wave.released) == (0, 20)
        await asyncio.gather(*(c.close() for c in clients))


def test_handshake_flood_refused_or_validated(settings):
    asyncio.run(_flood(settings))


async def _flood(settings):
    async with relay(settings, stream=False) as (ep, node):
        # handshake budget spent: every new connection is refused before any TLS work
        settings.sync.max_handshakes = 0
        outcomes = await asyncio.gather(*(asyncio.wait_for(dial(ep), 5) for _ in range(10)),
                                        return_exceptions=True)
        assert all(isinstance(o, Exception) for o in outcomes)
        assert node.sync.rejected["handshake_full"] >= 10
        assert not ep.conns
        # under load (here: always) a new address must first echo a stateless Retry; a
        # real client does, and gets in
        settings.sync.max_handshakes = 500
        settings.sync.retry_above_handshakes = 0
        c = await dial(ep)
        try:
            assert node.sync.retries >= 1
            assert await c.request(hello(1, "x", GROUP)) == ["Welcome", 1, 0, 0]
        finally:
            await c.close()


def test_stock_client_in_a_group_with_membership(settings):
    """Membership on (the default): a stock client's first HELLO creates the group; a stock
    client with another key (sync-cli makes one per command) is refused with the empty FIN;
    the creator's key keeps working; a device that sends Join gets in."""
    asyncio.run(_membership(settings))


async def _membership(settings):
    async with relay(settings, stream=False) as (ep, node):
        creator_key = iroh.SecretKey.generate()
        creator = await bind(creator_key.to_bytes())
        a = await dial(ep, creator)
        b = await dial(ep)
        try:
            assert await a.request(hello(1, "first", GROUP)) == ["Welcome", 1, 0, 0]
            assert await b.send_raw(frame(hello(1, "second run", GROUP))) == b""
            again = await dial(ep, creator)
            assert await again.request(hello(1, "first", GROUP)) == ["Welcome", 1, 0, 0]
            # Join: an admission signed by the creator's key for the joiner's endpoint id
            exp = 2 ** 40
            sig = creator_key.sign(b"0k-sync-admit-v1" + GROUP + b.id
                                   + struct.pack(">Q", exp)).to_bytes()
            join = msg("Join", byte_arr(GROUP), byte_arr(a.id), uint(exp), byte_arr(sig))
            assert await b.request(join) == ["Done", "Join"]
            assert await b.request(hello(2, "joined", GROUP)) == ["Welcome", 2, 0, 0]
        finally:
            await a.close()
            await b.close()
            await creator.close()
