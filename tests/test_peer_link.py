"""The peer channel's shells (runtime/peer_link.py) on real sockets, with real Noise IK
handshakes and the peer list in real Delta tables (delta_tables/peer_registry.py): a hand-off
reaches the egress side that subscribed its mailbox; a key the store does not list, or lists
for a node whose lease or registration expired, is refused, and its channel closed."""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta, timezone

import pytest

from delta_tables import peer_registry
from delta_tables.node_lease import NodeLease
from delta_tables.peer_registry import PeerRegistration, PeerStore
from egress.pending import MailboxHub
from engine.noise_session import LengthPrefixDeframer
from engine.peer_channel import PeerChannel
from runtime import keys
from runtime.handoff import Handoff
from runtime.peer_link import PeerDialer, PeerListener, peer_key

MAILBOX = b"r" * 32


@pytest.fixture
def cluster(settings):
    settings.cluster.peer_refresh_seconds = 0.2
    settings.ingress.lease_seconds = 30
    return settings


def handoff(n: int, size: int = 100) -> Handoff:
    return Handoff("trueseal", MAILBOX, n.to_bytes(32, "big"),
                   datetime.now(timezone.utc) + timedelta(hours=1), bytes([n % 256]) * size)


async def _acks(*_):
    return None


async def until(cond, timeout=10.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        await asyncio.sleep(0.01)


async def start_pair(settings, layout, tmp_path):
    store = PeerStore(layout.tables)
    listener = PeerListener(settings, peer_key(tmp_path / "a"), store, "node-a",
                            host="127.0.0.1", port=0)
    await listener.start()
    hub = MailboxHub(_acks)
    dialer = PeerDialer(settings, peer_key(tmp_path / "b"), store, "node-b-egress",
                        lambda h: hub.add_early(h.protocol, h.mailbox, h.event_id,
                                                h.envelope, h.expires_at),
                        hub.mailboxes_online)
    hub.watch = dialer.watch
    await dialer.start()
    return listener, dialer, hub


def test_peer_key_is_created_private_in_the_data_dir(tmp_path):
    key = peer_key(tmp_path)
    path = tmp_path / "keys" / "peer_static.key"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert peer_key(tmp_path).public == key.public
    assert key.public != keys.load_or_create(tmp_path).public   # not the trueseal key


def test_a_subscribed_mailbox_gets_hand_offs_across_the_channel(cluster, layout, tmp_path):
    async def main():
        listener, dialer, hub = await start_pair(cluster, layout, tmp_path)
        try:
            listed = {p.name: p for p in peer_registry.live(layout.tables)}
            assert set(listed) == {"node-a", "node-b-egress"}
            assert listed["node-a"].endpoint == f"127.0.0.1:{listener.bound_port}"
            assert listed["node-b-egress"].endpoint == ""
            await until(lambda: listener.links)
            listener.send(handoff(1))                   # nobody online there: not sent
            session = hub.open_session("trueseal", MAILBOX)
            await until(lambda: listener.by_mailbox)
            assert listener.sent == 0
            big = handoff(2, size=65_482)               # the largest trueseal envelope
            listener.send(big)
            listener.send(handoff(3))
            got = []
            while len(got) < 2:
                got += await asyncio.wait_for(session.next(), 5)
            assert [e.envelope for e in got] == [big.envelope, handoff(3).envelope]
            assert all(e.early for e in got)
            listener.send(handoff(3))                   # twice: delivered once
            await asyncio.sleep(0.2)
            assert hub.pending_count() == 2 and dialer.received == 3
            session.close()                             # the last session: unsubscribed
            await until(lambda: not listener.by_mailbox)
            # a new channel subscribes what is online then
            session = hub.open_session("trueseal", MAILBOX)
            for link in list(listener.links):
                link.close()
            await until(lambda: not listener.links)
            await until(lambda: listener.by_mailbox, timeout=15)
            session.close()
        finally:
            await dialer.close()
            await listener.close()
        now = datetime.now(timezone.utc)
        assert not [p for p in peer_registry.read_all(layout.tables) if p.live(now)]
    asyncio.run(main())


async def _dial_raw(port: int, key_dir, listener_pub: bytes) -> bytes:
    """A real IK initiator with the key in `key_dir`; what the listener answered."""
    core = PeerChannel(peer_key(key_dir).private_bytes, initiator=True,
                       remote_static=listener_pub)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(core.data_to_send())
    answer = await asyncio.wait_for(reader.read(65536), 5)   # b"": closed without a word
    writer.close()
    return answer


def test_unlisted_and_expired_keys_are_refused_without_an_answer(cluster, layout, tmp_path,
                                                                 caplog):
    caplog.set_level(logging.INFO, logger="relay.peer")

    async def main():
        a = peer_key(tmp_path / "a")
        listener = PeerListener(cluster, a, PeerStore(layout.tables), "node-a",
                                host="127.0.0.1", port=0)
        await listener.start()
        try:
            # never listed
            assert await _dial_raw(listener.bound_port, tmp_path / "x", a.public) == b""
            assert listener.rejected == 1
            # listed, but its registration expired (not renewed)
            PeerRegistration(layout.tables, "node-y-egress", "egress",
                             peer_key(tmp_path / "y").public, seconds=0.5).register()
            await asyncio.sleep(1.3)
            assert await _dial_raw(listener.bound_port, tmp_path / "y", a.public) == b""
            assert listener.rejected == 2
            # listed and renewed, but for a node whose lease expired
            def node_z(lease_seconds: float) -> NodeLease:
                lease = NodeLease(layout.tables, "node-z", "ingress-trueseal",
                                  seconds=lease_seconds).acquire()
                PeerRegistration(layout.tables, "node-z", "ingress",
                                 peer_key(tmp_path / "z").public, "127.0.0.1:9",
                                 epoch=lease.epoch, seconds=60).register()
                return lease
            node_z(0.5)
            await asyncio.sleep(1.3)
            assert await _dial_raw(listener.bound_port, tmp_path / "z", a.public) == b""
            assert listener.rejected == 3
            # the same, listed and live: answered (the IK reply, 48 bytes + 2 of length)
            lease = node_z(60)
            await asyncio.sleep(0.5)    # the listener's next read of the list (every 0.2 s)
            reply = await _dial_raw(listener.bound_port, tmp_path / "z", a.public)
            assert [len(m) for m in LengthPrefixDeframer().feed(reply)] == [48]
            lease.release()
        finally:
            await listener.close()
    asyncio.run(main())
    refusals = [r for r in caplog.records if getattr(r, "event", "") == "peer_rejected"]
    assert len(refusals) == 3
    text = "\n".join(r.getMessage() + repr(r.__dict__) for r in caplog.records)
    for d in ("a", "x", "y", "z"):
        assert peer_key(tmp_path / d).public.hex() not in text
    assert "127.0.0.1" not in text


def test_a_channel_closes_when_its_peer_registration_expires(cluster, layout, tmp_path):
    async def main():
        cluster.ingress.lease_seconds = 1.0
        listener, dialer, hub = await start_pair(cluster, layout, tmp_path)
        try:
            await until(lambda: listener.links)
            dialer._registered._task.cancel()           # the egress host stops renewing
            await until(lambda: not listener.links, timeout=5)
            assert not dialer.links or await _gone(dialer)
        finally:
            await dialer.close()
            await listener.close()
    asyncio.run(main())


async def _gone(dialer) -> bool:
    await until(lambda: not dialer.links, timeout=5)
    return True


def test_off_by_default_one_host_opens_no_port_and_makes_no_key(settings):
    from egress.service import EgressNode
    from ingress.service import IngressNode
    ingress, egress = IngressNode(settings, fsync=False), EgressNode(settings, fsync=False)
    assert ingress.peers is None and ingress.trueseal.peers is None and egress.peers is None
    assert egress.hub.watch is None
    assert not (tmp := settings.data_path / "keys" / "peer_static.key").exists(), tmp


def test_a_peer_that_stops_reading_costs_dropped_hand_offs_never_a_blocked_sender(
        cluster, layout, tmp_path):
    """A listed egress host subscribes and then reads nothing: the listener keeps at most
    `peer_send_buffer_bytes` for it and drops the rest (counted); `send` never waits."""
    from runtime.peer_link import SUBSCRIBE, _sub
    cluster.cluster.peer_send_buffer_bytes = 256 * 1024

    async def main():
        a = peer_key(tmp_path / "a")
        listener = PeerListener(cluster, a, PeerStore(layout.tables), "node-a",
                                host="127.0.0.1", port=0)
        await listener.start()
        PeerRegistration(layout.tables, "node-s-egress", "egress",
                         peer_key(tmp_path / "s").public, seconds=60).register()
        core = PeerChannel(peer_key(tmp_path / "s").private_bytes, initiator=True,
                           remote_static=a.public)
        reader, writer = await asyncio.open_connection("127.0.0.1", listener.bound_port)
        try:
            writer.write(core.data_to_send())
            core.receive_data(await asyncio.wait_for(reader.read(65536), 5))
            core.send(_sub(SUBSCRIBE, "trueseal", MAILBOX))
            writer.write(core.data_to_send())
            await until(lambda: listener.by_mailbox)
            t0 = time.monotonic()
            for n in range(600):                # ~39 MB, never read
                listener.send(handoff(n, size=65_000))
                if n % 50 == 0:
                    await asyncio.sleep(0.01)   # the loop writes what fits
            took = time.monotonic() - t0
            assert listener.dropped > 0 and listener.sent + listener.dropped == 600, took
            (link,) = listener.links
            assert link.writer.transport.get_write_buffer_size() + link.core.queued \
                <= 256 * 1024 + 65_100
        finally:
            writer.close()
            await listener.close()
    asyncio.run(main())


def test_a_peer_listener_on_every_address_needs_the_address_others_dial():
    from runtime import config
    env = {"RELAY_CLUSTER__PEER_LISTEN": "true", "RELAY_CLUSTER__PEER_BIND": "0.0.0.0"}
    with pytest.raises(config.ConfigError) as e:
        config.load(None, env=env)
    assert str(e.value) == ("setting cluster.peer_listen = true (from "
                            "RELAY_CLUSTER__PEER_LISTEN) binds every address ('0.0.0.0'): set "
                            "cluster.peer_advertise to the address other hosts dial")
    s = config.load(None, env=dict(env, RELAY_CLUSTER__PEER_ADVERTISE="10.0.0.5"))
    assert s.cluster.peer_advertise == "10.0.0.5"


def test_a_dialer_reaches_each_listener_of_its_protocols_even_two_sharing_a_hosts_key(
        cluster, layout, tmp_path):
    """Host A runs PPP and Heya as two processes (one data directory, one peer key) and a
    trueseal push process; host B's PPP+Heya dialler (it lists no row of its own: its
    listener's) dials the two of its protocols, not the trueseal one, and a WAKE it asked for
    reaches it."""
    async def main():
        key_a = peer_key(tmp_path / "a")
        store = PeerStore(layout.tables)
        ppp, heya, push = (PeerListener(cluster, key_a, store, name, host="127.0.0.1",
                                        port=0, protocols=protos)
                           for name, protos in (("a-ppp", ["ppp"]), ("a-heya", ["heya"]),
                                                ("a-trueseal", ["trueseal"])))
        b = PeerListener(cluster, peer_key(tmp_path / "b"), store, "b-ppp",
                         host="127.0.0.1", port=0, protocols=["ppp", "heya"])
        for listener in (ppp, heya, push, b):
            await listener.start()
        woken: list[str] = []
        dialer = PeerDialer(cluster, peer_key(tmp_path / "b"), store, "unused",
                            lambda h: None, lambda protocol: [], protocols=("ppp", "heya"),
                            register=False, wakes=woken.append)
        await dialer.start()
        try:
            await until(lambda: len(dialer.links) == 2)
            assert sorted(name for name, _ in dialer.links) == ["a-heya", "a-ppp"]
            assert not push.links and not b.links       # not trueseal's; not its own
            assert "unused" not in {p.name for p in peer_registry.live(layout.tables)}
            await until(lambda: heya.by_mailbox and ppp.by_mailbox)
            heya.wake("heya")
            ppp.wake("sync")                            # not asked for: nothing sent
            await until(lambda: woken)
            await asyncio.sleep(0.2)
            assert woken == ["heya"]
        finally:
            await dialer.close()
            for listener in (ppp, heya, push, b):
                await listener.close()
    asyncio.run(main())


def test_a_registration_table_from_before_the_protocols_column_takes_it(cluster, layout,
                                                                        tmp_path):
    """A row table written by the previous version (no `protocols`) is read as trueseal's,
    and the next registration under that name writes the column."""
    import pyarrow as pa
    from deltalake import write_deltalake

    from delta_tables.node_lease import open_one_row_table
    old_schema = pa.schema([f for f in peer_registry.SCHEMA if f.name != "protocols"])
    path = peer_registry.peers_root(layout.tables) / "old"
    now = datetime.now(timezone.utc)
    row = {"name": "old", "role": "ingress", "host": "h", "key": b"k" * 32, "endpoint": "e:1",
           "epoch": 0, "heartbeat": now, "expires": now + timedelta(minutes=1),
           "released": False}
    write_deltalake(open_one_row_table(path, old_schema, "peer"),
                    pa.Table.from_pylist([row], schema=old_schema), mode="overwrite")
    (old,) = peer_registry.live(layout.tables)
    assert old.protocols is None and old.serves("trueseal") and not old.serves("ppp")
    reg = PeerRegistration(layout.tables, "old", "ingress", b"k" * 32, "e:1",
                           protocols=["ppp", "heya"]).register()
    reg.renew()
    (new,) = peer_registry.live(layout.tables)
    assert new.protocols == "heya,ppp" and new.serves("ppp") and not new.serves("trueseal")
