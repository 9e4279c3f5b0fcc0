"""Heya on two hosts at once, all real: two `relay ingress --protocol heya` processes, each
with its own data directory and node id, over one tables directory (`hosts_harness.py`); TLS
1.3 clients with their own certificates, lines as the README (003) and heya-interop.md write
them. A mailbox registered and a send token minted on host A serve on host B (SEND, the LAST
greeting, EXTD, LIST); two clients racing on A and B for one inbox token make one mailbox,
the other is refused (the connection closes, README "INCO"); a token revoked on A is refused
on B; host B restarted folds the same state."""

from __future__ import annotations

import asyncio
import time

from delta_tables.heya_control import mint_inbox_tokens
from delta_tables.layout import Layout

from heya_client import Cert, HeyaClient, recv_line, register_and_mint, send_line
from hosts_harness import Host

END = 2220385707
FOLLOW_DEADLINE = 15.0     # the other host's follow: every second, generous for a busy machine


def test_heya_served_by_two_hosts_at_once(tmp_path):
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    lay = Layout(tmp_path / "host-a", tmp_path / "tables")
    i1, race = mint_inbox_tokens(lay, 2, fsync=False)
    certs = tmp_path / "certs"
    alice, bob, carol, dave = (Cert(certs, n) for n in ("alice", "bob", "carol", "dave"))
    a, b = Host(tmp_path, "a", "heya"), Host(tmp_path, "b", "heya")
    await asyncio.gather(a.start(), b.start())
    try:
        # Alice registers and mints on A; Bob sends with her token on B.
        sa, t_hex = await register_and_mint(a.port(), alice, i1.hex().encode(), END)
        sb = await HeyaClient.connect(b.port(), bob)
        sb.send(send_line(t_hex, b"across hosts"))
        await sb.expect(recv_line(b"across hosts"))
        # Alice on B: a mailbox there too (the LAST greeting names her token), EXTD, LIST.
        a2 = await HeyaClient.connect(b.port(), alice,
                                      greeting=b"HEYA 0\nLAST " + t_hex + b" 0\nDONE\n")
        a2.send(b"EXTD " + t_hex + b" 1000\nLIST\n")
        await a2.expect(b"EXTD " + t_hex + b" %d\nLIST 1\n" % (END + 1000) + t_hex
                        + b" 0 0 %d\n" % (END + 1000))
        # Extended on B, extended again on A: both count (A decides on B's row).
        sa.send(b"EXTD " + t_hex + b" 5\n")
        await sa.expect(b"EXTD " + t_hex + b" %d\n" % (END + 1005))

        # One inbox token, two certificates, two hosts, at once: one mailbox.
        c = await HeyaClient.connect(a.port(), carol)
        d = await HeyaClient.connect(b.port(), dave)
        line = b"INCO " + race.hex().encode() + b"\n"
        c.send(line)
        d.send(line)

        async def outcome(client: HeyaClient) -> str:
            try:
                got = await client.read_line(timeout=20)
            except (ConnectionError, OSError):
                return "refused"
            return "registered" if got == line else ("refused" if got == b"" else repr(got))
        results = await asyncio.gather(outcome(c), outcome(d))
        assert sorted(results) == ["refused", "registered"], results

        # B restarted folds what both hosts wrote: Alice's token with both extensions.
        assert await b.stop() == 0
        await b.start()
        a3 = await HeyaClient.connect(b.port(), alice,
                                      greeting=b"HEYA 0\nLAST " + t_hex + b" 0\nDONE\n")
        a3.send(b"LIST\n")
        await a3.expect(b"LIST 1\n" + t_hex + b" 0 0 %d\n" % (END + 1005))

        # Revoked on A: B refuses a SEND on it once it followed (the connection closes).
        sa.send(b"DEAU " + t_hex + b"\n")
        await sa.expect(b"DEAU " + t_hex + b"\n")
        deadline = time.monotonic() + FOLLOW_DEADLINE
        while True:
            s = await HeyaClient.connect(b.port(), bob)
            s.send(send_line(t_hex, b"after deau"))
            try:
                got = await s.read_line(timeout=10)
            except (ConnectionError, OSError):
                got = b""
            s.close()
            if got == b"":
                break
            assert got == recv_line(b"after deau")
            assert time.monotonic() < deadline, "host B still takes a token revoked on A"
            await asyncio.sleep(0.2)
        for client in (sa, sb, a2, a3, c, d):
            client.close()
    finally:
        codes = await asyncio.gather(a.stop(), b.stop())
    assert codes == [0, 0]
