"""`relay bench [--quick] [--out FILE]`: measure the relay on this machine, write JSON.

Everything runs for real: Noise handshakes over loopback TCP, group-committed landing with
fsync (as configured), Spark Structured Streaming into the inbox, egress delivering to XX
receive sessions. Sections, in order (all in one run, so ratios compare like with like):

1. `delta_append_ceiling_rows_per_s`: raw `write_deltalake(path, table, mode="append")` of
   pre-built Arrow tables (1k and 10k landing rows), no protocol work, no fsync.
2. `landing_commit_ms`: `LandingTarget.commit` of 10-row tables back to back, as configured
   (fsync, `commits_per_generation`, `refresh_handle_every`): p50 over the first 1k commits,
   over the last 1k, and per 1k window.
3. `trueseal_acked_pushes_per_s`: `IngressNode` in this process; load from `spawn`ed client
   processes (`relay/bench_client.py`), two shapes: one NK connection per push (the real
   client) and pipelined push sessions.
4. `stream_envelopes_per_s`: landing pre-filled with big commits, the inbox stream run with
   `availableNow` (SparkSession start and a small warm-up query excluded).
5. `push_to_deliver_ms`: `relay ingress` and `relay egress` as child processes (as `relay up`
   runs them), the inbox stream in this process, a client process pushing at a steady rate to
   receive sessions that timestamp each Deliver.
6. `heya_sends_per_s`, `heya_send_to_have_ms` {p50, p99}: `relay/bench_heya.py` (TLS
   connections pipelining SENDs; one sender and one receiver session through the stream).

The load generators run in separate processes started with `spawn` (delta-rs must not be
forked). Child processes are stopped on exit, error and Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa

from runtime import config

QUICK = {
    "ceiling_commits": {1000: 60, 10000: 20},
    "commit_target": 10_000, "commit_budget_s": 50,
    "ingress_seconds": 8, "ingress_warmup_s": 1,
    "stream_rows": 200_000, "stream_commit_rows": 20_000, "stream_batch_rows": 100_000,
    "e2e_rate": 200, "e2e_seconds": 10, "e2e_receivers": 20,
}
FULL = {
    "ceiling_commits": {1000: 300, 10000: 100},
    "commit_target": 101_000, "commit_budget_s": 19 * 60,
    "ingress_seconds": 30, "ingress_warmup_s": 2,
    "stream_rows": 1_000_000, "stream_commit_rows": 20_000, "stream_batch_rows": 100_000,
    "e2e_rate": 500, "e2e_seconds": 30, "e2e_receivers": 50,
}
ENVELOPE_SIZE = 600
MAILBOXES = 10_000
PER_CONNECTION_CONCURRENCY = 128    # in-flight one-push connections per client process
PIPELINED_SESSIONS = 256            # push sessions, split over the client processes
PIPELINED_WINDOW = 32               # Pushes sent ahead of their Acks, per session

_children: list = []                # Popen and mp.Process objects to stop on exit


# --- small helpers -----------------------------------------------------------------------------

def _p(values, q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _r(x, nd: int = 1):
    return None if x is None else round(float(x), nd)


def _say(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


def _stop_children() -> None:
    for child in reversed(_children):
        try:
            if isinstance(child, subprocess.Popen):
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
                    try:
                        child.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait(timeout=5)
            else:   # multiprocessing.Process
                if child.is_alive():
                    child.terminate()
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()
                    child.join(timeout=5)
        except Exception:
            pass
    _children.clear()


def _stop_spark(spark) -> None:
    """Stop the session and wait for its JVM: it exits when its stdin closes, and waiting here
    reaps it instead of leaving it to exit after us."""
    try:
        spark.stop()
    except Exception:
        pass
    try:
        from pyspark import SparkContext
        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None:
            if proc.stdin:
                proc.stdin.close()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=5)
    except Exception:
        pass


def _machine(loadavg: tuple[float, float, float]) -> dict:
    import deltalake
    import pyspark
    cores = os.cpu_count() or 1
    model, mem_kb = None, None
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                mem_kb = int(line.split()[1])
                break
    except OSError:
        pass
    return {
        "cores": cores, "memory_gb": _r(mem_kb / 1024 / 1024, 1) if mem_kb else None,
        "cpu_model": model or platform.processor(), "python": platform.python_version(),
        "pyspark": pyspark.__version__, "deltalake": deltalake.__version__,
        "pyarrow": pa.__version__, "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in loadavg],
        # Something else was using at least half the cores when we started.
        "contended": loadavg[0] >= cores / 2,
    }


def landing_table(n: int, mailboxes: pa.Array, rng: np.random.Generator,
                  size: int = ENVELOPE_SIZE) -> pa.Table:
    """`n` landing rows with random 600-byte envelopes and event ids, spread over mailboxes."""
    from delta_tables.schema import LANDING

    def fixed_binary(width: int) -> pa.Array:
        offsets = np.arange(0, (n + 1) * width, width, dtype=np.int32)
        return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets),
                                                      pa.py_buffer(rng.bytes(n * width))])

    now_us = int(time.time() * 1_000_000)
    ts = pa.timestamp("us", tz="UTC")
    received = pa.array(np.full(n, now_us, dtype=np.int64)).cast(ts)
    expires = pa.array(np.full(n, now_us + 86_400_000_000, dtype=np.int64)).cast(ts)
    cols = {
        "event_id": fixed_binary(32),
        "protocol": pa.array(["trueseal"] * n, pa.string()),
        "mailbox": mailboxes.take(pa.array(rng.integers(0, len(mailboxes), n))),
        "envelope": fixed_binary(size),
        "meta": pa.nulls(n, pa.binary()),
        "received_at": received,
        "expires_at": expires,
    }
    schema = LANDING.arrow_schema()
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)


def _mailboxes(rng: np.random.Generator, n: int = MAILBOXES) -> pa.Array:
    return pa.array([rng.bytes(32) for _ in range(n)], pa.binary())


# Every listening port the bench's relay processes might open: ephemeral (0), so a bench never
# collides with a relay (or a test) already running on this machine. Metrics port 0 = off.
_PORT_ENV = {"RELAY_TRUESEAL_PUSH_PORT": "0", "RELAY_TRUESEAL_RECEIVE_PORT": "0",
             "RELAY_HEYA_PORT": "0", "RELAY_SYNC_PORT": "0", "RELAY_PPP_PORT": "0",
             "RELAY_METRICS_PORT_INGRESS": "0",
             "RELAY_METRICS_PORT_EGRESS": "0", "RELAY_METRICS_PORT_STREAM": "0",
             "RELAY_METRICS_PORT_COMPACT": "0"}


def _settings(args, data_dir: Path) -> config.Settings:
    s = config.load(getattr(args, "conf", None), data_dir=str(data_dir))
    for section, key in (("trueseal", "push_port"), ("trueseal", "receive_port"),
                         ("heya", "port"), ("ppp", "port"), ("sync", "port"),
                         ("metrics", "ingress_port"),
                         ("metrics", "egress_port"), ("metrics", "stream_port"),
                         ("metrics", "compact_port")):
        obj = getattr(s, section, None)
        if obj is not None and hasattr(obj, key):
            setattr(obj, key, 0)
    return s


# --- 1. delta-rs append ceiling ------------------------------------------------------------------

def bench_ceiling(root: Path, p: dict) -> dict:
    from deltalake import write_deltalake

    from delta_tables.layout import ensure_table
    from delta_tables.schema import LANDING
    rng = np.random.default_rng(1)
    mailboxes = _mailboxes(rng, 1000)
    out: dict = {"method": "write_deltalake(path, table, mode='append') in a loop on a fresh "
                           "table with the landing schema/properties; no fsync, no protocol"}
    for rows, commits in p["ceiling_commits"].items():
        path = root / f"ceiling_{rows}"
        ensure_table(path, LANDING)
        table = landing_table(rows, mailboxes, rng)
        write_deltalake(str(path), table, mode="append")   # first append not timed
        times = []
        t_all = time.perf_counter()
        for _ in range(commits):
            t = time.perf_counter()
            write_deltalake(str(path), table, mode="append")
            times.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t_all
        med = statistics.median(times)
        out[f"rows_{rows // 1000}k"] = {
            "commits": commits, "commit_ms_p50": _r(med * 1000, 2),
            "commit_ms_p99": _r(_p(times, 99) * 1000, 2),
            "rows_per_s": round(rows / med), "rows_per_s_mean": round(rows * commits / elapsed)}
    best = max((v for k, v in out.items() if k.startswith("rows_")), key=lambda v: v["rows_per_s"])
    out["rows_per_s"] = best["rows_per_s"]
    return out


# --- 2. landing commit latency over many commits ----------------------------------------------

def bench_commit_latency(root: Path, args, p: dict) -> dict:
    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    settings = _settings(args, root / "commits")
    conf = settings.ingress
    target = LandingTarget(Layout(settings.data_dir), conf.node_id,
                           commits_per_generation=conf.commits_per_generation,
                           refresh_every=conf.refresh_handle_every, fsync=True)
    rng = np.random.default_rng(2)
    table = landing_table(10, _mailboxes(rng, 100), rng)
    goal, budget = p["commit_target"], p["commit_budget_s"]
    times: list[float] = []
    rotations: list[int] = []
    gen = target.generation
    t0 = time.perf_counter()
    next_report = t0 + 15
    while len(times) < goal and time.perf_counter() - t0 < budget:
        t = time.perf_counter()
        target.commit(table)
        times.append(time.perf_counter() - t)
        if target.generation != gen:
            gen = target.generation
            rotations.append(len(times) - 1)
        if t > next_report:
            next_report = t + 15
            _say(f"  {len(times)} commits, last 1k p50 "
                 f"{statistics.median(times[-1000:]) * 1000:.1f} ms")
    n = len(times)
    curve = [{"from": i, "p50_ms": _r(statistics.median(times[i:i + 1000]) * 1000, 2),
              "p99_ms": _r(_p(times[i:i + 1000], 99) * 1000, 2)}
             for i in range(0, n - n % 1000, 1000)]
    out: dict = {
        "method": "LandingTarget.commit of a 10-row table, back to back, one writer",
        "rows_per_commit": 10, "fsync": True,
        "commits_per_generation": conf.commits_per_generation,
        "refresh_handle_every": conf.refresh_handle_every,
        "commits_target": goal, "commits_measured": n,
        "stopped_by": "target" if n >= goal else f"time budget {budget}s",
        "seconds": _r(time.perf_counter() - t0, 1),
        "p50_first_1k": _r(statistics.median(times[:1000]) * 1000, 2),
        "p99_first_1k": _r(_p(times[:1000], 99) * 1000, 2),
        "p50_all": _r(statistics.median(times) * 1000, 2),
        "p50_after_100k": None,
        "generation_rotations_at": rotations,
        "curve_per_1k": curve,
        "note": ("rotation to a fresh landing generation every commits_per_generation commits "
                 "(plus delta checkpoints every 100 versions and a handle refresh every "
                 "refresh_handle_every commits) is what keeps the log, and so commit latency, "
                 "flat"),
    }
    if n >= 100_000 + 1000:
        out["p50_after_100k"] = _r(statistics.median(times[100_000:101_000]) * 1000, 2)
    elif n >= 2000:
        # The last 1k commits, named after how many commits came before them.
        last_from = n - 1000
        key = (f"p50_after_{last_from // 1000}k" if last_from % 1000 == 0
               else f"p50_after_{last_from}")
        out[key] = _r(statistics.median(times[last_from:]) * 1000, 2)
        out["p50_after_100k_note"] = (f"only {n} commits were run, so p50_after_100k is null; "
                                      f"{key} is the p50 of the last 1k commits "
                                      f"({last_from}..{n - 1})")
    else:
        out["p50_after_100k_note"] = (f"only {n} commits were run: too few for a later 1k "
                                      f"window that does not overlap the first")
    return out


# --- 3. trueseal ingress throughput -------------------------------------------------------------

def _spawn(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    _children.append(proc)
    return proc


async def _gather_workers(queue, procs, timeout: float) -> list[dict]:
    results = []
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("load generator did not report in time")
        try:
            results.append(await asyncio.to_thread(queue.get, True, min(1.0, left)))
        except Exception:   # queue.Empty
            if not any(p.is_alive() for p in procs) and queue.empty():
                raise RuntimeError("load generator processes died without a result")
    for r in results:
        if not r.get("ok"):
            raise RuntimeError(f"load generator failed: {r.get('error')}")
    return results


async def _ingress_shape(node, shape: str, p: dict, clients: int) -> dict:
    from . import bench_client as bc
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    port, pub = node.trueseal.bound_port, node.key.public
    duration, warm = p["ingress_seconds"] + p["ingress_warmup_s"], p["ingress_warmup_s"]
    procs = []
    for i in range(clients):
        if shape == "per_connection":
            procs.append(_spawn(bc.per_connection_worker, queue, go, "127.0.0.1", port, pub,
                                duration, PER_CONNECTION_CONCURRENCY, ENVELOPE_SIZE, MAILBOXES,
                                i + 1))
        else:
            procs.append(_spawn(bc.pipelined_worker, queue, go, "127.0.0.1", port, pub, duration,
                                PIPELINED_SESSIONS // clients, PIPELINED_WINDOW, ENVELOPE_SIZE,
                                MAILBOXES, i + 1))
    # Each worker says "ready" (imports done, pipelined sessions open), then waits for `go`.
    ready = 0
    deadline = time.monotonic() + 60
    while ready < clients:
        msg = await asyncio.to_thread(queue.get, True, max(0.1, deadline - time.monotonic()))
        if not msg.get("ok", True):
            raise RuntimeError(f"load generator failed: {msg.get('error')}")
        ready += 1
    ap = node.appender
    go.set()
    await asyncio.sleep(warm)
    c0, r0, cpu0, t0 = ap.commits, ap.rows_committed, time.process_time(), time.perf_counter()
    await asyncio.sleep(duration - warm)
    c1, r1, cpu1, t1 = ap.commits, ap.rows_committed, time.process_time(), time.perf_counter()
    commit_s = list(ap.commit_seconds)[-(c1 - c0):] if c1 > c0 else []
    results = await _gather_workers(queue, procs, timeout=120)
    for proc in procs:
        proc.join(timeout=10)
    # Per-second rates over the measured window, summed over the client processes.
    buckets = np.sum([r["buckets"] for r in results], axis=0)
    per_s = [int(buckets[i:i + 10].sum()) for i in range(warm * 10, duration * 10 - 9, 10)]
    window = t1 - t0
    out = {
        "client_processes": clients,
        "acked_per_s": round((r1 - r0) / window),
        "acked_per_s_median_1s": int(statistics.median(per_s)) if per_s else None,
        "acked_per_s_each_1s": per_s,
        "measured_seconds": _r(window, 2), "warmup_seconds": warm,
        "acked_total": int(sum(r["acked"] for r in results)),
        "errors": int(sum(r["errors"] for r in results)),
        "failures": sorted({f for r in results for f in r.get("failures", [])}),
        "group_commits_in_window": c1 - c0,
        "rows_per_commit_mean": _r((r1 - r0) / max(1, c1 - c0), 1),
        "commit_ms_p50": _r((_p(commit_s, 50) or 0) * 1000, 1),
        "relay_cpu_cores": _r((cpu1 - cpu0) / window, 2),
        "relay_cpu_us_per_push": _r((cpu1 - cpu0) / max(1, r1 - r0) * 1e6, 1),
        # Derived, not measured: what one fully available core would ack at that CPU cost.
        "relay_cpu_bound_per_core_derived": round((r1 - r0) / max(1e-9, cpu1 - cpu0)),
        "client_cpu_cores": _r(sum(r["cpu_s"] for r in results) / duration, 2),
    }
    if shape == "per_connection":
        lat = [x for r in results for x in r["latency_s"]]
        out.update({"concurrency_per_client": PER_CONNECTION_CONCURRENCY,
                    "push_to_ack_ms_p50": _r(_p(lat, 50) * 1000 if lat else None, 1),
                    "push_to_ack_ms_p99": _r(_p(lat, 99) * 1000 if lat else None, 1)})
    else:
        out.update({"sessions": PIPELINED_SESSIONS // clients * clients,
                    "window_per_session": PIPELINED_WINDOW})
    return out


async def _ingress_async(settings, p: dict, clients: int, stopped: list) -> dict:
    from ingress.service import IngressNode
    loop, task = asyncio.get_running_loop(), asyncio.current_task()

    def stop() -> None:       # Ctrl-C / SIGTERM: end cleanly (node closed), then report it
        stopped.append(True)
        task.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    node = IngressNode(settings)   # fsync=True: Ack = durable
    await node.start()
    try:
        out = {}
        for shape in ("per_connection", "pipelined"):
            _say(f"  ingress: {shape}, {clients} client process(es), "
                 f"{p['ingress_seconds']} s measured")
            out[shape] = await _ingress_shape(node, shape, p, clients)
            _say(f"    -> {out[shape]['acked_per_s']} acked pushes/s "
                 f"(relay {out[shape]['relay_cpu_cores']} cores, "
                 f"clients {out[shape]['client_cpu_cores']} cores)")
        return out
    finally:
        await node.close()


def bench_ingress(root: Path, args, p: dict) -> dict:
    settings = _settings(args, root / "ingress")
    clients = max(1, (os.cpu_count() or 2) - 1)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopped: list = []
    try:
        out = asyncio.run(_ingress_async(settings, p, clients, stopped))
    except asyncio.CancelledError:
        if stopped:
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stopped:
        raise KeyboardInterrupt
    best = max(("per_connection", "pipelined"), key=lambda k: out[k]["acked_per_s"])
    out.update({
        "headline_shape": best, "acked_per_s": out[best]["acked_per_s"],
        "fsync": True, "envelope_bytes": ENVELOPE_SIZE, "mailboxes": MAILBOXES,
        "max_rows_per_commit": settings.ingress.max_rows_per_commit,
        "method": ("IngressNode in the bench process (asyncio, one event loop), real NK "
                   "handshakes over loopback, group commit with fsync; load from spawned "
                   "client processes; Acks counted by the clients, rate = rows committed in "
                   "the window / window"),
    })
    return out


# --- 4. stream throughput ------------------------------------------------------------------------

def _prefill(settings, rows: int, per_commit: int, seed: int) -> None:
    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    rng = np.random.default_rng(seed)
    mailboxes = _mailboxes(rng)
    target = LandingTarget(Layout(settings.data_dir), settings.ingress.node_id,
                           commits_per_generation=settings.ingress.commits_per_generation,
                           fsync=False)
    for i in range(0, rows, per_commit):
        target.commit(landing_table(min(per_commit, rows - i), mailboxes, rng))


def _run_available_now(spark, settings) -> dict:
    from deltalake import DeltaTable

    from jobs.inbox_stream import start_inbox_stream
    t0 = time.perf_counter()
    query, sink = start_inbox_stream(spark, settings, available_now=True)
    while not query.awaitTermination(0.5):   # a timeout keeps Ctrl-C responsive
        pass
    elapsed = time.perf_counter() - t0
    if query.exception():
        raise RuntimeError(f"stream failed: {query.exception()}")
    batches = [h for h in sink.history if h.rows_in]
    inbox_rows = DeltaTable(str(Path(settings.data_dir) / "tables" / "inbox")) \
        .to_pyarrow_dataset().count_rows()
    progress = [dict(x) for x in query.recentProgress]
    return {"elapsed": elapsed, "batches": batches, "inbox_rows": inbox_rows,
            "progress": progress, "rows_in": sum(h.rows_in for h in batches),
            "accepted": sum(h.accepted for h in batches)}


def bench_stream(spark, root: Path, args, p: dict) -> dict:
    commit_rows, batch_rows = p["stream_commit_rows"], p["stream_batch_rows"]
    rows = p["stream_rows"]
    # Warm-up: a small query of its own, so the first Python workers and the first job's
    # planning (one-off costs of a SparkSession, like its start) are not in the figure.
    warm = _settings(args, root / "stream_warmup")
    _prefill(warm, 2000, 1000, seed=3)
    t = time.perf_counter()
    _run_available_now(spark, warm)
    warm_s = time.perf_counter() - t

    settings = _settings(args, root / "stream")
    settings.stream.max_files_per_trigger = max(1, batch_rows // commit_rows)
    t = time.perf_counter()
    _prefill(settings, rows, commit_rows, seed=4)
    prefill_s = time.perf_counter() - t
    _say(f"  stream: {rows} rows pre-filled in {prefill_s:.1f} s; running availableNow")
    r = _run_available_now(spark, settings)
    per_batch = [b.rows_in / b.seconds for b in r["batches"] if b.seconds > 0]
    trig = [pr.get("durationMs", {}).get("triggerExecution") for pr in r["progress"]]
    trig = [x for x in trig if x]
    return {
        "envelopes_per_s": round(r["rows_in"] / r["elapsed"]),
        "rows": rows, "rows_in": r["rows_in"], "accepted": r["accepted"],
        "inbox_rows": r["inbox_rows"], "seconds": _r(r["elapsed"], 2),
        "batches": len(r["batches"]),
        "rows_per_batch": batch_rows, "landing_commit_rows": commit_rows,
        "max_files_per_trigger": settings.stream.max_files_per_trigger,
        "batch_rows_per_s_median": round(statistics.median(per_batch)) if per_batch else None,
        "batch_seconds": [_r(b.seconds, 3) for b in r["batches"]],
        "trigger_execution_ms": trig,
        "envelope_bytes": ENVELOPE_SIZE, "mailboxes": MAILBOXES,
        "spark_master": settings.stream.master, "sink_fsync": True,
        "warmup_query_seconds": _r(warm_s, 2), "prefill_seconds": _r(prefill_s, 2),
        "method": ("landing pre-filled with LandingTarget commits; start_inbox_stream("
                   "available_now=True) in this process; timed from query start to "
                   "termination (SparkSession start and a 2k-row warm-up query excluded); "
                   "per batch: rows / foreachBatch seconds (read + transform + 3 commits)"),
    }


# --- 5. push -> deliver latency through the whole pipeline --------------------------------------

def write_conf(settings: config.Settings, path: Path) -> Path:
    """`settings` as a TOML file for a child `relay` role (`_start_role(conf=path)`): the
    bench's effective settings with a section's overrides (a lifted limit, a 0 ms window)."""
    def val(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        raise TypeError(f"no TOML form for {type(v).__name__}")

    lines: list[str] = []

    def table(name: str, d: dict) -> None:
        if name:
            lines.append(f"[{name}]")
        lines.extend(f"{json.dumps(k)} = {val(v)}" for k, v in d.items()
                     if not isinstance(v, dict))
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{name}.{json.dumps(k)}" if name else json.dumps(k), v)
    table("", config.as_dict(settings))
    path.write_text("\n".join(lines) + "\n")
    return path


def _start_role(role: str, args, data_dir: Path, log_dir: Path,
                conf: Path | None = None) -> tuple[subprocess.Popen, dict]:
    """`relay <role>` as a child process; `conf` (else `args.conf`) is its settings file."""
    argv = [sys.executable, "-m", "relay.cli"]
    if conf or getattr(args, "conf", None):
        argv += ["--conf", str(conf or args.conf)]
    argv += ["--data-dir", str(data_dir), role]
    env = dict(os.environ, **_PORT_ENV)
    log = open(log_dir / f"{role}.log", "w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)   # our Ctrl-C is handled by us, not them
    _children.append(proc)
    box: dict = {}
    done = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("ready") == role:
                box.update(msg)
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(90) or not box:
        raise RuntimeError(f"relay {role} did not start (see {log_dir / (role + '.log')})")
    return proc, box["listening"]


def _wait_result(queue, proc, timeout: float) -> dict:
    import queue as queue_mod
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if not proc.is_alive() and queue.empty():
                raise RuntimeError(f"client process exited ({proc.exitcode}) without a result")
    raise TimeoutError("client process did not report in time")


def _e2e_breakdown(inbox_path: Path, records: list) -> dict:
    """Where the time goes, per envelope, from the inbox rows and the inbox log:
    push -> Ack (client), Ack -> the micro-batch that took it started (`committed_at` is the
    batch timestamp), batch start -> inbox commit (commitInfo.timestamp of the version carrying
    the batch's transaction marker), inbox commit -> Deliver at the client (egress)."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from . import bench_client as bc
    t = DeltaTable(str(inbox_path)).to_pyarrow_table(
        columns=["envelope", "committed_at", "batch_id"])
    start_ns = pc.cast(t.column("committed_at"), pa.int64()).to_pylist()
    batch_of, started = {}, {}
    for env, st, b in zip(t.column("envelope").to_pylist(), start_ns,
                          t.column("batch_id").to_pylist()):
        stamp = bc.read_stamp(env) if env else None
        if stamp is not None:
            batch_of[stamp[0]] = b
            started[stamp[0]] = st * 1000
    commit_ns = {}
    for f in sorted((inbox_path / "_delta_log").glob("*.json")):
        txn, ts = None, None
        for line in f.read_text().splitlines():
            a = json.loads(line)
            if "txn" in a:
                txn = a["txn"].get("version")
            if "commitInfo" in a:
                ts = a["commitInfo"].get("timestamp")
        if txn is not None and ts is not None:
            commit_ns[txn] = ts * 1_000_000
    stages: dict[str, list[float]] = {"push_to_ack": [], "ack_to_batch_start": [],
                                       "batch_start_to_inbox_commit": [],
                                       "inbox_commit_to_deliver": []}
    for seq, push, ack, deliver in records:
        if ack is None or deliver is None or seq not in batch_of:
            continue
        committed = commit_ns.get(batch_of[seq])
        if committed is None:
            continue
        stages["push_to_ack"].append((ack - push) / 1e6)
        stages["ack_to_batch_start"].append((started[seq] - ack) / 1e6)
        stages["batch_start_to_inbox_commit"].append((committed - started[seq]) / 1e6)
        stages["inbox_commit_to_deliver"].append((deliver - committed) / 1e6)
    return {k: {"p50": _r(_p(v, 50)), "p99": _r(_p(v, 99))} for k, v in stages.items()} | {
        "note": "ms per envelope; clocks are one machine's; inbox commit time has ms precision"}


def bench_e2e(spark, root: Path, args, p: dict) -> dict:
    from delta_tables.layout import Layout
    from jobs.inbox_stream import start_inbox_stream
    from runtime import keys

    from . import bench_client as bc
    data_dir = root / "e2e"
    settings = _settings(args, data_dir)
    Layout(settings.data_dir).ensure_shared_tables()
    relay_pub = keys.load_or_create(settings.data_dir).public
    ingress, ing = _start_role("ingress", args, data_dir, root)
    egress, eg = _start_role("egress", args, data_dir, root)
    push_port = int(ing["trueseal_push"].rsplit(":", 1)[1])
    recv_port = int(eg["trueseal_receive"].rsplit(":", 1)[1])
    query, sink = start_inbox_stream(spark, settings)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        rate, seconds = p["e2e_rate"], p["e2e_seconds"]
        _say(f"  push->deliver: {rate}/s for {seconds} s, {p['e2e_receivers']} receive sessions")
        proc = _spawn(bc.e2e_worker, queue, "127.0.0.1", push_port, recv_port, relay_pub, rate,
                      seconds, ENVELOPE_SIZE, p["e2e_receivers"], 7, 30.0)
        res = _wait_result(queue, proc, seconds + 180)
        proc.join(timeout=10)
        if not res.get("ok"):
            raise RuntimeError(f"e2e client failed: {res.get('error')}")
        if query.exception():
            raise RuntimeError(f"stream failed: {query.exception()}")
        batches = [h for h in sink.history if h.rows_in]
        lat = res["latency_ms"]
        trig = [pr.get("durationMs", {}).get("triggerExecution")
                for pr in (dict(x) for x in query.recentProgress)]
        trig = [x for x in trig if x]
        try:
            breakdown = _e2e_breakdown(Path(settings.data_dir) / "tables" / "inbox",
                                       res["records"])
        except Exception as exc:
            breakdown = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "p50": _r(_p(lat, 50)), "p90": _r(_p(lat, 90)), "p99": _r(_p(lat, 99)),
            "max": _r(max(lat) if lat else None),
            "count": len(lat), "pushed": res["pushed"], "acked": res["acked"],
            "push_errors": res["push_errors"], "not_delivered": res["acked"] - len(lat),
            "duplicates_seen": res["duplicates"], "failures": res["failures"],
            "warmup_pushes_excluded": res["warmup"],
            "rate_per_s": rate, "seconds": seconds, "send_seconds": _r(res["send_seconds"], 2),
            "receive_sessions": p["e2e_receivers"],
            "push_to_ack_ms_p50": _r(_p(res["ack_latency_ms"], 50)),
            "push_to_ack_ms_p99": _r(_p(res["ack_latency_ms"], 99)),
            "trigger_interval_ms": settings.stream.trigger_interval_ms,
            "egress_poll_interval_ms": settings.egress.poll_interval_ms,
            "stream_batches": len(batches),
            "stream_batch_ms_p50": _r(_p([b.seconds * 1000 for b in batches], 50)),
            "stream_batch_rows_p50": _r(_p([b.rows_in for b in batches], 50)),
            "stream_trigger_execution_ms_p50": _r(_p(trig, 50)),
            "stages_ms": breakdown,
            "method": ("relay ingress and relay egress as child processes (fsync on), the inbox "
                       "stream in this process (processingTime trigger), one spawned client "
                       "process: one NK connection per push at a fixed open-loop rate, XX "
                       "receive sessions that DeliverAck each Deliver; latency = Deliver "
                       "arrival - time written into the envelope just before the Push"),
        }
    finally:
        try:
            query.stop()
        except Exception:
            pass
        for child in (egress, ingress):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in (egress, ingress):
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


# --- driver ---------------------------------------------------------------------------------

def _summary(res: dict) -> str:
    def g(*path):
        x = res
        for k in path:
            try:
                x = x[k]
            except (KeyError, IndexError, TypeError):
                return None
        return x
    busy = (f" [contended: load average {g('machine', 'loadavg_at_start', 0)} at start]"
            if g("machine", "contended") else "")
    lines = [f"relay bench ({res['mode']}) on {g('machine', 'cores')} cores{busy}"]
    lines.append(f"  trueseal acked pushes/s : {res.get('trueseal_acked_pushes_per_s')} "
                 f"(per_connection {g('trueseal', 'per_connection', 'acked_per_s')}, "
                 f"pipelined {g('trueseal', 'pipelined', 'acked_per_s')}; fsync on; relay CPU "
                 f"{g('trueseal', 'pipelined', 'relay_cpu_us_per_push')} us/push pipelined, "
                 f"{g('trueseal', 'per_connection', 'relay_cpu_us_per_push')} us/connection)")
    lc = res.get("landing_commit_ms") or {}
    after = {k: v for k, v in lc.items() if k.startswith("p50_after_") and not k.endswith("note")
             and v is not None}
    lines.append(f"  landing commit p50 ms   : first 1k {lc.get('p50_first_1k')}, "
                 + ", ".join(f"{k[4:]} {v}" for k, v in after.items())
                 + f" ({lc.get('commits_measured')} commits)")
    lines.append(f"  delta append ceiling    : {res.get('delta_append_ceiling_rows_per_s')} rows/s "
                 f"(1k rows/commit {g('delta_append_ceiling', 'rows_1k', 'rows_per_s')}, "
                 f"10k {g('delta_append_ceiling', 'rows_10k', 'rows_per_s')})")
    lines.append(f"  stream envelopes/s      : {res.get('stream_envelopes_per_s')} "
                 f"({g('stream', 'rows_in')} rows, {g('stream', 'batches')} batches, "
                 f"per-batch median {g('stream', 'batch_rows_per_s_median')})")
    pd = res.get("push_to_deliver_ms") or {}
    lines.append(f"  push->deliver ms        : p50 {pd.get('p50')}, p99 {pd.get('p99')} "
                 f"(n={pd.get('count')}, {pd.get('rate_per_s')}/s, trigger "
                 f"{pd.get('trigger_interval_ms')} ms, poll "
                 f"{pd.get('egress_poll_interval_ms')} ms)")
    hh = res.get("heya_send_to_have_ms") or {}
    lines.append(f"  heya sends/s            : {res.get('heya_sends_per_s')} "
                 f"(fsync on; {g('heya', 'throughput', 'connections')} TLS connections); "
                 f"send->HAVE ms p50 {hh.get('p50')}, p99 {hh.get('p99')}")
    pn = res.get("ppp_store_to_notify_ms") or {}
    lines.append(f"  ppp acked stores/s      : {res.get('ppp_acked_stores_per_s')} "
                 f"(fsync on; {g('ppp', 'throughput', 'sockets')} WebSockets); store->NOTIFY "
                 f"ms p50 {pn.get('p50')}, p99 {pn.get('p99')} (notify window "
                 f"{pn.get('notify_window_ms')} ms)")
    sn = res.get("sync_push_to_notify_ms") or {}
    lines.append(f"  sync pushes/s           : {res.get('sync_pushes_per_s')} "
                 f"(each PUSH_ACK waits for its inbox commit); push->NOTIFY ms "
                 f"p50 {sn.get('p50')}, p99 {sn.get('p99')}")
    lines.append(f"  ratios                  : trueseal/ceiling "
                 f"{res.get('trueseal_vs_ceiling_ratio')}, "
                 f"stream/ceiling {res.get('stream_vs_ceiling_ratio')}")
    for name, err in (res.get("errors") or {}).items():
        lines.append(f"  FAILED {name}: {err}")
    return "\n".join(lines)


def main(args) -> int:
    quick = bool(getattr(args, "quick", False))
    p = QUICK if quick else FULL
    out_path = Path(getattr(args, "out", None) or "bench-results.json")
    if getattr(args, "data_dir", None):
        root = Path(args.data_dir).resolve() / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
        root.mkdir(parents=True)
        keep = True
    else:
        root = Path(tempfile.mkdtemp(prefix="relay-bench-"))
        keep = False

    def on_term(*_):
        raise KeyboardInterrupt
    old_term = signal.signal(signal.SIGTERM, on_term)

    started = time.time()
    res: dict = {"mode": "quick" if quick else "full",
                 "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": _machine(os.getloadavg()), "data_dir": str(root)}
    base = _settings(args, root / "unused")
    res["settings_used"] = {
        "fsync": True, "envelope_bytes": ENVELOPE_SIZE,
        "ingress.max_rows_per_commit": base.ingress.max_rows_per_commit,
        "ingress.commits_per_generation": base.ingress.commits_per_generation,
        "ingress.refresh_handle_every": base.ingress.refresh_handle_every,
        "stream.trigger_interval_ms": base.stream.trigger_interval_ms,
        "stream.max_files_per_trigger": base.stream.max_files_per_trigger,
        "stream.max_partitions": base.stream.max_partitions,
        "stream.master": base.stream.master,
        "egress.poll_interval_ms": base.egress.poll_interval_ms,
        "trueseal.max_connections": base.trueseal.max_connections,
        "sizes": {k: (v if not isinstance(v, dict) else {str(a): b for a, b in v.items()})
                  for k, v in p.items()},
        "conf_file": getattr(args, "conf", None) or (str(config.default_conf_file())
                                                    if config.default_conf_file() else None),
    }
    if res["machine"]["contended"]:
        _say(f"note: load average {res['machine']['loadavg_at_start'][0]} on "
             f"{res['machine']['cores']} cores at start: figures are contended")
    errors: dict[str, str] = {}
    spark = None
    interrupted = False

    def section(name: str, fn, *a):
        _say(f"{name} ...")
        t = time.perf_counter()
        try:
            val = fn(*a)
            _say(f"{name} done in {time.perf_counter() - t:.1f} s")
            return val
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            _stop_children()
            return None

    try:
        res["delta_append_ceiling"] = section("delta append ceiling", bench_ceiling, root, p)
        res["landing_commit_ms"] = section("landing commit latency", bench_commit_latency,
                                           root, args, p)
        res["trueseal"] = section("trueseal ingress", bench_ingress, root, args, p)

        def start_spark():
            from jobs.spark_session import get_spark
            t = time.perf_counter()
            s = get_spark(base.stream.master, "relay-bench",
                          extra={"spark.ui.showConsoleProgress": "false"})
            s.sparkContext.setLogLevel("ERROR")
            res["spark_start_seconds"] = _r(time.perf_counter() - t, 1)
            return s
        spark = section("spark start", start_spark)
        if spark is not None:
            res["stream"] = section("stream throughput", bench_stream, spark, root, args, p)
            res["push_to_deliver_ms"] = section("push to deliver", bench_e2e, spark, root,
                                                args, p)
        # relay/bench_heya.py: sends/s without Spark; send->HAVE needs the stream (spark).
        from . import bench_heya
        res["heya"] = section("heya", bench_heya.run, _settings(args, root / "heya"), quick,
                              spark)
        from . import bench_ppp   # stores/s without Spark; store->NOTIFY needs the stream
        res["ppp"] = section("ppp", bench_ppp.run, _settings(args, root / "ppp"), quick, spark)
        from . import bench_sync  # PUSH_ACK waits for the inbox commit: needs the stream
        res["sync"] = section("sync", bench_sync.run, _settings(args, root / "sync"), quick, spark)
    except KeyboardInterrupt:
        interrupted = True
        _say("interrupted; stopping child processes")
    finally:
        _stop_children()
        if spark is not None:
            _stop_spark(spark)
        signal.signal(signal.SIGTERM, old_term)

    ceiling = (res.get("delta_append_ceiling") or {}).get("rows_per_s")
    ts = res.get("trueseal") or {}
    st = res.get("stream") or {}
    res["trueseal_acked_pushes_per_s"] = ts.get("acked_per_s")
    if ts:
        res["trueseal_headline_shape"] = ts.get("headline_shape")
        res["trueseal_acked_pushes_per_s_by_shape"] = {
            k: (ts.get(k) or {}).get("acked_per_s") for k in ("per_connection", "pipelined")}
    res["stream_envelopes_per_s"] = st.get("envelopes_per_s")
    res["heya_sends_per_s"] = (res.get("heya") or {}).get("heya_sends_per_s")
    res["heya_send_to_have_ms"] = (res.get("heya") or {}).get("heya_send_to_have_ms")
    res["ppp_acked_stores_per_s"] = (res.get("ppp") or {}).get("ppp_acked_stores_per_s")
    res["ppp_store_to_notify_ms"] = (res.get("ppp") or {}).get("ppp_store_to_notify_ms")
    res["sync_pushes_per_s"] = (res.get("sync") or {}).get("sync_pushes_per_s")
    res["sync_push_to_notify_ms"] = (res.get("sync") or {}).get("sync_push_to_notify_ms")
    res["delta_append_ceiling_rows_per_s"] = ceiling
    if ceiling and ts.get("acked_per_s"):
        res["trueseal_vs_ceiling_ratio"] = round(ts["acked_per_s"] / ceiling, 3)
    if ceiling and st.get("envelopes_per_s"):
        res["stream_vs_ceiling_ratio"] = round(st["envelopes_per_s"] / ceiling, 3)
    if ts.get("per_connection") and ts.get("pipelined"):
        res["per_connection_vs_pipelined_ratio"] = round(
            ts["per_connection"]["acked_per_s"] / max(1, ts["pipelined"]["acked_per_s"]), 3)
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["total_seconds"] = _r(time.time() - started, 1)
    if errors:
        res["errors"] = errors
    if interrupted:
        res["interrupted"] = True
    # Headline fields first, then the details.
    head = ["mode", "trueseal_acked_pushes_per_s", "heya_sends_per_s", "heya_send_to_have_ms",
            "ppp_acked_stores_per_s", "ppp_store_to_notify_ms",
            "trueseal_headline_shape",
            "trueseal_acked_pushes_per_s_by_shape", "push_to_deliver_ms", "stream_envelopes_per_s",
            "landing_commit_ms", "delta_append_ceiling_rows_per_s", "trueseal_vs_ceiling_ratio",
            "stream_vs_ceiling_ratio", "per_connection_vs_pipelined_ratio", "machine",
            "settings_used"]
    ordered = {k: res[k] for k in head if k in res}
    ordered.update({k: v for k, v in res.items() if k not in ordered})
    out_path.write_text(json.dumps(ordered, indent=2, default=str) + "\n")
    print(_summary(ordered), flush=True)
    print(f"bench: results in {out_path}", flush=True)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return 130 if interrupted else (1 if errors else 0)
