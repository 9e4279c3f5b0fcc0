"""Hostile clients on the cursor-sync listener (issue 19), with a real aioquic client on
loopback (tests/sync_client.py).

Several source addresses of 127.0.0.0/8 stand for several clients (the client's UDP socket is
bound to 127.0.0.N). `SilentInitial` sends one real Initial and nothing after: a handshake that
never finishes or, answered with a Retry, a spoofed source that never echoes it. Small and
quick: tens to a hundred connections; the 10,000-connection suite lives in tests/hostile/.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import tracemalloc
import weakref

import pytest
from aioquic.quic.packet import QuicPacketType

from engine.admission import Stage, address_key
from sync_client import (Device, SilentInitial, SyncClient, device_session, frame, group_id,
                         hello, join, packet_type, pull, push)
import loopback
from test_sync_shell import admission, blob, relay

HANDSHAKE, UNAUTH, AUTH = Stage.HANDSHAKE, Stage.UNAUTH, Stage.AUTH
TOO_MANY = (2, "too many sessions")


async def wait_until(cond, timeout: float = 10.0) -> None:
    await loopback.wait_until(cond, timeout)   # QUIC handshakes: a longer default


def no_retry(settings) -> None:
    """Address validation off: every Initial opens a connection (the relay is never 'under
    load'), so silent clients hold handshake state."""
    settings.sync.retry_above_handshakes = 10 ** 6
    settings.sync.retry_above_handshakes_per_address = 10 ** 6


def events(caplog, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


async def round_trip(c: SyncClient, n: int) -> float:
    """PUSH then PULL on an active session; seconds taken."""
    t = time.monotonic()
    assert (await c.request(push(blob(n), b"legit %d" % n, 0)))[:3] == ["PushAck", blob(n), n]
    page = await c.request(pull(n - 1, 10))
    assert [e[1] for e in page[1]] == [n]
    return time.monotonic() - t


# --- deadlines --------------------------------------------------------------------------------

def test_a_handshake_that_never_finishes_is_dropped_at_its_deadline_and_freed(settings, caplog):
    """aioquic alone keeps a half-done handshake for the idle timeout (60 s), renewed by every
    packet; here it is dropped at `handshake_timeout_seconds`, without a packet, and nothing
    refers to its state any more."""
    no_retry(settings)
    settings.sync.handshake_timeout_seconds = 2.0
    caplog.set_level(logging.INFO)

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            silent = [SilentInitial(port, f"127.0.0.{2 + i % 5}", send=False)
                      for i in range(40)]
            gc.collect()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            started = time.monotonic()
            for s in silent:
                s.send()
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 40)
            held = tracemalloc.get_traced_memory()[0] - before
            protocols = [weakref.ref(p) for p in set(srv._server._protocols.values())]
            assert len(protocols) == 40
            await asyncio.sleep(0.5)
            for s in silent:       # the relay's handshake flight (and its resends) came back
                assert s.received()
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 0, timeout=5)
            assert 1.9 < time.monotonic() - started < 5.0      # at the deadline, not later
            assert srv._server._protocols == {} and srv.conns == set()
            assert srv.rejected["handshake_timeout"] == 40
            for s in silent:
                s.received()
            await asyncio.sleep(1.5)
            assert not any(s.received() for s in silent)       # dropped: nothing sent after
            gc.collect()
            assert not [r for r in protocols if r() is not None]
            freed = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            print(f"traced per pending handshake: {held / 40 / 1024:.1f} KiB; "
                  f"left after the deadline: {freed / 1024:.1f} KiB")
            assert held / 40 < 256 * 1024
            assert freed < held / 10                           # returned
            for s in silent:
                s.close()
            # a real client still connects
            c, welcome = await device_session(port, Device(), group_id(b"after"))
            assert welcome[0] == "Welcome"
            await c.close()

    asyncio.run(go())
    # one line for forty timeouts (runtime/log_rate.py), none of aioquic's
    assert len(events(caplog, "sync_handshake_timeout")) == 1
    assert not [r for r in caplog.records if r.name == "quic"]


def test_a_handshake_whose_client_went_quiet_is_dropped_sooner_one_still_sending_is_kept(
        settings):
    """`handshake_idle_timeout_seconds`: a client that sent its Initial and left is dropped
    that long after its last packet; one that keeps resending (a lossy path) keeps its
    handshake until `handshake_timeout_seconds`, or until it too goes quiet."""
    no_retry(settings)
    settings.sync.handshake_timeout_seconds = 8.0
    settings.sync.handshake_idle_timeout_seconds = 1.5

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv, loop = node.sync, asyncio.get_running_loop()
            left = [SilentInitial(port, "127.0.0.2") for _ in range(5)]
            resending = [SilentInitial(port, "127.0.0.3") for _ in range(5)]
            started = loop.time()
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 10)
            while loop.time() - started < 4.0:       # resent every 0.5 s for 4 s
                await asyncio.sleep(0.5)
                for r in resending:
                    r.send()
                if loop.time() - started > 2.5:      # the quiet ones are gone by now
                    assert srv.admission.count(HANDSHAKE) == 5
                    assert srv.admission.count_of(address_key("127.0.0.3"), HANDSHAKE) == 5
            assert srv.rejected["handshake_timeout"] == 5
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 0, timeout=10)
            quiet_for = loop.time() - started
            # dropped 1.5 s after their last resend, before the 8 s deadline
            assert 5.0 < quiet_for < 7.5, quiet_for
            assert srv.rejected["handshake_timeout"] == 10
            assert srv._server._protocols == {}
            for x in left + resending:
                x.close()

    asyncio.run(go())


def test_a_request_stream_stalled_mid_frame_is_answered_at_its_deadline(settings):
    """A frame whose length prefix and part of its body came, then nothing: refused (empty
    FIN) `stream_read_timeout_seconds` after its first byte; the session goes on. Before HELLO
    the stream's window stays `stream_window_before_hello` however much of it is used."""
    settings.sync.stream_read_timeout_seconds = 1.0

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            g, a = group_id(b"stall"), Device()
            c = await SyncClient.connect(port)
            assert c.proto._quic._remote_max_streams_bidi == 4          # aioquic: 128
            assert c.proto._quic._remote_max_streams_uni == 0
            assert c.proto._quic._remote_max_stream_data_bidi_remote == 16384
            assert await c.authenticate(a) == ["Done", "AuthProof"]
            # before HELLO: 12 KiB of a 100 KiB frame (aioquic doubled the window past half)
            sid = c._open()
            sent = time.monotonic()
            c.proto._quic.send_stream_data(sid, b"\x00\x01\x90\x00" + b"\x90" * 12000)
            c.proto.transmit()
            conn = next(iter(node.sync.conns))
            await wait_until(lambda: sid in conn.streams
                             and conn.streams[sid].reader.buffered >= 12000)
            await asyncio.sleep(0.2)
            assert conn._quic._streams[sid].max_stream_data_local == 16384
            assert await asyncio.wait_for(c.proto.fins[sid], 5) == b""  # the empty FIN
            assert 0.9 < time.monotonic() - sent < 4.0
            assert sid not in conn.streams                               # its bytes freed
            # HELLO, then a frame of 600 KB on one stream: one largest frame per stream now,
            # and max_streams_per_connection open at once instead of max_streams_before_hello
            allowed = c.proto._quic._remote_max_streams_bidi
            assert (await c.request(hello(1, "phone", g)))[0] == "Welcome"
            await c.request(pull(0, 0))        # the MAX_STREAMS rides on a later packet
            await wait_until(lambda: c.proto._quic._remote_max_streams_bidi >= allowed + 12)
            sid = c._open()
            c.proto._quic.send_stream_data(sid, frame(push(blob(1), b"\x01" * 600_000, 0))[:300_000])
            c.proto.transmit()
            await wait_until(lambda: sid in conn.streams
                             and conn.streams[sid].reader.buffered >= 290_000)
            assert conn._quic._streams[sid].max_stream_data_local == node.sync.stream_window
            assert await asyncio.wait_for(c.proto.fins[sid], 5) == b""  # stalled: refused too
            assert (await c.request(pull(0, 0)))[0] == "PullResponse"  # the session goes on
            # streams answered are forgotten once aioquic has (they grew one per request)
            for _ in range(40):
                await c.request(pull(0, 0))
            assert len(conn.answered) <= 2 * settings.sync.max_streams_per_connection + 9
            await c.close()

    asyncio.run(go())


def test_a_flood_of_initials_waits_behind_the_sessions_packets(settings):
    """The listener drains its socket every turn (runtime/udp_endpoint.py): a session's packet
    read behind 400 new connections' Initials is answered while most of them still wait
    (at most `initial_queue`, the oldest dropped), instead of after all of them."""
    settings.sync.initial_queue = 64
    settings.sync.initial_queue_per_address = 64

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            c, welcome = await device_session(port, Device(), group_id(b"flood"))
            assert welcome[0] == "Welcome"
            flood = [SilentInitial(port, "127.0.0.2", send=False) for _ in range(400)]
            for f in flood:                  # all in the socket before the relay's next turn
                f.send()
            reply = await asyncio.wait_for(c.request(pull(0, 0)), 10)
            assert reply[0] == "PullResponse"
            assert len(srv._server._initials) > 0                    # still waiting
            assert srv.rejected["initial_queue_full"] >= 400 - 64 - 3 * 8   # 8 started a turn
            await wait_until(lambda: not srv._server._initials)    # then all started
            for f in flood:
                f.close()
            await c.close()

    asyncio.run(go())


def test_a_new_client_starts_ahead_of_another_address_flood_of_initials(settings):
    """New connections start one source address at a time in turn (engine/fair_queue.py): a
    client's handshake is not queued behind the Initials a flood from another address sent
    first; and one address queues at most `initial_queue_per_address`."""
    settings.sync.initial_queue_per_address = 300

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            flood = [SilentInitial(port, "127.0.0.2", send=False) for _ in range(400)]
            for f in flood:
                f.send()
            await wait_until(lambda: len(srv._server._initials) > 0)
            session = asyncio.create_task(device_session(port, Device(), group_id(b"fair")))
            # every loop turn: the flood's Initials still queued when the client's connection
            # was started (admitted: in handshake from 127.0.0.1)
            while srv.admission.count_of(address_key("127.0.0.1"), HANDSHAKE) == 0:
                assert not session.done()
                await asyncio.sleep(0)
            waiting_when_started = len(srv._server._initials)
            c, welcome = await session
            assert welcome[0] == "Welcome"
            assert waiting_when_started >= 100, waiting_when_started   # started ahead of them
            assert srv.rejected["initial_queue_full"] >= 400 - 300 - 8 * 8
            await wait_until(lambda: not srv._server._initials)
            for f in flood:
                f.close()
            await c.close()

    asyncio.run(go())


def test_a_client_holding_nothing_starts_ahead_of_many_addresses_holding_several(settings):
    """Round-robin alone gives a client one turn in as many as there are flooding addresses;
    an address holding at most one connection is served first (the light lane of
    engine/fair_queue.py), so 100 addresses that each hold handshakes and keep Initials
    queued do not make a device's connection wait behind one of each of theirs."""
    no_retry(settings)
    s = settings.sync
    s.handshakes_per_address_per_second = 1000
    s.max_handshakes = 2000

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            hosts = [f"127.0.1.{10 + i}" for i in range(100)]
            held = [SilentInitial(port, h) for h in hosts for _ in range(2)]
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 200)
            flood = [SilentInitial(port, h, send=False) for h in hosts for _ in range(3)]
            for f in flood:
                f.send()
            await wait_until(lambda: len(srv._server._initials) > 250)
            client = SilentInitial(port, "127.0.0.1", send=False)   # a device's first Initial
            started_before = srv.admission.count(HANDSHAKE)
            client.send()
            while srv.admission.count_of(address_key("127.0.0.1"), HANDSHAKE) == 0:
                await asyncio.sleep(0)
            started_ahead = srv.admission.count(HANDSHAKE) - 1 - started_before
            # round-robin: ~100 (one of each address); the light lane: a turn's worth
            assert started_ahead <= 16, started_ahead
            c, welcome = await device_session(port, Device(), group_id(b"light"))
            assert welcome[0] == "Welcome"
            await c.close()
            client.close()
            for f in held + flood:
                f.close()

    asyncio.run(go())


def test_new_connections_of_unknown_addresses_get_their_share_of_a_core_a_known_one_goes_first(
        settings):
    """`new_connection_cpu_share` (engine/work_budget.py): 200 Initials from 100 addresses
    that never authenticated start within their share of a core (what connections before
    HELLO cost, measured), while a device from an address that authenticated lately connects
    at once (the Initials it passes still wait)."""
    no_retry(settings)
    s = settings.sync
    s.handshakes_per_address_per_second = 1000
    s.max_handshakes = 2000
    s.new_connection_cpu_share = 0.1
    # the flood's handshakes (one Initial each) are still held when counted
    s.handshake_timeout_seconds = s.handshake_idle_timeout_seconds = 60.0

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv, loop = node.sync, asyncio.get_running_loop()
            c, welcome = await device_session(port, Device(), group_id(b"known"))
            assert welcome[0] == "Welcome"          # 127.0.0.1 authenticated: known
            await c.close()
            flood = [SilentInitial(port, f"127.0.1.{10 + i}", send=False)
                     for i in range(100) for _ in range(2)]
            spent0, started = srv.new_connections.spent, loop.time()
            for f in flood:
                f.send()
            session = asyncio.create_task(device_session(port, Device(),
                                                         group_id(b"known again")))
            # every loop turn: the flood's Initials still queued when the known client's
            # connection was started
            local = address_key("127.0.0.1")
            while not any(srv.admission.count_of(local, st) for st in (HANDSHAKE, UNAUTH)):
                assert not session.done()
                await asyncio.sleep(0)
            waiting_when_started = len(srv._server._initials)
            c, welcome = await asyncio.wait_for(session, 10)
            assert welcome[0] == "Welcome"
            assert waiting_when_started >= 100, waiting_when_started    # started ahead
            await c.close()
            await wait_until(lambda: not srv._server._initials, 60)
            took = loop.time() - started
            spent = srv.new_connections.spent - spent0
            assert srv.admission.count(HANDSHAKE) >= 150     # the flood did start, in time
            # a tenth of a core over the flood, plus the burst, the known client's handshake
            # and the last start (measured after it ran)
            assert spent <= 0.1 * took + 0.25 + 0.05, (spent, took)
            for f in flood:
                f.close()

    asyncio.run(go())


# --- address validation -----------------------------------------------------------------------

def test_under_load_a_new_client_gets_a_retry_and_still_connects(settings):
    """`retry_above_handshakes` handshakes under way: every new connection must echo a Retry
    before the relay keeps anything for it. Spoofed sources (clients that never echo it) make
    no state at all; a real client pays one round trip and gets its session."""
    s = settings.sync
    s.retry_above_handshakes = 3
    s.retry_above_handshakes_per_address = 10 ** 6

    async def go():
        async with relay(settings) as (port, node, _):
            srv = node.sync
            held = [SilentInitial(port, "127.0.0.2") for _ in range(3)]
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 3)
            assert srv.retries == 0
            cids = dict(srv._server._protocols)
            flood = [SilentInitial(port, f"127.0.0.{3 + i % 10}") for i in range(60)]
            await wait_until(lambda: srv.retries == 60)
            await asyncio.sleep(0.2)
            for f in flood:
                assert [packet_type(d) for d in f.received()] == [QuicPacketType.RETRY]
            assert srv._server._protocols == cids                 # no state for any of them
            assert srv.admission.count(HANDSHAKE) == 3 and srv.validating
            # a real client: Retry, echo, handshake, session
            c, welcome = await device_session(port, Device(), group_id(b"retry"),
                                              local_host="127.0.0.20")
            assert welcome[0] == "Welcome" and srv.retries == 61
            assert await round_trip(c, 1) < 2.0
            await c.close()
            for x in held + flood:
                x.close()

    asyncio.run(go())


def test_one_address_holding_handshakes_must_validate_its_new_ones(settings):
    """Per address: past `retry_above_handshakes_per_address` handshakes under way its new
    connections must echo a Retry, so a spoofer of that address holds at most that many (and
    cannot fill its `max_handshakes_per_address`); the address itself still gets in, and
    another address is untouched."""
    s = settings.sync
    s.retry_above_handshakes = 10 ** 6
    s.retry_above_handshakes_per_address = 2

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            silent = [SilentInitial(port, "127.0.0.2") for _ in range(2)]
            await wait_until(lambda: srv.admission.count_of("127.0.0.2", HANDSHAKE) == 2)
            spoofed = SilentInitial(port, "127.0.0.2")
            await wait_until(lambda: srv.retries == 1)
            await asyncio.sleep(0.2)
            assert [packet_type(d) for d in spoofed.received()] == [QuicPacketType.RETRY]
            # the address itself echoes its Retry and gets its connection
            c3 = await SyncClient.connect(port, local_host="127.0.0.2")   # handshake done
            assert srv.retries == 2 and srv.admission.count_of("127.0.0.2", UNAUTH) == 1
            more = [SilentInitial(port, "127.0.0.2") for _ in range(3)]
            await wait_until(lambda: srv.retries == 5)
            assert srv.admission.count_of("127.0.0.2", HANDSHAKE) == 2
            # 127.0.0.3 is not affected: no Retry, a session at once
            c, welcome = await device_session(port, Device(), group_id(b"other"),
                                              local_host="127.0.0.3")
            assert welcome[0] == "Welcome" and srv.retries == 5
            await c.close()
            await c3.close()
            for x in silent + more + [spoofed]:
                x.close()

    asyncio.run(go())


def test_one_address_starts_at_most_its_rate_of_handshakes_and_another_is_untouched(settings):
    """`handshakes_per_address_per_second`: a burst of new connections from one address
    starts that many handshakes; the rest are dropped unanswered (their clients resend),
    counted, and cost no connection state; another address starts its own at once."""
    no_retry(settings)
    settings.sync.handshakes_per_address_per_second = 5

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            burst = [SilentInitial(port, "127.0.0.2") for _ in range(12)]
            await wait_until(lambda: srv.rejected["handshake_rate"] >= 6)
            await asyncio.sleep(0.3)
            assert srv.admission.count_of("127.0.0.2", HANDSHAKE) in (5, 6)   # + 1 refilled
            answered = sum(1 for b in burst if b.received())
            assert answered == srv.admission.count_of("127.0.0.2", HANDSHAKE)
            c, welcome = await device_session(port, Device(), group_id(b"rate"),
                                              local_host="127.0.0.3")
            assert welcome[0] == "Welcome"
            await c.close()
            for b in burst:
                b.close()

    asyncio.run(go())


def test_a_closed_connection_is_forgotten_within_the_close_period_cap(settings):
    """A connection the client closes is dropped after at most `CLOSE_PERIOD_MAX_SECONDS`
    of draining (RFC 9000 §10.2 asks 3 PTO; a PTO measured while the relay was busy made it
    seconds), so a wave of closed connections does not keep its state."""
    from ingress.sync_quic import CLOSE_PERIOD_MAX_SECONDS

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            srv = node.sync
            c = await SyncClient.connect(port, local_host="127.0.0.2")
            await wait_until(lambda: srv.admission.count(UNAUTH) == 1)
            (proto,) = set(srv._server._protocols.values())
            # as if its handshake had been measured under load: a PTO of seconds
            proto._quic._loss._rtt_smoothed = proto._quic._loss._rtt_latest = 3.0
            # uncapped, 3 PTO of a 3 s round trip would keep it for more than 9 s
            assert 3 * proto._quic._loss.get_probe_timeout() > 9.0
            started = time.monotonic()
            await c.close()
            await wait_until(lambda: not srv._server._protocols)
            # dropped at the cap (1.5 s), not after 3 PTO: the margin is wide, as a busy CI
            # machine delays the close and the timer by seconds
            assert time.monotonic() - started < CLOSE_PERIOD_MAX_SECONDS + 4.5

    asyncio.run(go())


# --- budgets per address and in total --------------------------------------------------------

def test_one_address_at_its_cap_cannot_stop_another(settings):
    """Handshakes of one address at their cap: its next one is dropped, another address gets
    in. Unauthenticated and authenticated sessions of one address at their caps: the
    address's session idle longest is closed (code 2) for its newcomer. A full UNAUTH stage
    evicts the idlest of the address holding the most."""
    no_retry(settings)
    s = settings.sync
    s.max_handshakes = 6
    s.max_handshakes_per_address = 4
    s.max_unauth_sessions_per_address = 3
    s.max_unauth_sessions = 5
    s.max_sessions_per_address = 2
    s.hello_timeout_seconds = 30.0

    async def go():
        async with relay(settings) as (port, node, _):
            srv = node.sync
            # UNAUTH: three of 127.0.0.2 held; the fourth gets in, the idlest is closed
            a2 = [await SyncClient.connect(port, local_host="127.0.0.2") for _ in range(3)]
            extra = await SyncClient.connect(port, local_host="127.0.0.2")
            assert await a2[0].closed(5) == TOO_MANY
            assert srv.admission.decisions[("unauth", "evicted_address_cap")] == 1
            a2 = a2[1:] + [extra]
            # HANDSHAKE: four silent ones of 127.0.0.2 held, more are dropped unanswered
            silent = [SilentInitial(port, "127.0.0.2") for _ in range(4)]
            await wait_until(lambda: srv.admission.count_of("127.0.0.2", HANDSHAKE) == 4)
            dropped = [SilentInitial(port, "127.0.0.2") for _ in range(3)]
            await wait_until(lambda: srv.rejected["handshake_address_cap"] == 3)
            await asyncio.sleep(0.3)
            assert not any(d.received() for d in dropped)
            assert len(set(srv._server._protocols.values())) == 4 + 3     # silent + a2
            # HANDSHAKE full (6): two silent ones of 127.0.0.4; a newcomer's handshake takes
            # the slot of 127.0.0.2's oldest (the biggest holder), dropped without a word
            silent += [SilentInitial(port, "127.0.0.4") for _ in range(2)]
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 6)
            first = weakref.ref(min(
                (c for c in srv._server._protocols.values()
                 if c.ticket.address == "127.0.0.2" and c.ticket.stage is HANDSHAKE),
                key=lambda c: c.ticket.since))
            # UNAUTH full (5): two of 127.0.0.4, then a newcomer evicts 127.0.0.2's oldest
            a4 = [await SyncClient.connect(port, local_host="127.0.0.4") for _ in range(2)]
            assert srv.rejected["evicted_handshake"] == 1       # the second found room
            assert srv.admission.count_of("127.0.0.2", HANDSHAKE) == 3
            assert srv.admission.count_of("127.0.0.4", HANDSHAKE) == 2
            gc.collect()
            assert first() is None              # the evicted handshake's state is gone
            assert srv.admission.count(UNAUTH) == 5
            g, dev = group_id(b"caps"), Device()
            c, welcome = await device_session(port, dev, g, local_host="127.0.0.3")
            assert welcome[0] == "Welcome"
            assert await a2[0].closed(5) == TOO_MANY
            assert srv.rejected["evicted_unauth"] == 2
            assert srv.admission.count_of("127.0.0.2", UNAUTH) == 2
            assert srv.admission.count_of("127.0.0.4", UNAUTH) == 2
            assert await round_trip(c, 1) < 2.0
            # AUTH: two sessions of 127.0.0.5; the third device's HELLO is welcome, and the
            # address's idlest session is closed with code 2
            d5 = [Device() for _ in range(3)]
            s5 = [(await device_session(port, d, g, local_host="127.0.0.5",
                                        admission=admission(dev, g, d)))[0] for d in d5[:2]]
            c5 = await SyncClient.connect(port, local_host="127.0.0.5")
            assert await c5.authenticate(d5[2]) == ["Done", "AuthProof"]
            assert await c5.request(join(g, *admission(dev, g, d5[2]))) == ["Done", "Join"]
            assert (await c5.request(hello(2, "x", g)))[0] == "Welcome"
            assert await s5[0].closed(5) == TOO_MANY
            assert srv.admission.decisions[("auth", "evicted_address_cap")] == 1
            # ... while 127.0.0.6 gets its session
            c6, welcome = await device_session(port, Device(), group_id(b"six"),
                                               local_host="127.0.0.6")
            assert welcome[0] == "Welcome"
            for x in a2 + a4 + s5 + [c, c5, c6]:
                await x.close()
            for x in silent + dropped:
                x.close()

    asyncio.run(go())


def test_an_authenticated_client_keeps_working_while_many_unauthenticated_are_held(settings):
    """A hundred connections past their handshake that never authenticate, and forty
    handshakes that never finish, spread over 13 addresses (within their budgets): a device in
    session keeps its round-trip time, and a new device still gets a session."""
    settings.sync.hello_timeout_seconds = 30.0
    settings.sync.handshake_timeout_seconds = 30.0
    settings.sync.handshake_idle_timeout_seconds = 30.0

    async def go():
        async with relay(settings) as (port, node, _):
            srv = node.sync
            g, a = group_id(b"busy"), Device()
            ca, _ = await device_session(port, a, g)
            base = min([await round_trip(ca, n) for n in (1, 2, 3)])
            idle = []
            for batch in range(5):
                idle += await asyncio.gather(*(
                    SyncClient.connect(port, local_host=f"127.0.0.{2 + i}") for i in range(5)
                    for _ in range(4)))
            silent = [SilentInitial(port, f"127.0.0.{7 + i % 8}") for i in range(40)]
            await wait_until(lambda: srv.admission.count(HANDSHAKE) == 40)
            assert srv.admission.count(UNAUTH) == 100 and srv.admission.count(AUTH) == 1
            assert srv.retries == 0         # below the thresholds: nobody paid a round trip
            under = max([await round_trip(ca, n) for n in (4, 5, 6)])
            print(f"round trip alone {base * 1000:.0f} ms, with 100 unauth + 40 handshakes "
                  f"held {under * 1000:.0f} ms")
            assert under < base + 1.0
            b = Device()
            cb, welcome = await device_session(port, b, g, admission=admission(a, g, b),
                                               local_host="127.0.0.30")
            assert welcome[0] == "Welcome"
            assert srv.admission.count(AUTH) == 2
            await asyncio.gather(*(x.close() for x in idle + [ca, cb]))
            for x in silent:
                x.close()

    asyncio.run(go())


def test_a_peer_breaking_quic_is_one_rate_limited_line_without_its_connection_id(settings,
                                                                                 caplog):
    """aioquic logs a WARNING naming the connection id each time a peer breaks the protocol
    (here: no common ALPN, twenty times); the relay keeps one `sync_quic_error` line."""
    import ssl

    from aioquic.quic.configuration import QuicConfiguration

    from sync_client import connect_from
    caplog.set_level(logging.INFO)

    async def go():
        async with relay(settings, stream=False) as (port, node, _):
            conf = QuicConfiguration(is_client=True, alpn_protocols=["h3"],
                                     verify_mode=ssl.CERT_NONE)

            async def attempt(n):
                with pytest.raises(ConnectionError):
                    async with connect_from(f"127.0.0.{2 + n % 4}", port, configuration=conf):
                        pass
            await asyncio.gather(*(attempt(n) for n in range(20)))
            assert node.sync.admission.count(HANDSHAKE) == 0

    asyncio.run(go())
    assert [r.error_code for r in events(caplog, "sync_quic_error")] == [0x100 + 120]
    assert not [r for r in caplog.records if r.name == "quic"]
