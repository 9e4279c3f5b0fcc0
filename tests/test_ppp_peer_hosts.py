"""PPP's live path between hosts (runtime/peer_link.py): two `relay ingress --protocol ppp`
processes with their own data directories, node ids and peer keys over one tables directory
(`hosts_harness.py`), each a peer listener and dialler. Bob connected to host B gets a STORE
made to host A (spec 004 wire, `ppp_wire.py`) before any stream has run, so before its inbox
row exists: NOTIFY, FETCH and ACK as on one host. Once the stream writes the rows, nothing
is NOTIFY'd or FETCHed twice, the early ACK becomes an ack row with the row's seq, and an
event not acked early is served from its row exactly once."""

from __future__ import annotations

import asyncio
import time

from deltalake import DeltaTable
from nacl.signing import SigningKey

from delta_tables import peer_registry
from delta_tables.layout import Layout
from delta_tables.schema import C
from engine.ppp.keys import Identity
from jobs.inbox_stream import start_inbox_stream
from runtime import config

from hosts_harness import Host
from ppp_wire import Ws
from test_peer_hosts import ack_rows
from test_ppp_end_to_end import presence

PEERS = {"RELAY_CLUSTER__PEER_LISTEN": "true", "RELAY_CLUSTER__PEER_DIAL": "true",
         "RELAY_CLUSTER__PEER_PORT": "0", "RELAY_CLUSTER__PEER_REFRESH_SECONDS": "0.5",
         "RELAY_PPP__NOTIFY_WINDOW_MS": "20"}


async def connected(host: Host, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while '"event": "peer_connected"' not in host.stderr.read_text():
        assert time.monotonic() - t0 < timeout, f"host {host.name}: no peer channel"
        await asyncio.sleep(0.1)


async def quiet(ws: Ws, seconds: float) -> dict | None:
    try:
        return await ws.recv(timeout=seconds)
    except asyncio.TimeoutError:
        return None


def test_a_store_on_host_a_reaches_bob_on_host_b_before_its_row_and_once(tmp_path, spark):
    settings = config.load(None, env={}, data_dir=str(tmp_path / "stream"),
                           tables_dir=str(tmp_path / "tables"))
    asyncio.run(_scenario(tmp_path, settings, spark))


async def _scenario(tmp_path, settings, spark) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    a, b = Host(tmp_path, "a", "ppp", PEERS), Host(tmp_path, "b", "ppp", PEERS)
    await asyncio.gather(a.start(), b.start())
    layout = Layout.of(settings)
    try:
        await asyncio.gather(connected(a), connected(b))
        peers = {p.name: p for p in peer_registry.live(layout.tables)}
        assert set(peers) == {"node-a-ppp", "node-b-ppp"}       # one registration each
        assert all(p.serves("ppp") and not p.serves("trueseal") for p in peers.values())
        bob_b = await Ws.login(b.port(), SigningKey(bob.seed))
        alice_a = await Ws.login(a.port(), SigningKey(alice.seed))
        await asyncio.sleep(1.0)        # bob's subscription crosses to host A

        gw1 = presence(alice, bob, "across hosts, at once")
        t0 = time.monotonic()
        assert await alice_a.call({"cmd": "STORE", "event": gw1.encode()}) == {
            "cmd": "STORED", "event_id": gw1.event_id}
        assert (await bob_b.recv(timeout=5)) == {"cmd": "NOTIFY", "count": 1}
        took = time.monotonic() - t0
        got = await bob_b.call({"cmd": "FETCH", "since": 0})
        assert got["cmd"] == "EVENTS" and got["events"] == [gw1.encode()], took
        assert DeltaTable(str(layout.inbox)).to_pyarrow_table().num_rows == 0  # no stream yet
        assert await bob_b.call({"cmd": "ACK", "event_ids": [gw1.event_id]}) == {
            "cmd": "ACKED", "count": 1}

        gw2 = presence(alice, bob, "served early, acked after its row")
        assert (await alice_a.call({"cmd": "STORE", "event": gw2.encode()}))["cmd"] == "STORED"
        assert (await bob_b.recv(timeout=5)) == {"cmd": "NOTIFY", "count": 1}

        query, _ = start_inbox_stream(spark, settings, fsync=False)
        try:
            deadline = time.monotonic() + 120
            await ack_rows(layout, 1, deadline)         # the early ACK's
            assert await quiet(bob_b, 1.0) is None          # the rows NOTIFY nothing again
            got = await bob_b.call({"cmd": "FETCH", "since": 0})
            assert got["cmd"] == "EVENTS" and got["events"] == [gw2.encode()]
            assert await bob_b.call({"cmd": "ACK", "event_ids": [gw2.event_id]}) == {
                "cmd": "ACKED", "count": 1}
            await ack_rows(layout, 2, deadline)
        finally:
            query.stop()
        rows = DeltaTable(str(layout.inbox)).to_pyarrow_table().to_pylist()
        acks = DeltaTable(str(layout.acks)).to_pyarrow_table().to_pylist()
        assert sorted(r[C.EVENT_ID] for r in rows) == sorted([gw1.event_id, gw2.event_id])
        assert sorted((r[C.SEQ], r[C.EVENT_ID]) for r in rows) == \
            sorted((k[C.SEQ], k[C.EVENT_ID]) for k in acks)
        assert await bob_b.call({"cmd": "FETCH", "since": 0}) == {"cmd": "EVENTS", "events": []}
        for ws in (bob_b, alice_a):
            await ws.close()
    finally:
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
    for host in (a, b):
        text = host.stderr.read_text()
        assert gw1.ciphertext.hex() not in text and bob.pubkey.hex() not in text
