"""The trueseal listeners on real loopback sockets: push into a real Delta landing table,
receive from the real MailboxHub. The client is the test-only one in trueseal_client.py."""

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from deltalake import DeltaTable

from delta_tables.group_commit import GroupCommitAppender, LandingTarget
from delta_tables.layout import Layout
from delta_tables.schema import C
from egress.pending import MailboxHub, PendingEnvelope
from egress.trueseal_receive import start_receive_server
from engine.trueseal.ids import event_id
from ingress.trueseal_push import start_push_server
from loopback import wait_until
from runtime.config import Settings
from runtime.keys import RelayKey
from trueseal_client import (ACK, ERROR, HEARTBEAT, NK, XX, AsyncClient, deliver_ack_frame,
                             frame, keypair, push_frame, u16)

KEY = RelayKey(bytes(range(100, 132)))
R1, R2 = bytes([1]) * 32, bytes([2]) * 32


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def make_settings(**trueseal) -> Settings:
    s = Settings()
    for k, v in trueseal.items():
        setattr(s.trueseal, k, v)
    return s


def landed(tmp_path) -> list[dict]:
    tables = Layout(tmp_path).landing_tables()
    rows = []
    for path in tables.values():
        rows += DeltaTable(str(path)).to_pyarrow_table().to_pylist()
    return rows


def track(relay, client: AsyncClient) -> AsyncClient:
    relay.__dict__.setdefault("clients", []).append(client)
    return client


async def close_clients(relay) -> None:
    for c in relay.__dict__.get("clients", []):
        c.writer.close()
        try:
            await c.writer.wait_closed()
        except OSError:
            pass


class push_relay:
    """A push listener on an ephemeral port writing to tmp_path's landing table."""

    def __init__(self, tmp_path, conf=None, appender=None):
        self.tmp_path, self.conf, self.appender = tmp_path, conf or make_settings(), appender

    async def __aenter__(self):
        if self.appender is None:
            self.appender = GroupCommitAppender(
                LandingTarget(Layout(self.tmp_path), "node-t", fsync=False))
            await self.appender.start()
            self._own = True
        else:
            self._own = False
        self.server = await start_push_server(self.conf, self.appender, KEY,
                                              host="127.0.0.1", port=0)
        return self

    async def connect(self, **kw) -> AsyncClient:
        return track(self, await AsyncClient.connect(self.server.bound_port, NK, KEY.public, **kw))

    async def __aexit__(self, *exc):
        await close_clients(self)
        await self.server.close()
        if self._own:
            await self.appender.close()


# --- push ---------------------------------------------------------------------------------------
def test_pipelined_pushes_are_acked_in_order_and_land(tmp_path):
    blobs = [(R1 if i % 2 else R2, f"envelope-{i}".encode() * (i + 1)) for i in range(20)]

    async def main():
        async with push_relay(tmp_path) as relay:
            c = await relay.connect()
            t0 = datetime.now(timezone.utc)
            for r, e in blobs:
                c.send(push_frame(r, e))
            replies = [await c.recv_frame() for _ in blobs]
            c.close()
            return replies, t0

    replies, t0 = run(main())
    assert replies == [ACK] * len(blobs)
    rows = landed(tmp_path)
    assert len(rows) == len(blobs)
    by_env = {r[C.ENVELOPE]: r for r in rows}
    for r, e in blobs:
        row = by_env[e]
        assert row[C.MAILBOX] == r
        assert row[C.EVENT_ID] == event_id(r, e)
        assert row[C.PROTOCOL] == "trueseal"
        assert row[C.META] is None
        assert row[C.RECEIVED_AT] >= t0 - timedelta(seconds=1)
        assert row[C.EXPIRES_AT] - row[C.RECEIVED_AT] == timedelta(seconds=30 * 24 * 3600)


def test_one_push_per_connection_like_the_real_client(tmp_path):
    async def one(relay, i):
        c = await relay.connect()
        c.send(push_frame(R1, b"blob-%d" % i))
        reply = await c.recv_frame()
        c.close()
        return reply

    async def main():
        async with push_relay(tmp_path) as relay:
            return await asyncio.gather(*(one(relay, i) for i in range(30)))

    assert run(main()) == [ACK] * 30
    assert sorted(r[C.ENVELOPE] for r in landed(tmp_path)) == sorted(b"blob-%d" % i
                                                                      for i in range(30))


def test_rejects_are_error_in_order_and_never_land(tmp_path):
    conf = make_settings(max_envelope=100)

    async def main():
        async with push_relay(tmp_path, conf) as relay:
            c = await relay.connect()
            c.send(push_frame(R1, b"ok-1"))
            c.send(frame(0x01, R1[:31]))            # body < 32
            c.send(push_frame(R1, b"x" * 101))       # over max_envelope
            c.send(push_frame(R1, b"x" * 100))
            c.send(HEARTBEAT)
            replies = [await c.recv_frame() for _ in range(5)]
            c.close()
            return replies

    assert run(main()) == [ACK, ERROR, ERROR, ACK, HEARTBEAT]
    assert sorted(r[C.ENVELOPE] for r in landed(tmp_path)) == [b"ok-1", b"x" * 100]


def test_malformed_frame_closes_and_nothing_lands(tmp_path):
    async def main():
        async with push_relay(tmp_path) as relay:
            c = await relay.connect()
            c.send(frame(0x07, b"?"))
            c.send(push_frame(R1, b"after"))
            return await c.read_to_eof()

    assert run(main()) == b""
    assert landed(tmp_path) == []


def test_bad_handshake_closes_with_nothing_sent(tmp_path):
    async def main():
        async with push_relay(tmp_path) as relay:
            wrong = track(relay, await AsyncClient.connect(
                relay.server.bound_port, NK, keypair()[1], handshake=False))
            wrong.writer.write(wrong.client.hello())
            garbage = await relay.connect(handshake=False)
            garbage.writer.write(u16(b"\x00" * 48))
            return await wrong.read_to_eof(), await garbage.read_to_eof()

    assert run(main()) == (b"", b"")
    assert landed(tmp_path) == []


def test_handshake_timeout(tmp_path):
    async def main():
        async with push_relay(tmp_path, make_settings(handshake_timeout_seconds=0.2)) as relay:
            c = await relay.connect(handshake=False)
            c.writer.write(c.client.hello()[:10])    # a slow loris
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            data = await c.read_to_eof(timeout=5)
            return data, loop.time() - t0

    data, waited = run(main())
    assert data == b"" and waited < 2


def test_connection_cap_closes_at_once_sending_nothing(tmp_path):
    async def main():
        async with push_relay(tmp_path, make_settings(max_connections=1)) as relay:
            first = await relay.connect()
            second = await relay.connect(handshake=False)
            refused = await second.read_to_eof()
            first.send(push_frame(R1, b"still served"))
            reply = await first.recv_frame()
            first.close()
            for _ in range(100):   # the slot is freed once the first connection is gone
                if relay.server.connections == 0:
                    break
                await asyncio.sleep(0.01)
            third = await relay.connect()
            third.send(push_frame(R1, b"third"))
            return refused, reply, await third.recv_frame()

    assert run(main()) == (b"", ACK, ACK)


class GatedAppender:
    """Completes each append only when the test says so, in any order; can fail one."""

    def __init__(self):
        self.rows, self.gates = [], []

    async def append(self, row):
        gate = asyncio.get_running_loop().create_future()
        self.rows.append(row)
        self.gates.append(gate)
        return await gate


def test_acks_wait_for_the_store_and_keep_push_order(tmp_path):
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, appender=appender) as relay:
            c = await relay.connect()
            for i in range(3):
                c.send(push_frame(R1, b"p%d" % i))
            while len(appender.gates) < 3:
                await asyncio.sleep(0.01)
            appender.gates[2].set_result(None)
            appender.gates[1].set_exception(OSError("disk full"))
            with pytest.raises(asyncio.TimeoutError):
                await c.recv_frame(timeout=0.3)       # push 0 is not durable yet
            appender.gates[0].set_result(None)
            replies = [await c.recv_frame() for _ in range(2)]
            c.close()
            return replies

    # A failed store is transient: Ack what came before it, then close without a reply, so
    # the real client sees PushFailed and retries (Error would make it drop the blob for good).
    assert run(main()) == [ACK, None]


def test_the_acks_of_one_group_commit_leave_in_one_write(tmp_path):
    """Pushes whose stores complete together (one group commit) queue their Acks in one loop
    turn and the first to flush sends them all: one write, not one per push (a write per Ack
    was 16% of the listener's CPU pipelined). The server's own send is counted."""
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, appender=appender) as relay:
            writes = []
            real_send = relay.server.send

            async def send(writer, data, *a):
                if data:
                    writes.append(len(data))
                await real_send(writer, data, *a)
            relay.server.send = send
            c = await relay.connect()
            writes.clear()                       # the handshake's reply
            for i in range(20):
                c.send(push_frame(R1, b"p%d" % i))
            while len(appender.gates) < 20:
                await asyncio.sleep(0.01)
            for gate in appender.gates:          # the group commit returns for all at once
                gate.set_result(None)
            replies = [await c.recv_frame() for _ in range(20)]
            c.close()
            return replies, writes

    replies, writes = run(main())
    assert replies == [ACK] * 20
    assert len(writes) == 1, writes


def test_half_closed_client_still_gets_its_acks(tmp_path):
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, appender=appender) as relay:
            c = await relay.connect()
            c.send(push_frame(R1, b"a"))
            c.send(push_frame(R1, b"b"))
            while len(appender.gates) < 2:
                await asyncio.sleep(0.01)
            c.writer.write_eof()
            await asyncio.sleep(0.05)
            for g in appender.gates:
                g.set_result(None)
            return [await c.recv_frame(), await c.recv_frame(), await c.recv_frame()]

    assert run(main()) == [ACK, ACK, None]


# --- receive -------------------------------------------------------------------------------------
class receive_relay:
    def __init__(self, conf=None, max_pending=1000):
        self.conf = conf or make_settings()
        self.acked: list[tuple[bytes, int]] = []

        async def ack_sink(protocol, mailbox, env, device):
            assert protocol == "trueseal"
            self.acked.append((mailbox, env.seq))

        self.hub = MailboxHub(ack_sink, max_pending=max_pending)

    async def __aenter__(self):
        self.server = await start_receive_server(self.conf, self.hub, KEY,
                                                 host="127.0.0.1", port=0)
        return self

    async def connect(self, static_priv=None, **kw) -> AsyncClient:
        return track(self, await AsyncClient.connect(self.server.bound_port, XX, KEY.public,
                                                     static_priv, **kw))

    def add(self, mailbox, *seqs):
        self.hub.add("trueseal", mailbox, [
            PendingEnvelope(seq=s, cursor=s, event_id=bytes(32), envelope=b"env-%d" % s)
            for s in seqs])

    async def __aexit__(self, *exc):
        await close_clients(self)
        await self.server.close()


def deliver_of(pt: bytes) -> tuple[int, bytes]:
    assert pt[0] == 0x02 and int.from_bytes(pt[1:5], "big") == len(pt) - 5
    return int.from_bytes(pt[5:13], "big"), pt[13:]


def test_receive_flushes_inbox_in_order_then_delivers_live_and_acks(tmp_path):
    priv, pub = keypair()

    async def main():
        async with receive_relay() as relay:
            relay.add(pub, 10, 11, 12)
            c = await relay.connect(priv)
            got = [deliver_of(await c.recv_frame()) for _ in range(3)]
            relay.add(pub, 13)                              # arrives while connected
            got.append(deliver_of(await c.recv_frame()))
            for seq, _ in got:
                c.send(deliver_ack_frame(seq))
            await wait_until(lambda: len(relay.acked) == 4)
            c.close()
            return got, relay.acked

    got, acked = run(main())
    assert got == [(10, b"env-10"), (11, b"env-11"), (12, b"env-12"), (13, b"env-13")]
    assert acked == [(pub, 10), (pub, 11), (pub, 12), (pub, 13)]


def test_deliver_ack_is_scoped_to_the_device(tmp_path):
    a_priv, a_pub = keypair()
    b_priv, b_pub = keypair()

    async def main():
        async with receive_relay() as relay:
            relay.add(a_pub, 1)
            relay.add(b_pub, 2)
            cb = await relay.connect(b_priv)
            assert deliver_of(await cb.recv_frame())[0] == 2
            cb.send(deliver_ack_frame(1))     # someone else's blob: ignored
            cb.send(deliver_ack_frame(999))   # unknown: ignored
            cb.send(HEARTBEAT)
            assert await cb.recv_frame() == HEARTBEAT   # the acks before it were processed
            await asyncio.sleep(0.05)
            ca = await relay.connect(a_priv)
            first = deliver_of(await ca.recv_frame())
            ca.close()
            cb.close()
            return relay.acked, first

    acked, first = run(main())
    assert acked == []
    assert first == (1, b"env-1")


def test_unacked_blobs_are_redelivered_on_the_next_session(tmp_path):
    priv, pub = keypair()

    async def main():
        async with receive_relay() as relay:
            relay.add(pub, 5, 6)
            c1 = await relay.connect(priv)
            s1 = [deliver_of(await c1.recv_frame())[0] for _ in range(2)]
            c1.send(deliver_ack_frame(5))
            await wait_until(lambda: relay.acked)
            c1.close()
            await wait_until(lambda: relay.hub.sessions_open() == 0)
            c2 = await relay.connect(priv)
            s2 = deliver_of(await c2.recv_frame())[0]
            with pytest.raises(asyncio.TimeoutError):
                await c2.recv_frame(timeout=0.2)    # 5 was acked; 6 is not sent twice
            c2.close()
            return s1, s2

    assert run(main()) == ([5, 6], 6)


def test_relay_heartbeat_on_idle_and_close_when_unanswered(tmp_path):
    conf = make_settings(heartbeat_idle_seconds=0.2, heartbeat_timeout_seconds=0.3)
    priv, pub = keypair()

    async def main():
        async with receive_relay(conf) as relay:
            c = await relay.connect(priv)
            loop = asyncio.get_running_loop()
            assert await c.recv_frame(timeout=2) == HEARTBEAT
            c.send(HEARTBEAT)                       # the echo keeps the session
            assert await c.recv_frame(timeout=2) == HEARTBEAT
            t0 = loop.time()                       # now stay silent
            end = await c.recv_frame(timeout=3)
            return end, loop.time() - t0, relay.hub.sessions_open()

    end, waited, sessions = run(main())
    assert end is None and 0.2 < waited < 2
    assert sessions == 0


def test_client_heartbeats_during_deliveries_keep_nonces_in_order(tmp_path):
    priv, pub = keypair()
    n = 300

    async def main():
        async with receive_relay() as relay:
            c = await relay.connect(priv)
            relay.add(pub, *range(1, n + 1))
            for _ in range(50):
                c.send(HEARTBEAT)
            frames = []
            while len(frames) < n + 50:
                frames.append(await c.recv_frame())   # decrypt fails on any nonce mix-up
            c.close()
            return frames

    frames = run(main())
    assert frames.count(HEARTBEAT) == 50
    assert [deliver_of(f)[0] for f in frames if f != HEARTBEAT] == list(range(1, n + 1))


def test_receive_protocol_violation_releases_claims(tmp_path):
    priv, pub = keypair()

    async def main():
        async with receive_relay() as relay:
            relay.add(pub, 1)
            c = await relay.connect(priv)
            assert deliver_of(await c.recv_frame())[0] == 1
            c.send(push_frame(R1, b"wrong listener"))
            end = await c.recv_frame()
            await wait_until(lambda: relay.hub.sessions_open() == 0)
            c2 = await relay.connect(priv)
            again = deliver_of(await c2.recv_frame())[0]
            c2.close()
            return end, again

    assert run(main()) == (None, 1)


def test_receive_handshake_timeout_and_cap(tmp_path):
    conf = make_settings(handshake_timeout_seconds=0.2, max_connections=1)

    async def main():
        async with receive_relay(conf) as relay:
            idle = await relay.connect(handshake=False)
            refused = await relay.connect(handshake=False)
            r = await refused.read_to_eof()
            i = await idle.read_to_eof()
            return r, i

    assert run(main()) == (b"", b"")


def test_pipelining_past_max_in_flight_pushes_back(tmp_path):
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, appender=appender) as relay:
            relay.server.max_in_flight = 4
            c = await relay.connect()
            for i in range(10):
                c.send(push_frame(R1, b"p%d" % i))
                await c.writer.drain()
                await asyncio.sleep(0.02)         # one read each (the bound is per read)
            await asyncio.sleep(0.1)
            stalled = len(appender.gates)          # the shell stopped reading at the bound
            replies = []
            while len(replies) < 10:
                for g in appender.gates:
                    if not g.done():
                        g.set_result(None)
                replies.append(await c.recv_frame())
            return stalled, replies

    stalled, replies = run(main())
    assert stalled == 4
    assert replies == [ACK] * 10


def test_superseded_silent_session_is_probed_and_its_blobs_move_on_in_order():
    """A device reconnects while its old connection is dead (never answers): the old session
    holds blob 1, the new one must not get 2 before 1, and must not wait for the idle timer."""
    conf = make_settings(heartbeat_idle_seconds=60.0, heartbeat_timeout_seconds=60.0,
                         superseded_probe_seconds=0.3)
    priv, pub = keypair()

    async def main():
        async with receive_relay(conf) as relay:
            relay.add(pub, 1)
            dead = await relay.connect(priv)
            assert deliver_of(await dead.recv_frame())[0] == 1      # never acked, never answers
            fresh = await relay.connect(priv)
            await wait_until(lambda: relay.hub.sessions_open() == 2)
            relay.add(pub, 2)
            assert await dead.recv_frame(timeout=2) == HEARTBEAT      # probed at once
            assert await dead.recv_frame(timeout=2) is None           # closed: unanswered
            got = [deliver_of(await fresh.recv_frame(timeout=2))[0] for _ in range(2)]
            return got

    assert run(main()) == [1, 2]


def test_shutdown_acks_the_pushes_being_stored_before_closing(tmp_path):
    """SIGTERM path: close() waits for stores under way and writes their Acks, so a restart
    does not turn durable pushes into client retries."""
    appender = GatedAppender()

    async def main():
        async with push_relay(tmp_path, appender=appender) as relay:
            c = await relay.connect()
            c.send(push_frame(R1, b"in flight at shutdown"))
            await wait_until(lambda: len(appender.gates) == 1)
            closing = asyncio.create_task(relay.server.close())
            await asyncio.sleep(0.1)
            assert not closing.done()                  # waits for the store ...
            appender.gates[0].set_result(None)         # ... which commits
            await asyncio.wait_for(closing, 5)
            return [await c.recv_frame(), await c.recv_frame()]

    assert run(main()) == [ACK, None]
