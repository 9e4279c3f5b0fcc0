"""cursor-sync benchmarks for `relay bench`: `sync_pushes_per_s` and `sync_push_to_notify_ms`.

`run(settings, quick, spark=None) -> dict`. A PUSH_ACK carries the cursor the stream assigns,
so both figures need the stream: without a SparkSession this section reports nothing.

Topology, as `relay up` runs it: `relay ingress` is a child process (QUIC listener, landing
group commit with fsync, sync inbox tail), given its settings by a TOML file the bench writes
(the bench's effective settings plus this section's overrides); the inbox stream runs in the
bench process (its foreachBatch holds this process's GIL for each micro-batch, so it must not
share a process with the listener or the clients); the load clients run in `spawn`ed
processes and report through a queue. Each figure gets a fresh data directory, relay and
stream.

1. `sync_pushes_per_s`: `CLIENT_PROCS` client processes, each with its own group of
   `DEVICES / CLIENT_PROCS` authenticated devices, each device keeping `WINDOW` PUSHes in
   flight on their own bidirectional streams (a client that pipelines). Counted: PUSH_ACKs
   (landing commit + inbox commit) that arrive in the measured window, after a warm-up. The
   per-device and global rate limits are lifted (they would cap it at 1000/s). Every PUSH_ACK
   waits for the micro-batch that assigns its cursor, so pushes/s ~ in-flight / push->ack;
   the CPU each process used in the window is reported to show what saturates.
2. `sync_push_to_notify_ms` {p50, p99}: one sender at a steady open-loop rate, one other device
   of the group online, both in one client process; from writing a PUSH to reading the NOTIFY
   whose cursor covers it (landing commit, micro-batch, inbox tail, NOTIFY on a uni stream).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import multiprocessing as mp
import ssl
import struct
import time
from pathlib import Path

import numpy as np

from .harness import (CpuMeter, batches_after, child_ingress_and_stream, collect, durations_ms,
                      jvm_pid, last_batch, p50_p99, percentile, port_of, rounded, spawn)

BODY_SIZE = 600
# 512 PUSHes in flight: on 2 cores the curve (in flight -> pushes/s) flattens here (the relay
# process nears one core); more in flight mostly adds push->ack latency.
DEVICES = 64          # devices in all (split over the client processes, one group each)
WINDOW = 8            # PUSHes in flight per device
CLIENT_PROCS = 2
QUICK = {"seconds": 5, "warmup": 2, "rate": 50, "latency_seconds": 6}
FULL = {"seconds": 30, "warmup": 5, "rate": 100, "latency_seconds": 30}
WARMUP = 5            # latency run: pushes (and their NOTIFYs) before the timed ones


class _Client:
    """A minimal cursor-sync client (aioquic) for load: requests on fresh bi streams,
    NOTIFY frames from uni streams into `notes`. Accepts any relay certificate."""

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
                self.keep_notes = True

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
                    if ev.end_stream and ev.stream_id % 4 == 3 and self.keep_notes:
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
        try:
            q.send_stream_data(sid, frame(body), end_stream=fin)
            self.proto.transmit()
            out = await asyncio.wait_for(fut, 60)
        finally:
            self.proto.waiters.pop(sid, None)
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
    """`n` authenticated devices of `group` (device 0 creates it and admits the others)."""
    from nacl.signing import SigningKey

    from engine.sync import identity
    from engine.sync import messages as m
    keys = [SigningKey.generate() for _ in range(n)]

    async def device(i: int, key) -> _Client:
        c = await _Client.connect(port)
        await c.authenticate(key)
        if i:
            exp = 2 ** 40
            sig = keys[0].sign(identity.admit_message(group, bytes(key.verify_key), exp))
            await c.request(m.encode(m.Join(group, bytes(keys[0].verify_key), exp,
                                            sig.signature)))
        welcome = m.decode(await c.request(m.encode(m.Hello(2, f"bench-{i}", group, 0))))
        assert isinstance(welcome, m.Welcome), welcome
        return c
    # device 0 creates the group first; the others join it at once, not one after another
    first = await device(0, keys[0])
    return [first, *await asyncio.gather(*(device(i, k) for i, k in enumerate(keys) if i))]


class _IrohClient:
    """The same load over iroh, as a stock 0k-sync client speaks it (`IrohTransport`): its own
    endpoint (key = device id), one bidirectional stream per request, frame + FIN out, the
    answer read to FIN. Relays and discovery off: the relay's direct address."""

    def __init__(self, endpoint, conn):
        self.endpoint, self.conn = endpoint, conn

    @classmethod
    async def connect(cls, where: str) -> "_IrohClient":
        import iroh
        node, _, addr = where.partition("@")
        ep = await iroh.Endpoint.bind(iroh.EndpointOptions(
            preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0",
            relay_mode=iroh.RelayMode.disabled()))
        conn = await ep.connect(iroh.EndpointAddr(iroh.EndpointId.from_string(node), None,
                                                  [addr]), b"/0k-sync/1")
        return cls(ep, conn)

    async def request(self, body: bytes) -> bytes:
        from engine.sync.framing import frame
        bi = await self.conn.open_bi()
        send = bi.send()
        await send.write_all(frame(body))
        await send.finish()
        return (await asyncio.wait_for(bi.recv().read_to_end(4 << 20), 60))[4:]

    async def close(self) -> None:
        self.conn.close(0, b"closing")
        await self.endpoint.close()


async def _iroh_devices(where: str, group: bytes, n: int) -> list[_IrohClient]:
    """`n` stock devices (HELLO version 1, no Join: the section runs with open groups)."""
    from engine.sync import messages as m

    async def device(i: int) -> _IrohClient:
        c = await _IrohClient.connect(where)
        welcome = m.decode(await c.request(m.encode(m.Hello(1, f"bench-{i}", group, 0))))
        assert isinstance(welcome, m.Welcome), welcome
        return c
    return list(await asyncio.gather(*(device(i) for i in range(n))))


async def _close(clients) -> None:
    """Close every client at once: aioquic's close waits ~1 s for its CONNECTION_CLOSE."""
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


# --- spawned client processes ------------------------------------------------------------------

def push_worker(queue, go, port, seed: int, devices: int, window: int, warmup: float,
                seconds: float, body_size: int, pull: bool = False) -> None:
    """Throughput load: `devices` devices of one group, `window` PUSHes in flight each
    (`pull`: PULLs of the empty group instead, which need no stream: the transport's and the
    request path's cost alone). `port`: the aioquic listener's port, or
    "<endpoint id>@<host:port>" for iroh."""
    try:
        asyncio.run(_push_worker(queue, go, port, seed, devices, window, warmup, seconds,
                                 body_size, pull))
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _push_worker(queue, go, port, seed, devices, window, warmup, seconds,
                       body_size, pull=False) -> None:
    from engine.sync import messages as m
    group = hashlib.sha256(b"bench-throughput-%d" % seed).digest()
    if isinstance(port, str):
        clients = await _iroh_devices(port, group, devices)
    else:
        clients = await _devices(port, group, devices)
        for c in clients:
            c.proto.keep_notes = False  # NOTIFYs of the group's other devices: not needed here
    body = np.random.default_rng(seed).bytes(body_size)
    queue.put({"ready": True})
    await asyncio.to_thread(go.wait)
    t0 = time.perf_counter()
    start, end = t0 + warmup, t0 + warmup + seconds
    counter = itertools.count(seed << 48)
    lat: list[float] = []
    errors = 0

    async def one_device_slot(c) -> None:
        nonlocal errors
        while time.perf_counter() < end:
            n = next(counter)
            t = time.perf_counter()
            req = m.Pull(0, 100) if pull else m.Push(n.to_bytes(16, "big"), body, 0)
            try:
                out = m.decode(await c.request(m.encode(req)))
            except Exception:
                errors += 1
                await asyncio.sleep(0.05)
                continue
            done = time.perf_counter()
            if not isinstance(out, m.PullResponse if pull else m.PushAck):
                errors += 1
            elif start <= done < end:
                lat.append(done - t)

    tasks = [asyncio.create_task(one_device_slot(c)) for c in clients for _ in range(window)]
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    cpu0 = time.process_time()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cpu1 = time.process_time()
    await asyncio.wait(tasks, timeout=60)
    queue.put({"ok": True, "acked": len(lat), "errors": errors, "cpu_s": cpu1 - cpu0,
               "latency_ms": [x * 1000 for x in lat]})
    await _close(clients)


def notify_worker(queue, port: int, rate: float, seconds: float, body_size: int) -> None:
    """Latency load: one sender at `rate` PUSH/s, one receiver device timestamping NOTIFYs."""
    try:
        asyncio.run(_notify_worker(queue, port, rate, seconds, body_size))
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _notify_worker(queue, port, rate, seconds, body_size) -> None:
    from engine.sync import messages as m
    group = hashlib.sha256(b"bench-latency").digest()
    sender, receiver = await _devices(port, group, 2)
    rng = np.random.default_rng(5)
    sent: dict[int, float] = {}
    acks: list[float] = []
    total = int(rate * seconds)

    async def one(i: int) -> None:
        t = time.perf_counter()
        ack = m.decode(await sender.request(m.encode(m.Push(i.to_bytes(16, "big"),
                                                            rng.bytes(body_size), 0))))
        sent[ack.cursor] = t
        acks.append(time.perf_counter() - t)

    for i in range(WARMUP):
        await one(i)
    del acks[:]
    pending = []
    t0 = time.perf_counter()
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        pending.append(asyncio.create_task(one(WARMUP + i)))
    await asyncio.gather(*pending)
    # NOTIFYs were timestamped on arrival; matched to the pushes' cursors once all are acked.
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
    queue.put({"ok": True, "latency_ms": lat, "ack_ms": [x * 1000 for x in acks],
               "pushed": total})
    await _close((sender, receiver))


# --- the two figures ---------------------------------------------------------------------------

def _worker(client: str):
    """The load client's process function: `push_worker`, or the Rust iroh client's
    (`iroh_client.py`; `client` "rust")."""
    if client == "rust":
        from . import iroh_client
        return iroh_client.push_worker
    return push_worker


def throughput(spark, settings, p: dict, devices: int = DEVICES, window: int = WINDOW,
               procs: int = CLIENT_PROCS, transport: str = "quic",
               client: str = "python") -> dict:
    with child_ingress_and_stream(spark, settings) as (listening, query, sink, relay):
        port = port_of(listening, "sync") if transport == "quic" else listening["sync_iroh"]
        ctx = mp.get_context("spawn")
        queue, go = ctx.Queue(), ctx.Event()
        per = max(1, devices // procs)
        workers = [spawn(_worker(client), queue, go, port, i + 1, per, window, p["warmup"],
                         p["seconds"], BODY_SIZE) for i in range(procs)]
        collect(queue, workers, procs, 180)              # connected, authenticated, HELLO'd
        meter = CpuMeter(relay_process=relay.pid, **({"spark_jvm": jvm_pid()}
                                                     if jvm_pid() else {}))
        go.set()
        time.sleep(p["warmup"])
        meter.start()
        b0 = last_batch(sink)
        time.sleep(p["seconds"])
        cpu = meter.stop()
        batches = batches_after(sink, b0)
        durations = durations_ms(query, {b.batch_id for b in batches})
        results = collect(queue, workers, procs, p["seconds"] + 120)
        for w in workers:
            w.join(timeout=10)
    acked = sum(r["acked"] for r in results)
    lat = [x for r in results for x in r["latency_ms"]]
    cpu["clients"] = rounded(sum(r["cpu_s"] for r in results) / p["seconds"], 2)
    if acked and cpu.get("relay_process") is not None:
        cpu["relay_ms_per_push"] = rounded(cpu["relay_process"] * p["seconds"] / acked * 1000, 2)
    rows = [b.rows_in for b in batches]
    return {
        "pushes_per_s": rounded(acked / p["seconds"]), "acked": acked,
        "errors": sum(r["errors"] for r in results),
        "seconds": p["seconds"], "warmup_seconds": p["warmup"],
        "client_processes": procs, "devices": per * procs, "window_per_device": window,
        "in_flight": per * procs * window, "groups": procs, "body_bytes": BODY_SIZE,
        "push_to_ack_ms": p50_p99(lat),
        "stream_batches": len(batches),
        "stream_batches_per_s": rounded(len(batches) / p["seconds"], 2),
        "stream_batch_rows_p50": rounded(percentile(rows, 50)),
        "stream_batch_ms_p50": rounded(percentile([b.seconds * 1000 for b in batches], 50)),
        "stream_batch_ms_p99": rounded(percentile([b.seconds * 1000 for b in batches], 99)),
        "stream_duration_ms_p50": durations,
        "trigger_interval_ms": settings.stream.trigger_interval_ms,
        "cpu_cores": cpu,
        "transport": transport, "client": client,
        "method": ("relay ingress as a child process (fsync on, sync rate limits lifted via "
                   "its conf file), the inbox stream in the bench process (processingTime "
                   f"trigger), {procs} spawned client process(es), {per * procs} devices x "
                   f"{window} PUSHes in flight on own QUIC streams "
                   + ("(aioquic, Auth + Join + HELLO v2)" if transport == "quic" else
                      "(iroh endpoints, stock HELLO v1, open groups)")
                   + "; PUSH_ACKs (after landing and inbox commit) counted by the clients in "
                   "the measured window"),
    }


def requests_throughput(settings, p: dict, transport: str, devices: int = DEVICES,
                        window: int = WINDOW, procs: int = CLIENT_PROCS,
                        client: str = "python") -> dict:
    """PULL requests of an empty group answered per second: the transport and the request
    path without the stream (no Spark), the relay as a child process."""
    from .harness import start_role, stop_process, write_conf, children
    from delta_tables.layout import Layout
    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = write_conf(settings, data_dir.with_name(data_dir.name + ".toml"))
    Layout.of(settings).ensure_shared_tables()
    relay, listening = start_role("ingress", None, data_dir, data_dir, conf=conf)
    try:
        port = port_of(listening, "sync") if transport == "quic" else listening["sync_iroh"]
        ctx = mp.get_context("spawn")
        queue, go = ctx.Queue(), ctx.Event()
        per = max(1, devices // procs)
        workers = [spawn(_worker(client), queue, go, port, i + 1, per, window, p["warmup"],
                         p["seconds"], BODY_SIZE, True) for i in range(procs)]
        collect(queue, workers, procs, 180)
        meter = CpuMeter(relay_process=relay.pid)
        go.set()
        time.sleep(p["warmup"])
        meter.start()
        time.sleep(p["seconds"])
        cpu = meter.stop()
        results = collect(queue, workers, procs, p["seconds"] + 120)
        for w in workers:
            w.join(timeout=10)
    finally:
        stop_process(relay, 40)
        if relay in children:
            children.remove(relay)
    answered = sum(r["acked"] for r in results)
    cpu["clients"] = rounded(sum(r["cpu_s"] for r in results) / p["seconds"], 2)
    if answered and cpu.get("relay_process") is not None:
        cpu["relay_ms_per_request"] = rounded(cpu["relay_process"] * p["seconds"] / answered
                                              * 1000, 3)
    return {"requests_per_s": rounded(answered / p["seconds"]), "transport": transport,
            "client": client,
            "errors": sum(r["errors"] for r in results),
            "request_ms": p50_p99([x for r in results for x in r["latency_ms"]]),
            "in_flight": per * procs * window, "cpu_cores": cpu,
            "method": (f"relay ingress as a child process, no stream; {procs} spawned client "
                       f"processes, {per * procs} devices x {window} PULLs of an empty group "
                       "in flight, each on its own bidirectional stream; PULL_RESPONSEs "
                       "counted in the measured window")}


def latency(spark, settings, p: dict) -> dict:
    with child_ingress_and_stream(spark, settings) as (listening, query, sink, relay):
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        worker = spawn(notify_worker, queue, port_of(listening, "sync"), p["rate"],
                              p["latency_seconds"], BODY_SIZE)
        res = collect(queue, [worker], 1, p["latency_seconds"] + 240)[0]
        worker.join(timeout=10)
    lat = res["latency_ms"]
    return {**p50_p99(lat),
            "max": rounded(max(lat) if lat else None), "messages": len(lat),
            "pushed": res["pushed"],
            "push_to_ack_ms": p50_p99(res["ack_ms"]),
            "rate_per_s": p["rate"], "seconds": p["latency_seconds"],
            "trigger_interval_ms": settings.stream.trigger_interval_ms,
            "tail_poll_interval_ms": settings.egress.poll_interval_ms,
            "method": ("relay ingress as a child process (fsync on), the inbox stream in the "
                       "bench process, one spawned client process with the sender (open-loop "
                       "rate) and one other online device of the group; latency = NOTIFY "
                       "arrival - PUSH write, matched by cursor")}


def _section_settings(settings, sub: str):
    s = copy.deepcopy(settings)
    s.data_dir = str(Path(settings.data_dir) / sub)
    s.sync.port = 0
    s.sync.iroh_port = 0
    s.heya.enabled = False
    s.ppp.enabled = False
    s.sync.messages_per_minute = 10 ** 9      # the bench measures the relay, not its limits
    s.sync.global_requests_per_second = 10 ** 9
    s.sync.connections_per_minute = 10 ** 6
    # every bench device connects from 127.0.0.1 at once: the per-address budgets (hostile
    # clients) would admit 32 of them at a time and 20 handshakes a second
    for key in ("max_unauth_sessions_per_address", "max_handshakes_per_address",
                "retry_above_handshakes_per_address", "max_sessions_per_address",
                "handshakes_per_address_per_second"):
        setattr(s.sync, key, 10 ** 4)
    return s


def run(settings, quick: bool, spark=None) -> dict:
    """Both figures (the stream is in the path of every PUSH_ACK: needs `spark`)."""
    p = QUICK if quick else FULL
    out: dict = {}
    # the transports' own ceiling (no stream in the path), aioquic and iroh in turn
    for transport in ("quic", "iroh"):
        s = _section_settings(settings, f"requests-{transport}")
        s.sync.open_groups = True
        out[f"requests_{transport}"] = requests_throughput(s, p, transport)
    out["sync_requests_per_s"] = {t: out[f"requests_{t}"]["requests_per_s"]
                                  for t in ("quic", "iroh")}
    if spark is None:
        return out
    out["throughput"] = throughput(spark, _section_settings(settings, "pushes"), p)
    iroh_settings = _section_settings(settings, "pushes-iroh")
    iroh_settings.sync.open_groups = True     # stock 0k-sync clients send no Join
    out["throughput_iroh"] = throughput(spark, iroh_settings, p, transport="iroh")
    out["latency"] = latency(spark, _section_settings(settings, "latency"), p)
    out["sync_pushes_per_s"] = out["throughput"]["pushes_per_s"]
    out["sync_push_to_notify_ms"] = out["latency"]
    out["sync_iroh_pushes_per_s"] = out["throughput_iroh"]["pushes_per_s"]
    out["sync_iroh_push_ack_ms"] = out["throughput_iroh"]["push_to_ack_ms"]
    out["sync_push_ack_ms"] = out["throughput"]["push_to_ack_ms"]
    return out
