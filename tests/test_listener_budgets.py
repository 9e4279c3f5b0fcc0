"""Hostile clients on the TCP listeners (issue 19), on real loopback sockets.

Several source addresses of 127.0.0.0/8 stand for several clients (a client socket is bound
to 127.0.0.N before it connects). Small and quick: connection counts in the hundreds; the
10,000-connection hostile-load suite lives in tests/hostile/.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from egress.pending import PendingEnvelope
from engine.admission import Stage
from heya_client import Cert, HeyaClient, client_context, recv_line, send_line
from test_heya_shell import auth, mailbox, mint, node
from test_trueseal_shells import (KEY, R1, make_settings, push_relay, receive_relay, run)
from trueseal_client import ACK, NK, XX, AsyncClient, Client, keypair, push_frame
from loopback import closed_by_server, raw, wait_until

ROOT = Path(__file__).resolve().parents[1]


# --- clients from many addresses --------------------------------------------------------------

async def trueseal(port: int, src: str, pattern=NK, static_priv=None,
                   handshake=True) -> AsyncClient:
    reader, writer = await raw(port, src)
    c = AsyncClient(reader, writer, Client(pattern, KEY.public, static_priv))
    if handshake:
        await c.handshake()
    return c


async def push_once(port: int, src: str, body: bytes = b"legitimate") -> bytes | None:
    c = await trueseal(port, src)
    try:
        c.send(push_frame(R1, body))
        return await c.recv_frame(timeout=5)
    finally:
        c.close()


def close_all(conns) -> None:
    for c in conns:
        writer = c[1] if isinstance(c, tuple) else c.writer
        writer.close()


# --- trueseal push ------------------------------------------------------------------------------

def test_one_address_at_its_caps_does_not_stop_another(tmp_path):
    conf = make_settings(max_handshakes_per_address=20, max_push_sessions_per_address=10,
                         push_idle_timeout_seconds=30.0)

    async def main():
        async with push_relay(tmp_path, conf) as relay:
            port, adm = relay.server.bound_port, relay.server.admission
            silent = [await raw(port, "127.0.0.2") for _ in range(30)]
            await wait_until(lambda: relay.server.rejected["handshake_address_cap"] == 10)
            assert adm.count_of("127.0.0.2", Stage.HANDSHAKE) == 20
            refused = [await closed_by_server(r, 2) for r, _ in silent[20:]]
            assert refused == [True] * 10                     # closed at once, nothing sent
            assert await push_once(port, "127.0.0.3") == ACK  # another address: served
            close_all(silent)

            idle = [await trueseal(port, "127.0.0.4") for _ in range(10)]
            await wait_until(lambda: adm.count_of("127.0.0.4", Stage.UNAUTH) == 10)
            # at its session cap the address's idlest session makes room for the newcomer
            extra = await trueseal(port, "127.0.0.4")
            assert await closed_by_server(idle[0].reader, 2)
            assert relay.server.rejected["evicted_unauth"] == 1
            extra.send(push_frame(R1, b"newcomer"))
            assert await extra.recv_frame(timeout=5) == ACK
            assert await push_once(port, "127.0.0.3") == ACK
            assert not await closed_by_server(idle[1].reader, 0.1)
            close_all(idle + [extra])

    run(main())


def test_silent_and_idle_connections_are_closed_at_their_deadlines(tmp_path):
    conf = make_settings(handshake_timeout_seconds=0.3, push_idle_timeout_seconds=0.6)

    async def main():
        async with push_relay(tmp_path, conf) as relay:
            port = relay.server.bound_port
            loop = asyncio.get_running_loop()
            silent_reader, silent_writer = await raw(port, "127.0.0.2")
            t0 = loop.time()
            assert await closed_by_server(silent_reader, 5)
            assert 0.25 < loop.time() - t0 < 5   # generous: other tests share the cores
            # After NK the real client pushes at once; a session that says nothing is closed.
            idle = await trueseal(port, "127.0.0.3")
            t0 = loop.time()
            assert await closed_by_server(idle.reader, 5)
            assert 0.55 < loop.time() - t0 < 5
            # A session that keeps pushing within the deadline stays; after its last Ack the
            # idle deadline starts again.
            busy = await trueseal(port, "127.0.0.4")
            for i in range(5):
                await asyncio.sleep(0.2)
                busy.send(push_frame(R1, b"again-%d" % i))
                assert await busy.recv_frame() == ACK
            t0 = loop.time()
            assert await busy.recv_frame(timeout=5) is None
            assert 0.55 < loop.time() - t0 < 5
            rejected = relay.server.rejected
            assert (rejected["handshake_timeout"], rejected["idle_timeout"]) == (1, 2)
            silent_writer.close()

    run(main())


def test_a_frame_dripped_or_left_half_sent_is_closed_at_its_byte_rate_deadline(tmp_path):
    conf = make_settings(frame_timeout_seconds=0.3, min_frame_bytes_per_second=1000,
                         push_idle_timeout_seconds=30.0)

    async def main():
        async with push_relay(tmp_path, conf) as relay:
            port = relay.server.bound_port
            loop = asyncio.get_running_loop()
            c = await trueseal(port, "127.0.0.2")
            record = c.client.send(push_frame(R1, b"x" * 900))   # ~960 bytes: 0.3 + 0.96 s
            t0 = loop.time()
            for byte in record[:40]:                             # 10 bytes/s: too slow
                c.writer.write(bytes([byte]))
                if await closed_by_server(c.reader, 0.1):
                    break
            else:
                raise AssertionError("a dripped frame was never closed")
            assert 1.1 < loop.time() - t0 < 5
            half = await trueseal(port, "127.0.0.3")
            half.writer.write(half.client.send(push_frame(R1, b"y" * 900))[:500])
            t0 = loop.time()
            assert await closed_by_server(half.reader, 5)
            assert 1.1 < loop.time() - t0 < 5
            assert relay.server.rejected["frame_timeout"] == 2
            assert await push_once(port, "127.0.0.4") == ACK

    run(main())


def test_full_stages_evict_idle_connections_for_a_legitimate_push(tmp_path):
    conf = make_settings(max_handshakes=40, handshake_timeout_seconds=30.0,
                         max_push_sessions=20, push_idle_timeout_seconds=30.0)

    async def main():
        async with push_relay(tmp_path, conf) as relay:
            port, srv = relay.server.bound_port, relay.server
            silent = [await raw(port, f"127.0.0.{10 + i % 4}") for i in range(40)]
            await wait_until(lambda: srv.admission.count(Stage.HANDSHAKE) == 40)
            assert await push_once(port, "127.0.0.20") == ACK
            assert srv.rejected["evicted_handshake"] == 1
            assert await closed_by_server(silent[0][0], 2)       # the oldest of a biggest holder
            close_all(silent)
            await wait_until(lambda: srv.admission.count(Stage.HANDSHAKE) == 0)

            idle = [await trueseal(port, f"127.0.0.{30 + i % 2}") for i in range(20)]
            await wait_until(lambda: srv.admission.count(Stage.UNAUTH) == 20)
            for i in range(5):
                assert await push_once(port, "127.0.0.40", b"legit-%d" % i) == ACK
            # The first took an idle session's slot; it left after its Ack, and so did the
            # next ones: one eviction in all.
            assert srv.rejected["evicted_unauth"] == 1
            await wait_until(lambda: srv.admission.count(Stage.UNAUTH) == 19)
            close_all(idle)

    run(main())


# --- trueseal receive ---------------------------------------------------------------------------

def test_receive_half_sent_frame_is_bounded_and_sessions_are_capped_per_address():
    conf = make_settings(frame_timeout_seconds=0.3, min_frame_bytes_per_second=100_000,
                         heartbeat_idle_seconds=60.0, heartbeat_timeout_seconds=60.0,
                         max_receive_sessions_per_address=3)

    async def main():
        async with receive_relay(conf) as relay:
            port, srv = relay.server.bound_port, relay.server
            loop = asyncio.get_running_loop()
            priv, _ = keypair()
            c = await trueseal(port, "127.0.0.2", XX, priv)
            await wait_until(lambda: relay.hub.sessions_open() == 1)
            heartbeat = c.client.send(bytes([0x03, 0, 0, 0, 0]))
            t0 = loop.time()
            for byte in heartbeat[:-1]:      # one byte each 0.1 s, never the last one
                c.writer.write(bytes([byte]))
                if await closed_by_server(c.reader, 0.1):
                    break
            assert await closed_by_server(c.reader, 3)
            assert 0.25 < loop.time() - t0 < 5
            assert srv.rejected["frame_timeout"] == 1
            await wait_until(lambda: relay.hub.sessions_open() == 0)

            # the address at its cap: its session idle longest goes for the newcomer, but
            # never one holding a Deliver it has not acked (mid-delivery)
            keys = [keypair() for _ in range(3)]
            held = [await trueseal(port, "127.0.0.3", XX, priv) for priv, _ in keys]
            await wait_until(lambda: relay.hub.sessions_open() == 3)
            relay.hub.add("trueseal", keys[0][1], [PendingEnvelope(
                seq=1, cursor=1, event_id=bytes(32), envelope=os.urandom(100))])
            frame = await held[0].recv_frame(timeout=5)
            assert frame[0] == 0x02                              # Deliver, not acked
            fourth = await trueseal(port, "127.0.0.3", XX, keypair()[0])
            assert await closed_by_server(held[1].reader, 2)    # idlest not owing: held[1]
            assert not await closed_by_server(held[0].reader, 0.1)
            assert not await closed_by_server(fourth.reader, 0.1)
            assert srv.rejected["evicted_auth"] == 1
            assert srv.admission.decisions[("auth", "evicted_address_cap")] == 1
            other = await trueseal(port, "127.0.0.4", XX, keypair()[0])
            await wait_until(lambda: relay.hub.sessions_open() == 4)
            close_all(held + [fourth, other])

    run(main())


def test_a_device_gets_a_receive_session_past_a_flood_by_fair_share():
    """Any key passes XX, so a flood of cheap identities from several addresses can fill the
    receive stage: a device from another address still gets in, by taking the oldest session
    of the address holding the most; equal holders never displace each other."""
    conf = make_settings(heartbeat_idle_seconds=60.0, heartbeat_timeout_seconds=60.0,
                         max_receive_sessions=6, max_receive_sessions_per_address=3)

    async def main():
        async with receive_relay(conf) as relay:
            port, srv = relay.server.bound_port, relay.server
            flood = [await trueseal(port, src, XX, keypair()[0])
                     for src in ("127.0.0.3",) * 3 + ("127.0.0.4",) * 3]
            await wait_until(lambda: relay.hub.sessions_open() == 6)
            device = await trueseal(port, "127.0.0.5", XX, keypair()[0])
            assert await closed_by_server(flood[0].reader, 2)    # .3's oldest made room
            assert not await closed_by_server(device.reader, 0.3)
            assert srv.rejected["evicted_auth"] == 1
            await wait_until(lambda: relay.hub.sessions_open() == 6)
            second = await trueseal(port, "127.0.0.5", XX, keypair()[0])   # 1 vs 3: fair
            assert await closed_by_server(flood[3].reader, 2)    # .4's oldest this time
            again = await trueseal(port, "127.0.0.3", XX, keypair()[0])    # 2 vs 2: no gain
            assert await closed_by_server(again.reader, 2)
            assert srv.rejected["auth_stage_full"] == 1
            assert not any([await closed_by_server(c.reader, 0.05)
                            for c in flood[1:3] + flood[4:] + [device, second]])
            close_all(flood + [device, second, again])

    run(main())


async def queued_flood(port: int, srv, first_message: bytes, hosts: int = 100,
                       each: int = 3) -> list:
    """`hosts` x `each` connections from 127.0.1.x, each sending a handshake's first message
    at once; returns once most of their steps wait in the listener's handshake gate."""
    conns = [await raw(port, f"127.0.1.{10 + h}") for h in range(hosts) for _ in range(each)]
    for _, writer in conns:
        writer.write(first_message)
    while len(srv.gate) < hosts * each * 2 // 3:
        await asyncio.sleep(0)
    return conns


def test_a_known_device_handshakes_ahead_of_a_flood_of_queued_handshakes():
    """Every handshake step waits its turn in the listener's gate (runtime/handshake_gate.py),
    a few per loop turn: a device whose address authenticated before goes ahead of 300
    handshakes queued by 100 other addresses, where round-robin would have it wait for one
    of each (the hostile suite's ramp: 4-5 s round trips before the gate)."""
    conf = make_settings(max_handshakes=1000, max_handshakes_per_address=64)
    priv, _ = keypair()

    async def main():
        async with receive_relay(conf) as relay:
            port, srv = relay.server.bound_port, relay.server
            first = await trueseal(port, "127.0.0.1", XX, priv)   # authenticates: known
            first.close()
            srv.gate.steps_per_turn = 1
            flood = await queued_flood(port, srv, Client(XX, KEY.public).hello())
            before = srv.gate.run_steps
            device = await trueseal(port, "127.0.0.1", XX, priv)  # msg 1 and msg 3: 2 steps
            await wait_until(lambda: relay.hub.sessions_open() == 1)
            ahead = srv.gate.run_steps - before - 2
            # steps run meanwhile, one per loop turn its own connection takes while its
            # packets cross loopback: ~20-60 on a slower machine, 72-77 on a faster one
            # (shorter turns, more of them). With every address in one lane (round-robin) the
            # whole flood ran first: 300 here. So the bound is half of that flood.
            assert ahead <= 150, ahead
            assert len(srv.gate) > 100                # the flood still waits behind it
            device.close()
            close_all(flood)

    run(main())


def test_a_device_that_stops_reading_is_closed_at_the_write_deadline():
    conf = make_settings(write_timeout_seconds=0.5, heartbeat_idle_seconds=60.0,
                         heartbeat_timeout_seconds=60.0)

    async def main():
        async with receive_relay(conf) as relay:
            srv = relay.server
            priv, pub = keypair()
            c = await trueseal(srv.bound_port, "127.0.0.2", XX, priv)   # and never reads
            await wait_until(lambda: relay.hub.sessions_open() == 1)
            relay.hub.add("trueseal", pub, [
                PendingEnvelope(seq=s, cursor=s, event_id=bytes(32), envelope=os.urandom(60_000))
                for s in range(1, 301)])
            await wait_until(lambda: srv.rejected["write_timeout"] == 1, timeout=15)
            await wait_until(lambda: relay.hub.sessions_open() == 0)
            c.writer.close()

    run(main())


# --- backlogs -------------------------------------------------------------------------------------

def _backlog(port: int) -> int:
    """The listen backlog of the socket on `port` (ss: Send-Q of a LISTEN socket)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout.split()
    return int(out[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listen_backlogs_are_1024(settings, tmp_path):
    async def go():
        async with node(settings) as n:
            heya = _backlog(n.heya.bound_port)
            push = _backlog(n.trueseal.bound_port)
        async with receive_relay() as relay:
            receive = _backlog(relay.server.bound_port)
        return heya, push, receive

    assert asyncio.run(go()) == (1024, 1024, 1024)


# --- Heya -------------------------------------------------------------------------------------------

async def heya(port: int, src: str, cert: Cert, greeting: bytes | None = b"") -> HeyaClient:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_context(cert), local_addr=(src, 0))
    c = HeyaClient(reader, writer)
    if greeting is not None:
        await c.expect(greeting or b"HEYA 0\nDONE\n")
    return c


def test_heya_strangers_of_one_address_cannot_take_the_slots_of_others(settings, tmp_path):
    """An address keeps at most its share of UNAUTH sessions however it pings, and one
    certificate at most `max_sessions_per_certificate`: a newcomer always gets in, and the
    session idle longest in application terms (PING does not count) is the one that goes. A
    full UNAUTH stage makes room for a newcomer at the biggest holder's expense; mailboxes
    are AUTH."""
    async def go():
        (inbox_token,) = mint(settings)
        stranger = Cert(tmp_path, "stranger")
        async with node(settings, max_unauth_sessions=40, max_unauth_sessions_per_address=32,
                        idle_timeout_seconds=30.0, max_sessions_per_certificate=4) as n:
            port, srv = n.heya.bound_port, n.heya
            alice_cert = Cert(tmp_path, "alice")
            alice = await mailbox(port, alice_cert, inbox_token)
            t_hex = await auth(alice)
            # one certificate, ten connections: every one greeted, the four newest kept
            same = [await heya(port, "127.0.0.2", stranger) for _ in range(10)]
            assert srv.admission.count_of("127.0.0.2", Stage.UNAUTH) == 4
            assert srv.admission.decisions[("unauth", "evicted_identity_cap")] == 6
            assert [await c.closed_by_server(2) for c in same[:6]] == [True] * 6
            for c in same:
                c.close()
            await wait_until(lambda: srv.admission.count_of("127.0.0.2", Stage.UNAUTH) == 0)
            # a fresh certificate per connection: the address's cap (32) holds; each one
            # past it evicts the address's session idle longest, PINGs or not
            greeted = [await heya(port, "127.0.0.2", Cert(tmp_path, f"s{i}"))
                       for i in range(32)]
            for c in greeted:
                c.send(b"PING\n")
                await c.expect(b"PONG\n")
            greeted[0].send(b"WANT " + b"ab" * 32 + b" 0\n")      # a real command
            await greeted[0].expect(b"GONE " + b"ab" * 32 + b" 0\n")
            newcomer = await heya(port, "127.0.0.2", Cert(tmp_path, "newcomer"))
            assert await greeted[1].closed_by_server(2)   # idle longest: greeted[0] worked
            assert not await greeted[0].closed_by_server(0.1)
            assert srv.rejected["evicted_unauth"] == 6 + 1
            greeted[1].close()
            greeted = greeted[:1] + greeted[2:] + [newcomer]
            assert srv.admission.count_of("127.0.0.2", Stage.UNAUTH) == 32
            more = [await heya(port, "127.0.0.3", Cert(tmp_path, f"m{i}")) for i in range(8)]
            assert srv.admission.count(Stage.UNAUTH) == 40
            # A mailbox is AUTH at its greeting: a full UNAUTH stage is not its business.
            phone = await heya(port, "127.0.0.6", alice_cert,
                               greeting=b"HEYA 0\nLAST " + t_hex + b" 0\nDONE\n")
            assert srv.rejected["evicted_unauth"] == 6 + 1
            assert srv.admission.count(Stage.AUTH) == 2
            # A sender from elsewhere is greeted (one of 127.0.0.2's is evicted), sends, and
            # with a valid token becomes AUTH.
            sender = await heya(port, "127.0.0.4", Cert(tmp_path, "sender"))
            assert srv.rejected["evicted_unauth"] == 6 + 1 + 1
            body = b"hello from elsewhere"
            sender.send(send_line(t_hex, body))
            await sender.expect(recv_line(body))
            assert srv.admission.count_of("127.0.0.4", Stage.AUTH) == 1
            assert srv.admission.count(Stage.UNAUTH) == 39
            for c in (alice, phone):
                c.send(b"PING\n")
                await c.expect(b"PONG\n")
            for c in greeted + more + [sender, alice, phone]:
                c.close()

    asyncio.run(go())


def test_heya_unauth_sessions_end_at_their_deadline_unless_promoted(settings, tmp_path):
    async def go():
        (inbox_token,) = mint(settings)
        async with node(settings, unauth_timeout_seconds=1.0, idle_timeout_seconds=30.0) as n:
            port, srv = n.heya.bound_port, n.heya
            a = await mailbox(port, Cert(tmp_path, "alice"), inbox_token)   # promoted by INCO
            t_hex = await auth(a)
            pinger = await heya(port, "127.0.0.2", Cert(tmp_path, "pinger"))
            t0 = time.monotonic()
            sender = await heya(port, "127.0.0.3", Cert(tmp_path, "sender"))
            sender.send(send_line(t_hex, b"m"))                # promoted at its valid SEND
            await sender.expect(recv_line(b"m"))
            closed = False
            while time.monotonic() - t0 < 5:           # pings do not save a stranger
                await asyncio.sleep(0.2)
                try:
                    pinger.send(b"PING\n")
                    await pinger.expect(b"PONG\n", timeout=1)
                except (ConnectionError, OSError, asyncio.IncompleteReadError, AssertionError):
                    closed = True
                    break
            assert closed and 0.9 < time.monotonic() - t0 < 5
            assert srv.rejected["auth_timeout"] == 1
            for c in (a, sender):                      # mailbox and sender stay
                c.send(b"PING\n")
                await c.expect(b"PONG\n")
            a.close()
            sender.close()

    asyncio.run(go())


def test_heya_handshakes_are_bounded_by_the_handshake_cap(settings, tmp_path):
    """Each connection in its TLS handshake holds a TLS engine: no more of them than
    `max_handshakes`, the oldest of the biggest holder evicted for a newcomer."""
    async def go():
        ctx = client_context(Cert(tmp_path, "slow"))
        import ssl
        hello = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO())
        with pytest.raises(ssl.SSLWantReadError):
            hello.do_handshake()
        client_hello = out.read()
        async with node(settings, max_handshakes=20, handshake_timeout_seconds=30.0) as n:
            port, srv = n.heya.bound_port, n.heya
            conns = []
            for i in range(50):
                reader, writer = await raw(port, f"127.0.0.{2 + i % 5}")
                writer.write(client_hello[:len(client_hello) // 2])   # a TLS engine each
                conns.append((reader, writer))
            await wait_until(lambda: srv.rejected["evicted_handshake"] == 30)
            assert srv.admission.count(Stage.HANDSHAKE) == 20
            assert len(srv._tls.handshaking) <= 20
            c = await heya(port, "127.0.0.9", Cert(tmp_path, "quick"))
            c.close()
            close_all(conns)
            await wait_until(lambda: srv.admission.total == 0)

    asyncio.run(go())


def test_heya_a_known_mailbox_handshakes_ahead_of_a_flood_of_client_hellos(settings, tmp_path):
    """The same gate on Heya's TLS handshakes: a mailbox certificate whose address
    authenticated before completes TLS (two steps) ahead of 300 queued ClientHellos."""
    async def go():
        import ssl
        hello = client_context(Cert(tmp_path, "flood")).wrap_bio(ssl.MemoryBIO(),
                                                                   out := ssl.MemoryBIO())
        with pytest.raises(ssl.SSLWantReadError):
            hello.do_handshake()
        client_hello = out.read()
        async with node(settings, max_handshakes=1000, max_handshakes_per_address=64,
                        handshake_timeout_seconds=30.0) as n:
            port, srv = n.heya.bound_port, n.heya
            cert, token = Cert(tmp_path, "mailbox"), mint(settings)[0]
            (await mailbox(port, cert, token)).close()          # AUTH: its address is known
            srv.gate.steps_per_turn = 1
            flood = await queued_flood(port, srv, client_hello)
            before = srv.gate.run_steps
            c = await heya(port, "127.0.0.1", cert)               # TLS and the greeting
            ahead = srv.gate.run_steps - before - 2
            assert ahead <= 60, ahead             # round-robin: 200 or more
            assert len(srv.gate) > 100
            c.close()
            close_all(flood)

    asyncio.run(go())


# --- descriptors ----------------------------------------------------------------------------------

_LISTENER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    from ingress.trueseal_push import PushServer
    from runtime.config import Settings
    from runtime.keys import RelayKey

    class Fmt(logging.Formatter):
        def format(self, r):
            return f"{r.levelname} {r.name} {getattr(r, 'event', '-')} {r.getMessage()}"

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Fmt())
    logging.basicConfig(level=logging.INFO, handlers=[handler])

    class Sink:
        async def append(self, row):
            return None

    async def main():
        s = Settings()
        s.process.open_files_reserve = int(sys.argv[2])
        s.trueseal.handshake_timeout_seconds = 60.0
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), hard))
        server = PushServer(s, Sink(), RelayKey(bytes(range(100, 132))), host="127.0.0.1",
                            port=0)
        await server.start()
        print(server.bound_port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(server.pauses, flush=True)
        await server.close()

    asyncio.run(main())
""")


@pytest.mark.parametrize("reserve", [0, 16], ids=["emfile", "reserve"])
def test_near_the_descriptor_limit_the_listener_pauses_says_so_once_and_recovers(reserve):
    """RLIMIT_NOFILE 100 and 300 connections: accept() fails with EMFILE (reserve 0) or the
    reserve is reached; the listener stops accepting with one log line (asyncio's own loop
    logged an ERROR per try, in a hot loop), and serves again once the clients left."""
    proc = subprocess.Popen([sys.executable, "-c", _LISTENER, "100", str(reserve)], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        port = int(proc.stdout.readline())

        async def main():
            conns = [await raw(port, f"127.0.0.{2 + i % 3}") for i in range(300)]
            await asyncio.sleep(1.0)
            close_all(conns)
            deadline = time.monotonic() + 10
            while True:
                try:
                    reply = await push_once(port, "127.0.0.9")
                except (ConnectionError, OSError, asyncio.TimeoutError,
                        asyncio.IncompleteReadError, AssertionError):
                    reply = None
                if reply == ACK:
                    return
                assert time.monotonic() < deadline, "the listener did not recover"
                await asyncio.sleep(0.2)

        run(main())
        out, err = proc.communicate("stop\n", timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert int(out.split()[-1]) >= 1                 # it did pause
    lines = err.splitlines()
    assert "out of system resource" not in err
    assert sum("listener_paused" in line for line in lines) == 1, err
    assert len(lines) < 10, err
