"""Heya benchmarks for `relay bench`: `heya_sends_per_s` and `heya_send_to_have_ms`.

`run(settings, quick, spark=None) -> dict`, called by `run.py` with its settings
(ports 0, fsync as configured) and, for the latency part, its SparkSession.

1. `heya_sends_per_s`: an `IngressNode` in this process, its collector as a role runs it
   (`harness.serving`) (the Heya listener, TLS 1.3, landing
   group commit with fsync: RECV = durable); load from `spawn`ed client processes, each with
   its own client certificate and `CONNECTIONS_PER_CLIENT` TLS connections that keep
   `WINDOW` SENDs of `BODY_SIZE` bytes in flight over `TOKENS` send tokens of one mailbox.
   Counted: RECVs, i.e. rows the landing appender committed in the measured window.
2. `heya_send_to_have_ms` {p50, p99}: `relay ingress` (Heya) as a child process and the
   inbox stream (Spark Structured Streaming, this process), as `relay up` runs them; one
   sender at a steady rate and one receiver session of the mailbox, in a spawned process;
   from writing a SEND to reading its `HAVE <token> <seq + 1>`: landing commit, stream
   micro-batch (inbox commit), inbox tail, HAVE. (Until 2026-11-27 the listener and the
   clients shared this process with the stream's foreachBatch, and its GIL.)

The clients are written from the spec like the tests (no relay code on the client side).
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import multiprocessing as mp
import os
import ssl
import statistics
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np

from .harness import (child_ingress_and_stream, collect, gather_workers, join_all,
                      measure_appender, p50_p99, per_second, port_of, rounded, serving, spawn)

BODY_SIZE = 600
TOKENS = 64
CONNECTIONS_PER_CLIENT = 16
WINDOW = 32
QUICK = {"seconds": 5, "warmup_s": 1, "rate": 100, "latency_seconds": 6}
FULL = {"seconds": 30, "warmup_s": 2, "rate": 200, "latency_seconds": 30}
END = 9_999_999_999
WARMUP_MESSAGES = 20


def client_cert(directory: str, name: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(days=1)).not_valid_after(now + timedelta(days=1))
            .sign(key, hashes.SHA256()))
    cert_file, key_file = Path(directory) / f"{name}.crt", Path(directory) / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


async def _connect(port: int, cert: tuple[str, str]):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(*cert)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                   limit=1 << 20)
    assert await reader.readline() == b"HEYA 0\n"
    while (await reader.readline()) != b"DONE\n":
        pass
    return reader, writer


def _send_line(token_hex: bytes, body: bytes) -> bytes:
    return (b"SEND " + token_hex + b" " + hashlib.sha256(body).hexdigest().encode() + b" "
            + b"%d\n" % len(body) + body + b"\n")


async def _mailbox(port: int, cert, inbox_token: bytes, tokens: int):
    """INCO, then AUTH `tokens` send tokens; returns the open connection and the tokens."""
    reader, writer = await _connect(port, cert)
    writer.write(b"INCO " + inbox_token.hex().encode() + b"\n")
    assert (await reader.readline()).startswith(b"INCO ")
    out = []
    for _ in range(tokens):
        writer.write(b"AUTH 0 %d\n" % END)
        out.append((await reader.readline()).split()[1])
    return reader, writer, out


# --- 1. throughput: client processes ------------------------------------------------------------

def send_worker(queue, go, port: int, cert: tuple[str, str], tokens: list[bytes],
                duration: float, connections: int, window: int, size: int, seed: int) -> None:
    """A spawned load generator: `connections` TLS connections, `window` SENDs in flight
    each, RECVs counted in 100 ms buckets. Says "ready" once connected, then waits for `go`."""
    try:
        asyncio.run(_send_worker(queue, go, port, cert, tokens, duration, connections, window,
                                 size, seed))
    except Exception as exc:   # the parent reports it
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _send_worker(queue, go, port, cert, tokens, duration, connections, window, size,
                       seed) -> None:
    rng = np.random.default_rng(seed)
    pool = [_send_line(tokens[i % len(tokens)], rng.bytes(size)) for i in range(512)]
    conns = [await _connect(port, tuple(cert)) for _ in range(connections)]
    queue.put({"ready": True})
    await asyncio.to_thread(go.wait)
    buckets = np.zeros(int(duration * 10) + 20, np.int64)
    t0 = time.perf_counter()
    deadline = t0 + duration
    cpu0 = time.process_time()

    async def one(i: int, reader, writer) -> int:
        n, k = 0, i
        outstanding = 0
        while True:
            while outstanding < window and time.perf_counter() < deadline:
                writer.write(pool[k % len(pool)])
                k += 7
                outstanding += 1
            if outstanding == 0:
                return n
            line = await reader.readline()
            if not line.startswith(b"RECV "):
                raise RuntimeError("connection closed or unexpected reply")
            outstanding -= 1
            n += 1
            buckets[min(len(buckets) - 1, int((time.perf_counter() - t0) * 10))] += 1

    counts = await asyncio.gather(*(one(i, r, w) for i, (r, w) in enumerate(conns)))
    for _, w in conns:
        w.close()
    queue.put({"ok": True, "recv": int(sum(counts)), "buckets": buckets.tolist(),
               "cpu_s": time.process_time() - cpu0})


async def _throughput(settings, p: dict, clients: int, workdir: str) -> dict:
    from delta_tables.layout import Layout
    from delta_tables.heya_control import mint_inbox_tokens
    from ingress.service import IngressNode
    procs = []
    async with serving(IngressNode(settings)) as node:   # fsync as configured: RECV = durable
        try:
            port = node.heya.bound_port
            (inbox_token,) = mint_inbox_tokens(Layout.of(settings))
            _, mw, tokens = await _mailbox(port, client_cert(workdir, "receiver"), inbox_token,
                                           TOKENS)
            ctx = mp.get_context("spawn")
            queue, go = ctx.Queue(), ctx.Event()
            duration, warm = p["seconds"] + p["warmup_s"], p["warmup_s"]
            for i in range(clients):
                proc = ctx.Process(target=send_worker, daemon=True, args=(
                    queue, go, port, client_cert(workdir, f"sender{i}"), tokens, duration,
                    CONNECTIONS_PER_CLIENT, WINDOW, BODY_SIZE, i + 1))
                proc.start()
                procs.append(proc)
            for _ in range(clients):
                msg = await asyncio.to_thread(queue.get, True, 120)
                if not msg.get("ok", True):
                    raise RuntimeError(f"load generator failed: {msg.get('error')}")
            w = await measure_appender(node.appender, go, warm, duration)
            results = await gather_workers(queue, procs, timeout=120)
            mw.close()
            return {
                "sends_per_s": round(w.rows / w.seconds),
                "sends_per_s_each_1s": per_second(results, warm, duration),
                **w.figures(), "warmup_seconds": warm,
                "client_processes": clients, "connections": clients * CONNECTIONS_PER_CLIENT,
                "window_per_connection": WINDOW, "body_bytes": BODY_SIZE, "send_tokens": TOKENS,
                "client_cpu_cores": rounded(sum(r["cpu_s"] for r in results) / duration, 2),
                "recv_total": int(sum(r["recv"] for r in results)),
            }
        finally:
            await join_all(procs, 10)   # off the loop: the node serves the clients' closes


# --- 2. latency: SEND -> HAVE through the stream -------------------------------------------------

def latency_worker(queue, port: int, inbox_token: bytes, p: dict, workdir: str) -> None:
    """A spawned client process: the receiver's session and the sender, measured here."""
    try:
        queue.put({"ok": True, **asyncio.run(_latency_clients(port, inbox_token, p, workdir))})
    except Exception as exc:   # the parent reports it
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


async def _latency_clients(port: int, inbox_token: bytes, p: dict, workdir: str) -> dict:
    rreader, rwriter, tokens = await _mailbox(port, client_cert(workdir, "receiver"),
                                              inbox_token, 9)
    sreader, swriter = await _connect(port, client_cert(workdir, "sender"))
    # Warm-up (not measured): the stream's first micro-batches start its Python workers.
    warm, tokens = tokens[0], tokens[1:]
    for i in range(WARMUP_MESSAGES):
        swriter.write(_send_line(warm, b"warm-up %d" % i))
        assert (await sreader.readline()).startswith(b"RECV ")
    while (await rreader.readline()) != b"HAVE " + warm + b" %d\n" % WARMUP_MESSAGES:
        pass
    sent: dict[bytes, list[float]] = {t: [] for t in tokens}
    lat: list[float] = []
    total = int(p["rate"] * p["latency_seconds"])
    got = 0
    done = asyncio.Event()

    async def receive() -> None:
        nonlocal got
        while got < total:
            line = await rreader.readline()
            if not line:
                raise RuntimeError("receiver connection closed")
            now = time.perf_counter()
            if line.startswith(b"HAVE "):
                _, token, n = line.split()
                lat.append(now - sent[token][int(n) - 1])
                got += 1
        done.set()

    async def ping() -> None:   # as the reference client: keeps the idle timer away
        while True:
            await asyncio.sleep(5)
            rwriter.write(b"PING\n")

    recv_at: list[float] = []

    async def recvs() -> None:
        for _ in range(total):
            if not (await sreader.readline()).startswith(b"RECV "):
                raise RuntimeError("SEND refused")
            recv_at.append(time.perf_counter())

    rx, acks = asyncio.create_task(receive()), asyncio.create_task(recvs())
    pinger = asyncio.create_task(ping())
    rng = np.random.default_rng(5)
    t0 = time.perf_counter()
    for i in range(total):
        target = t0 + i / p["rate"]
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        token = tokens[i % len(tokens)]
        sent[token].append(time.perf_counter())
        swriter.write(_send_line(token, rng.bytes(BODY_SIZE)))
    await asyncio.wait_for(acks, 60)
    await asyncio.wait_for(done.wait(), 120)
    rx.cancel()
    pinger.cancel()
    rwriter.close()
    swriter.close()
    ms = [x * 1000 for x in lat]
    # RECVs come back in SEND order on the one connection: i-th RECV <-> i-th SEND.
    order = sorted(x for v in sent.values() for x in v)
    recv_ms = [(r - s_) * 1000 for r, s_ in zip(recv_at, order)]
    return {**p50_p99(ms), "max": rounded(max(ms)),
            "mean": rounded(statistics.fmean(ms)), "messages": len(ms),
            "send_to_recv_ms": p50_p99(recv_ms)}


def _latency(spark, settings, p: dict, workdir: str) -> dict:
    """`relay ingress` (Heya only) as a child process and the stream in this process, as
    `relay up` runs them, the clients in a spawned process: the stream's foreachBatch holds
    this process's GIL for each micro-batch, and neither the listener nor the clients share
    a process with it (sync.py does the same)."""
    from delta_tables.heya_control import mint_inbox_tokens
    from delta_tables.layout import Layout
    s = copy.deepcopy(settings)
    s.heya.port = 0
    s.ppp.enabled = False
    s.sync.enabled = False
    with child_ingress_and_stream(spark, s) as (listening, _query, sink, _proc):
        (inbox_token,) = mint_inbox_tokens(Layout.of(s))
        queue = mp.get_context("spawn").Queue()
        worker = spawn(latency_worker, queue, port_of(listening, "heya"), inbox_token, p,
                       workdir)
        res = collect(queue, [worker], 1, p["latency_seconds"] + 240)[0]
        worker.join(timeout=10)
        batches = [b.seconds * 1000 for b in sink.history if b.rows_in]
    res.pop("ok", None)
    return {**res, "rate_per_s": p["rate"], "seconds": p["latency_seconds"],
            "trigger_interval_ms": s.stream.trigger_interval_ms,
            "poll_interval_ms": s.egress.poll_interval_ms,
            "stream_batch_ms": {**p50_p99(batches), "batches": len(batches)},
            "method": ("relay ingress (Heya) as a child process (fsync on), the inbox stream "
                       "in the bench process, one spawned client process with the receiver's "
                       "session and the sender at an open-loop rate; latency = HAVE arrival - "
                       "SEND write")}


def run(settings, quick: bool, spark=None) -> dict:
    """Both Heya figures; `settings.data_dir` is this section's own (empty) directory."""
    p = QUICK if quick else FULL
    out: dict = {}
    workdir = tempfile.mkdtemp(prefix="heya-bench-certs-")
    root = Path(settings.data_dir)
    s1 = copy.deepcopy(settings)
    s1.data_dir = str(root / "sends")
    s1.heya.port = 0
    clients = max(1, (os.cpu_count() or 2) - 1)
    out["throughput"] = asyncio.run(_throughput(s1, p, clients, workdir))
    out["heya_sends_per_s"] = out["throughput"]["sends_per_s"]
    if spark is not None:
        s2 = copy.deepcopy(settings)
        s2.data_dir = str(root / "latency")
        out["heya_send_to_have_ms"] = _latency(spark, s2, p, workdir)
    return out
