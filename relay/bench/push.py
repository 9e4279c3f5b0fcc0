"""Push benchmarks for `relay bench`: `push_wakeups_per_s` and `inbox_commit_to_push_ms`.

`run(settings, quick, spark) -> dict`, called by `run.py`. As `relay up` runs it: `relay
ingress` (PPP) and `relay push` as child processes, the inbox stream in this process, and an
APNs provider on loopback in a `spawn`ed process (`push_providers.FakeApns`: HTTP/2 over TLS,
ES256 token auth checked, 200 at once), so the job's production client does the real work:
one pooled HTTP/2 connection, a JWT, a request per wake-up.

1. `inbox_commit_to_push_ms` {p50, p99}: the job running, senders STORE one event to each
   of `latency_devices` offline devices (each registered an APNs token over PPP, then left)
   at `rate` per second; per wake-up, the inbox commit that held its event (the commit's own
   timestamp) -> the provider's answer, from `push_log.inbox_to_push_ms`.
2. `push_wakeups_per_s`: the job stopped, one event to each of `devices` fresh offline
   devices is stored and committed to the inbox; then the job starts, and the figure is
   `devices` / (the last wake-up's arrival at the provider - the job's ready line): the job's
   own capacity (read the inbox, ask the PPP desk, record intents, send, record outcomes).

Every device is distinct, so the per-device window never holds a wake-up back.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import queue as queue_mod
import time
from pathlib import Path

from .harness import (child_ingress_and_stream, p50_p99, port_of, rounded, say, spawn,
                      start_role, stop_process, write_conf)

QUICK = {"latency_devices": 100, "rate": 20, "devices": 300, "senders": 20}
FULL = {"latency_devices": 600, "rate": 40, "devices": 3000, "senders": 60}
STORES_PER_SENDER = 60      # appendix C.3: 60 STOREs per pubkey per minute


def provider_worker(queue, directory: str, stop) -> None:
    from .push_providers import FakeApns

    async def main() -> None:
        apns = FakeApns(Path(directory))
        await apns.start()
        queue.put({"port": apns.port, "key_file": str(apns.key_file), "cert": str(apns.cert)})
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await apns.close()
        queue.put({"arrivals": [t for t, _, _ in apns.arrival_times],
                   "bad_auth": apns.bad_auth})
    asyncio.run(main())


def client_worker(queue, port: int, devices: int, senders: int, rate: float,
                  register_only: bool) -> None:
    asyncio.run(_clients(queue, port, devices, senders, rate, register_only))


async def _clients(queue, port, devices, senders, rate, register_only) -> None:
    import msgpack
    from nacl.signing import SigningKey

    from .ppp import _login, _wrap
    keys = [SigningKey.generate() for _ in range(devices)]
    gate = asyncio.Semaphore(50)

    async def register(sk) -> None:
        async with gate:
            ws, _ = await _login(port, sk)
            await ws.send(msgpack.packb({"cmd": "REGISTER_PUSH", "platform": "apns",
                                         "token": os.urandom(32).hex()}))
            assert msgpack.unpackb(await ws.recv(), raw=False)["cmd"] == "PUSH_REGISTERED"
            await ws.close()
    await asyncio.gather(*(register(sk) for sk in keys))
    queue.put({"registered": devices})
    socks = [(await _login(port))[0] for _ in range(senders)]
    stored = 0
    t0 = time.perf_counter()
    for i, sk in enumerate(keys):
        ws = socks[i % senders]
        await ws.send(msgpack.packb({"cmd": "STORE", "event": _wrap(bytes(sk.verify_key))}))
        r = msgpack.unpackb(await ws.recv(), raw=False)
        stored += r["cmd"] == "STORED"
        if rate:
            await asyncio.sleep(max(0.0, t0 + (i + 1) / rate - time.perf_counter()))
    for ws in socks:
        await ws.close()
    queue.put({"stored": stored})


def _get(queue, key: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = queue.get(timeout=1.0)
        except queue_mod.Empty:
            continue
        if key in msg:
            return msg
    raise TimeoutError(f"bench push: no {key!r} in {timeout:.0f} s")


def _sent(log_path: Path) -> list[dict]:
    from deltalake import DeltaTable

    from delta_tables import query
    if not (log_path / "_delta_log").exists():
        return []
    return [r for r in query.read(DeltaTable(str(log_path)),
                                   ["outcome", "inbox_to_push_ms", "trigger"]).to_pylist()
            if r["outcome"] == "sent"]


def _wait_sent(log_path: Path, n: int, timeout: float) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        rows = _sent(log_path)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def run(settings, quick: bool, spark=None) -> dict:
    if spark is None:
        return {}
    from delta_tables.layout import Layout
    from delta_tables.schema_push import PUSH_LOG
    p = QUICK if quick else FULL
    data = Path(settings.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    pq_, stop = ctx.Queue(), ctx.Event()
    provider = spawn(provider_worker, pq_, str(data.parent), stop)
    got = _get(pq_, "port", 60)
    settings.heya.enabled = settings.sync.enabled = False
    a = settings.push.apns
    a.key_file, a.key_id, a.team_id, a.topic = (got["key_file"], "KEY1234567", "TEAM123456",
                                                "org.example.messenger")
    a.url, a.ca_file = f"https://127.0.0.1:{got['port']}", got["cert"]
    log_path = Layout.of(settings).table(PUSH_LOG)
    out: dict = {}
    with child_ingress_and_stream(spark, settings) as (listening, _query, _sink, _relay):
        conf = write_conf(settings, data.with_name(data.name + "-push.toml"))
        job, _ = start_role("push", None, data, data, conf=conf)
        port = port_of(listening, "ppp")
        q = ctx.Queue()
        # 1. latency, the job running
        w = spawn(client_worker, q, port, p["latency_devices"], p["senders"], p["rate"], False)
        _get(q, "stored", 600)
        w.join(30)
        rows = _wait_sent(log_path, p["latency_devices"], 120)
        lat = [r["inbox_to_push_ms"] for r in rows if r["trigger"] == "message"
               and r["inbox_to_push_ms"] is not None]
        out["inbox_commit_to_push_ms"] = {**p50_p99(lat), "count": len(lat),
                                          "rate_per_s": p["rate"]}
        # 2. capacity: a backlog of fresh devices' events, then the job starts
        stop_process(job, 30)
        w = spawn(client_worker, q, port, p["devices"], p["senders"], 0, False)
        _get(q, "stored", 900)
        w.join(30)
        time.sleep(3.0)                       # the stream commits the last of them
        before = len(rows)
        logs = data.with_name(data.name + "-backlog")      # its own push.log
        logs.mkdir(exist_ok=True)
        job, _ = start_role("push", None, data, logs, conf=conf)
        t_ready = time.time()
        rows = _wait_sent(log_path, before + p["devices"], 300)
        stop_process(job, 30)
    stop.set()
    arrivals = sorted(_get(pq_, "arrivals", 60)["arrivals"])
    provider.join(10)
    backlog = [t for t in arrivals if t >= t_ready][:p["devices"]]
    if backlog:
        span = max(1e-3, backlog[-1] - t_ready)
        out["push_wakeups_per_s"] = rounded(len(backlog) / span)
        out["push_backlog"] = {"devices": p["devices"], "woken": len(backlog),
                               "seconds": rounded(span, 2)}
    say(f"push: {out}")
    return out
