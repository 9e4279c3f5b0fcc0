"""The cursor-sync listener on loopback: a real aioquic client (tests/sync_client.py, frames
built byte by byte), the real ingress node (landing group commit), real Delta tables, and the
stream's real sink (dedup, cursors) driven without Spark (tests/sync_stream.py; the Spark
stream itself runs in tests/test_sync_end_to_end.py).

Two devices of one group (create, admission, PUSH -> PUSH_ACK after the inbox commit, NOTIFY,
PULL with pagination, re-push idempotence, DELETE after every device acknowledged, REVOKE);
an outsider refused; every limit at its budget and one past it; malformed and oversize frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from datetime import timedelta

import pytest
from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from delta_tables.schema_sync import SYNC_PUSH, S
from ingress.service import IngressNode

from sync_client import (Device, SyncClient, ack, byte_arr, bye, content_ref, delete,
                         device_session, frame, group_id, hello, join, msg, presence, pull, push,
                         register_push, revoke, uint, unregister_push)
from sync_stream import SinkDriver

EXP = 2 ** 40          # admissions valid far into the future
EMPTY = None           # SyncClient.request: the empty-FIN refusal


def blob(n: int) -> bytes:
    return n.to_bytes(16, "big")


def admission(admitter: Device, group: bytes, joiner: Device) -> list:
    return [admitter.id, EXP, admitter.admit(group, joiner.id, EXP)]


@contextlib.asynccontextmanager
async def relay(settings, stream: bool = True):
    settings.heya.enabled = False
    settings.ppp.enabled = False
    node = IngressNode(settings, fsync=False)
    await node.start()
    driver = SinkDriver(settings)
    if stream:
        driver.start()
    try:
        yield node.sync.bound_port, node, driver
    finally:
        await driver.stop()
        await node.close()


def rows(settings, table: str) -> list[dict]:
    return DeltaTable(str(Layout.of(settings).tables / table)).to_pyarrow_table().to_pylist()


def sync_inbox(settings) -> list[dict]:
    return [r for r in rows(settings, "inbox") if r[C.PROTOCOL] == "sync"]


def test_two_devices_push_notify_pull_repush_delete_revoke(settings):
    asyncio.run(_two_devices(settings))
    inbox = sync_inbox(settings)
    assert sorted(r[C.CURSOR] for r in inbox) == list(range(1, 7))      # gap-free from 1
    rejects = [r for r in rows(settings, "rejects") if r[C.PROTOCOL] == "sync"]
    assert [r[C.REASON] for r in rejects] == ["duplicate"]               # the concurrent re-push
    acks = [r for r in rows(settings, "acks") if r[C.PROTOCOL] == "sync"]
    assert len(acks) == 1 and acks[0][C.CURSOR] == 1                     # the DELETE
    # compaction's purge key (protocol, mailbox, seq) takes the deleted blob's bytes
    from jobs.compact import run_compaction
    settings.compaction.ack_grace_seconds = 0
    run_compaction(settings, progress=lambda _: None)
    assert {r[C.CURSOR]: r[C.ENVELOPE] for r in sync_inbox(settings)}[1] is None
    assert {r[C.CURSOR]: r[C.ENVELOPE] for r in sync_inbox(settings)}[2] == b"second"


async def _two_devices(settings):
    async with relay(settings) as (port, node, _):
        g = group_id(b"family photos")
        a, b, outsider = Device(), Device(), Device()
        ca, welcome = await device_session(port, a, g, name="phone", version=1)
        assert welcome == ["Welcome", 1, 0, 0]                         # a creates the group
        # b joins with an admission signed by a
        cb, welcome = await device_session(port, b, g, name="laptop",
                                           admission=admission(a, g, b))
        assert welcome == ["Welcome", 2, 0, 0]

        # outsider: HELLO refused (v1: empty FIN, v2: ERROR 1004), a self-made admission too
        co, w = await device_session(port, outsider, g, version=1)
        assert w is EMPTY
        assert await co.request(hello(2, "x", g)) == ["Error", 1004, "not a member of this group"]
        assert (await co.request(join(g, *admission(outsider, g, outsider))))[:2] == \
            ["Error", 1006]
        assert await co.request(pull(0, 10)) is EMPTY                  # still no session

        # PUSH -> PUSH_ACK with the inbox cursor; NOTIFY at b, not at a
        assert await ca.request(push(blob(1), b"first", 0)) == ["PushAck", blob(1), 1]
        assert await cb.next_uni() == ["Notify", 1, 1]
        # a re-push of a committed blob answers its original cursor
        assert await ca.request(push(blob(1), b"first", 0)) == ["PushAck", blob(1), 1]
        # two pushes of one new blob id at once: both land, the stream keeps one (rejects
        # gets the other), both answer the same cursor
        r1, r2 = await asyncio.gather(ca.request(push(blob(2), b"second", 0)),
                                      ca.request(push(blob(2), b"second", 0)))
        assert r1 == r2 == ["PushAck", blob(2), 2]
        assert await cb.next_uni() == ["Notify", 2, 1]
        for n in range(3, 7):
            assert await cb.request(push(blob(n), b"n%d" % n, 0)) == ["PushAck", blob(n), n]
        assert ca.proto.uni.qsize() == 0 or (await ca.next_uni())[0] == "Notify"

        # PULL with pagination: limit 2 over six blobs
        page = await cb.request(pull(0, 2))
        assert page == ["PullResponse", [[blob(1), 1, list(b"first"), page[1][0][3]],
                                         [blob(2), 2, list(b"second"), page[1][1][3]]],
                        True, 2]
        page = await cb.request(pull(2, 2))
        assert [e[1] for e in page[1]] == [3, 4] and page[2:] == [True, 4]
        page = await cb.request(pull(4, 2))
        assert [e[1] for e in page[1]] == [5, 6] and page[2:] == [False, 6]
        assert await cb.request(pull(6, 2)) == ["PullResponse", [], False, 6]

        # DELETE waits for every device: a has not acknowledged blob 5 (b sent it) ...
        assert (await ca.request(delete(blob(5))))[:2] == ["Error", 2004]
        # blob 1 is a's own; b pulled after 6, which acknowledges 1..6
        assert await ca.request(delete(blob(1))) == ["Done", "Delete"]
        page = await cb.request(pull(0, 10))
        assert [e[1] for e in page[1]] == [2, 3, 4, 5, 6]
        assert (await ca.request(delete(blob(1))))[:2] == ["Error", 2003]
        # a's WELCOME on reconnect counts what it has not acknowledged from others: 3..6
        ca2, w = await device_session(port, a, g, name="phone", version=1)
        assert w == ["Welcome", 1, 6, 4]
        assert await ca2.request(ack(6)) == ["Done", "Ack"]
        await ca2.close()

        # presence: both online, names as given
        pl = await ca.request(presence(True))
        assert pl[0] == "PresenceList"
        assert sorted((bytes(e[0]), e[1], e[2]) for e in pl[1]) == sorted(
            [(a.id, "phone", True), (b.id, "laptop", True)])

        # push registration: stored durably
        assert await cb.request(register_push("apns", "tok-1")) == ["Done", "RegisterPush"]
        assert await cb.request(unregister_push("apns", "tok-1")) == ["Done", "UnregisterPush"]
        assert [r[S.OP] for r in sorted(rows(settings, SYNC_PUSH.name), key=lambda r: r[S.AT])
                ] == ["register", "unregister"]

        # CONTENT_REF: relayed to the other online device (version 2 sessions only)
        ref = content_ref(b"\x11" * 32, b"\x22" * 24, 100, 116)
        assert await cb.request(ref) == ["Done", "ContentRef"]
        got = await ca.next_uni()
        while got[0] == "Notify":
            got = await ca.next_uni()
        assert got == ["ContentRef", [0x11] * 32, [0x22] * 24, 100, 116]
        assert await ca.request(ref) is EMPTY                          # v1 session: as 0k-sync
        assert (await cb.request(content_ref(b"\x11" * 32, b"\x22" * 24, 100, 117)))[:2] == \
            ["Error", 2005]

        # REVOKE: b is told DEVICE_REVOKED and closed (code 4); its admission is dead
        assert await ca.request(revoke(b.id)) == ["Done", "RevokeDevice"]
        got = await cb.next_uni()
        while got[0] != "DeviceRevoked":
            got = await cb.next_uni()
        assert got == ["DeviceRevoked", list(b.id)]
        assert (await cb.closed())[0] == 4
        cb2 = await SyncClient.connect(port)
        await cb2.authenticate(b)
        assert (await cb2.request(join(g, *admission(a, g, b))))[:2] == ["Error", 1005]
        assert (await cb2.request(hello(2, "laptop", g)))[:2] == ["Error", 1005]
        # ... and a revoked device's admissions no longer admit anyone
        c = Device()
        cc = await SyncClient.connect(port)
        await cc.authenticate(c)
        assert (await cc.request(join(g, *admission(b, g, c))))[:2] == ["Error", 1006]

        # BYE: no response, and the session takes nothing more
        assert await ca.request(bye("done")) is EMPTY
        assert await ca.request(pull(0, 1)) is EMPTY
        for cl in (ca, cb, co, cb2, cc):
            await cl.close()


def test_limits_at_budget_and_one_past(settings):
    s = settings.sync
    s.messages_per_minute = 6
    s.max_pull_limit = 3
    s.cursor_gap_cap = 4
    s.max_group_storage = 20
    s.connections_per_minute = 3
    asyncio.run(_limits(settings))


async def _limits(settings):
    async with relay(settings) as (port, node, driver):
        g, a = group_id(b"limits"), Device()
        ca, _ = await device_session(port, a, g, name="n" * 300)         # connection 1 of 3
        # quota: 20 bytes: 12 + 8 fit, one more byte does not (and lands nowhere)
        assert (await ca.request(push(blob(1), b"x" * 12, 0)))[0] == "PushAck"
        assert (await ca.request(push(blob(2), b"y" * 8, 0)))[0] == "PushAck"
        assert (await ca.request(push(blob(3), b"z", 0)))[:2] == ["Error", 2001]
        # per-device rate: 6 PUSH+PULL per minute, burst 6: the three pushes above spent 3
        # (the one refused for quota too: 0k-sync checks the limiters first) ...
        for _ in range(3):
            assert (await ca.request(pull(0, 0)))[0] == "PullResponse"   # 4th, 5th, 6th
        assert await ca.request(pull(0, 0)) == ["Error", 2000, "rate limited"]   # the 7th
        assert len(sync_inbox(settings)) == 2
        # connections per device per minute: 3 allowed, the 4th closed with code 1
        c2 = await SyncClient.connect(port)
        await c2.authenticate(a)
        c3 = await SyncClient.connect(port)
        await c3.authenticate(a)
        c4 = await SyncClient.connect(port)
        with pytest.raises(Exception):
            await c4.authenticate(a)
        assert await c4.closed() == (1, "rate limited")
        # names cut to 256 bytes on a character boundary: 300 x "n" -> 256; 255 x "n" + "é"
        # (257 bytes) -> the 255 "n"
        names = [e[1] for e in (await ca.request(presence(True)))[1]]
        assert names == ["n" * 256]
        await ca.close()
        assert (await c2.request(hello(2, "n" * 255 + "é", g)))[0] == "Welcome"
        names = [e[1] for e in (await c2.request(presence(True)))[1]]
        assert names == ["n" * 255]
        for cl in (ca, c2, c3, c4):
            await cl.close()

        # pull clamp 3 and gap cap 4, with fresh devices (fresh rate budgets)
        b, d = Device(), Device()
        g2 = group_id(b"gap")
        cb, _ = await device_session(port, b, g2)
        for n in range(1, 4):
            assert (await cb.request(push(blob(10 + n), b"p", 0)))[0] == "PushAck"
        await cb.close()
        cd, _ = await device_session(port, d, g2, admission=admission(b, g2, d))
        for n in range(4, 6):
            assert (await cd.request(push(blob(10 + n), b"p", 0)))[0] == "PushAck"
        page = await cd.request(pull(0, 1000))                  # limit 1000 clamped to 3
        assert [e[1] for e in page[1]] == [1, 2, 3] and page[2:] == [True, 3]
        # everyone acknowledges, b deletes 1..4: the window after 0 (cursors 1..4) is empty
        assert await cd.request(ack(9)) == ["Done", "Ack"]
        cb, _ = await device_session(port, b, g2)
        assert await cb.request(ack(5)) == ["Done", "Ack"]
        for n in (1, 2, 3, 4):
            assert await cb.request(delete(blob(10 + n))) == ["Done", "Delete"]
        # -> no blobs, max_cursor 4 (the client moves on), has_more; then the rest
        assert await cd.request(pull(0, 3)) == ["PullResponse", [], True, 4]
        page = await cd.request(pull(4, 3))
        assert [e[1] for e in page[1]] == [5] and page[2:] == [False, 5]
        for cl in (cb, cd):
            await cl.close()


def test_ttl_default_and_clamp_and_global_rate(settings):
    settings.sync.global_requests_per_second = 3
    asyncio.run(_ttl(settings))
    inbox = sorted(sync_inbox(settings), key=lambda r: r[C.CURSOR])
    ttl = [r[C.EXPIRES_AT] - r[C.RECEIVED_AT] for r in inbox]
    assert ttl == [timedelta(days=7), timedelta(seconds=60), timedelta(days=30)]


async def _ttl(settings):
    async with relay(settings) as (port, node, _):
        g, a = group_id(b"ttl"), Device()
        ca, _ = await device_session(port, a, g)
        for n, t in ((1, 0), (2, 60), (3, 2 ** 32 - 1)):
            assert (await ca.request(push(blob(n), b"t", t)))[0] == "PushAck"
        # the global limiter (3/s, burst 3): of 8 PULLs sent at once at most 3 pass (4, if a
        # third of a second went by while they were read), the rest are refused as busy. Sent
        # at once, so the PUSHes' wait for their cursors cannot refill the bucket in between.
        answers = await asyncio.gather(*(ca.request(pull(0, 1)) for _ in range(8)))
        busy = [a for a in answers if a == ["Error", 2000, "relay busy"]]
        assert len(busy) >= 4, answers
        assert all(a[0] == "PullResponse" for a in answers if a not in busy)
        await ca.close()


def test_sessions_hello_timeout_auth_and_frames(settings):
    settings.sync.max_concurrent_sessions = 2
    settings.sync.hello_timeout_seconds = 1.0
    asyncio.run(_frames(settings))
    assert sync_inbox(settings) == []        # nothing refused was stored


async def _frames(settings):
    async with relay(settings, stream=False) as (port, node, _):
        g, a = group_id(b"frames"), Device()
        ca, welcome = await device_session(port, a, g, version=1)
        assert welcome[0] == "Welcome"
        cb = await SyncClient.connect(port)
        # session cap 2: the third connection is closed with code 2
        cc = await SyncClient.connect(port)
        assert await cc.closed() == (2, "too many sessions")
        # no HELLO in time: closed with code 3
        assert await cb.closed() == (3, "hello timeout")

        # oversize: a length prefix of MAX + 1 is refused before the body (empty FIN)
        max_size = settings.sync.max_message_size
        assert await ca.send_raw(struct.pack(">I", max_size + 1) + b"\x93") == b""
        # malformed bodies: empty FIN, the session goes on
        for body in (b"\xc1", b"\x93\xa4Pull\x01", msg("Pull", uint(1)),
                     msg("Nope", uint(1), uint(2)), msg("Push", byte_arr(blob(1)),
                                                         byte_arr(b""), uint(0))):
            assert await ca.send_raw(frame(body)) == b""
        assert await ca.send_raw(b"\x00\x00\x00\x05\x93") == b""      # FIN inside a frame
        assert await ca.send_raw(b"") == b""                           # FIN, no frame
        # a frame of exactly MAX bytes is read and decoded: a HELLO whose name fills it (on an
        # active session: refused as a second HELLO, empty FIN under version 1) ...
        name = "n" * (max_size - 49)
        big = hello(1, name, b"\x01" * 32)
        assert len(big) == max_size
        assert await ca.request(big) is EMPTY
        # ... and a PUSH too close to the cap to be pulled back is refused as too large
        assert await ca.request(push(blob(9), b"\x01" * (max_size - 60), 0)) is EMPTY
        assert (await ca.request(pull(0, 0)))[0] == "PullResponse"     # still in session
        await ca.close()
        await cb.close()
        await cc.close()

        # a wrong signature in the identity challenge: closed with code 3
        cd = await SyncClient.connect(port)
        with pytest.raises(Exception):
            await cd.authenticate(a, sign_with=Device())
        assert await cd.closed() == (3, "auth failed")
        await cd.close()


def test_expired_blobs_leave_the_view_and_free_the_quota(settings):
    """Review fix: an expired blob used to stay in the view for good, so its bytes counted
    against the group quota until a restart and every event id stayed in memory."""
    settings.sync.max_group_storage = 10
    settings.sync.push_ack_timeout_seconds = 2.0       # also the shortest TTL
    asyncio.run(_expiry(settings))


async def _expiry(settings):
    async with relay(settings) as (port, node, _):
        node.sync.inbox.forget_after = timedelta(0)
        g, a = group_id(b"expiry"), Device()
        ca, _ = await device_session(port, a, g)
        assert await ca.request(push(blob(1), b"x" * 8, 2)) == ["PushAck", blob(1), 1]
        assert (await ca.request(push(blob(2), b"y" * 8, 2)))[:2] == ["Error", 2001]
        await asyncio.sleep(2.5)                        # blob 1's TTL passes
        assert await ca.request(push(blob(2), b"y" * 8, 2)) == ["PushAck", blob(2), 2]
        assert node.sync.inbox.blob(g, blob(1)) is None
        assert len(node.sync.inbox._cursor_of) == 1     # only blob 2's event id is held
        await ca.close()


def test_short_ttl_outlives_the_wait_for_the_inbox_commit(settings):
    """Review fix: a TTL shorter than the stream's latency made the stream reject the row as
    expired; the PUSH then hung until push_ack_timeout and was refused. TTLs are raised to
    push_ack_timeout_seconds, so a row the stream takes in time is never expired."""
    settings.sync.push_ack_timeout_seconds = 3.0
    asyncio.run(_short_ttl(settings))
    inbox = sync_inbox(settings)
    assert [r[C.EXPIRES_AT] - r[C.RECEIVED_AT] for r in inbox] == [timedelta(seconds=3)]


async def _short_ttl(settings):
    async with relay(settings) as (port, node, driver):
        g, a = group_id(b"short ttl"), Device()
        ca, _ = await device_session(port, a, g)
        driver.paused = True
        await asyncio.sleep(0.2)                         # a batch in progress finishes
        req = asyncio.ensure_future(ca.request(push(blob(1), b"short", 1)))
        await asyncio.sleep(1.5)                         # landed; the asked-for 1 s passed
        driver.paused = False
        assert await req == ["PushAck", blob(1), 1]
        await ca.close()


class _NoNotifyReader:
    """A peer that grants two unidirectional streams and never more, as a 0k-sync (quinn)
    client does once it holds max_concurrent_uni_streams it never `accept_uni`s."""

    def __init__(self, limit):
        self.frame_type, self.name = limit.frame_type, limit.name
        self.sent = self.value = 2
        self.used = 0

    def __setattr__(self, key, val):
        if key in ("value", "sent") and key in self.__dict__:
            return        # never raise the credit
        object.__setattr__(self, key, val)


def test_notify_to_a_peer_that_takes_no_more_streams_is_dropped(settings):
    """Review fix: every NOTIFY past the peer's stream credit used to queue a blocked stream in
    the relay for the connection's life (0k-sync clients never read NOTIFY)."""
    asyncio.run(_no_credit(settings))


async def _no_credit(settings):
    import ssl

    from aioquic.asyncio import connect
    from aioquic.quic.configuration import QuicConfiguration

    import sync_client

    class Proto(sync_client._Proto):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._quic._local_max_streams_uni = _NoNotifyReader(self._quic._local_max_streams_uni)

    async with relay(settings) as (port, node, _):
        g, a, b = group_id(b"credit"), Device(), Device()
        ca, _ = await device_session(port, a, g)
        conf = QuicConfiguration(is_client=True, alpn_protocols=[sync_client.ALPN],
                                 verify_mode=ssl.CERT_NONE)
        ctx = connect("127.0.0.1", port, configuration=conf, create_protocol=Proto)
        cb = SyncClient(await ctx.__aenter__(), ctx)
        assert await cb.authenticate(b) == ["Done", "AuthProof"]
        assert await cb.request(join(g, *admission(a, g, b))) == ["Done", "Join"]
        assert (await cb.request(hello(1, "quinn", g)))[0] == "Welcome"
        for n in range(1, 6):       # one NOTIFY each (each PUSH_ACK follows its own commit)
            assert (await ca.request(push(blob(n), b"p", 0)))[:3] == ["PushAck", blob(n), n]
        assert [(await cb.next_uni())[0] for _ in range(2)] == ["Notify", "Notify"]
        conn = next(c for c in node.sync.conns if c.device_id == b.id)
        assert conn._quic._streams_blocked_uni == []
        # the session goes on: PULL still answers everything
        page = await cb.request(pull(0, 10))
        assert [e[1] for e in page[1]] == [1, 2, 3, 4, 5]
        await ca.close()
        await cb.close()


def test_frames_after_the_request_are_not_buffered(settings):
    """Review fix: frames a client kept writing on a request stream after its request (while
    the PUSH waited for its commit) were all kept in memory; only the identity exchange reads
    a second frame, so at most one is held."""
    asyncio.run(_extra_frames(settings))


async def _extra_frames(settings):
    async with relay(settings) as (port, node, driver):
        g, a = group_id(b"extra frames"), Device()
        ca, _ = await device_session(port, a, g)
        driver.paused = True
        await asyncio.sleep(0.2)
        sid = ca._open()
        ca.proto._quic.send_stream_data(sid, frame(push(blob(1), b"p", 0)) +
                                        frame(pull(0, 1)) * 50, end_stream=False)
        ca.proto.transmit()
        conn = next(c for c in node.sync.conns if c.device_id == a.id)
        while sid not in conn.streams or conn.streams[sid].got < 2:
            await asyncio.sleep(0.05)
        await ca.request(pull(0, 1))          # the relay has read everything sent before it
        assert len(conn.streams[sid].later) <= 1
        driver.paused = False
        ca.proto._quic.send_stream_data(sid, b"", end_stream=True)
        ca.proto.transmit()
        out = await asyncio.wait_for(ca.proto.fins[sid], 30)
        assert out[4:] == push_ack(1)
        await ca.close()


def test_a_session_keeps_no_handshake_buffers_and_shares_its_frame_table(settings):
    """Memory per session (issue 19): once the handshake is over a connection holds no 16 KiB
    CRYPTO staging buffers, and its frame handlers come from one shared table, each bound to
    its own connection; the sessions still push and pull, and an unknown frame type is still
    aioquic's KeyError ("Unknown frame type")."""
    asyncio.run(_lean_sessions(settings))


async def _lean_sessions(settings):
    from ingress.sync_quic import SPENT_CRYPTO_BUFFER
    async with relay(settings) as (port, node, _):
        g, a, b = group_id(b"lean"), Device(), Device()
        ca, _ = await device_session(port, a, g)
        cb, _ = await device_session(port, b, g, admission=admission(a, g, b))
        quics = [next(c for c in node.sync.conns if c.device_id == d.id)._quic for d in (a, b)]
        for q in quics:
            assert set(q._crypto_buffers.values()) == {SPENT_CRYPTO_BUFFER}
            table = q._QuicConnection__frame_handlers
            handler, epochs = table[0x08]                  # STREAM
            assert handler.__self__ is q and handler.__func__.__name__ == "_handle_stream_frame"
            assert epochs is quics[0]._QuicConnection__frame_handlers[0x08][1]   # shared
            with pytest.raises(KeyError):
                table[0x2F]
        assert (await ca.request(push(blob(1), b"lean", 0)))[:1] == ["PushAck"]
        page = await cb.request(pull(0, 10))
        assert page[0] == "PullResponse" and [e[0] for e in page[1]] == [blob(1)]
        await ca.close()
        await cb.close()


def push_ack(n: int) -> bytes:
    return msg("PushAck", b"\xc4\x10" + blob(n), uint(n))


def test_extension_requests_have_their_own_budget(settings):
    """Each extension request writes a Delta row or fans out to the group: a device gets
    `control_requests_per_minute` of them (a token bucket), and PUSH / PULL are untouched."""
    settings.sync.control_requests_per_minute = 3

    async def go():
        async with relay(settings) as (port, node, driver):
            g, a = group_id(b"control"), Device()
            ca, _ = await device_session(port, a, g)
            for _ in range(3):
                assert (await ca.request(presence(True)))[0] == "PresenceList"
            assert await ca.request(ack(1)) == ["Error", 2000, "rate limited"]     # the 4th
            assert (await ca.request(pull(0, 0)))[0] == "PullResponse"      # other bucket
            await ca.close()
    asyncio.run(go())


def test_replies_released_together_share_packets(settings):
    """An established session sends once per event-loop turn, not after every datagram it
    receives and every reply it writes: 40 PUSHes in flight, answered as the inbox commits
    that carry them come, take far fewer datagrams from the relay than there are replies
    (here 19 datagrams; before, each PUSH_ACK and each ACK of the client's packets went out
    alone: 63)."""
    async def go():
        async with relay(settings) as (port, node, _):
            c, _ = await device_session(port, Device(), group_id(b"packets"))
            endpoint = node.sync._server._transport
            sent, send = [0], endpoint.sendto

            def counted(data, addr=None):
                sent[0] += 1
                send(data, addr)
            endpoint.sendto = counted
            n = 40
            acks = await asyncio.gather(*(c.request(push(blob(i), b"x" * 600, 0))
                                          for i in range(1, n + 1)))
            assert sorted(a[2] for a in acks) == list(range(1, n + 1))
            print(f"{sent[0]} datagrams for {n} PUSH_ACKs")
            assert sent[0] <= n
            await c.close()

    asyncio.run(go())
