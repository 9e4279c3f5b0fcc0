"""cursor-sync benchmarks for `relay bench`: `sync_pushes_per_s` and `sync_push_to_notify_ms`.

`run(settings, quick, spark=None) -> dict`. A PUSH_ACK carries the cursor the stream assigns,
so both figures need the stream: without a SparkSession this section reports nothing.

1. `sync_pushes_per_s`: an `IngressNode` (the QUIC listener, landing group commit with fsync)
   and the inbox stream (Spark, this process); `DEVICES` authenticated devices of one group,
   each keeping `WINDOW` PUSHes in flight on their own bidirectional streams (as a client that
   pipelines). Counted: PUSH_ACKs (landing commit + inbox commit) in the measured window. The
   per-device and global rate limits are lifted for the run (they would cap it at 1000/s).
   The clients run on the relay's event loop (one process): the figure is a lower bound.
2. `sync_push_to_notify_ms` {p50, p99}: one sender at a steady rate, one other device of the
   group online; from writing a PUSH to reading the NOTIFY whose cursor covers it (landing
   commit, micro-batch, inbox tail, NOTIFY on a unidirectional stream).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import ssl
import struct
import time
from pathlib import Path

import numpy as np

BODY_SIZE = 600
DEVICES = 16
WINDOW = 16
QUICK = {"seconds": 8, "rate": 50, "latency_seconds": 10}
FULL = {"seconds": 30, "rate": 100, "latency_seconds": 30}
WARMUP = 5


def _p(values, q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if values else None


def _r(x, nd: int = 1):
    return None if x is None else round(float(x), nd)


class _Client:
    """A minimal cursor-sync client (aioquic) for load: requests on fresh bi streams,
    NOTIFY frames from uni streams into `notes`."""

    def __init__(self, proto):
        self.proto = proto

    @classmethod
    async def connect(cls, port: int) -> "_Client":
        from aioquic.asyncio import QuicConnectionProtocol, connect
        from aioquic.quic.configuration import QuicConfiguration
        from aioquic.quic.events import StreamDataReceived

        class Proto(QuicConnectionProtocol):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.bufs: dict[int, bytearray] = {}
                self.waiters: dict[int, asyncio.Future] = {}
                self.notes: asyncio.Queue = asyncio.Queue()

            def quic_event_received(self, ev) -> None:
                if isinstance(ev, StreamDataReceived):
                    buf = self.bufs.setdefault(ev.stream_id, bytearray())
                    buf += ev.data
                    fut = self.waiters.get(ev.stream_id)
                    if fut is not None and not fut.done() and (
                            ev.end_stream or (len(buf) >= 4 and ev.stream_id % 4 == 0
                                              and len(buf) >= 4 + struct.unpack(
                                                  ">I", buf[:4])[0])):
                        fut.set_result(bytes(buf))
                    if ev.end_stream and ev.stream_id % 4 == 3:
                        self.notes.put_nowait((time.perf_counter(), bytes(buf)))
                    if ev.end_stream:
                        self.bufs.pop(ev.stream_id, None)

        conf = QuicConfiguration(is_client=True, alpn_protocols=["/0k-sync/1"],
                                 verify_mode=ssl.CERT_NONE)
        ctx = connect("127.0.0.1", port, configuration=conf, create_protocol=Proto)
        proto = await ctx.__aenter__()
        client = cls(proto)
        client.ctx = ctx
        return client

    async def request(self, body: bytes, *, fin: bool = True) -> bytes:
        from engine.sync.framing import frame
        q = self.proto._quic
        sid = q.get_next_available_stream_id()
        fut = self.proto.waiters[sid] = self.proto._loop.create_future()
        q.send_stream_data(sid, frame(body), end_stream=fin)
        self.proto.transmit()
        out = await asyncio.wait_for(fut, 60)
        del self.proto.waiters[sid]
        self.proto.bufs.pop(sid, None)
        self._last = sid
        return out[4:]

    async def authenticate(self, key) -> None:
        from engine.sync import identity
        from engine.sync import messages as m
        from engine.sync.framing import frame
        der = self.proto._quic.tls._peer_certificate.public_bytes(
            __import__("cryptography.hazmat.primitives.serialization",
                       fromlist=["Encoding"]).Encoding.DER)
        challenge = m.decode(await self.request(m.encode(m.Auth(1)), fin=False))
        sid = self._last
        fut = self.proto.waiters[sid] = self.proto._loop.create_future()
        proof = m.AuthProof(bytes(key.verify_key), key.sign(
            identity.auth_message(challenge.nonce, der)).signature)
        self.proto._quic.send_stream_data(sid, frame(m.encode(proof)), end_stream=True)
        self.proto.transmit()
        await asyncio.wait_for(fut, 60)

    async def close(self) -> None:
        await self.ctx.__aexit__(None, None, None)


async def _devices(port: int, group: bytes, n: int) -> list[_Client]:
    from nacl.signing import SigningKey
    from engine.sync import identity
    from engine.sync import messages as m
    keys = [SigningKey.generate() for _ in range(n)]
    out = []
    for i, key in enumerate(keys):
        c = await _Client.connect(port)
        await c.authenticate(key)
        if i:
            exp = 2 ** 40
            sig = keys[0].sign(identity.admit_message(group, bytes(key.verify_key), exp))
            await c.request(m.encode(m.Join(group, bytes(keys[0].verify_key), exp,
                                            sig.signature)))
        welcome = m.decode(await c.request(m.encode(m.Hello(2, f"bench-{i}", group, 0))))
        assert isinstance(welcome, m.Welcome), welcome
        out.append(c)
    return out


async def _throughput(settings, p: dict) -> dict:
    from engine.sync import messages as m
    from ingress.service import IngressNode
    node = IngressNode(settings)
    await node.start()
    try:
        group = hashlib.sha256(b"bench-throughput").digest()
        clients = await _devices(node.sync.bound_port, group, DEVICES)
        rng = np.random.default_rng(3)
        body = rng.bytes(BODY_SIZE)
        counter = iter(range(1 << 62))
        acked = 0
        measuring = False
        stop = False

        async def worker(c: _Client) -> None:
            nonlocal acked
            while not stop:
                n = next(counter)
                out = m.decode(await c.request(m.encode(m.Push(n.to_bytes(16, "big"), body,
                                                               0))))
                assert isinstance(out, m.PushAck), out
                if measuring:
                    acked += 1

        tasks = [asyncio.create_task(worker(c)) for c in clients for _ in range(WINDOW)]
        await asyncio.sleep(2)                 # warm-up: the stream's first micro-batches
        measuring, t0 = True, time.perf_counter()
        await asyncio.sleep(p["seconds"])
        measuring, elapsed = False, time.perf_counter() - t0
        stop = True
        await asyncio.wait(tasks, timeout=60)
        for c in clients:
            await c.close()
        return {"pushes_per_s": _r(acked / elapsed), "acked": acked,
                "seconds": _r(elapsed, 2), "devices": DEVICES, "window": WINDOW,
                "body_bytes": BODY_SIZE}
    finally:
        await node.close()


async def _latency(settings, p: dict) -> dict:
    from engine.sync import messages as m
    from ingress.service import IngressNode
    node = IngressNode(settings)
    await node.start()
    try:
        group = hashlib.sha256(b"bench-latency").digest()
        sender, receiver = await _devices(node.sync.bound_port, group, 2)
        rng = np.random.default_rng(5)
        sent: dict[int, float] = {}
        total = int(p["rate"] * p["latency_seconds"])

        async def one(i: int) -> None:
            t = time.perf_counter()
            ack = m.decode(await sender.request(m.encode(m.Push(i.to_bytes(16, "big"),
                                                                rng.bytes(BODY_SIZE), 0))))
            sent[ack.cursor] = t

        for i in range(WARMUP):
            await one(i)
        while not receiver.proto.notes.empty():
            receiver.proto.notes.get_nowait()
        base = WARMUP
        pending = []
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i / p["rate"] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pending.append(asyncio.create_task(one(base + i)))
        await asyncio.gather(*pending)
        lat: list[float] = []
        seen: set[int] = set()
        deadline = time.perf_counter() + 60
        while len(seen) < total and time.perf_counter() < deadline:
            at, data = await asyncio.wait_for(receiver.proto.notes.get(), 60)
            note = m.decode(data[4:])
            for cur in range(note.latest_cursor - note.count + 1, note.latest_cursor + 1):
                if cur > WARMUP and cur not in seen and cur in sent:
                    seen.add(cur)
                    lat.append((at - sent[cur]) * 1000)
        await sender.close()
        await receiver.close()
        return {"p50": _r(_p(lat, 50)), "p99": _r(_p(lat, 99)),
                "max": _r(max(lat) if lat else None), "messages": len(lat),
                "rate_per_s": p["rate"], "seconds": p["latency_seconds"],
                "trigger_interval_ms": settings.stream.trigger_interval_ms}
    finally:
        await node.close()


def _section_settings(settings, sub: str):
    s = copy.deepcopy(settings)
    s.data_dir = str(Path(settings.data_dir) / sub)
    s.sync.port = 0
    s.heya.enabled = False
    s.ppp.enabled = False
    s.sync.messages_per_minute = 10 ** 9      # the bench measures the relay, not its limits
    s.sync.global_requests_per_second = 10 ** 9
    s.sync.connections_per_minute = 10 ** 6
    return s


def run(settings, quick: bool, spark=None) -> dict:
    """Both figures (the stream is in the path of every PUSH_ACK: needs `spark`)."""
    from jobs.inbox_stream import start_inbox_stream
    p = QUICK if quick else FULL
    out: dict = {}
    if spark is None:
        return out
    for name, fn, sub in (("throughput", _throughput, "pushes"),
                          ("latency", _latency, "latency")):
        s = _section_settings(settings, sub)
        query, _sink = start_inbox_stream(spark, s)
        try:
            out[name] = asyncio.run(fn(s, p))
        finally:
            query.stop()
    out["sync_pushes_per_s"] = out["throughput"]["pushes_per_s"]
    out["sync_push_to_notify_ms"] = out["latency"]
    return out
