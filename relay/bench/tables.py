"""`relay bench` without a protocol: what delta-rs and the stream do on this machine.

1. `delta_append_ceiling_rows_per_s` (`bench_ceiling`): raw `write_deltalake(path, table,
   mode="append")` of pre-built Arrow tables (1k and 10k landing rows), no protocol work, no
   fsync.
2. `landing_commit_ms` (`bench_commit_latency`): `LandingTarget.commit` of 10-row tables back
   to back, as configured (fsync, `commits_per_generation`): p50 over the first 1k commits,
   over the last 1k, and per 1k window.
4. `stream_envelopes_per_s` (`bench_stream`): landing pre-filled with big commits, the inbox
   stream run with `availableNow` (SparkSession start and a small warm-up query excluded).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from .harness import ENVELOPE_SIZE, MAILBOXES, percentile, rounded, say, settings_for


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
            "commits": commits, "commit_ms_p50": rounded(med * 1000, 2),
            "commit_ms_p99": rounded(percentile(times, 99) * 1000, 2),
            "rows_per_s": round(rows / med), "rows_per_s_mean": round(rows * commits / elapsed)}
    best = max((v for k, v in out.items() if k.startswith("rows_")), key=lambda v: v["rows_per_s"])
    out["rows_per_s"] = best["rows_per_s"]
    return out


# --- 2. landing commit latency over many commits ----------------------------------------------

def bench_commit_latency(root: Path, args, p: dict) -> dict:
    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    settings = settings_for(args, root / "commits")
    conf = settings.ingress
    target = LandingTarget(Layout.of(settings), conf.node_id,
                           commits_per_generation=conf.commits_per_generation, fsync=True)
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
            say(f"  {len(times)} commits, last 1k p50 "
                 f"{statistics.median(times[-1000:]) * 1000:.1f} ms")
    n = len(times)
    curve = [{"from": i, "p50_ms": rounded(statistics.median(times[i:i + 1000]) * 1000, 2),
              "p99_ms": rounded(percentile(times[i:i + 1000], 99) * 1000, 2)}
             for i in range(0, n - n % 1000, 1000)]
    out: dict = {
        "method": "LandingTarget.commit of a 10-row table, back to back, one writer",
        "rows_per_commit": 10, "fsync": True,
        "commits_per_generation": conf.commits_per_generation,
        "commits_target": goal, "commits_measured": n,
        "stopped_by": "target" if n >= goal else f"time budget {budget}s",
        "seconds": rounded(time.perf_counter() - t0, 1),
        "p50_first_1k": rounded(statistics.median(times[:1000]) * 1000, 2),
        "p99_first_1k": rounded(percentile(times[:1000], 99) * 1000, 2),
        "p50_all": rounded(statistics.median(times) * 1000, 2),
        "p50_after_100k": None,
        "generation_rotations_at": rotations,
        "curve_per_1k": curve,
        "note": ("each commit is a direct append (delta_tables/direct_append.py): a pyarrow "
                 "Parquet file and the commit file, four fsyncs, no log read, so latency "
                 "does not grow with the table"),
    }
    if n >= 100_000 + 1000:
        out["p50_after_100k"] = rounded(statistics.median(times[100_000:101_000]) * 1000, 2)
    elif n >= 2000:
        # The last 1k commits, named after how many commits came before them.
        last_from = n - 1000
        key = (f"p50_after_{last_from // 1000}k" if last_from % 1000 == 0
               else f"p50_after_{last_from}")
        out[key] = rounded(statistics.median(times[last_from:]) * 1000, 2)
        out["p50_after_100k_note"] = (f"only {n} commits were run, so p50_after_100k is null; "
                                      f"{key} is the p50 of the last 1k commits "
                                      f"({last_from}..{n - 1})")
    else:
        out["p50_after_100k_note"] = (f"only {n} commits were run: too few for a later 1k "
                                      f"window that does not overlap the first")
    return out


# --- 4. stream throughput ------------------------------------------------------------------------

def _prefill(settings, rows: int, per_commit: int, seed: int) -> None:
    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    rng = np.random.default_rng(seed)
    mailboxes = _mailboxes(rng)
    target = LandingTarget(Layout.of(settings), settings.ingress.node_id,
                           commits_per_generation=settings.ingress.commits_per_generation,
                           fsync=False)
    for i in range(0, rows, per_commit):
        target.commit(landing_table(min(per_commit, rows - i), mailboxes, rng))


def _run_available_now(spark, settings) -> dict:
    from deltalake import DeltaTable

    from delta_tables import query
    from delta_tables.layout import Layout
    from jobs.inbox_stream import start_inbox_stream
    t0 = time.perf_counter()
    query, sink = start_inbox_stream(spark, settings, available_now=True)
    while not query.awaitTermination(0.5):   # a timeout keeps Ctrl-C responsive
        pass
    elapsed = time.perf_counter() - t0
    if query.exception():
        raise RuntimeError(f"stream failed: {query.exception()}")
    batches = [h for h in sink.history if h.rows_in]
    inbox_rows = query.read(DeltaTable(str(Layout.of(settings).inbox)), ["seq"]).num_rows
    progress = [dict(x) for x in query.recentProgress]
    return {"elapsed": elapsed, "batches": batches, "inbox_rows": inbox_rows,
            "progress": progress, "rows_in": sum(h.rows_in for h in batches),
            "accepted": sum(h.accepted for h in batches)}


def bench_stream(spark, root: Path, args, p: dict) -> dict:
    commit_rows, rows = p["stream_commit_rows"], p["stream_rows"]
    # Warm-up: a small query of its own, so the first Python workers and the first job's
    # planning (one-off costs of a SparkSession, like its start) are not in the figure.
    warm = settings_for(args, root / "stream_warmup")
    _prefill(warm, 2000, 1000, seed=3)
    t = time.perf_counter()
    _run_available_now(spark, warm)
    warm_s = time.perf_counter() - t

    settings = settings_for(args, root / "stream")    # batches bounded as configured
    t = time.perf_counter()
    _prefill(settings, rows, commit_rows, seed=4)
    prefill_s = time.perf_counter() - t
    say(f"  stream: {rows} rows pre-filled in {prefill_s:.1f} s; running availableNow")
    r = _run_available_now(spark, settings)
    per_batch = [b.rows_in / b.seconds for b in r["batches"] if b.seconds > 0]
    sizes = [b.rows_in for b in r["batches"]]
    trig = [pr.get("durationMs", {}).get("triggerExecution") for pr in r["progress"]]
    trig = [x for x in trig if x]
    return {
        "envelopes_per_s": round(r["rows_in"] / r["elapsed"]),
        "rows": rows, "rows_in": r["rows_in"], "accepted": r["accepted"],
        "inbox_rows": r["inbox_rows"], "seconds": rounded(r["elapsed"], 2),
        "batches": len(r["batches"]),
        "rows_per_batch_median": round(statistics.median(sizes)) if sizes else None,
        "landing_commit_rows": commit_rows,
        "max_files_per_trigger": settings.stream.max_files_per_trigger,
        "max_bytes_per_trigger": settings.stream.max_bytes_per_trigger,
        "batch_rows_per_s_median": round(statistics.median(per_batch)) if per_batch else None,
        "batch_seconds": [rounded(b.seconds, 3) for b in r["batches"]],
        "trigger_execution_ms": trig,
        "envelope_bytes": ENVELOPE_SIZE, "mailboxes": MAILBOXES,
        "spark_master": settings.stream.master, "sink_fsync": True,
        "warmup_query_seconds": rounded(warm_s, 2), "prefill_seconds": rounded(prefill_s, 2),
        "method": ("landing pre-filled with LandingTarget commits; start_inbox_stream("
                   "available_now=True) in this process; timed from query start to "
                   "termination (SparkSession start and a 2k-row warm-up query excluded); "
                   "per batch: rows / foreachBatch seconds (read + transform + 3 commits)"),
    }
