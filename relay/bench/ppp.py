"""PPP benchmarks for `relay bench`: `ppp_acked_stores_per_s`, `ppp_store_to_notify_ms`,
`ppp_room_messages_per_s` and `ppp_room_store_to_notify_ms`.

`run(settings, quick, spark=None) -> dict`, called by `run.py` with its settings.

1. `ppp_acked_stores_per_s`: an `IngressNode` in this process, its collector as a role runs it
   (`harness.serving`) (uvicorn WebSocket listener,
   landing group commit with fsync on: STORED = durable); load from `spawn`ed client
   processes, each with `SOCKETS_PER_CLIENT` authenticated WebSockets, one Ed25519 identity
   each. Appendix C.3 allows 60 STOREs per pubkey per minute, so the load is many identities
   each sending its whole minute's budget (`STORES_PER_SOCKET`, pipelined) at the same
   moment: counted STORED replies over the time from the first send to the last reply.
   STORED needs only the landing commit, so no stream runs here: the node has this process
   to itself and the clients are in their own.
2. `ppp_store_to_notify_ms` {p50, p99}: as `relay up` runs it: `relay ingress` as a child
   process (its settings, e.g. the window below, from a TOML file the bench writes), the inbox
   stream in this process (its foreachBatch holds this process's GIL per micro-batch), the
   clients in a `spawn`ed process: senders STORE at a steady rate (rotating identities to stay
   inside the STORE budget) to one connected recipient; from writing STORE to reading the
   NOTIFY that covers it: landing commit, stream micro-batch, inbox tail, NOTIFY batch window.
   The window used is reported (`notify_window_ms`, default 0 here so the figure is the
   pipeline's own; the spec's 30 s default would add up to 30 s by design).
3. Rooms (spec 004 §7), on that same `relay ingress` and stream: `ppp_room_store_to_notify_ms`
   {p50, p99}: `LATENCY_SENDERS` senders STORE_ROOM into an open room at the latency rate,
   one subscriber (it FETCH_ROOMed) times STORE_ROOM write -> the ROOM_NOTIFY covering it.
   `ppp_room_messages_per_s`: `room_sockets` identities each send their minute's STORE_ROOM
   budget (C.3 default, 30) pipelined into one room; ROOM_STORED replies / (last reply -
   first send). ROOM_STORED carries the stream's sequence number, so every reply waits for
   an inbox commit: this is a figure of the stream's cadence, not of the landing commit.

Clients are written from the spec (msgpack maps, `websockets`, PyNaCl), no relay code.
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing as mp
import os
import time
from pathlib import Path

from .harness import (child_ingress_and_stream, collect, join_all, p50_p99, port_of, rounded,
                      serving, spawn)

CT_SIZE = 1040          # a 1024-byte padding bucket + 16-byte tag (§8 buckets)
WARMUP_EVENTS = 20
QUICK = {"clients": 1, "sockets": 150, "stores": 60, "rate": 20, "latency_seconds": 6,
         "lone_events": 50, "room_sockets": 50}
FULL = {"clients": 1, "sockets": 600, "stores": 60, "rate": 50, "latency_seconds": 30,
        "lone_events": 200, "room_sockets": 200}
ROOM_STORES_PER_SOCKET = 30    # appendix C.3's default budget (STORE_ROOM is not listed)
LATENCY_SENDERS = 40
NOTIFY_WINDOW_MS = 0
CLOSE_TIMEOUT_S = 1     # a bench socket's close handshake: websockets' default waits up to 10 s


def _wrap(recipient: bytes) -> bytes:
    import msgpack
    now = int(time.time())
    return msgpack.packb({1: recipient, 2: os.urandom(32), 3: os.urandom(24),
                          4: os.urandom(CT_SIZE), 5: now, 6: now + 3600}, use_bin_type=True)


async def _login(port: int, sk=None):
    """An authenticated WebSocket (and its pubkey), as `sk` or a fresh identity."""
    import msgpack
    from nacl.signing import SigningKey
    from websockets.asyncio.client import connect
    sk = sk or SigningKey.generate()
    ws = await connect(f"ws://127.0.0.1:{port}/v1/ws", max_size=8 << 20, open_timeout=60,
                       close_timeout=CLOSE_TIMEOUT_S)
    ch = msgpack.unpackb(await ws.recv(), raw=False)
    await ws.send(msgpack.packb({"cmd": "AUTH", "pubkey": bytes(sk.verify_key),
                                 "sig": sk.sign(ch["nonce"]).signature}, use_bin_type=True))
    assert msgpack.unpackb(await ws.recv(), raw=False)["cmd"] == "AUTH_OK"
    return ws, bytes(sk.verify_key)


async def _close_all(sockets) -> None:
    """Close every socket at once: one by one, each close handshake waited its turn (with
    replies left unread, up to `CLOSE_TIMEOUT_S` each)."""
    await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)


def store_worker(queue, ready, go, port: int, sockets: int, stores: int) -> None:
    asyncio.run(_store_worker(queue, ready, go, port, sockets, stores))


async def _store_worker(queue, ready, go, port, sockets, stores) -> None:
    import msgpack
    conns = []
    for i in range(0, sockets, 50):
        conns += await asyncio.gather(*(_login(port) for _ in range(min(50, sockets - i))))
    frames = [[msgpack.packb({"cmd": "STORE", "event": _wrap(pk)}, use_bin_type=True)
               for _ in range(stores)] for _, pk in conns]
    ready.set()
    await asyncio.to_thread(go.wait)
    t0 = time.time()

    async def one(ws, fs):
        for f in fs:
            await ws.send(f)
        ok = 0
        for _ in fs:
            ok += msgpack.unpackb(await ws.recv(), raw=False)["cmd"] == "STORED"
        return ok, time.time()

    res = await asyncio.gather(*(one(ws, fs) for (ws, _), fs in zip(conns, frames)))
    queue.put({"stored": sum(r[0] for r in res), "first": t0, "last": max(r[1] for r in res)})
    await _close_all(ws for ws, _ in conns)


async def _throughput(settings, p: dict) -> dict:
    from ingress.service import IngressNode
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    readies = [ctx.Event() for _ in range(p["clients"])]
    async with serving(IngressNode(settings, fsync=True)) as node:
        procs = [ctx.Process(target=store_worker, args=(
                     queue, readies[i], go, node.ppp.bound_port, p["sockets"], p["stores"]),
                     daemon=True) for i in range(p["clients"])]
        try:
            for pr in procs:
                pr.start()
            for r in readies:
                if not await asyncio.to_thread(r.wait, 300):
                    raise RuntimeError("a PPP bench client did not connect")
            commits0 = node.appender.commits
            go.set()
            results = [await asyncio.to_thread(queue.get, True, 600) for _ in procs]
            commits = node.appender.commits - commits0
        finally:
            await join_all(procs, 30)   # off the loop: the node serves the clients' closes
    stored = sum(r["stored"] for r in results)
    secs = max(r["last"] for r in results) - min(r["first"] for r in results)
    return {"stores_per_s": rounded(stored / secs, 0), "stored": stored,
            "seconds": rounded(secs, 2),
            "sockets": p["clients"] * p["sockets"], "stores_per_socket": p["stores"],
            "landing_commits": commits, "fsync": True, "ciphertext_bytes": CT_SIZE,
            "method": ("IngressNode in the bench process, its collector as a role runs it (no "
                       "stream running; STORED = landing "
                       "commit with fsync), spawned client process(es) with authenticated "
                       "WebSockets each sending its minute's STORE budget pipelined; rate = "
                       "STORED replies / (last reply - first send)")}


def notify_worker(queue, port: int, rate: float, seconds: float,
                  rx_port: int | None = None) -> None:
    """Latency load (a spawned process): one recipient (on `rx_port`, another host's
    listener, if given), `LATENCY_SENDERS` senders."""
    try:
        asyncio.run(_notify_worker(queue, port, rate, seconds, rx_port or port))
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _notify_worker(queue, port, rate, seconds, rx_port) -> None:
    import msgpack
    rx, rx_pk = await _login(rx_port)
    senders = [await _login(port) for _ in range(LATENCY_SENDERS)]
    # Warm-up (not timed): the stream's and the tail's first batches pay one-off costs
    # (Python worker start, first Delta reads) that a steady relay does not.
    warm, _ = await _login(port)
    for _ in range(WARMUP_EVENTS):
        await warm.send(msgpack.packb({"cmd": "STORE", "event": _wrap(rx_pk)},
                                      use_bin_type=True))
    for _ in range(WARMUP_EVENTS):      # its STOREDs: unread, they held its close
        await asyncio.wait_for(warm.recv(), 120)
    notified = 0
    while notified < WARMUP_EVENTS:
        m = msgpack.unpackb(await asyncio.wait_for(rx.recv(), 120), raw=False)
        notified += m["count"] if m["cmd"] == "NOTIFY" else 0
    await warm.close()
    sent: list[float] = []          # STORE write times, in order
    stored_at: list[float] = []     # STORE -> STORED, per sender in order
    lat: list[float] = []
    total = int(rate * seconds)

    async def receive():
        while len(lat) < total:
            m = msgpack.unpackb(await asyncio.wait_for(rx.recv(), 120), raw=False)
            if m["cmd"] == "NOTIFY":
                now = time.perf_counter()
                for _ in range(m["count"]):
                    lat.append((now - sent[len(lat)]) * 1000)

    by_sender: list[list[float]] = [[] for _ in senders]

    async def send():
        period = 1.0 / rate
        t_next = time.perf_counter()
        for i in range(total):
            ws, _ = senders[i % len(senders)]
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            frame = msgpack.packb({"cmd": "STORE", "event": _wrap(rx_pk)}, use_bin_type=True)
            t = time.perf_counter()
            sent.append(t)
            by_sender[i % len(senders)].append(t)
            await ws.send(frame)
            t_next += period

    async def drain(k, ws):   # STORED replies, in order per WebSocket
        for j in range(len(range(k, total, len(senders)))):
            try:
                await asyncio.wait_for(ws.recv(), 120)
            except Exception:
                return
            while len(by_sender[k]) <= j:
                await asyncio.sleep(0.001)
            stored_at.append((time.perf_counter() - by_sender[k][j]) * 1000)

    await asyncio.gather(receive(), send(), *(drain(k, ws) for k, (ws, _) in enumerate(senders)))
    queue.put({"ok": True, "latency_ms": lat, "stored_ms": stored_at})
    await _close_all([ws for ws, _ in senders] + [rx])


def lone_worker(queue, port: int, count: int) -> None:
    """One sender, one connected recipient, one event at a time (a spawned process)."""
    try:
        asyncio.run(_lone_worker(queue, port, count))
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


LONE_PAIR_EVENTS = 25    # then a new sender and recipient: appendix C.3 allows 30 FETCH/min


async def _lone_worker(queue, port: int, count: int) -> None:
    import hashlib
    import msgpack
    pack = lambda m: msgpack.packb(m, use_bin_type=True)   # noqa: E731
    unpack = lambda b: msgpack.unpackb(b, raw=False, strict_map_key=False)  # noqa: E731
    acked: list[float] = []
    delivered: list[float] = []
    ack_acked: list[float] = []
    rx = tx = None
    for i in range(count + WARMUP_EVENTS):
        if i % LONE_PAIR_EVENTS == 0:
            await _close_all(ws for ws in (rx, tx) if ws is not None)
            (rx, rx_pk), (tx, _) = await _login(port), await _login(port)
        event = _wrap(rx_pk)
        t0 = time.perf_counter()
        await tx.send(pack({"cmd": "STORE", "event": event}))
        assert unpack(await asyncio.wait_for(tx.recv(), 60))["cmd"] == "STORED"
        t_ack = time.perf_counter()
        while True:     # NOTIFY, then FETCH until the event is in hand
            m = unpack(await asyncio.wait_for(rx.recv(), 60))
            if m["cmd"] != "NOTIFY":
                continue
            await rx.send(pack({"cmd": "FETCH", "since": 0}))
            got = unpack(await asyncio.wait_for(rx.recv(), 60))
            while got["cmd"] == "NOTIFY":
                got = unpack(await asyncio.wait_for(rx.recv(), 60))
            if event in got["events"]:
                break
        t_in_hand = time.perf_counter()
        ids = [unpack(e) for e in got["events"]]
        await rx.send(pack({"cmd": "ACK", "event_ids": [
            hashlib.blake2b(w[2] + w[3] + w[4], digest_size=32).digest() for w in ids]}))
        while unpack(await asyncio.wait_for(rx.recv(), 60))["cmd"] != "ACKED":
            pass
        if i >= WARMUP_EVENTS:
            acked.append((t_ack - t0) * 1000)
            delivered.append((t_in_hand - t0) * 1000)
            ack_acked.append((time.perf_counter() - t_in_hand) * 1000)
    queue.put({"ok": True, "acked_ms": acked, "delivered_ms": delivered, "ack_ms": ack_acked})
    await _close_all((rx, tx))


def room_worker(queue, port: int, rate: float, seconds: float, sockets: int) -> None:
    """Room latency, then room throughput (a spawned process)."""
    try:
        asyncio.run(_room_worker(queue, port, rate, seconds, sockets))
    except Exception as exc:
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def _room_store(room_id: bytes) -> bytes:
    import msgpack
    return msgpack.packb({"cmd": "STORE_ROOM", "room_id": room_id, "nonce": os.urandom(24),
                          "ciphertext": os.urandom(CT_SIZE)}, use_bin_type=True)


async def _room_worker(queue, port, rate, seconds, sockets) -> None:
    import msgpack
    unpack = lambda b: msgpack.unpackb(b, raw=False)   # noqa: E731
    admin, _ = await _login(port)
    rooms = []
    for _ in range(2):      # latency room, throughput room: open (not gated), 100 members
        room_id = os.urandom(16)
        await admin.send(msgpack.packb({
            "cmd": "CREATE_ROOM", "room_id": room_id, "s2_cell_id": "47a851dff",
            "s2_coarse_id": "47a851", "gated": False, "proximity_required": False,
            "ble_enabled": False, "max_members": 100,
            "expires_at": int(time.time()) + 3600}, use_bin_type=True))
        assert unpack(await admin.recv())["cmd"] == "ROOM_CREATED"
        rooms.append(room_id)
    rx, _ = await _login(port)
    await rx.send(msgpack.packb({"cmd": "FETCH_ROOM", "room_id": rooms[0], "since_id": 0},
                                use_bin_type=True))
    assert unpack(await rx.recv())["cmd"] == "ROOM_MESSAGES"
    senders = [(await _login(port))[0] for _ in range(LATENCY_SENDERS)]
    for ws in senders[:1]:     # warm-up, not timed
        for _ in range(min(WARMUP_EVENTS, ROOM_STORES_PER_SOCKET)):
            await ws.send(_room_store(rooms[0]))
        for _ in range(min(WARMUP_EVENTS, ROOM_STORES_PER_SOCKET)):
            await asyncio.wait_for(ws.recv(), 120)
    heard = 0
    while heard < min(WARMUP_EVENTS, ROOM_STORES_PER_SOCKET):
        m = unpack(await asyncio.wait_for(rx.recv(), 120))
        heard += m["count"] if m["cmd"] == "ROOM_NOTIFY" else 0
    total = min(int(rate * seconds), (LATENCY_SENDERS - 1) * ROOM_STORES_PER_SOCKET)
    sent: list[float] = []
    lat: list[float] = []

    async def receive():
        while len(lat) < total:
            m = unpack(await asyncio.wait_for(rx.recv(), 120))
            if m["cmd"] == "ROOM_NOTIFY":
                now = time.perf_counter()
                for _ in range(m["count"]):
                    lat.append((now - sent[len(lat)]) * 1000)

    async def send():
        t_next = time.perf_counter()
        for i in range(total):
            ws = senders[1 + i % (LATENCY_SENDERS - 1)]
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            frame = _room_store(rooms[0])
            sent.append(time.perf_counter())
            await ws.send(frame)
            t_next += 1.0 / rate

    async def drain(ws, k):     # ROOM_STORED replies (ROOM_NOTIFYs to the sender skipped)
        while k:
            k -= unpack(await asyncio.wait_for(ws.recv(), 120))["cmd"] != "ROOM_NOTIFY"

    per = [len(range(j, total, LATENCY_SENDERS - 1)) for j in range(LATENCY_SENDERS - 1)]
    await asyncio.gather(receive(), send(), *(drain(ws, k) for ws, k in zip(senders[1:], per)))
    await _close_all(senders + [rx])

    conns = []
    for i in range(0, sockets, 50):
        conns += [c for c, _ in await asyncio.gather(
            *(_login(port) for _ in range(min(50, sockets - i))))]
    frames = [[_room_store(rooms[1]) for _ in range(ROOM_STORES_PER_SOCKET)] for _ in conns]
    t0 = time.time()

    refused: dict[str, int] = {}

    async def one(ws, fs):
        for f in fs:
            await ws.send(f)
        ok = got = 0
        while got < len(fs):
            m = unpack(await asyncio.wait_for(ws.recv(), 120))
            if m["cmd"] == "ROOM_NOTIFY":    # a sender is a subscriber too
                continue
            got += 1
            if m["cmd"] == "ROOM_STORED":
                ok += 1
            else:
                why = str(m.get("reason", m["cmd"])).split(" (request")[0]
                refused[why] = refused.get(why, 0) + 1
        return ok, time.time()

    res = await asyncio.gather(*(one(ws, fs) for ws, fs in zip(conns, frames)))
    queue.put({"ok": True, "latency_ms": lat, "stored": sum(r[0] for r in res),
               "refused": refused, "first": t0, "last": max(r[1] for r in res)})
    await _close_all(conns + [admin])


def _latency(spark, settings, p: dict) -> dict:
    with child_ingress_and_stream(spark, settings) as (listening, query, sink, relay):
        queue = mp.get_context("spawn").Queue()
        worker = spawn(notify_worker, queue, port_of(listening, "ppp"), p["rate"],
                              p["latency_seconds"])
        res = collect(queue, [worker], 1, p["latency_seconds"] + 300)[0]
        worker.join(timeout=10)
        worker = spawn(lone_worker, queue, port_of(listening, "ppp"), p["lone_events"])
        lone = collect(queue, [worker], 1, 300)[0]
        worker.join(timeout=10)
        worker = spawn(room_worker, queue, port_of(listening, "ppp"), p["rate"],
                       p["latency_seconds"], p["room_sockets"])
        rooms = collect(queue, [worker], 1, p["latency_seconds"] + 600)[0]
        worker.join(timeout=10)
    lat = res["latency_ms"]
    room_secs = rooms["last"] - rooms["first"]
    room_figures = {
        "ppp_room_messages_per_s": rounded(rooms["stored"] / room_secs, 0),
        "room_throughput": {
            "stored": rooms["stored"], "refused": rooms["refused"],
            "seconds": rounded(room_secs, 2),
            "sockets": p["room_sockets"], "stores_per_socket": ROOM_STORES_PER_SOCKET,
            "method": ("on relay ingress (child) + the stream: authenticated WebSockets each "
                       "sending its minute's STORE_ROOM budget pipelined into one open room; "
                       "rate = ROOM_STORED replies (each after the inbox commit that numbered "
                       "it) / (last reply - first send)")},
        "ppp_room_store_to_notify_ms": {
            **p50_p99(rooms["latency_ms"]), "count": len(rooms["latency_ms"]),
            "rate_per_s": p["rate"], "notify_window_ms": settings.ppp.notify_window_ms,
            "method": (f"{LATENCY_SENDERS - 1} sender WebSockets STORE_ROOM at an open-loop "
                       "rate into one room; one subscriber (it FETCH_ROOMed); STORE_ROOM "
                       "write -> the ROOM_NOTIFY covering it, counts matched in order")}}
    return {**p50_p99(lat), "count": len(lat), "rooms": room_figures,
            "lone_client": {
                "events": len(lone["acked_ms"]),
                "store_to_stored_ms": p50_p99(lone["acked_ms"]),
                "store_to_event_in_hand_ms": p50_p99(lone["delivered_ms"]),
                "ack_to_acked_ms": p50_p99(lone["ack_ms"]),
                "method": ("one sender WebSocket STOREs one event at a time to one connected "
                           "recipient, which FETCHes on NOTIFY and ACKs; the next STORE "
                           "after that: STORED and the event in the recipient's hand (NOTIFY "
                           "+ FETCH) timed from the STORE write, and ACK to ACKED")},
            "warmup_events": WARMUP_EVENTS,
            "store_to_stored_ms": p50_p99(res["stored_ms"]),
            "rate_per_s": p["rate"], "notify_window_ms": settings.ppp.notify_window_ms,
            "trigger_interval_ms": settings.stream.trigger_interval_ms,
            "tail_poll_interval_ms": settings.egress.poll_interval_ms,
            "method": ("relay ingress as a child process (fsync on; notify_window_ms from its "
                       "conf file), the inbox stream in the bench process, one spawned client "
                       f"process: {LATENCY_SENDERS} sender WebSockets (rotating identities) at "
                       "an open-loop rate and one recipient WebSocket; latency = NOTIFY "
                       "arrival - STORE write, NOTIFY counts matched to STOREs in order")}


def run(settings, quick: bool, spark=None) -> dict:
    """Both PPP figures; `settings.data_dir` is this section's own (empty) directory."""
    p = QUICK if quick else FULL
    out: dict = {}
    root = Path(settings.data_dir)
    s1 = copy.deepcopy(settings)
    s1.data_dir = str(root / "stores")
    s1.ppp.port = 0
    s1.heya.enabled = False
    s1.sync.enabled = False
    out["throughput"] = asyncio.run(_throughput(s1, p))
    out["ppp_acked_stores_per_s"] = out["throughput"]["stores_per_s"]
    if spark is not None:
        s2 = copy.deepcopy(settings)
        s2.data_dir = str(root / "latency")
        s2.ppp.port = 0
        s2.heya.enabled = False
        s2.ppp.notify_window_ms = NOTIFY_WINDOW_MS
        s2.sync.enabled = False
        out["ppp_store_to_notify_ms"] = _latency(spark, s2, p)
        rooms = out["ppp_store_to_notify_ms"].pop("rooms")
        out.update(rooms)
    return out
