"""`relay bench --hosts`: push on host A -> Deliver at a receiver on host B, against the same
host, in one run.

Each round runs two layouts of the same load in alternating order (`relay bench`'s
push->deliver section: one NK connection per push at a fixed open-loop rate, XX receive
sessions that DeliverAck each Deliver, the inbox stream in this process):

* `same_host`: `relay ingress` and `relay egress` on one data directory: the Unix socket
  hand-off (runtime/handoff.py) reaches egress.
* `cross_host`: `relay ingress` on data directory A ([cluster] peer_listen) and `relay egress`
  on data directory B with a node id of its own ([cluster] peer_dial), the tables shared: each
  host has its own keys and sockets, so only the peer channel (runtime/peer_link.py, Noise
  IK over loopback TCP) carries a push ahead of its inbox row. The clients push to A's key
  and receive with B's.

PPP (`ppp_same_host`, `ppp_cross_host`, after the trueseal rounds of each round): senders
STORE to `relay ingress` on A at a steady rate, one recipient connected to the same process
(same host: PPP's own early delivery) or to `relay ingress` on B (cross host: both PPP
listeners peer_listen and peer_dial; the STORE is handed over the channel); latency = NOTIFY
arrival - STORE write (`relay bench`'s `ppp_store_to_notify_ms` client, window 0), the
inbox stream running beside A.

Latency = Deliver arrival - the time written into the envelope just before its Push (one
client process: one clock). Figures: p50/p90/p99 per layout, medians over the rounds, and
cross/same ratios; `early_share`: Delivers that came before their inbox row;
`ack_to_deliver_ms`: Deliver arrival - Ack arrival (negative: the Deliver came first), the
hand-off's own path without the landing commit both layouts share.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from .harness import (ENVELOPE_SIZE, bench_spark, machine, percentile, rounded, say,
                      settings_for, spawn, start_role, stop_children, stop_process,
                      wait_result, write_conf)

ROUNDS = 3
FULL = {"rate": 500, "seconds": 30, "receivers": 50}
QUICK = {"rate": 200, "seconds": 8, "receivers": 20}
LAYOUTS = ("same_host", "cross_host")
PPP_LAYOUTS = ("ppp_same_host", "ppp_cross_host")
PPP = {"rate": 20, "seconds": 6}    # inside C.3's STORE budget of the client's identities
# the targets across hosts on loopback: name -> (quantile, at most ms)
TARGETS = {"cross_host_p50_ms": ("p50", 20), "cross_host_p99_ms": ("p99", 100)}


def _wait_log(path: Path, message: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while message not in path.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no '{message}' in {path} after {timeout:g} s")
        time.sleep(0.1)


def _run(spark, args, root: Path, layout: str, p: dict, seed: int) -> dict:
    from jobs.inbox_stream import start_inbox_stream
    from runtime import keys

    from . import trueseal_client as bc
    tables = root / "tables"
    a_dir, b_dir = root / "a", (root / "b" if layout == "cross_host" else root / "a")
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    a = settings_for(args, a_dir)
    a.tables_dir = str(tables)
    a.cluster.peer_listen = layout == "cross_host"
    a.cluster.peer_port = 0
    b = settings_for(args, b_dir)
    b.tables_dir = str(tables)
    if layout == "cross_host":
        b.ingress.node_id = "node-b"
        b.cluster.peer_dial = True
    conf_a, conf_b = write_conf(a, root / "a.toml"), write_conf(b, root / "b.toml")
    from delta_tables.layout import Layout
    Layout.of(a).ensure_shared_tables()
    push_pub = keys.load_or_create(a_dir).public
    recv_pub = keys.load_or_create(b_dir).public
    ingress, ing = start_role("ingress", args, a_dir, logs, conf_a)
    egress, eg = start_role("egress", args, b_dir, logs, conf_b)
    if layout == "cross_host":      # (a text log line: the message, not the event name)
        _wait_log(logs / "egress.log", "peer connected", 30)
    push_port = int(ing["trueseal_push"].rsplit(":", 1)[1])
    recv_port = int(eg["trueseal_receive"].rsplit(":", 1)[1])
    query, _ = start_inbox_stream(spark, a)
    try:
        queue = mp.get_context("spawn").Queue()
        proc = spawn(bc.e2e_worker, queue, "127.0.0.1", push_port, recv_port, push_pub,
                     p["rate"], p["seconds"], ENVELOPE_SIZE, p["receivers"], seed, 30.0,
                     recv_pub)
        res = wait_result(queue, proc, p["seconds"] + 180)
        proc.join(timeout=10)
        if not res.get("ok"):
            raise RuntimeError(f"e2e client failed: {res.get('error')}")
        lat = res["latency_ms"]
        # Deliver after the Ack (negative: before it): the hand-off's path without the
        # landing commit's, which both layouts share
        after_ack = [(d - a) / 1e6 for _, _, a, d in res["records"] if a and d]
        return {"p50": rounded(percentile(lat, 50), 2), "p90": rounded(percentile(lat, 90), 2),
                "p99": rounded(percentile(lat, 99), 2), "max": rounded(max(lat) if lat else None),
                "delivered": len(lat), "acked": res["acked"], "pushed": res["pushed"],
                "not_delivered": res["acked"] - len(lat), "duplicates_seen": res["duplicates"],
                "early_share": rounded(res["early"] / max(1, len(lat)), 3),
                "push_to_ack_ms_p50": rounded(percentile(res["ack_latency_ms"], 50), 2),
                "push_to_ack_ms_p99": rounded(percentile(res["ack_latency_ms"], 99), 2),
                "ack_to_deliver_ms_p50": rounded(percentile(after_ack, 50), 2),
                "ack_to_deliver_ms_p99": rounded(percentile(after_ack, 99), 2),
                "push_errors": res["push_errors"]}
    finally:
        try:
            query.stop()
        except Exception:
            pass
        stop_process(egress, 30)
        stop_process(ingress, 30)


def _run_ppp(spark, args, root: Path, layout: str, p: dict) -> dict:
    from jobs.inbox_stream import start_inbox_stream

    from .ppp import notify_worker
    tables = root / "tables"
    dirs = [root / "a"] + ([root / "b"] if layout == "ppp_cross_host" else [])
    ports, procs = [], []
    query = None
    try:
        for n, d in enumerate(dirs):
            s = settings_for(args, d)
            s.tables_dir = str(tables)
            s.ppp.port = 0
            s.ppp.notify_window_ms = 0
            s.heya.enabled = s.sync.enabled = False
            if len(dirs) > 1:
                s.ingress.node_id = f"node-{'ab'[n]}"
                s.cluster.peer_listen = s.cluster.peer_dial = True
                s.cluster.peer_port = 0
            if n == 0:
                from delta_tables.layout import Layout
                Layout.of(s).ensure_shared_tables()
                first = s
            logs = root / f"logs-{'ab'[n]}"
            logs.mkdir(parents=True, exist_ok=True)
            proc, listening = start_role("ingress", args, d, logs,
                                         write_conf(s, root / f"{n}.toml"))
            procs.append((proc, logs))
            ports.append(int(listening["ppp"].rsplit(":", 1)[1]))
        for _, logs in procs[1:]:
            _wait_log(logs / "ingress.log", "peer connected", 30)
        query, _ = start_inbox_stream(spark, first)
        queue = mp.get_context("spawn").Queue()
        proc = spawn(notify_worker, queue, ports[0], p["rate"], p["seconds"], ports[-1])
        res = wait_result(queue, proc, p["seconds"] + 300)
        proc.join(timeout=10)
        if not res.get("ok"):
            raise RuntimeError(f"ppp client failed: {res.get('error')}")
        lat = res["latency_ms"]
        return {"p50": rounded(percentile(lat, 50), 2), "p90": rounded(percentile(lat, 90), 2),
                "p99": rounded(percentile(lat, 99), 2), "notified": len(lat),
                "store_to_stored_ms_p50": rounded(percentile(res["stored_ms"], 50), 2)}
    finally:
        if query is not None:
            try:
                query.stop()
            except Exception:
                pass
        for proc, _ in reversed(procs):
            stop_process(proc, 30)


def main(args) -> int:
    quick = bool(getattr(args, "quick", False))
    p = QUICK if quick else FULL
    out_path = Path(getattr(args, "out", None) or "bench-hosts.json")
    rounds = max(1, int(getattr(args, "rounds", None) or ROUNDS))
    root = Path(tempfile.mkdtemp(prefix="relay-bench-hosts-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "mode": "quick" if quick else "full", "machine": machine(os.getloadavg()),
                 "load": {**p, "envelope_bytes": ENVELOPE_SIZE}, "rounds": []}
    try:
        spark = bench_spark(settings_for(args, root / "spark"), "relay-bench-hosts")
        for n in range(rounds):
            one = {}
            for layout in (LAYOUTS if n % 2 == 0 else LAYOUTS[::-1]):
                say(f"round {n + 1} of {rounds}: {layout}, {p['rate']}/s for {p['seconds']} s, "
                    f"{p['receivers']} receive sessions")
                one[layout] = _run(spark, args, root / f"r{n}-{layout}", layout, p, 7 + n)
                say(f"  p50 {one[layout]['p50']} ms, p90 {one[layout]['p90']}, p99 "
                    f"{one[layout]['p99']}; early {one[layout]['early_share']}, not "
                    f"delivered {one[layout]['not_delivered']}, duplicates "
                    f"{one[layout]['duplicates_seen']}")
            for layout in (PPP_LAYOUTS if n % 2 == 0 else PPP_LAYOUTS[::-1]):
                say(f"round {n + 1} of {rounds}: {layout}, {PPP['rate']} STOREs/s for "
                    f"{PPP['seconds']} s, one recipient")
                one[layout] = _run_ppp(spark, args, root / f"r{n}-{layout}", layout, PPP)
                say(f"  STORE->NOTIFY p50 {one[layout]['p50']} ms, p99 {one[layout]['p99']}")
            res["rounds"].append(one)
    finally:
        stop_children()
        shutil.rmtree(root, ignore_errors=True)
    med = {layout: {k: rounded(statistics.median(r[layout][k] or 0 for r in res["rounds"]), 3)
                    for k in res["rounds"][0][layout]} for layout in LAYOUTS + PPP_LAYOUTS}
    res["median"] = med
    res["cross_over_same"] = {q: rounded(med["cross_host"][q] / med["same_host"][q], 2)
                              if med["same_host"][q] else None for q in ("p50", "p90", "p99")}
    res["ppp_cross_over_same"] = {
        q: rounded(med["ppp_cross_host"][q] / med["ppp_same_host"][q], 2)
        if med["ppp_same_host"][q] else None for q in ("p50", "p90", "p99")}
    res["ppp_load"] = PPP
    res["targets"] = {name: {"target": t, "kind": "at most", "measured": med["cross_host"][q],
                             "met": bool(med["cross_host"][q]) and med["cross_host"][q] <= t}
                      for name, (q, t) in TARGETS.items()}
    res["method"] = __doc__.split("\n\n", 1)[1].strip()
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    for layout in LAYOUTS + PPP_LAYOUTS:
        m = med[layout]
        say(f"{layout:<14} ms p50 {m['p50']} p90 {m['p90']} p99 {m['p99']}"
            + (f" (early {m['early_share']})" if "early_share" in m else ""))
    say(f"cross/same: {res['cross_over_same']}")
    say(f"wrote {out_path}")
    return 0
