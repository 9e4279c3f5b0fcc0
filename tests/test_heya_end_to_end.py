"""Heya end to end, all real: TLS 1.3 on loopback with per-test client certificates, the ingress
node (landing group commit), Spark Structured Streaming into the inbox, the Heya inbox view,
and compaction. Every line is written out byte by byte from the README (003) and
heya-interop.md.

The receiver / sender scenario: INCO, AUTH, three SENDs -> RECV (after the landing commit),
HAVE on every connected session of the mailbox once the inbox commit lands, WANT -> GIVE,
GONE, TRIM, EXTD, a reconnect with LAST lines and live HAVEs after it, DEAU then a refused
SEND, DALL, QUIT; then the sequence numbers in the inbox, and compaction taking the revoked
messages off the disk.
"""

from __future__ import annotations

import asyncio
import time

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from delta_tables.heya_control import mint_inbox_tokens
from ingress.service import IngressNode
from jobs.compact import run_compaction
from jobs.inbox_stream import start_inbox_stream

from heya_client import Cert, HeyaClient, recv_line, register_and_mint, send_line

END = 2220385707
HAVE_TIMEOUT = 60.0     # one micro-batch normally; generous for a loaded 2-core machine


def test_heya_receiver_and_sender_through_the_stream(spark, settings, tmp_path):
    settings.stream.trigger_interval_ms = 100
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        tokens, bodies = asyncio.run(_scenario(settings, tmp_path))
    finally:
        query.stop()
    t, t2 = tokens
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    heya = [r for r in inbox if r[C.PROTOCOL] == "heya"]
    # Sequence numbers are the stream's cursors: per send token, contiguous from 0.
    assert sorted(r[C.CURSOR] for r in heya if r[C.MAILBOX] == t) == [0, 1, 2, 3]
    assert sorted(r[C.CURSOR] for r in heya if r[C.MAILBOX] == t2) == [0]
    assert [r[C.ENVELOPE] for r in sorted(heya, key=lambda r: (r[C.MAILBOX] != t, r[C.CURSOR]))
            ] == bodies

    # DEAU and DALL revoked both tokens: compaction takes their messages off the disk.
    settings.compaction.vacuum_retention_seconds = 0
    report = run_compaction(settings, progress=lambda _: None)
    assert report.heya_inbox_deleted == 5
    inbox_dir = Layout.of(settings).inbox
    disk = b"".join(p.read_bytes() for p in inbox_dir.rglob("*") if p.is_file())
    for b in bodies:
        assert b not in disk


async def _scenario(settings, tmp_path):
    (inbox_token,) = mint_inbox_tokens(Layout.of(settings), fsync=False)
    alice, bob = Cert(tmp_path, "alice"), Cert(tmp_path, "bob")
    i_hex = inbox_token.hex().encode()
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.heya.bound_port
        # Receiver: register the inbox, mint a send token.
        a, t_hex = await register_and_mint(port, alice, i_hex, END)
        token = bytes.fromhex(t_hex.decode())
        # A second session of the same certificate (another device of the receiver).
        a2 = await HeyaClient.connect(port, alice, greeting=b"HEYA 0\nLAST " + t_hex
                                      + b" 0\nDONE\n")

        # Sender: three SENDs, pipelined; RECV each (after its landing commit).
        bodies = [b"hello", b"there", b"maxi"]
        b = await HeyaClient.connect(port, bob)
        t0 = time.monotonic()
        b.send(b"".join(send_line(t_hex, x) for x in bodies))
        for x in bodies:
            await b.expect(recv_line(x))
        # HAVE, one per message (newest seq + 1), on both sessions, once the stream commits.
        for c in (a, a2):
            await c.expect(b"HAVE " + t_hex + b" 1\nHAVE " + t_hex + b" 2\nHAVE " + t_hex
                           + b" 3\n", timeout=HAVE_TIMEOUT)
        assert time.monotonic() - t0 < HAVE_TIMEOUT

        a.send(b"WANT " + t_hex + b" 0\nWANT " + t_hex + b" 1\nWANT " + t_hex + b" 3\n")
        await a.expect(b"GIVE " + t_hex + b" 0 5\nhello\nGIVE " + t_hex + b" 1 5\nthere\n"
                       + b"GONE " + t_hex + b" 3\n")
        a.send(b"TRIM " + t_hex + b" 1\nWANT " + t_hex + b" 0\nWANT " + t_hex + b" 2\n")
        await a.expect(b"TRIM " + t_hex + b" 1 2\nGONE " + t_hex + b" 0\nGIVE " + t_hex
                       + b" 2 4\nmaxi\n")
        a.send(b"EXTD " + t_hex + b" 1000\n")
        await a.expect(b"EXTD " + t_hex + b" %d\n" % (END + 1000))

        # Reconnect: LAST says next_seq (TRIM does not lower it); HAVE keeps coming after it.
        a.send(b"QUIT\n")
        assert await a.closed_by_server()
        a = await HeyaClient.connect(port, alice, greeting=b"HEYA 0\nLAST " + t_hex
                                     + b" 3\nDONE\n")
        b.send(send_line(t_hex, b"fourth"))
        await b.expect(recv_line(b"fourth"))
        for c in (a, a2):
            await c.expect(b"HAVE " + t_hex + b" 4\n", timeout=HAVE_TIMEOUT)
        a.send(b"WANT " + t_hex + b" 3\nLIST\n")
        await a.expect(b"GIVE " + t_hex + b" 3 6\nfourth\nLIST 1\n" + t_hex
                       + b" 4 0 %d\n" % (END + 1000))

        # DEAU, then a SEND on the revoked token is refused: the connection closes.
        a.send(b"DEAU " + t_hex + b"\n")
        await a.expect(b"DEAU " + t_hex + b"\n")
        b.send(send_line(t_hex, b"too late"))
        assert await b.closed_by_server()
        a.send(b"WANT " + t_hex + b" 2\n")                 # its messages went with it
        await a.expect(b"GONE " + t_hex + b" 2\n")

        # A second token, one message, then DALL.
        a.send(b"AUTH 0 %d\n" % END)
        await a.expect(b"AUTH ")
        t2_hex = await a.read_exact(64)
        await a.expect(b" 0 %d\n" % END)
        b = await HeyaClient.connect(port, bob)
        b.send(send_line(t2_hex, b"last one"))
        await b.expect(recv_line(b"last one"))
        await a.expect(b"HAVE " + t2_hex + b" 1\n", timeout=HAVE_TIMEOUT)
        a.send(b"DALL\n")
        await a.expect(b"DALL\n")
        a.send(b"QUIT\n")
        assert await a.closed_by_server()
        a = await HeyaClient.connect(port, alice)            # no mailbox: no LAST lines
        a.send(b"QUIT\n")
        assert await a.closed_by_server()
        b.send(send_line(t2_hex, b"after dall"))
        assert await b.closed_by_server()
        a2.close()
        return (token, bytes.fromhex(t2_hex.decode())), bodies + [b"fourth", b"last one"]
    finally:
        await node.close()
