"""trueseal's live path (issue 20): ingress hands a landed envelope to egress at once
(runtime/handoff.py), egress delivers it before its inbox row, and the row that follows is
matched to it (never delivered twice in a session, the ack row carries the row's seq)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from egress.pending import EARLY_BASE, EARLY_MAX_AGE_SECONDS, MailboxHub, PendingEnvelope
from egress.service import EgressNode
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream
from runtime.handoff import Handoff, HandoffReceiver, HandoffSender, decode, encode

from loopback import wait_until
from test_end_to_end import parse_deliver
from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame

A = b"a" * 32
T = "trueseal"


def exp() -> datetime:
    return datetime.now(timezone.utc) + timedelta(hours=1)


def row(seq: int, cursor: int, eid: bytes, envelope: bytes = b"x" * 10) -> PendingEnvelope:
    return PendingEnvelope(seq, cursor, eid, envelope, exp())


class Acks:
    def __init__(self):
        self.rows = []

    async def __call__(self, protocol, mailbox, e, device):
        await asyncio.sleep(0)
        self.rows.append((mailbox, e.seq, e.cursor, e.event_id, device))


async def _next(s, timeout=0.2):
    return await asyncio.wait_for(s.next(), timeout)


async def _early_delivered():
    """A hub with a session for A that was just sent one early envelope, e1."""
    acks = Acks()
    hub = MailboxHub(acks)
    s = hub.open_session(T, A, device=b"d1")
    assert hub.add_early(T, A, b"e1" * 16, b"sealed", exp())
    (e,) = await _next(s)
    return acks, hub, s, e


def test_an_early_envelope_is_delivered_at_once_and_its_row_is_not_delivered_again():
    async def main():
        acks, hub, s, e = await _early_delivered()
        assert e.early and e.seq >= EARLY_BASE and e.envelope == b"sealed"
        hub.add(T, A, [row(41, 1, b"e1" * 16, b"sealed"), row(42, 2, b"e2" * 16)])
        (e2,) = await _next(s)                      # only the new row: e1 is not sent twice
        assert e2.seq == 42
        assert hub.early_waiting == 0
        assert await s.ack(e.seq)                   # acked by its provisional id ...
        assert acks.rows == [(A, 41, 1, b"e1" * 16, b"d1")]   # ... recorded as its row
        assert hub.early_bytes == 0
    asyncio.run(main())


def test_an_ack_before_the_row_is_kept_and_written_when_the_row_arrives():
    async def main():
        acks, hub, s, e = await _early_delivered()
        assert await s.ack(e.seq) and acks.rows == []      # no row yet: nothing to write
        assert hub.early_waiting == 1 and hub.early_bytes == 0
        s.close()                                   # the device leaves; the ack is kept
        hub.add(T, A, [row(41, 1, b"e1" * 16)])
        await hub.drain()
        assert acks.rows == [(A, 41, 1, b"e1" * 16, b"d1")]
        assert hub.early_waiting == 0 and hub.pending_count() == 0
        s2 = hub.open_session(T, A)                 # nothing left to deliver
        assert s2._claimable() == []
    asyncio.run(main())


def test_what_is_not_taken_early():
    async def main():
        hub = MailboxHub(Acks(), max_pending=2)
        assert not hub.add_early(T, A, b"e0" * 16, b"x", exp())   # no session here
        s = hub.open_session(T, A)
        hub.add(T, A, [row(7, 1, b"e1" * 16)])
        assert not hub.add_early(T, A, b"e1" * 16, b"x", exp())   # its row is pending already
        assert hub.add_early(T, A, b"e2" * 16, b"x", exp())
        assert not hub.add_early(T, A, b"e2" * 16, b"x", exp())   # handed over twice
        assert not hub.add_early(T, A, b"e3" * 16, b"x", exp())   # max_pending reached
        got = await _next(s)
        for e in got:
            assert await s.ack(e.seq)
        # a client's retry of a push acked a moment ago is not delivered again early
        assert not hub.add_early(T, A, b"e1" * 16, b"x", exp())
        assert not hub.add_early(T, A, b"e2" * 16, b"x", exp())
        hub.early_max_bytes = 5
        assert not hub.add_early(T, A, b"e4" * 16, b"123456", exp())   # over the byte budget
        assert hub.add_early(T, A, b"e4" * 16, b"12345", exp())
    asyncio.run(main())


def test_a_row_paged_in_while_overflowing_is_matched_to_its_early_envelope():
    rows = [row(100 + c, c, bytes([c]) * 32) for c in range(1, 6)]
    early_row = row(106, 6, b"E" * 32, b"early")

    async def loader(protocol, mailbox, after, limit):
        return [r for r in rows + [early_row] if r.cursor > after][:limit]

    async def main():
        acks = Acks()
        hub = MailboxHub(acks, max_pending=4, loader=loader)
        s = hub.open_session(T, A)
        assert hub.add_early(T, A, b"E" * 32, b"early", exp())
        hub.add(T, A, rows + [early_row])           # overflows: 3 taken, the rest skipped
        seen = []
        while len(seen) < 6:
            for e in await _next(s):
                seen.append(e)
                assert await s.ack(e.seq)
        await hub._page_in(s)                       # reads on past the last row
        await hub.drain()
        assert [e.envelope for e in seen].count(b"early") == 1
        assert sorted(r[1] for r in acks.rows) == list(range(101, 107))
        assert hub.early_waiting == 0 and s._claimable() == []
    asyncio.run(main())


def test_early_state_whose_row_never_comes_is_forgotten():
    async def main():
        hub = MailboxHub(Acks())
        s = hub.open_session(T, A)
        assert hub.add_early(T, A, b"e1" * 16, b"dup", exp())
        assert hub.add_early(T, A, b"e2" * 16, b"dup", exp())
        (a, b) = await _next(s)
        assert await s.ack(a.seq)                   # kept, waiting for a row
        hub._sweep_early(time.monotonic() + EARLY_MAX_AGE_SECONDS + 11)
        assert hub.early_waiting == 0 and hub.early_bytes == 0 and hub.pending_count() == 0
        assert not await s.ack(b.seq)
    asyncio.run(main())


def test_handoffs_reach_egress_in_order_and_only_from_this_user(tmp_path):
    h = Handoff(T, A, b"e" * 32, datetime(2027, 1, 2, 3, 4, 5, 678901, tzinfo=timezone.utc),
                os.urandom(65482))
    assert decode(encode(h)) == h
    assert "e" * 10 not in repr(h) and str(len(h.envelope)) in repr(h)
    for bad in (b"", b"\xc1", encode(h)[:-1], b"\x96\x02" + encode(h)[2:]):
        assert decode(bad) is None

    async def main():
        got = []
        sender = HandoffSender(tmp_path / "handoff")
        sender.send(h)                              # no egress registered: nothing sent
        assert sender.sent == 0 and sender.dropped == 0
        r = await HandoffReceiver.open(tmp_path / "handoff", "egress", got.append)
        await asyncio.sleep(HandoffSender.RECHECK_SECONDS)   # the sender's next look finds it
        sock_path = r.path.read_text()
        sock_dir = os.path.dirname(sock_path)
        assert stat.S_IMODE(os.stat(sock_dir).st_mode) == 0o700   # this user only
        burst = [dataclasses.replace(h, envelope=b"%04d" % i + bytes(300)) for i in range(500)]
        for x in burst:                             # a burst keeps its order, none dropped
            sender.send(x)
        sender.send(h)
        await wait_until(lambda: len(got) == 501)
        assert got == burst + [h] and sender.dropped == 0
        # a stranger's bytes (were it in the directory): skipped, then its stream dropped
        _, w = await asyncio.open_unix_connection(sock_path)
        w.write(struct.pack(">I", 3) + b"bad" + struct.pack(">I", 10 ** 6))
        await wait_until(lambda: r.malformed == 2)
        sender.send(h)
        await wait_until(lambda: len(got) == 502)  # the sender's own stream is untouched
        r.close()
        assert not os.path.exists(sock_dir) and not r.path.exists()
        sender.send(h)                              # gone: forgotten, never raised
        sender.close()
        w.close()
    asyncio.run(main())


def test_a_push_reaches_an_online_receiver_before_its_inbox_row(spark, settings):
    """Real Noise sessions, real landing commit, no stream running: the receiver has the
    envelope anyway. Its DeliverAck waits for the row; the stream then gives it one, the ack
    row carries that row's seq, and the session is not sent the envelope again."""
    async def main():
        ingress, egress = IngressNode(settings, fsync=False), EgressNode(settings, fsync=False)
        await ingress.start()
        await egress.start()
        query = None
        try:
            relay_pub = ingress.key.public
            priv, pub = keypair()
            rx = await AsyncClient.connect(egress.trueseal.bound_port, XX, relay_pub,
                                           static_priv=priv)
            await wait_until(lambda: egress.hub.sessions_open() == 1)
            tx = await AsyncClient.connect(ingress.trueseal.bound_port, NK, relay_pub)
            envelope = b"sealed-" + os.urandom(300)
            t0 = time.monotonic()
            tx.send(push_frame(pub, envelope))
            assert await tx.recv_frame(timeout=10) == ACK
            blob_id, got = parse_deliver(await rx.recv_frame(timeout=5))
            took = time.monotonic() - t0
            tx.close()
            assert got == envelope and blob_id >= EARLY_BASE, took
            inbox = Layout.of(settings).inbox
            assert DeltaTable(str(inbox)).to_pyarrow_table().num_rows == 0
            rx.send(deliver_ack_frame(blob_id))
            await wait_until(lambda: egress.hub.acked == 1)
            assert egress.hub.early_waiting == 1

            query, _ = start_inbox_stream(spark, settings, fsync=False)
            acks = Layout.of(settings).acks
            deadline = time.monotonic() + 120
            while DeltaTable(str(acks)).to_pyarrow_table().num_rows == 0:
                assert time.monotonic() < deadline, "the ack row was never written"
                await asyncio.sleep(0.2)
            (r,) = DeltaTable(str(inbox)).to_pyarrow_table().to_pylist()
            (a,) = DeltaTable(str(acks)).to_pyarrow_table().to_pylist()
            assert (a[C.SEQ], a[C.CURSOR], a[C.EVENT_ID]) == (r[C.SEQ], 1, r[C.EVENT_ID])
            assert a[C.DEVICE] is None and r[C.ENVELOPE] == envelope   # one device per key
            assert egress.hub.early_waiting == 0
            try:   # nothing more for this session: at most a heartbeat
                frame = await rx.recv_frame(timeout=1.0)
                assert frame is None or frame[0] == 0x03, "delivered twice"
            except asyncio.TimeoutError:
                pass
            rx.close()
        finally:
            if query is not None:
                query.stop()
            await ingress.close()
            await egress.close()
    asyncio.run(main())


def test_a_receiver_killed_without_closing_leaves_nothing_behind_the_next_one(tmp_path):
    """kill -9 of egress leaves its registration and socket directory; the next egress that
    opens removes both (another user's or a live process's are never touched)."""
    directory = tmp_path / "handoff"
    directory.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    sock_dir = tempfile.mkdtemp(prefix="relay-handoff-")
    (directory / f"{dead}-egress").write_text(os.path.join(sock_dir, "s"))
    live_dir = tempfile.mkdtemp(prefix="relay-handoff-")
    (directory / f"{os.getpid()}-other").write_text(os.path.join(live_dir, "s"))

    async def main():
        r = await HandoffReceiver.open(directory, "egress", lambda h: None)
        assert not os.path.exists(sock_dir) and not (directory / f"{dead}-egress").exists()
        assert os.path.exists(live_dir) and (directory / f"{os.getpid()}-other").exists()
        r.close()
    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(live_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
