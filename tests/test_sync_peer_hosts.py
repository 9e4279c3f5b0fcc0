"""cursor-sync's path between hosts (runtime/peer_link.py): a PUSH_ACK and a NOTIFY carry the
cursor the stream gives a blob, so no host has them before the inbox row; the peer channel
shortens the wait after it. Two `relay ingress --protocol sync` processes (hosts A and B, own
data directories and peer keys, one tables directory), QUIC clients built byte by byte
(`sync_client.py`), the stream beside A (its commits signal A's listener). Both poll the inbox
only every 60 s here, so B hears of a row only through A's WAKE: the laptop on B is NOTIFY'd
of the phone's PUSH on A, and its own PUSH on B acked with its cursor, not a poll later, once."""

from __future__ import annotations

import asyncio
import time

from jobs.inbox_stream import start_inbox_stream
from runtime import config

from hosts_harness import Host
from sync_client import Device, device_session, group_id, push
from test_heya_peer_hosts import POLL_MS, WAKES
from test_ppp_peer_hosts import connected

EXP = 2 ** 40


def test_a_push_on_host_a_notifies_a_device_on_host_b_with_the_streams_wake_up(
        tmp_path, spark):
    asyncio.run(_scenario(tmp_path, spark))


async def _scenario(tmp_path, spark) -> None:
    env = {**WAKES, "RELAY_SYNC_IROH_PORT": "0"}
    a, b = Host(tmp_path, "a", "sync", env), Host(tmp_path, "b", "sync", env)
    await asyncio.gather(a.start(), b.start())
    settings = config.load(None, env={}, data_dir=str(tmp_path / "host-a"),
                           tables_dir=str(tmp_path / "tables"))
    clients = []
    query = None
    try:
        await asyncio.gather(connected(a), connected(b))
        g, phone, laptop = group_id(b"across hosts"), Device(), Device()
        ca, w = await device_session(a.port(), phone, g, name="phone")
        clients.append(ca)
        assert w[0] == "Welcome"
        cb, w = await device_session(b.port(), laptop, g, name="laptop",
                                     admission=[phone.id, EXP, phone.admit(g, laptop.id, EXP)])
        clients.append(cb)
        assert w[0] == "Welcome"
        query, _ = start_inbox_stream(spark, settings, fsync=False)
        await asyncio.sleep(1.0)        # B's WAKE subscription is on A's listener by now

        one = (1).to_bytes(16, "big")
        assert await ca.request(push(one, b"one", 0)) == ["PushAck", one, 1]   # A: signalled
        t_a = time.monotonic()
        assert await cb.next_uni(30) == ["Notify", 1, 1]     # B: A's WAKE, not its poll
        lag = time.monotonic() - t_a
        assert lag < POLL_MS / 1000 / 2, lag

        two = (2).to_bytes(16, "big")
        t0 = time.monotonic()
        assert await cb.request(push(two, b"two", 0)) == ["PushAck", two, 2]   # landed on B
        acked_in = time.monotonic() - t0
        assert acked_in < POLL_MS / 1000 / 2, acked_in
        assert await ca.next_uni(30) == ["Notify", 2, 1]
        try:
            extra = await cb.next_uni(1.0)
        except asyncio.TimeoutError:
            extra = None
        assert extra is None, extra     # its own blob and the phone's, each NOTIFY'd once
    finally:
        if query is not None:
            query.stop()
        for c in clients:
            await c.close()
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
