"""`relay bench --sync-transports`: cursor-sync's two transports side by side, and what one
request costs over the iroh bindings -> bench-sync-transports.json.

Each round, one after the other (compare within a round, as ratios; report medians):

1. `requests`: PULLs of an empty group answered per second without the stream (the
   transport and the request path alone; `sync.requests_throughput`): aioquic, iroh with
   the Python load clients, and iroh with the Rust load client (`iroh_client.py`) when it
   is built. The relay's CPU per request is split between its main thread (the asyncio loop:
   our request path and the bindings' completions) and its other threads (iroh's Rust
   runtime: QUIC, TLS, UDP), read from /proc per thread.
2. `pushes` (with a SparkSession): PUSH -> PUSH_ACK with the inbox stream in the path
   (`sync.throughput`), aioquic then iroh, iroh's load from the Rust client when built.
3. `crossing`: what one async call across the bindings costs the calling thread: a stream
   carries `CROSSINGS` bytes already received, read back one byte per `read_exact(1)` call
   (each a Rust future polled, completed from iroh's thread and woken on the asyncio loop);
   CPU of this process per call (and of the loop's thread alone), and the same loop of plain `await` of a finished asyncio
   future for the floor of the loop itself. A request on the iroh endpoint makes
   `CROSSINGS_PER_REQUEST` such calls, so crossings x their cost is the floor of the relay's
   main-thread CPU per request, before any cursor-sync work.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from . import iroh_client, sync
from .harness import bench_spark, machine, rounded, say, settings_for, stop_children

CROSSINGS = 20_000
# accept_bi, read (one chunk: the whole frame), write_all, finish (ingress/sync_iroh.py)
CROSSINGS_PER_REQUEST = 4


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of `pid`'s main thread and of all its other threads."""
    tick = os.sysconf("SC_CLK_TCK")
    main = other = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            rest = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(rest[11]) + int(rest[12])) / tick
        if int(task.name) == pid:
            main += cpu
        else:
            other += cpu
    return {"main_thread": main, "other_threads": other}


async def _crossing(n: int) -> dict:
    import iroh
    alpn = b"bench/crossing"

    async def bind(alpns):
        return await iroh.Endpoint.bind(iroh.EndpointOptions(
            preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0", alpns=alpns,
            secret_key=iroh.SecretKey.generate().to_bytes(),
            relay_mode=iroh.RelayMode.disabled()))
    server, client = await bind([alpn]), await bind([])
    try:
        async def accept():
            return await (await (await server.accept_next()).accept()).connect()
        conn, sconn = await asyncio.gather(client.connect(iroh.EndpointAddr(
            server.id(), None, [a for a in server.bound_sockets() if a.startswith("127.")]),
            alpn), accept())
        bi = await conn.open_bi()
        await bi.send().write_all(b"x" * n)
        await bi.send().finish()
        recv = (await sconn.accept_bi()).recv()
        await recv.read_exact(1)
        await asyncio.sleep(0.5)                 # everything received before timing
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        for _ in range(n - 1):
            await recv.read_exact(1)
        cpu, wall = time.process_time() - c0, time.perf_counter() - w0
        own = time.thread_time() - t0
        loop = asyncio.get_running_loop()
        c1 = time.process_time()
        for _ in range(n):
            fut = loop.create_future()
            fut.set_result(None)
            await fut
        plain = time.process_time() - c1
        conn.close(0, b"done")
    finally:
        await client.close()
        await server.close()
    return {"calls": n - 1, "cpu_us_per_call": rounded(cpu / (n - 1) * 1e6, 1),
            "loop_thread_cpu_us_per_call": rounded(own / (n - 1) * 1e6, 1),
            "wall_us_per_call": rounded(wall / (n - 1) * 1e6, 1),
            "plain_await_cpu_us": rounded(plain / n * 1e6, 2)}


def crossing(n: int = CROSSINGS) -> dict:
    return asyncio.run(_crossing(n))


def _split(res: dict, before: dict, after: dict, answered: int) -> None:
    if answered:
        res["relay_ms_per_request_by_thread"] = {
            k: rounded((after[k] - before[k]) / answered * 1000, 3) for k in before}


def requests_round(settings, p: dict, client: str) -> dict:
    out = {}
    for name, transport, who in (("quic", "quic", "python"), ("iroh", "iroh", "python"),
                                 ("iroh_rust_client", "iroh", "rust")):
        if who == "rust" and client != "rust":
            continue
        s = sync._section_settings(settings, f"requests-{name}")
        s.sync.open_groups = True
        out[name] = _with_threads(lambda: sync.requests_throughput(s, p, transport,
                                                                   client=who), p["seconds"])
    return out


def _with_threads(fn, seconds: float) -> dict:
    """`fn()`'s result with the relay's CPU per request split by thread (see the module)."""
    from . import harness
    seen: dict = {}
    real = harness.CpuMeter

    class Meter(real):
        def start(self):
            pid = self.pids.get("relay_process")
            seen["pid"], seen["before"] = pid, thread_cpu(pid)
            return super().start()

        def stop(self):
            seen["after"] = thread_cpu(seen["pid"])
            return super().stop()
    harness.CpuMeter = sync.CpuMeter = Meter
    try:
        res = fn()
    finally:
        harness.CpuMeter = sync.CpuMeter = real
    if "after" in seen:
        n = res.get("acked") or round((res.get("requests_per_s") or 0) * seconds)
        _split(res, seen["before"], seen["after"], n)
    return res


def main(args) -> int:
    quick = bool(getattr(args, "quick", False))
    if getattr(args, "build_only", False):
        iroh_client.build(say)
        return 0
    p = dict(sync.QUICK if quick else sync.FULL)
    rounds = getattr(args, "rounds", None) or 3
    client = "rust" if iroh_client.available() else "python"
    if client == "python":
        say("note: the Rust iroh load client is not built (relay bench --sync-transports "
            "--build-only); iroh's load comes from the Python clients")
    out_path = Path(getattr(args, "out", None) or "bench-sync-transports.json")
    root = Path(tempfile.mkdtemp(prefix="relay-bench-sync-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(os.getloadavg()), "iroh_load_client": client,
                 "sizes": p, "rounds": []}
    spark = bench_spark(settings_for(args, root / "unused"), "relay-bench-sync")
    try:
        for n in range(rounds):
            _round(args, root, n, p, client, spark, res, out_path)
    finally:
        stop_children()
    say(json.dumps(res["summary"], indent=1))
    return 0


def _round(args, root: Path, n: int, p: dict, client: str, spark, res: dict,
           out_path: Path) -> None:
    """One round: the crossing cost, requests without the stream, PUSH_ACKs with it; the
    results file rewritten after it (an interrupted run keeps its rounds)."""
    base = settings_for(args, root / f"round-{n}")
    r: dict = {"load_before": round(os.getloadavg()[0], 2)}
    say(f"round {n + 1}: crossing cost ...")
    r["crossing"] = crossing()
    say(f"round {n + 1}: requests without the stream ...")
    r["requests"] = requests_round(base, p, client)
    say(f"round {n + 1}: PUSH_ACKs with the stream ...")
    r["pushes"] = {"quic": _with_threads(lambda: sync.throughput(
        spark, sync._section_settings(base, "pushes"), p), p["seconds"])}
    s = sync._section_settings(base, "pushes-iroh")
    s.sync.open_groups = True            # stock 0k-sync clients send no Join
    r["pushes"]["iroh"] = _with_threads(lambda: sync.throughput(
        spark, s, p, transport="iroh", client=client), p["seconds"])
    r["load_after"] = round(os.getloadavg()[0], 2)
    res["rounds"].append(r)
    res["summary"] = summary(res["rounds"])
    out_path.write_text(json.dumps(res, indent=1, sort_keys=True))


def _median(xs):
    xs = [x for x in xs if x is not None]
    return rounded(statistics.median(xs), 3) if xs else None


def summary(rounds: list[dict]) -> dict:
    """Medians over the rounds, and iroh / aioquic per round then their median."""
    out: dict = {}
    req = [r["requests"] for r in rounds]
    for name in ("quic", "iroh", "iroh_rust_client"):
        got = [q[name] for q in req if name in q]
        if got:
            out[f"requests_per_s_{name}"] = _median([g["requests_per_s"] for g in got])
            out[f"relay_ms_per_request_{name}"] = _median(
                [g["cpu_cores"].get("relay_ms_per_request") for g in got])
            out[f"relay_ms_per_request_by_thread_{name}"] = {
                k: _median([(g.get("relay_ms_per_request_by_thread") or {}).get(k)
                            for g in got]) for k in ("main_thread", "other_threads")}
    for name in ("iroh", "iroh_rust_client"):
        ratios = [q[name]["requests_per_s"] / q["quic"]["requests_per_s"] for q in req
                  if name in q and q["quic"]["requests_per_s"]]
        if ratios:
            out[f"requests_ratio_{name}_to_quic"] = _median(ratios)
    pushes = [r["pushes"] for r in rounds if "pushes" in r]
    for name in ("quic", "iroh"):
        if pushes:
            out[f"push_acks_per_s_{name}"] = _median([q[name]["pushes_per_s"] for q in pushes])
            out[f"push_ack_p50_ms_{name}"] = _median(
                [q[name]["push_to_ack_ms"].get("p50") for q in pushes])
    if pushes:
        out["push_acks_ratio_iroh_to_quic"] = _median(
            [q["iroh"]["pushes_per_s"] / q["quic"]["pushes_per_s"] for q in pushes
             if q["quic"]["pushes_per_s"]])
    cross = [r["crossing"] for r in rounds]
    out["crossing_cpu_us"] = _median([c["cpu_us_per_call"] for c in cross])
    out["crossing_loop_thread_cpu_us"] = _median([c["loop_thread_cpu_us_per_call"]
                                                  for c in cross])
    out["plain_await_cpu_us"] = _median([c["plain_await_cpu_us"] for c in cross])
    out["crossings_per_request"] = CROSSINGS_PER_REQUEST
    if out["crossing_cpu_us"]:
        floor = out["crossing_cpu_us"] * CROSSINGS_PER_REQUEST / 1000
        out["binding_floor_ms_per_request"] = rounded(floor, 3)
        out["binding_floor_requests_per_s_per_core"] = rounded(1 / floor * 1000)
    return out
