"""trueseal end to end: push sessions -> ingress -> landing -> Spark stream -> inbox -> egress
-> receive sessions, all real: Noise over loopback, Delta on disk, Spark Structured Streaming."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random

from deltalake import DeltaTable

from delta_tables.layout import Layout
from delta_tables.schema import C
from egress.service import EgressNode
from ingress.service import IngressNode
from jobs.inbox_stream import start_inbox_stream

from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame

SESSIONS = 4
PER_SESSION = 40
RETRIES = 25


def parse_deliver(plain: bytes) -> tuple[int, bytes]:
    assert plain[0] == 0x02, plain[:5]
    n = int.from_bytes(plain[1:5], "big")
    body = plain[5:5 + n]
    return int.from_bytes(body[:8], "big"), body[8:]


async def push_all(port, relay_pub, items):
    """One push session sending `items` [(recipient, envelope)] pipelined; returns acked."""
    c = await AsyncClient.connect(port, NK, relay_pub)
    for recipient, env in items:
        c.send(push_frame(recipient, env))
    replies = [await c.recv_frame(timeout=30) for _ in items]
    c.close()
    assert replies == [ACK] * len(items)
    return items


async def receive(port, relay_pub, priv, want: int, timeout=90.0):
    """A device session: collect Delivers (DeliverAck each) until `want` distinct envelopes."""
    c = await AsyncClient.connect(port, XX, relay_pub, static_priv=priv)
    got: list[tuple[int, bytes]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len({e for _, e in got}) < want:
        plain = await c.recv_frame(timeout=max(0.1, deadline - loop.time()))
        assert plain is not None, "relay closed the receive session"
        if plain[0] == 0x03:                       # heartbeat: echo
            c.send(plain)
            continue
        blob_id, env = parse_deliver(plain)
        got.append((blob_id, env))
        c.send(deliver_ack_frame(blob_id))
    return c, got


def test_pushes_reach_receivers_exactly_once_in_order(spark, settings):
    settings.stream.trigger_interval_ms = 100
    query, _sink = start_inbox_stream(spark, settings, fsync=False)
    try:
        asyncio.run(_scenario(settings))
    finally:
        query.stop()
    inbox = DeltaTable(str(Layout.of(settings).inbox)).to_pyarrow_table()
    ids = inbox.column(C.EVENT_ID).to_pylist()
    assert len(ids) == len(set(ids)) == SESSIONS * PER_SESSION
    per: dict[bytes, list[int]] = {}
    for r in inbox.select([C.MAILBOX, C.CURSOR]).to_pylist():
        per.setdefault(r[C.MAILBOX], []).append(r[C.CURSOR])
    assert all(sorted(c) == list(range(1, len(c) + 1)) for c in per.values())
    rejects = DeltaTable(str(Layout.of(settings).rejects)).to_pyarrow_table()
    assert rejects.column(C.REASON).to_pylist() == ["duplicate"] * RETRIES
    acks = DeltaTable(str(Layout.of(settings).acks)).to_pyarrow_table()
    assert sorted(acks.column(C.SEQ).to_pylist()) == sorted(inbox.column(C.SEQ).to_pylist())


@contextlib.asynccontextmanager
async def relay_nodes(settings):
    """An ingress and an egress node on `settings`, started, closed on the way out."""
    ingress, egress = IngressNode(settings, fsync=False), EgressNode(settings, fsync=False)
    await ingress.start()
    await egress.start()
    try:
        yield ingress, egress
    finally:
        await ingress.close()
        await egress.close()


async def _scenario(settings):
    async with relay_nodes(settings) as (ingress, egress):
        relay_pub = ingress.key.public
        push_port, recv_port = ingress.trueseal.bound_port, egress.trueseal.bound_port
        (a_priv, a_pub), (b_priv, b_pub) = keypair(), keypair()
        rng = random.Random(7)
        sessions = [[(rng.choice([a_pub, b_pub]), b"s%d-n%03d-" % (s, i) + os.urandom(200))
                     for i in range(PER_SESSION)] for s in range(SESSIONS)]
        per_box = {a_pub: [], b_pub: []}
        for items in sessions:
            for r, e in items:
                per_box[r].append(e)

        # A is online before anything is pushed: live delivery. B comes later: stored flush.
        a_task = asyncio.create_task(receive(recv_port, relay_pub, a_priv, len(per_box[a_pub])))
        await asyncio.sleep(0.2)
        await asyncio.gather(*(push_all(push_port, relay_pub, items) for items in sessions))
        # client retries of already-acked blobs, over new sessions, land as duplicates
        retry = rng.sample([x for items in sessions for x in items], RETRIES)
        await push_all(push_port, relay_pub, retry)

        a_conn, a_got = await a_task
        b_conn, b_got = await receive(recv_port, relay_pub, b_priv, len(per_box[b_pub]))
        for got, box in ((a_got, a_pub), (b_got, b_pub)):
            blob_ids = [b for b, _ in got]
            assert len(blob_ids) == len(set(blob_ids)), "a blob was delivered twice in a session"
            assert blob_ids == sorted(blob_ids), "delivery out of order"
            assert sorted(e for _, e in got) == sorted(per_box[box])
            # FIFO per sender: each push session's blobs arrive in the order it pushed them
            for s in range(SESSIONS):
                mine = [e for _, e in got if e.startswith(b"s%d-" % s)]
                assert mine == sorted(mine)
        # acks are durable before the hub forgets; a new session for A gets nothing more
        await asyncio.sleep(0.3)
        a_conn.close()
        c2 = await AsyncClient.connect(recv_port, XX, relay_pub, static_priv=a_priv)
        try:
            frame = await c2.recv_frame(timeout=1.0)
            assert frame is None or frame[0] == 0x03, "acked blob was redelivered"
        except asyncio.TimeoutError:
            pass
        c2.close()
        b_conn.close()
