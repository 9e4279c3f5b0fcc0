"""`relay bench --object-store`: the tables on local disk and on an S3 server, side by side.

Issue 18 asks for the landing commit latency and the stream's throughput with the tables on
an S3 server beside the local-disk figures of the same run. The S3 server is moto's server mode
on loopback (relay/bench/s3_server.py): a Python process, so its figures measure our commit
path and request count against a slow server, not S3's latency (tens of ms per PUT on AWS,
which docs/scale-out.md takes from AWS's own documentation, not from here). Each section
alternates local and S3 per round; every figure is the median over the rounds.

Three sections follow the stream as it runs against the store: `read` lands many small
commits (READ_NODES nodes x READ_COMMITS of 10 rows, as lone senders make them) and times the
stream over them (landing commits read per second); `idle` counts, in moto's request log, the
requests a caught-up stream makes per second with nothing landing; `follow` runs the stream
while the nodes land as fast as they can, and times its drain after the last commit.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .harness import machine, percentile, rounded, say, settings_for
from .s3_server import BUCKET, RequestLog, s3_server
from .tables import _mailboxes, _prefill, _run_available_now, landing_table

COMMITS = 200               # 10-row landing commits per storage per round
STREAM_ROWS = 40_000        # rows landed, then one availableNow stream over them
STREAM_COMMIT_ROWS = 1000
READ_NODES = 2              # `read`: landing nodes, each ...
READ_COMMITS = 200          # ... this many commits of READ_ROWS rows
READ_ROWS = 10
IDLE_SECONDS = 10.0         # `idle`: the window counted


def _settings(args, root: Path, name: str, endpoint: str | None):
    s = settings_for(args, root / name)
    if endpoint:
        s.tables_dir = f"s3://{BUCKET}/{root.name}-{name}"
        s.object_store.endpoint = endpoint
    return s


def commit_latency(settings, commits: int) -> dict:
    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout
    target = LandingTarget(Layout.of(settings), settings.ingress.node_id, fsync=True)
    rng = np.random.default_rng(2)
    table = landing_table(10, _mailboxes(rng, 100), rng)
    target.commit(table)                                  # the first creates; not timed
    times = []
    for _ in range(commits):
        t = time.perf_counter()
        target.commit(table)
        times.append(time.perf_counter() - t)
    return {"commits": commits, "p50_ms": rounded(statistics.median(times) * 1000, 2),
            "p99_ms": rounded(percentile(times, 99) * 1000, 2)}


def stream_throughput(spark, settings, rows: int) -> dict:
    settings.stream.max_files_per_trigger = 20            # 20k-row micro-batches
    _prefill(settings, rows, STREAM_COMMIT_ROWS, seed=4)
    r = _run_available_now(spark, settings)
    return {"rows": r["rows_in"], "seconds": rounded(r["elapsed"], 2),
            "envelopes_per_s": round(r["rows_in"] / r["elapsed"]),
            "batches": len(r["batches"]), "inbox_rows": r["inbox_rows"]}


def _land_nodes(settings, nodes: int, commits: int, rows: int) -> None:
    """`commits` landing commits of `rows` rows on each of `nodes` nodes, the nodes at once
    (as ingress hosts would; on S3 a commit is mostly waiting on the server)."""
    from concurrent.futures import ThreadPoolExecutor

    from delta_tables.group_commit import LandingTarget
    from delta_tables.layout import Layout

    def land(i: int) -> None:
        rng = np.random.default_rng(10 + i)
        target = LandingTarget(Layout.of(settings), f"bench-{i}", fsync=False)
        mailboxes = _mailboxes(rng, 100)
        for _ in range(commits):
            target.commit(landing_table(rows, mailboxes, rng))
    with ThreadPoolExecutor(nodes) as pool:
        list(pool.map(land, range(nodes)))


def stream_read(spark, settings) -> dict:
    """The stream over READ_NODES x READ_COMMITS small landing commits, availableNow with the
    configured batch bounds: landing commits read per second, over the run (query start
    included) and over the triggers that took rows (Spark's triggerExecution: planning,
    reading, the inbox commits)."""
    _land_nodes(settings, READ_NODES, READ_COMMITS, READ_ROWS)
    commits = READ_NODES * READ_COMMITS
    r = _run_available_now(spark, settings)
    # the sink reads the files itself (numInputRows stays 0): a trigger took rows if its
    # offsets moved
    busy = [p for p in r["progress"]
            if any(s.get("startOffset") != s.get("endOffset") for s in p.get("sources", []))]
    busy_ms = sum(p.get("durationMs", {}).get("triggerExecution", 0) for p in busy)
    return {"commits": commits, "rows": r["rows_in"], "inbox_rows": r["inbox_rows"],
            "batches": len(r["batches"]), "seconds": rounded(r["elapsed"], 2),
            "commits_per_s": rounded(commits / r["elapsed"], 1),
            "busy_seconds": rounded(busy_ms / 1000, 2),
            "commits_per_s_busy": rounded(commits * 1000 / busy_ms, 1) if busy_ms else None,
            "ms_per_commit_busy": rounded(busy_ms / commits, 2)}


def stream_idle(spark, settings, requests: RequestLog, seconds: float = IDLE_SECONDS) -> dict:
    """The requests per second of the stream, caught up (after `stream_read` on the same
    tables) and running as `relay stream` runs it, with nothing landing."""
    from jobs.inbox_stream import start_inbox_stream
    query, _ = start_inbox_stream(spark, settings)
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress and time.monotonic() < deadline:
            time.sleep(0.2)                         # its first (boot) batch
        time.sleep(2.0)
        requests.mark()
        time.sleep(seconds)
        counts = requests.counts()
    finally:
        query.stop()
    per_s = {k: rounded(v / seconds, 2) for k, v in sorted(counts.items())}
    return {"seconds": seconds, "requests_per_s": per_s,
            "total_per_s": rounded(sum(counts.values()) / seconds, 2),
            "wait_for_data_ms": settings.stream.wait_for_data_ms}


def stream_follow(spark, settings) -> dict:
    """The stream running as `relay stream` runs it while READ_NODES nodes land READ_COMMITS
    commits each as fast as they can: the landing rate, and how long after the last landing
    commit the stream had every row (drain; a stream that keeps up drains in about a batch)."""
    from jobs.inbox_stream import start_inbox_stream
    rows: list[int] = []
    query, _ = start_inbox_stream(spark, settings, on_batch=lambda st: rows.append(st.rows_in))
    try:
        deadline = time.monotonic() + 60
        while not query.recentProgress and time.monotonic() < deadline:
            time.sleep(0.2)                         # its first (boot) batch
        t0 = time.perf_counter()
        _land_nodes(settings, READ_NODES, READ_COMMITS, READ_ROWS)
        landed = time.perf_counter()
        total = READ_NODES * READ_COMMITS * READ_ROWS
        while sum(rows) < total and time.perf_counter() < landed + 120:
            time.sleep(0.02)
        done = time.perf_counter()
    finally:
        query.stop()
    commits = READ_NODES * READ_COMMITS
    return {"commits": commits, "rows_in": sum(rows),
            "batches": sum(1 for r in rows if r),
            "landing_commits_per_s": rounded(commits / (landed - t0), 1),
            "drain_seconds": rounded(done - landed, 2),
            "commits_read_per_s": rounded(commits / (done - t0), 1)}


def _median(rounds: list[dict], section: str, key: str):
    vals = [r[section][key] for r in rounds if r.get(section)]
    return statistics.median(vals) if vals else None


def main(args) -> int:
    from jobs.spark_session import get_spark
    rounds_n = max(1, int(getattr(args, "rounds", None) or 3))
    out_path = Path(getattr(args, "out", None) or "bench-object-store.json")
    root = Path(tempfile.mkdtemp(prefix="relay-bench-s3-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(os.getloadavg()),
                 "s3_server": "moto server mode on loopback (PyPI moto[server])",
                 "method": (f"per round and storage: {COMMITS} LandingTarget.commit of 10 rows "
                            f"(fsync on local disk; a PUT on S3), then {STREAM_ROWS} rows "
                            f"landed in {STREAM_COMMIT_ROWS}-row commits and one availableNow "
                            "inbox stream over them (SparkSession and its start excluded); "
                            f"then {READ_NODES} nodes x {READ_COMMITS} landing commits of "
                            f"{READ_ROWS} rows and one availableNow stream over them (landing "
                            "commits read/s); then on S3 that stream continuous and caught up, "
                            f"its requests counted in moto's log over {IDLE_SECONDS:.0f} s; "
                            "then the continuous stream while the nodes land as many "
                            "commits again as fast as they can (landing rate; drain: from "
                            "the last landing commit to every row in a batch); "
                            "local and S3 alternate; medians over the rounds")}
    per_round: list[dict] = []
    requests = RequestLog(root / "s3-requests.log")
    with s3_server(request_log=requests.path) as endpoint:
        spark = get_spark("local[2]", "relay-bench-object-store",
                          extra={"spark.ui.showConsoleProgress": "false"})
        spark.sparkContext.setLogLevel("ERROR")
        try:
            for n in range(1, rounds_n + 1):
                one: dict = {}
                order = [("local", None), ("s3", endpoint)]
                if n % 2 == 0:
                    order.reverse()
                for name, ep in order:
                    say(f"round {n}: {name} commits ...")
                    one[f"commit_{name}"] = commit_latency(
                        _settings(args, root, f"r{n}-commit-{name}", ep), COMMITS)
                for name, ep in order:
                    say(f"round {n}: {name} stream ...")
                    one[f"stream_{name}"] = stream_throughput(
                        spark, _settings(args, root, f"r{n}-stream-{name}", ep), STREAM_ROWS)
                for name, ep in order:
                    say(f"round {n}: {name} read of small commits ...")
                    read_settings = _settings(args, root, f"r{n}-read-{name}", ep)
                    one[f"read_{name}"] = stream_read(spark, read_settings)
                    if ep:
                        say(f"round {n}: {name} idle ...")
                        one["idle_s3"] = stream_idle(spark, read_settings, requests)
                for name, ep in order:
                    say(f"round {n}: {name} stream following the landing ...")
                    one[f"follow_{name}"] = stream_follow(
                        spark, _settings(args, root, f"r{n}-follow-{name}", ep))
                per_round.append(one)
                say(f"round {n}: {json.dumps(one)}")
        finally:
            spark.stop()
    summary = {
        "landing_commit_p50_ms": {s: _median(per_round, f"commit_{s}", "p50_ms")
                                  for s in ("local", "s3")},
        "landing_commit_p99_ms": {s: _median(per_round, f"commit_{s}", "p99_ms")
                                  for s in ("local", "s3")},
        "stream_envelopes_per_s": {s: _median(per_round, f"stream_{s}", "envelopes_per_s")
                                   for s in ("local", "s3")},
        "landing_commits_read_per_s": {s: _median(per_round, f"read_{s}", "commits_per_s")
                                       for s in ("local", "s3")},
        "landing_commits_read_per_s_busy": {
            s: _median(per_round, f"read_{s}", "commits_per_s_busy") for s in ("local", "s3")},
        "follow_landing_commits_per_s": {
            s: _median(per_round, f"follow_{s}", "landing_commits_per_s") for s in ("local", "s3")},
        "follow_drain_seconds": {
            s: _median(per_round, f"follow_{s}", "drain_seconds") for s in ("local", "s3")},
        "idle_s3_requests_per_s": {
            k: statistics.median(r["idle_s3"]["requests_per_s"].get(k, 0) for r in per_round)
            for k in sorted({k for r in per_round for k in r["idle_s3"]["requests_per_s"]})},
    }
    c, st = summary["landing_commit_p50_ms"], summary["stream_envelopes_per_s"]
    summary["s3_over_local"] = {
        "landing_commit_p50": rounded(c["s3"] / c["local"], 2) if c["local"] else None,
        "stream_envelopes_per_s": rounded(st["s3"] / st["local"], 2) if st["local"] else None}
    for key in ("landing_commits_read_per_s", "landing_commits_read_per_s_busy"):
        rd = summary[key]
        summary["s3_over_local"][key] = rounded(rd["s3"] / rd["local"], 2) if rd["local"] else None
    res.update(summary=summary, rounds=per_round,
               seconds=rounded(time.time() - datetime.fromisoformat(
                   res["started_at"]).timestamp(), 1))
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    say(f"wrote {out_path}: {json.dumps(summary)}")
    return 0
