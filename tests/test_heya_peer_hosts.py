"""Heya's path between hosts (runtime/peer_link.py): a HAVE carries the seq the stream gives a
message, so no host can send it before the inbox row; what the peer channel shortens is the
wait after the row. Two `relay ingress --protocol heya` processes ("hosts" A and B, own data
directories and peer keys, one tables directory), the stream running beside A (A's data
directory: its commits signal A's listener, runtime/inbox_signal.py). Both poll the inbox
only every 60 s here, so B hears of the row only through A's WAKE over the channel: Alice's
session on B gets its HAVE as her session on A does, not a poll later, once."""

from __future__ import annotations

import asyncio
import time

from delta_tables.heya_control import mint_inbox_tokens
from delta_tables.layout import Layout
from jobs.inbox_stream import start_inbox_stream
from runtime import config

from heya_client import Cert, HeyaClient, recv_line, register_and_mint, send_line
from hosts_harness import Host
from test_ppp_peer_hosts import connected

END = 2220385707
POLL_MS = 60_000
WAKES = {"RELAY_CLUSTER__PEER_LISTEN": "true", "RELAY_CLUSTER__PEER_DIAL": "true",
         "RELAY_CLUSTER__PEER_PORT": "0", "RELAY_CLUSTER__PEER_REFRESH_SECONDS": "0.5",
         "RELAY_EGRESS__POLL_INTERVAL_MS": str(POLL_MS)}


def test_a_send_reaches_a_session_on_host_b_with_the_streams_wake_up(tmp_path, spark):
    asyncio.run(_scenario(tmp_path, spark))


async def _scenario(tmp_path, spark) -> None:
    lay = Layout(tmp_path / "host-a", tmp_path / "tables")
    (inbox_token,) = mint_inbox_tokens(lay, 1, fsync=False)
    certs = tmp_path / "certs"
    alice, bob = Cert(certs, "alice"), Cert(certs, "bob")
    a, b = Host(tmp_path, "a", "heya", WAKES), Host(tmp_path, "b", "heya", WAKES)
    await asyncio.gather(a.start(), b.start())
    settings = config.load(None, env={}, data_dir=str(tmp_path / "host-a"),
                           tables_dir=str(tmp_path / "tables"))
    try:
        await asyncio.gather(connected(a), connected(b))
        sa, t_hex = await register_and_mint(a.port(), alice, inbox_token.hex().encode(), END)
        on_b = await HeyaClient.connect(b.port(), alice,
                                        greeting=b"HEYA 0\nLAST " + t_hex + b" 0\nDONE\n")
        bob_b = await HeyaClient.connect(b.port(), bob)
        bob_b.send(send_line(t_hex, b"from host b"))
        await bob_b.expect(recv_line(b"from host b"))
        await asyncio.sleep(1.0)        # B's WAKE subscription is on A's listener by now

        query, _ = start_inbox_stream(spark, settings, fsync=False)
        try:
            have = b"HAVE " + t_hex + b" 1\n"
            await sa.expect(have, timeout=120)      # A: signalled by its stream
            t_a = time.monotonic()
            await on_b.expect(have, timeout=30)     # B: by A's WAKE, not its 60 s poll
            lag = time.monotonic() - t_a
            assert lag < POLL_MS / 1000 / 2, lag
            try:
                extra = await on_b.read_line(timeout=1.0)
            except asyncio.TimeoutError:
                extra = None
            assert extra is None, extra             # one HAVE per message
            on_b.send(b"WANT " + t_hex + b" 0\n")
            await on_b.expect(b"GIVE " + t_hex + b" 0 ")
        finally:
            query.stop()
        for client in (sa, on_b, bob_b):
            client.close()
    finally:
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
