"""cursor-sync end to end through the real Spark stream: the ingress node's QUIC listener,
landing group commit, Spark Structured Streaming assigning cursors into the inbox, the sync
inbox view following the inbox commits, and a real aioquic client on loopback (frames built
byte by byte in tests/sync_client.py). PUSH_ACK carries the stream's cursor; NOTIFY reaches
the other device; PULL pages through; a re-push answers the original cursor."""

from __future__ import annotations

import asyncio

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream

from sync_client import Device, device_session, group_id, pull, push

NOTIFY_TIMEOUT = 60.0   # one micro-batch normally; generous for a loaded 2-core machine


def test_sync_through_the_spark_stream(spark, settings):
    settings.stream.trigger_interval_ms = 100
    settings.heya.enabled = False
    settings.ppp.enabled = False
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        asyncio.run(_scenario(settings))
    finally:
        query.stop()
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table().to_pylist()
    sync = sorted((r for r in inbox if r[C.PROTOCOL] == "sync"), key=lambda r: r[C.CURSOR])
    assert [r[C.CURSOR] for r in sync] == [1, 2, 3]
    assert [r[C.ENVELOPE] for r in sync] == [b"one", b"two", b"three"]


async def _scenario(settings):
    node = IngressNode(settings, fsync=False)
    await node.start()
    try:
        port = node.sync.bound_port
        g, a, b = group_id(b"e2e"), Device(), Device()
        ca, w = await device_session(port, a, g, version=1)
        assert w == ["Welcome", 1, 0, 0]
        exp = 2 ** 40
        cb, w = await device_session(port, b, g, admission=[a.id, exp, a.admit(g, b.id, exp)])
        assert w == ["Welcome", 2, 0, 0]
        for n, body in ((1, b"one"), (2, b"two")):
            assert await ca.request(push(n.to_bytes(16, "big"), body, 0)) == \
                ["PushAck", n.to_bytes(16, "big"), n]
            assert await cb.next_uni(NOTIFY_TIMEOUT) == ["Notify", n, 1]
        assert (await ca.request(push((3).to_bytes(16, "big"), b"three", 0)))[2] == 3
        page = await cb.request(pull(0, 2))
        assert [(e[1], bytes(e[2])) for e in page[1]] == [(1, b"one"), (2, b"two")]
        assert page[2:] == [True, 2]
        page = await cb.request(pull(2, 2))
        assert [(e[1], bytes(e[2])) for e in page[1]] == [(3, b"three")] and page[2:] == [False, 3]
        assert await ca.request(push((3).to_bytes(16, "big"), b"three", 0)) == \
            ["PushAck", (3).to_bytes(16, "big"), 3]
        await ca.close()
        await cb.close()
    finally:
        await node.close()
