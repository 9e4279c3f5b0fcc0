"""`relay bench --object-store`: the tables on local disk and on an S3 server, side by side.

Issue 18 asks for the landing commit latency and the stream's throughput with the tables on
an S3 server beside the local-disk figures of the same run. The S3 server is moto's server mode
on loopback (relay/bench/s3_server.py): a Python process, so its figures measure our commit
path and request count against a slow server, not S3's latency (tens of ms per PUT on AWS,
which docs/scale-out.md takes from AWS's own documentation, not from here). Each section
alternates local and S3 per round; every figure is the median over the rounds.
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
from .s3_server import BUCKET, s3_server
from .tables import _mailboxes, _prefill, _run_available_now, landing_table

COMMITS = 200               # 10-row landing commits per storage per round
STREAM_ROWS = 40_000        # rows landed, then one availableNow stream over them
STREAM_COMMIT_ROWS = 1000


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
                            "local and S3 alternate; medians over the rounds")}
    per_round: list[dict] = []
    with s3_server() as endpoint:
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
    }
    c, st = summary["landing_commit_p50_ms"], summary["stream_envelopes_per_s"]
    summary["s3_over_local"] = {
        "landing_commit_p50": rounded(c["s3"] / c["local"], 2) if c["local"] else None,
        "stream_envelopes_per_s": rounded(st["s3"] / st["local"], 2) if st["local"] else None}
    res.update(summary=summary, rounds=per_round,
               seconds=rounded(time.time() - datetime.fromisoformat(
                   res["started_at"]).timestamp(), 1))
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    say(f"wrote {out_path}: {json.dumps(summary)}")
    return 0
