"""`relay bench --state`: the stream's state in Spark's state store as it grows.

The stateful part of the stream (jobs/stream_state.decided: the JVM processor over the RocksDB
state store, the checkpoint on local disk) is fed synthetic landing rows (32-byte random event
ids, 50,000 mailboxes, 16-byte envelopes, 100,000 rows a micro-batch) until the state holds
each size of live event ids, in a process of its own; then:

- `stream_rss_mib`: the resident memory of that process's whole tree (the Python driver, the
  JVM with its executors' RocksDB) once the state holds the size, while the state store's
  maintenance runs with the query still up (20 s: it uploads the snapshot a restart loads):
  the median of 10 samples, 2 s apart (`stream_rss_mib_samples`), since the JVM's heap alone
  moves by 100 MiB and more between collections;
- `state_memory_mib`: RocksDB's own memory (block cache and memtables, Spark's
  `memoryUsedBytes`), which the bounded budget caps;
- `fill_last_batch`: where the last 100k-row batch of the fill spent its time, by part;
- `restart_to_first_batch_s`: a new process on the same checkpoint, from its start to the end
  of its first micro-batch (one new file), the state restored from the checkpoint.

The batches are consumed by Spark's `noop` sink, not the inbox sink: what is measured is the
state, not the Delta writes (which `relay bench` measures). Results -> bench-state.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS_PER_FILE = 100_000
MAILBOXES = 50_000


def _tree_rss_mib(pid: int) -> float:
    """RSS of `pid` and every descendant (from /proc), in MiB."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(entry))
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total / (1 << 20)


def _write_files(src: Path, start: int, count: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from delta_tables.schema import C, LANDING_SOURCE
    schema = LANDING_SOURCE.arrow_schema()
    rng = np.random.default_rng(start)
    now = int(time.time() * 1_000_000)
    for i in range(start, start + count):
        n = ROWS_PER_FILE
        ids = rng.integers(0, 256, (n, 32), dtype=np.uint8)
        mbx = rng.integers(0, MAILBOXES, n)
        cols = {
            C.EVENT_ID: pa.array([r.tobytes() for r in ids], pa.binary()),
            C.PROTOCOL: pa.array(["trueseal"] * n),
            C.MAILBOX: pa.array([b"m%09d" % m for m in mbx], pa.binary()),
            C.ENVELOPE: pa.array([b"e" * 16] * n, pa.binary()),
            C.RECEIVED_AT: pa.array(np.full(n, now), pa.int64()).cast(pa.timestamp("us", "UTC")),
            C.EXPIRES_AT: pa.array(np.full(n, now + 86400 * 10**6), pa.int64())
            .cast(pa.timestamp("us", "UTC")),
            C.LANDING_TABLE: pa.array(["bench/g000001"] * n),
            C.LANDING_VERSION: pa.array(np.full(n, i), pa.int64()),
        }
        table = pa.table({f.name: cols.get(f.name, pa.nulls(n, f.type)) for f in schema},
                         schema=schema)
        pq.write_table(table, src / f".part-{i:06d}.parquet")
        os.rename(src / f".part-{i:06d}.parquet", src / f"part-{i:06d}.parquet")


def _child(workdir: str, files: int, start: int) -> None:
    """Add `files` files from `start` on, run the stream over what is new, print figures."""
    t0 = time.perf_counter()
    from jobs.inbox_transform import StreamRules
    from jobs.spark_session import get_spark, stream_jvm_options
    from jobs.stream_state import decided
    from delta_tables.schema import LANDING_SOURCE

    work = Path(workdir)
    src = work / "in"
    src.mkdir(exist_ok=True)
    _write_files(src, start, files)
    write_s = time.perf_counter() - t0
    # the JVM options of a stream with its state in the state store (the full JIT), then
    # RELAY_BENCH_JVM_OPTIONS ("-XX:TieredStopAtLevel=1": C1 only, as on the driver path)
    spark = get_spark("local[2]", "relay-bench-state", jvm_options=stream_jvm_options(
        True, os.environ.get("RELAY_BENCH_JVM_OPTIONS", "")))
    rules = StreamRules(max_ttl_us=7 * 86400 * 10**6)
    first: list[float] = []

    def batch(df, _batch_id):
        df.write.format("noop").mode("overwrite").save()
        if not first:
            first.append(time.perf_counter() - t0 - write_s)

    stream = (spark.readStream.schema(LANDING_SOURCE.spark_schema())
              .option("maxFilesPerTrigger", 1).parquet(str(src)))
    t1 = time.perf_counter()
    query = (decided(stream, rules).writeStream.foreachBatch(batch)
             .option("checkpointLocation", str(work / "ckpt"))
             .start())
    query.processAllAvailable()
    run_s = time.perf_counter() - t1
    if files > 1:
        # A running stream's state store maintenance uploads the newest snapshot every
        # stateStore.maintenanceInterval, as in a relay that stays up: keep the query running
        # while it does. (An availableNow query ends at once and unloads its state stores, so
        # nothing is uploaded and the restart replays every batch's changelog.)
        samples = []
        for _ in range(10):              # the tree's RSS every 2 s of those 20: the JVM's
            time.sleep(2)                # heap moves by 100 MiB and more between collections
            samples.append(_tree_rss_mib(os.getpid()))
    else:
        samples = [_tree_rss_mib(os.getpid())]
    query.stop()
    progress = query.lastProgress or {}
    state = (progress.get("stateOperators") or [{}])[0]
    # where a batch's time went (Spark's durationMs) and the state store's own metrics
    # (load, lookups, block cache misses, commit): the first batch of a restart is the one
    # that restores the state
    shown = [p for p in query.recentProgress if p.get("numInputRows")]
    first_progress = shown[0] if shown else progress
    first_state = (first_progress.get("stateOperators") or [{}])[0]
    # and of the fill's last full batch, warm: where a batch's time goes once the JVM has
    # compiled the path (the cost of each part of the stateful stage)
    last_progress = shown[-1] if shown else progress
    last_state = (last_progress.get("stateOperators") or [{}])[0]
    samples.sort()
    out = {"rss_mib": round(samples[len(samples) // 2], 1),
           "rss_mib_samples": [round(x, 1) for x in samples],
           "first_batch_s": round(first[0], 2) if first else None,
           "rows": files * ROWS_PER_FILE, "run_s": round(run_s, 2),
           "rows_per_s": round(files * ROWS_PER_FILE / run_s),
           "state_rows": state.get("numRowsTotal") or None,   # 0: not tracked (spark_session)
           "state_memory_mib": round((state.get("memoryUsedBytes") or 0) / (1 << 20), 1),
           "first_batch_duration_ms": first_progress.get("durationMs"),
           "first_batch_state_metrics": {
               k: v for k, v in (first_state.get("customMetrics") or {}).items() if v},
           "first_batch_state_ms": {k: first_state.get(k) for k in (
               "allUpdatesTimeMs", "allRemovalsTimeMs", "commitTimeMs")},
           "last_batch": _parts(last_progress, last_state)}
    spark.stop()
    print("STATE-RESULT " + json.dumps(out), flush=True)


def _parts(progress: dict, state: dict) -> dict:
    """One batch's time by part, in ms: the whole batch (Spark's addBatch, wall time), and,
    summed over the batch's tasks (2 run at once on `local[2]`), the stateful operator's work
    on the rows (`allUpdatesTimeMs`: the processor with its encoders, sort and state calls), of
    which RocksDB's gets and puts, and the state store's commit."""
    metrics = state.get("customMetrics") or {}
    d = progress.get("durationMs") or {}
    return {"rows": progress.get("numInputRows"), "add_batch_ms": d.get("addBatch"),
            "trigger_ms": d.get("triggerExecution"),
            "operator_task_ms": state.get("allUpdatesTimeMs"),
            "rocksdb_get_task_ms": metrics.get("rocksdbGetLatency"),
            "rocksdb_put_task_ms": metrics.get("rocksdbPutLatency"),
            "rocksdb_gets": metrics.get("rocksdbGetCount"),
            "rocksdb_puts": metrics.get("rocksdbPutCount"),
            "state_commit_task_ms": state.get("commitTimeMs")}


def child_result(module_args: list[str], marker: str, timeout: float = 3600) -> dict:
    """`python -m <module_args>` in a session of its own, killed whole once it has exited,
    and the JSON it printed after `marker`: a Spark child's JVM has been seen to outlive its
    Python, holding the output pipe open (and the bench waiting for ever)."""
    import signal
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", *module_args], stdout=out, stderr=err,
                                text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        for line in out.read().splitlines():
            if line.startswith(marker):
                return json.loads(line[len(marker):])
        raise RuntimeError(f"{module_args[0]} child failed: {err.read()[-2000:]}")


def _run_child(workdir: Path, files: int, start: int) -> dict:
    return child_result(["relay.bench.state", str(workdir), str(files), str(start)],
                        "STATE-RESULT ")


def measure(sizes: tuple[int, ...]) -> dict:
    """state_scaling for each size (live event ids), in one checkpoint that grows."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="relay-bench-state-") as tmp:
        work = Path(tmp)
        have = 0
        for size in sizes:
            files = (size - have) // ROWS_PER_FILE
            fill = _run_child(work, files, have // ROWS_PER_FILE)
            have = size
            restart = _run_child(work, 1, have // ROWS_PER_FILE)   # one new file: 100k more
            have += ROWS_PER_FILE
            rows.append({"live_event_ids": size, "stream_rss_mib": fill["rss_mib"],
                         "restart_to_first_batch_s": restart["first_batch_s"],
                         "stream_rss_mib_samples": fill["rss_mib_samples"],
                         "restart_rss_mib": restart["rss_mib"],
                         "fill_rows_per_s": fill["rows_per_s"],
                         "fill_last_batch": fill["last_batch"],
                         "state_rows": fill["state_rows"],
                         "state_memory_mib": fill["state_memory_mib"],
                         "restart_batch_duration_ms": restart["first_batch_duration_ms"],
                         "restart_state_metrics": restart["first_batch_state_metrics"],
                         "restart_state_ms": restart["first_batch_state_ms"]})
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(work / "in", ignore_errors=True)   # read already; keep the disk
            (work / "in").mkdir()
    first, last = rows[0], rows[-1]
    millions = (last["live_event_ids"] - first["live_event_ids"]) / 1e6
    return {"state_scaling": rows,
            "rss_growth_mib_per_million_ids": round(
                (last["stream_rss_mib"] - first["stream_rss_mib"]) / millions, 1),
            "restart_ratio_last_to_first": round(
                last["restart_to_first_batch_s"] / first["restart_to_first_batch_s"], 2)}


def main(args) -> int:
    sizes = (200_000, 1_000_000) if args.quick else (1_000_000, 5_000_000)
    result = {"section": "state", "sizes": list(sizes), **measure(sizes),
              "targets": {"rss_growth_mib_per_million_ids": 20,
                          "restart_ratio_last_to_first": 1.5}}
    out = Path(args.out or "bench-state.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bench --state: {out}")
    return 0


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
