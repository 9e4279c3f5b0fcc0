"""`relay bench [--quick] [--rounds N] [--out FILE]`: measure the relay on this machine, write
JSON.

Everything runs for real: Noise handshakes over loopback TCP, group-committed landing with
fsync (as configured), Spark Structured Streaming into the inbox, egress delivering to XX
receive sessions. Sections, in order (all in one run, so ratios compare like with like), each
in the module of what it measures:

1. `delta_append_ceiling_rows_per_s` (`tables.py`): raw delta-rs appends, no protocol.
2. `landing_commit_ms` (`tables.py`): landing commit latency over many commits.
3. `trueseal_acked_pushes_per_s` (`trueseal.py`): `IngressNode` in this process, load from
   `spawn`ed client processes (`trueseal_client.py`).
4. `stream_envelopes_per_s` (`tables.py`): the inbox stream over a pre-filled landing.
5. `push_to_deliver_ms` (`trueseal.py`): `relay ingress` and `relay egress` as child
   processes, the stream in this process, receive sessions timestamping each Deliver.
6. `heya_sends_per_s`, `heya_send_to_have_ms` (`heya.py`).
7. `ppp_acked_stores_per_s`, `ppp_store_to_notify_ms`, `ppp_room_messages_per_s`,
   `ppp_room_store_to_notify_ms` (`ppp.py`).
8. `sync_pushes_per_s`, `sync_push_to_notify_ms` (`sync.py`).
9. `push_wakeups_per_s`, `inbox_commit_to_push_ms` (`push.py`).
10. `spark_floor` (`jobs/batch_profile.py`): a small micro-batch of the relay's stream against
   Spark's own floor, the same source and trigger with a no-op sink, over the same trickle.

Every section runs `rounds` times (3 unless `--rounds` says otherwise), the sections in this
order in every round, and each figure is the median over the rounds (`rounds.py`; `rounds` in
the file lists each round's headline figures, `section_seconds` what each section took). Spark
starts once, in the first round.

Every figure with a target (`TARGETS`, the issue's) gets `targets[name]`: the target, the
measured value and `short_by` (how many times better it must get; <= 1: met). Each section
records the machine's load average before and after it (`load`).

Each module builds on `harness.py` alone; a protocol's module offers `run(settings, quick,
spark=None) -> dict` (trueseal, the first measured, offers its two sections as they sit around
the Spark start). This module runs them and writes the file. The CLI imports it only when
`relay bench` runs: nothing of the benchmark is loaded by `relay up` or the relay's roles.
The load generators run in separate processes started with `spawn` (delta-rs must not be
forked). Child processes are stopped on exit, error and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from functools import partial
from datetime import datetime, timezone
from pathlib import Path

from runtime import config

from . import heya, ppp, push, sync, tables, trueseal
from .rounds import median_of
from .harness import (ENVELOPE_SIZE, machine, rounded, say, settings_for, stop_children,
                      stop_spark)

# issue 13's targets: (figure path, target, "min" = at least / "max" = at most)
TARGETS = {
    "trueseal_pipelined_per_s": (("trueseal", "pipelined", "acked_per_s"), 20_000, "min"),
    "trueseal_per_connection_per_s": (("trueseal", "per_connection", "acked_per_s"), 3_000,
                                      "min"),
    "push_to_deliver_p50_ms": (("push_to_deliver_ms", "p50"), 250, "max"),
    "push_to_deliver_p99_ms": (("push_to_deliver_ms", "p99"), 600, "max"),
    "stream_envelopes_per_s": (("stream_envelopes_per_s",), 100_000, "min"),
    "stream_vs_ceiling_ratio": (("stream_vs_ceiling_ratio",), 0.4, "min"),
    "heya_sends_per_s": (("heya_sends_per_s",), 15_000, "min"),
    "heya_send_to_have_p50_ms": (("heya_send_to_have_ms", "p50"), 250, "max"),
    "ppp_acked_stores_per_s": (("ppp_acked_stores_per_s",), 15_000, "min"),
    "ppp_store_to_notify_p50_ms": (("ppp_store_to_notify_ms", "p50"), 200, "max"),
    "sync_pushes_per_s": (("sync_pushes_per_s",), 5_000, "min"),
    "sync_iroh_pushes_per_s": (("sync_iroh_pushes_per_s",), 5_000, "min"),
    "sync_iroh_push_ack_p50_ms": (("sync_iroh_push_ack_ms", "p50"), 200, "max"),
}


def targets(res: dict) -> dict:
    """Each target beside what was measured; `short_by` > 1 says how far off it is."""
    out = {}
    for name, (path, target, kind) in TARGETS.items():
        value = res
        for k in path:
            value = value.get(k) if isinstance(value, dict) else None
        short = None
        if isinstance(value, (int, float)) and value > 0:
            short = round(target / value if kind == "min" else value / target, 2)
        out[name] = {"target": target, "kind": "at least" if kind == "min" else "at most",
                     "measured": value, "short_by": short, "met": short is not None
                     and short <= 1}
    return out


def headline(res: dict) -> None:
    """A round's headline figures and ratios, from its sections' results (in place)."""
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
    res["ppp_room_messages_per_s"] = (res.get("ppp") or {}).get("ppp_room_messages_per_s")
    res["ppp_room_store_to_notify_ms"] = (res.get("ppp") or {}).get(
        "ppp_room_store_to_notify_ms")
    res["sync_pushes_per_s"] = (res.get("sync") or {}).get("sync_pushes_per_s")
    res["sync_push_to_notify_ms"] = (res.get("sync") or {}).get("sync_push_to_notify_ms")
    for key in ("sync_iroh_pushes_per_s", "sync_iroh_push_ack_ms", "sync_push_ack_ms",
                "sync_requests_per_s"):
        res[key] = (res.get("sync") or {}).get(key)
    res["push_wakeups_per_s"] = (res.get("push") or {}).get("push_wakeups_per_s")
    res["inbox_commit_to_push_ms"] = (res.get("push") or {}).get("inbox_commit_to_push_ms")
    res["delta_append_ceiling_rows_per_s"] = ceiling
    if ceiling and ts.get("acked_per_s"):
        res["trueseal_vs_ceiling_ratio"] = round(ts["acked_per_s"] / ceiling, 3)
    if ceiling and st.get("envelopes_per_s"):
        res["stream_vs_ceiling_ratio"] = round(st["envelopes_per_s"] / ceiling, 3)
    if ts.get("per_connection") and ts.get("pipelined"):
        res["per_connection_vs_pipelined_ratio"] = round(
            ts["per_connection"]["acked_per_s"] / max(1, ts["pipelined"]["acked_per_s"]), 3)


QUICK = {
    "rounds": 3,
    "ceiling_commits": {1000: 60, 10000: 20},
    "commit_target": 2_000, "commit_budget_s": 10,
    "ingress_seconds": 5, "ingress_warmup_s": 1,
    # the full size: 200k rows was ~1.3 s, a quarter of it the query's start and end
    "stream_rows": 1_000_000, "stream_commit_rows": 20_000,
    "e2e_rate": 200, "e2e_seconds": 6, "e2e_receivers": 20,
    "floor_seconds": 6,
}


FULL = {
    "rounds": 3,
    "ceiling_commits": {1000: 300, 10000: 100},
    "commit_target": 101_000, "commit_budget_s": 19 * 60,
    "ingress_seconds": 30, "ingress_warmup_s": 2,
    "stream_rows": 1_000_000, "stream_commit_rows": 20_000,
    "e2e_rate": 500, "e2e_seconds": 30, "e2e_receivers": 50,
    "floor_seconds": 40,
}


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
    lines = [f"relay bench ({res['mode']}) on {g('machine', 'cores')} cores{busy}: "
             f"medians of {res.get('rounds_run')} rounds"]
    lines.append(f"  trueseal acked pushes/s : {res.get('trueseal_acked_pushes_per_s')} "
                 f"(per_connection {g('trueseal', 'per_connection', 'acked_per_s')}, "
                 f"pipelined {g('trueseal', 'pipelined', 'acked_per_s')}; fsync on; relay CPU "
                 f"{g('trueseal', 'pipelined', 'relay_cpu_us_per_push')} us/push pipelined, "
                 f"{g('trueseal', 'per_connection', 'relay_cpu_us_per_push')} us/connection, "
                 f"listener thread busy {g('trueseal', 'per_connection', 'listener_thread_busy')}"
                 f" per connection, {g('trueseal', 'pipelined', 'listener_thread_busy')} "
                 f"pipelined)")
    for shape in ("per_connection", "pipelined"):
        if g("trueseal", shape, "errors"):   # pushes the clients saw fail: say so, and why
            lines.append(f"  trueseal failed pushes  : {shape} {g('trueseal', shape, 'errors')} "
                         f"({', '.join(g('trueseal', shape, 'failures') or [])})")
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
    rn = res.get("ppp_room_store_to_notify_ms") or {}
    lines.append(f"  ppp room messages/s     : {res.get('ppp_room_messages_per_s')} "
                 f"(ROOM_STORED after the inbox commit); STORE_ROOM->ROOM_NOTIFY ms "
                 f"p50 {rn.get('p50')}, p99 {rn.get('p99')}")
    sn = res.get("sync_push_to_notify_ms") or {}
    lines.append(f"  sync pushes/s           : {res.get('sync_pushes_per_s')} "
                 f"(each PUSH_ACK waits for its inbox commit); push->NOTIFY ms "
                 f"p50 {sn.get('p50')}, p99 {sn.get('p99')}")
    lines.append(f"  sync over iroh pushes/s : {res.get('sync_iroh_pushes_per_s')} (stock 0k-sync "
                 f"clients); PUSH_ACK ms p50 {(res.get('sync_iroh_push_ack_ms') or {}).get('p50')} "
                 f"(aioquic {(res.get('sync_push_ack_ms') or {}).get('p50')}); PULLs/s without "
                 f"the stream {res.get('sync_requests_per_s')}")
    ip = res.get("inbox_commit_to_push_ms") or {}
    lines.append(f"  push wake-ups/s         : {res.get('push_wakeups_per_s')} (a backlog of "
                 f"{g('push', 'push_backlog', 'devices')} offline devices, APNs over HTTP/2 on "
                 f"loopback); inbox commit->provider answer ms p50 {ip.get('p50')}, "
                 f"p99 {ip.get('p99')}")
    lines.append(f"  ratios                  : trueseal/ceiling "
                 f"{res.get('trueseal_vs_ceiling_ratio')}, "
                 f"stream/ceiling {res.get('stream_vs_ceiling_ratio')}")
    sf = res.get("spark_floor") or {}
    lines.append(f"  small micro-batch ms p50: ours {g('spark_floor', 'relay', 'batch_ms_p50')}"
                 f" (our sink {g('spark_floor', 'relay', 'sink_ms_p50')}), Spark's floor "
                 f"{g('spark_floor', 'floor', 'batch_ms_p50')}: "
                 f"x{sf.get('relay_over_floor')}")
    missed = {k: v["short_by"] for k, v in (res.get("targets") or {}).items()
              if v["short_by"] and v["short_by"] > 1}
    lines.append("  targets missed (x short): " + (", ".join(
        f"{k} {v}" for k, v in missed.items()) or "none"))
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
                 "machine": machine(os.getloadavg()), "data_dir": str(root)}
    base = settings_for(args, root / "unused")
    res["settings_used"] = {
        "fsync": True, "envelope_bytes": ENVELOPE_SIZE,
        "ingress.max_rows_per_commit": base.ingress.max_rows_per_commit,
        "ingress.commits_per_generation": base.ingress.commits_per_generation,
        "stream.trigger_interval_ms": base.stream.trigger_interval_ms,
        "stream.max_files_per_trigger": base.stream.max_files_per_trigger,
        "stream.max_bytes_per_trigger": base.stream.max_bytes_per_trigger,
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
        say(f"note: load average {res['machine']['loadavg_at_start'][0]} on "
             f"{res['machine']['cores']} cores at start: figures are contended")
    errors: dict[str, str] = {}
    spark = None
    interrupted = False

    loads: dict[int, dict] = {}          # round -> section -> 1-min load before, after
    seconds: dict[str, list] = {}        # section -> its duration in each round

    def section(n: int, load: dict, name: str, fn, *a):
        say(f"{name} ...")
        t = time.perf_counter()
        before = round(os.getloadavg()[0], 2)
        try:
            val = fn(*a)
            took = time.perf_counter() - t
            say(f"{name} done in {took:.1f} s")
            load[name] = [before, round(os.getloadavg()[0], 2)]
            seconds.setdefault(name, []).append(round(took, 1))
            return val
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            errors[f"{name} (round {n})"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            stop_children()
            return None

    rounds = max(1, int(getattr(args, "rounds", None) or p["rounds"]))
    per_round: list[dict] = []
    try:
        def start_spark():
            from jobs.spark_session import get_spark
            t = time.perf_counter()
            s = get_spark(base.stream.master, "relay-bench",
                          extra={"spark.ui.showConsoleProgress": "false"},
                          jvm_options=base.stream.jvm_options)
            s.sparkContext.setLogLevel("ERROR")
            res["spark_start_seconds"] = rounded(time.perf_counter() - t, 1)
            return s
        for n in range(1, rounds + 1):
            say(f"round {n} of {rounds}")
            one: dict = {}
            per_round.append(one)
            loads[n] = one["load"] = {}
            sec = partial(section, n, one["load"])
            work = root / f"round-{n}"
            work.mkdir()
            one["delta_append_ceiling"] = sec("delta append ceiling", tables.bench_ceiling,
                                              work, p)
            one["landing_commit_ms"] = sec("landing commit latency",
                                           tables.bench_commit_latency, work, args, p)
            one["trueseal"] = sec("trueseal ingress", trueseal.bench_ingress, work, args, p)
            if spark is None and n == 1:
                spark = sec("spark start", start_spark)
            if spark is not None:
                one["stream"] = sec("stream throughput", tables.bench_stream, spark, work,
                                    args, p)
                one["push_to_deliver_ms"] = sec("push to deliver", trueseal.bench_e2e, spark,
                                                work, args, p)
            # heya.py: sends/s without Spark; send->HAVE needs the stream (spark).
            one["heya"] = sec("heya", heya.run, settings_for(args, work / "heya"), quick,
                              spark)
            # ppp.py: stores/s without Spark; store->NOTIFY needs the stream
            one["ppp"] = sec("ppp", ppp.run, settings_for(args, work / "ppp"), quick, spark)
            # sync.py: PUSH_ACK waits for the inbox commit: needs the stream
            one["sync"] = sec("sync", sync.run, settings_for(args, work / "sync"), quick,
                              spark)
            # push.py: the push job after the inbox commit: needs the stream
            one["push"] = sec("push", push.run, settings_for(args, work / "push"), quick, spark)
            if spark is not None:
                from jobs import batch_profile
                one["spark_floor"] = sec("spark floor", batch_profile.measure, spark,
                                         p["floor_seconds"])
            headline(one)
            one["targets"] = targets(one)
    except KeyboardInterrupt:
        interrupted = True
        say("interrupted; stopping child processes")
    finally:
        stop_children()
        if spark is not None:
            stop_spark(spark)
        signal.signal(signal.SIGTERM, old_term)

    # every figure is the median over the rounds (relay/bench/rounds.py); each round's
    # headline figures stay beside it, so the spread is visible
    res.update(median_of(per_round) or {})
    res["rounds"] = [{name: t["measured"] for name, t in one.get("targets", {}).items()}
                     | {"delta_append_ceiling_rows_per_s":
                        one.get("delta_append_ceiling_rows_per_s"),
                        "spark_relay_over_floor": (one.get("spark_floor") or {}).get(
                            "relay_over_floor")}
                     for one in per_round]
    res["rounds_run"] = len(per_round)
    res["load"] = {f"round {n}": v for n, v in loads.items()}
    res["section_seconds"] = seconds
    res["targets"] = targets(res)
    res["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["total_seconds"] = rounded(time.time() - started, 1)
    if errors:
        res["errors"] = errors
    if interrupted:
        res["interrupted"] = True
    # Headline fields first, then the details.
    head = ["mode", "trueseal_acked_pushes_per_s", "heya_sends_per_s", "heya_send_to_have_ms",
            "ppp_acked_stores_per_s", "ppp_store_to_notify_ms", "ppp_room_messages_per_s",
            "ppp_room_store_to_notify_ms", "push_wakeups_per_s", "inbox_commit_to_push_ms",
            "trueseal_headline_shape",
            "trueseal_acked_pushes_per_s_by_shape", "push_to_deliver_ms", "stream_envelopes_per_s",
            "landing_commit_ms", "delta_append_ceiling_rows_per_s", "trueseal_vs_ceiling_ratio",
            "stream_vs_ceiling_ratio", "per_connection_vs_pipelined_ratio", "targets",
            "rounds_run", "rounds", "spark_floor", "machine", "load", "section_seconds",
            "settings_used"]
    ordered = {k: res[k] for k in head if k in res}
    ordered.update({k: v for k, v in res.items() if k not in ordered})
    out_path.write_text(json.dumps(ordered, indent=2, default=str) + "\n")
    print(_summary(ordered), flush=True)
    print(f"bench: results in {out_path}", flush=True)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return 130 if interrupted else (1 if errors else 0)
