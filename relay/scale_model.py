"""Capacity on paper (issue 18): what 1 M users sending 100 M messages a day need, worked out
from this machine's measurements. docs/scale-out.md prints `report()`'s table and the capacity
notebook runs it; tests/test_scale_model.py keeps the document equal to this code.

Every input names where it comes from: a `relay bench` figure (docs/benchmarks/, the JSON
files), the load generator's model of a day (jobs/loadgen.py), or a published price or limit
of the object store (named as such: those are not measured here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Inputs:
    users: int = 1_000_000
    messages_per_day: int = 100_000_000
    # jobs/loadgen.diurnal: busiest hour / mean hour of the synthetic day
    peak_over_mean: float = 2.04
    # jobs/loadgen.py: padded sizes 256/1024/4096/16384 at 55/28/10/4 % (+3 % unpadded)
    envelope_bytes: int = 1539
    # relay bench --quick 2026-11-24 morning: relay CPU per trueseal push over a new Noise NK
    # connection (the real client's shape), ms; the costliest protocol per message measured
    cpu_ms_per_message: float = 1.2
    # relay bench --quick 2026-11-24 evening: stream envelopes/s over a 200k-row run, local[2]
    stream_envelopes_per_s: int = 37_567
    # relay bench --quick: micro-batch trigger interval (ms) of the measured runs
    trigger_ms: int = 100
    # relay bench --object-store, 2026-11-26 (bench-object-store.json): landing commit p50 on
    # moto's S3 server on loopback, median of 3 rounds (2.23 ms on local disk in the same run).
    # AWS documents "tens of milliseconds" median for small requests: moto is slower.
    s3_commit_ms: float = 121.0
    # a node commits back to back while rows wait; a longer period groups more rows per commit
    # (fewer requests, slower acks): 0 = back to back
    landing_commit_every_ms: float = 0.0
    # requests of one delta-rs commit on S3, counted in moto's request log over 40 landing
    # commits (this stop): PUT-priced = 2 PUT (data, conditional log) + 3 LIST; GET-priced = 2
    put_tier_per_commit: int = 5
    get_per_commit: int = 2
    # tables written by each micro-batch (rejects, inbox, padding_audit) and processes that
    # read each inbox commit (egress, the PPP, Heya and cursor-sync listeners), each a HEAD and
    # GET of the next commit, a LIST, and two GETs (the commit file, its data file:
    # egress/inbox_tail.py, landing_lag.LogFollower)
    tables_per_batch: int = 3
    inbox_followers: int = 4
    # AWS S3 Standard us-east-1 published prices, USD (not measured): per 1,000 PUT/LIST, per
    # 1,000 GET, per GB-month
    usd_per_1k_put: float = 0.005
    usd_per_1k_get: float = 0.0004
    usd_per_gb_month: float = 0.023
    # AWS S3 documented floor per partitioned prefix: PUT/s and GET/s
    s3_put_per_s_per_prefix: int = 3500
    s3_get_per_s_per_prefix: int = 5500
    cores_per_node: int = 2
    node_headroom: float = 0.7   # plan nodes to 70 % CPU at the peak hour
    # relay bench --object-store, 2026-12-02 (docs/results/2026-12-02-stream-on-s3.md): landing
    # commits the stream reads per second on moto's S3 server, 2 nodes x 200 commits of 10 rows,
    # availableNow, the run's wall time with the query's start, median of 3 rounds
    stream_commits_read_per_s_s3: float = 72.0
    # the stream's read of one landing commit on S3: its commit file and its data file, one GET
    # each (sizes known: no HEAD); each look that finds news LISTs that table's log once
    stream_get_per_landing_commit: int = 2
    # idle: the stream looks once per stream.wait_for_data_ms (a HEAD for each node's live
    # landing table and one for its next generation) and LISTs the landing prefixes (one, and
    # one per node) once per stream.landing_list_interval_ms (counted in moto's log, same
    # run); each inbox follower HEADs the inbox's next commit once per egress.poll_interval_ms
    # and LISTs its log once per follower_list_every_s (tests/test_landing_source_s3.py)
    wait_for_data_ms: int = 1000
    landing_list_interval_ms: int = 10_000
    follower_poll_ms: int = 1000
    follower_list_every_s: int = 60


def model(i: Inputs = Inputs()) -> dict[str, float]:
    mean_rate = i.messages_per_day / 86_400
    peak_rate = mean_rate * i.peak_over_mean
    ingress_cores = peak_rate * i.cpu_ms_per_message / 1000
    nodes = math.ceil(ingress_cores / (i.cores_per_node * i.node_headroom)) + 1  # +1: one lost
    # Each node commits once per period while rows wait.
    period_ms = max(i.s3_commit_ms, i.landing_commit_every_ms)
    commits_per_s = nodes * 1000 / period_ms
    rows_per_commit_peak = peak_rate / commits_per_s
    # a micro-batch commits its tables one after another: on S3 that, not the trigger, can
    # bound how many batches run per second
    batches_per_s = min(1000 / i.trigger_ms, 1000 / (i.tables_per_batch * i.s3_commit_ms))
    table_commits_per_s = commits_per_s + batches_per_s * i.tables_per_batch
    # + the stream's look before each batch: a LIST of each node's live landing log
    put_tier_per_s = table_commits_per_s * i.put_tier_per_commit + \
        batches_per_s * (i.inbox_followers + nodes)
    get_per_s = (table_commits_per_s * i.get_per_commit + batches_per_s * i.inbox_followers * 4
                 + commits_per_s * i.stream_get_per_landing_commit)
    # idle: nothing lands, nothing is committed; only the looks for news
    idle_head_per_s = (2 * nodes * 1000 / i.wait_for_data_ms
                       + i.inbox_followers * 1000 / i.follower_poll_ms)
    idle_list_per_s = ((1 + nodes) * 1000 / i.landing_list_interval_ms
                       + i.inbox_followers / i.follower_list_every_s)
    gb_per_day = i.messages_per_day * i.envelope_bytes / 1e9
    return {
        "mean messages/s": mean_rate,
        "peak messages/s": peak_rate,
        "ingress cores at peak": ingress_cores,
        "ingress nodes (2 cores, 70 %, +1)": nodes,
        "stream load at peak (share of one local[2] driver)": peak_rate / i.stream_envelopes_per_s,
        "landing commits/s (all nodes, S3)": commits_per_s,
        "rows per landing commit at peak": rows_per_commit_peak,
        "stream micro-batches/s (trigger or 3 commits in a row)": batches_per_s,
        "Delta commits/s (landing + 3 tables per micro-batch)": table_commits_per_s,
        "S3 PUT/LIST per s": put_tier_per_s,
        "S3 GET per s": get_per_s,
        "PUT/LIST as share of one prefix's floor": put_tier_per_s / i.s3_put_per_s_per_prefix,
        "S3 requests USD/day": 86.4 * (put_tier_per_s * i.usd_per_1k_put
                                       + get_per_s * i.usd_per_1k_get),
        "envelope GB landed/day": gb_per_day,
        "storage USD/day if a day stays stored": gb_per_day * 2 * i.usd_per_gb_month / 30,
        "ack latency on S3, p50 (ms)": i.s3_commit_ms + (period_ms - i.s3_commit_ms) / 2,
        "stream's landing read at peak (share of the rate measured on S3)":
            commits_per_s / i.stream_commits_read_per_s_s3,
        "idle: HEAD per s (the stream's and followers' looks)": idle_head_per_s,
        "idle: LIST per s (landing prefixes, inbox followers)": idle_list_per_s,
        "idle: S3 requests USD/day": 86.4 * (idle_list_per_s * i.usd_per_1k_put
                                             + idle_head_per_s * i.usd_per_1k_get),
    }


def report(i: Inputs = Inputs()) -> str:
    """The Markdown table of docs/scale-out.md."""
    lines = ["| figure | value |", "|---|---:|"]
    for name, value in model(i).items():
        text = f"{value:,.0f}" if abs(value) >= 100 or float(value).is_integer() else (
            f"{value:.2f}" if abs(value) >= 0.01 else f"{value:.4f}")
        lines.append(f"| {name} | {text} |")
    return "\n".join(lines)


def inputs_table(i: Inputs = Inputs()) -> str:
    return "\n".join(["| input | value |", "|---|---:|"] + [
        f"| `{f.name}` | {getattr(i, f.name):,} |" for f in fields(i)])


if __name__ == "__main__":
    print(report())
