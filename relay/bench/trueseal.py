"""trueseal sections of `relay bench`: `trueseal_acked_pushes_per_s` and `push_to_deliver_ms`.

3. `trueseal_acked_pushes_per_s` (`bench_ingress`): `IngressNode` in this process, its
   collector as a role runs it (`harness.serving`); load from
   `spawn`ed client processes (`trueseal_client.py`), two shapes: one NK connection per push
   (the real client) and pipelined push sessions.
5. `push_to_deliver_ms` (`bench_e2e`): `relay ingress` and `relay egress` as child processes
   (as `relay up` runs them), the inbox stream in this process, a client process pushing at a
   steady rate to receive sessions that timestamp each Deliver.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import pyarrow as pa

from runtime.metrics import batch_work_ms

from .harness import (ENVELOPE_SIZE, MAILBOXES, gather_workers, join_all, measure_appender,
                      p50_p99, per_second, percentile, rounded, say, serving, settings_for,
                      spawn, start_role, wait_result)

PER_CONNECTION_CONCURRENCY = 128    # in-flight one-push connections per client process
PIPELINED_SESSIONS = 256            # push sessions, split over the client processes
PIPELINED_WINDOW = 32               # Pushes sent ahead of their Acks, per session


# --- 3. trueseal ingress throughput -------------------------------------------------------------

async def _ingress_shape(node, shape: str, p: dict, clients: int, host: str = "127.0.0.1",
                         netns: str | None = None) -> dict:
    """One load shape against `node`; `netns`: the client processes run in that network
    namespace (trueseal_netns.py), reaching the relay at `host` over a veth pair."""
    from . import trueseal_client as bc
    from .netns import in_netns
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    port, pub = node.trueseal.bound_port, node.key.public
    duration, warm = p["ingress_seconds"] + p["ingress_warmup_s"], p["ingress_warmup_s"]
    procs = []
    for i in range(clients):
        if shape == "per_connection":
            procs.append(spawn(in_netns, netns, bc.per_connection_worker, queue, go, host, port,
                               pub, duration, PER_CONNECTION_CONCURRENCY, ENVELOPE_SIZE,
                               MAILBOXES, i + 1))
        else:
            procs.append(spawn(bc.pipelined_worker, queue, go, "127.0.0.1", port, pub, duration,
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
    w = await measure_appender(node.appender, go, warm, duration)
    results = await gather_workers(queue, procs, timeout=120)
    await join_all(procs, 10)   # off the loop: the node serves the clients' closes
    per_s = per_second(results, warm, duration)
    out = {
        "client_processes": clients,
        "acked_per_s": round(w.rows / w.seconds),
        "acked_per_s_median_1s": int(statistics.median(per_s)) if per_s else None,
        "acked_per_s_each_1s": per_s,
        **w.figures(), "warmup_seconds": warm,
        "acked_total": int(sum(r["acked"] for r in results)),
        "errors": int(sum(r["errors"] for r in results)),
        "failures": sorted({f for r in results for f in r.get("failures", [])}),
        "commit_ms_p50": rounded((percentile(w.commit_seconds, 50) or 0) * 1000, 1),
        "relay_cpu_us_per_push": rounded(w.cpu_seconds / max(1, w.rows) * 1e6, 1),
        # Derived, not measured: what one fully available core would ack at that CPU cost.
        "relay_cpu_bound_per_core_derived": round(w.rows / max(1e-9, w.cpu_seconds)),
        "client_cpu_cores": rounded(sum(r["cpu_s"] for r in results) / duration, 2),
    }
    if shape == "per_connection":
        lat = [x for r in results for x in r["latency_s"]]
        out.update({"concurrency_per_client": PER_CONNECTION_CONCURRENCY,
                    "push_to_ack_ms_p50": rounded(percentile(lat, 50) * 1000 if lat else None, 1),
                    "push_to_ack_ms_p99": rounded(percentile(lat, 99) * 1000 if lat else None, 1)})
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
    async with serving(IngressNode(settings)) as node:   # fsync=True: Ack = durable
        out = {}
        for shape in ("per_connection", "pipelined"):
            say(f"  ingress: {shape}, {clients} client process(es), "
                 f"{p['ingress_seconds']} s measured")
            out[shape] = await _ingress_shape(node, shape, p, clients)
            say(f"    -> {out[shape]['acked_per_s']} acked pushes/s "
                 f"(relay {out[shape]['relay_cpu_cores']} cores, its listener's thread "
                 f"{out[shape]['listener_thread_busy']}, "
                 f"clients {out[shape]['client_cpu_cores']} cores)")
        return out


def bench_ingress(root: Path, args, p: dict) -> dict:
    settings = settings_for(args, root / "ingress")
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


# --- 5. push -> deliver latency through the whole pipeline --------------------------------------

def _e2e_breakdown(inbox_path: Path, records: list) -> dict:
    """Where the time goes, per envelope, from the inbox rows and the inbox log:
    push -> Ack (client), Ack -> the micro-batch that took it started (`committed_at` is the
    batch timestamp), batch start -> inbox commit (commitInfo.timestamp of the version carrying
    the batch's transaction marker), inbox commit -> Deliver at the client (egress)."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable

    from delta_tables import query

    from . import trueseal_client as bc
    t = query.read(DeltaTable(str(inbox_path)), ["envelope", "committed_at", "batch_id"])
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
    stages: dict[str, list[float]] = {"push_to_ack": [], "ack_to_deliver": [],
                                       "ack_to_batch_start": [],
                                       "batch_start_to_inbox_commit": [],
                                       "inbox_commit_to_deliver": []}
    for seq, push, ack, deliver in records:
        if ack is None or deliver is None:
            continue
        # the live path (issue 20): a Deliver may come before the batch (negative below)
        stages["ack_to_deliver"].append((deliver - ack) / 1e6)
        if seq not in batch_of:
            continue
        committed = commit_ns.get(batch_of[seq])
        if committed is None:
            continue
        stages["push_to_ack"].append((ack - push) / 1e6)
        stages["ack_to_batch_start"].append((started[seq] - ack) / 1e6)
        stages["batch_start_to_inbox_commit"].append((committed - started[seq]) / 1e6)
        stages["inbox_commit_to_deliver"].append((deliver - committed) / 1e6)
    return {k: p50_p99(v) for k, v in stages.items()} | {
        "note": "ms per envelope; clocks are one machine's; inbox commit time has ms precision"}


def bench_e2e(spark, root: Path, args, p: dict) -> dict:
    from delta_tables.layout import Layout
    from jobs.inbox_stream import start_inbox_stream
    from runtime import keys

    from . import trueseal_client as bc
    data_dir = root / "e2e"
    settings = settings_for(args, data_dir)
    Layout.of(settings).ensure_shared_tables()
    relay_pub = keys.load_or_create(settings.data_dir).public
    ingress, ing = start_role("ingress", args, data_dir, root)
    egress, eg = start_role("egress", args, data_dir, root)
    push_port = int(ing["trueseal_push"].rsplit(":", 1)[1])
    recv_port = int(eg["trueseal_receive"].rsplit(":", 1)[1])
    query, sink = start_inbox_stream(spark, settings)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        rate, seconds = p["e2e_rate"], p["e2e_seconds"]
        say(f"  push->deliver: {rate}/s for {seconds} s, {p['e2e_receivers']} receive sessions")
        proc = spawn(bc.e2e_worker, queue, "127.0.0.1", push_port, recv_port, relay_pub, rate,
                      seconds, ENVELOPE_SIZE, p["e2e_receivers"], 7, 30.0)
        res = wait_result(queue, proc, seconds + 180)
        proc.join(timeout=10)
        if not res.get("ok"):
            raise RuntimeError(f"e2e client failed: {res.get('error')}")
        if query.exception():
            raise RuntimeError(f"stream failed: {query.exception()}")
        batches = [h for h in sink.history if h.rows_in]
        lat = res["latency_ms"]
        trig = [batch_work_ms(pr.get("durationMs"))
                for pr in (dict(x) for x in query.recentProgress)]
        trig = [x for x in trig if x]
        try:
            breakdown = _e2e_breakdown(Path(settings.data_dir) / "tables" / "inbox",
                                       res["records"])
        except Exception as exc:
            breakdown = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "p50": rounded(percentile(lat, 50)), "p90": rounded(percentile(lat, 90)),
            "p99": rounded(percentile(lat, 99)),
            "max": rounded(max(lat) if lat else None),
            "count": len(lat), "pushed": res["pushed"], "acked": res["acked"],
            "push_errors": res["push_errors"], "not_delivered": res["acked"] - len(lat),
            "duplicates_seen": res["duplicates"], "failures": res["failures"],
            "warmup_pushes_excluded": res["warmup"],
            "rate_per_s": rate, "seconds": seconds, "send_seconds": rounded(res["send_seconds"], 2),
            "receive_sessions": p["e2e_receivers"],
            "push_to_ack_ms_p50": rounded(percentile(res["ack_latency_ms"], 50)),
            "push_to_ack_ms_p99": rounded(percentile(res["ack_latency_ms"], 99)),
            "trigger_interval_ms": settings.stream.trigger_interval_ms,
            "egress_poll_interval_ms": settings.egress.poll_interval_ms,
            "stream_batches": len(batches),
            "stream_batch_ms_p50": rounded(percentile([b.seconds * 1000 for b in batches], 50)),
            "stream_batch_rows_p50": rounded(percentile([b.rows_in for b in batches], 50)),
            "stream_trigger_execution_ms_p50": rounded(percentile(trig, 50)),  # less the wait
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
