"""The harness every `relay bench` section runs on: results, child processes, Spark.

* Results: `percentile`, `rounded` (JSON figures), `say` (progress lines), `machine` (what
  the figures were measured on).
* Load generators run in processes started with `spawn` (delta-rs must not be forked):
  `spawn` starts one and remembers it in `children`, `stop_children` stops all of them (on
  exit, error and Ctrl-C); `gather_workers`, `wait_result` and `collect` wait for what they
  put on their queue.
* Relay roles run as child processes, as `relay up` runs them: `settings_for` (a section's
  settings, every port ephemeral), `write_conf` (those settings as the child's TOML file),
  `start_role`, and `child_ingress_and_stream` (`relay ingress` as a child, the inbox stream
  in this process on the same data directory).
* While a section runs: `CpuMeter` (CPU of process trees and the machine), the stream's
  batches and Spark's durations (`batches_after`, `durations_ms`, `last_batch`), `stop_spark`.

A protocol's module (`trueseal.py`, `heya.py`, `ppp.py`, `sync.py`) and `tables.py` build on
this and on nothing of each other; `run.py` runs them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import platform
import queue as queue_mod
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from runtime import config
from runtime.role import role_collector

ENVELOPE_SIZE = 600                 # landing rows and trueseal pushes (bytes)
MAILBOXES = 10_000                  # mailboxes the landing rows and pushes are spread over

children: list = []                 # Popen and mp.Process objects to stop on exit


# --- results -------------------------------------------------------------------------------------

def percentile(values, q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def rounded(x, nd: int = 1):
    return None if x is None else round(float(x), nd)


def p50_p99(values) -> dict:
    return {"p50": rounded(percentile(values, 50)), "p99": rounded(percentile(values, 99))}


def say(msg: str) -> None:
    print(f"bench: {msg}", flush=True)


def machine(loadavg: tuple[float, float, float]) -> dict:
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
        "cores": cores, "memory_gb": rounded(mem_kb / 1024 / 1024, 1) if mem_kb else None,
        "cpu_model": model or platform.processor(), "python": platform.python_version(),
        "pyspark": pyspark.__version__, "deltalake": deltalake.__version__,
        "pyarrow": pa.__version__, "platform": platform.platform(),
        "loadavg_at_start": [round(x, 2) for x in loadavg],
        # Something else was using at least half the cores when we started.
        "contended": loadavg[0] >= cores / 2,
    }


# --- child processes: load generators (spawned) and relay roles ------------------------------

def spawn(target, *args) -> mp.Process:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    children.append(proc)
    return proc


def stop_children() -> None:
    for child in reversed(children):
        try:
            if isinstance(child, subprocess.Popen):
                stop_process(child, 20)
            else:   # multiprocessing.Process
                if child.is_alive():
                    child.terminate()
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()
                    child.join(timeout=5)
        except Exception:
            pass
    children.clear()


def stop_process(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM a child relay role if it still runs; SIGKILL it after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@dataclass
class Window:
    """What a landing appender committed while the load ran, after its warm-up."""
    seconds: float                 # the measured window, wall clock
    commits: int
    rows: int
    cpu_seconds: float             # this process's CPU in the window (the relay's, when here)
    commit_seconds: list[float]    # latency of each commit in the window
    # CPU of the event loop's own thread (the listener's, when the node runs here): at ~1 per
    # second the listener is bound by its one thread, whatever cores are left
    loop_cpu_seconds: float = 0.0

    def figures(self) -> dict:
        """What every throughput section reports of its window."""
        return {"measured_seconds": rounded(self.seconds, 2),
                "group_commits_in_window": self.commits,
                "rows_per_commit_mean": rounded(self.rows / max(1, self.commits), 1),
                "relay_cpu_cores": rounded(self.cpu_seconds / self.seconds, 2),
                "listener_thread_busy": rounded(self.loop_cpu_seconds / self.seconds, 2)}


def per_second(results: list[dict], warm: int, duration: int) -> list[int]:
    """Counts per second of the measured window (after `warm`), summed over the client
    processes, each of which reports its counts per 100 ms (`buckets`)."""
    buckets = np.sum([r["buckets"] for r in results], axis=0)
    return [int(buckets[i:i + 10].sum()) for i in range(warm * 10, duration * 10 - 9, 10)]


async def measure_appender(appender, go, warm: float, duration: float) -> Window:
    """Release the load generators (`go`), let them warm up for `warm` s, then count what
    `appender` (a node's landing group commit) committed in the `duration - warm` s after."""
    go.set()
    await asyncio.sleep(warm)
    c0, r0 = appender.commits, appender.rows_committed
    cpu0, loop0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
    await asyncio.sleep(duration - warm)
    c1, r1 = appender.commits, appender.rows_committed
    cpu1, loop1, t1 = time.process_time(), time.thread_time(), time.perf_counter()
    commit_s = list(appender.commit_seconds)[-(c1 - c0):] if c1 > c0 else []
    return Window(t1 - t0, c1 - c0, r1 - r0, cpu1 - cpu0, commit_s, loop1 - loop0)


async def gather_workers(queue, procs, timeout: float) -> list[dict]:
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


@contextlib.asynccontextmanager
async def serving(node):
    """An in-process node, started and run with the cyclic collector as `relay up`'s roles run
    it (`runtime.role.role_collector`), so a section measures what a role runs; closed on
    leaving."""
    await node.start()
    try:
        with role_collector():
            yield node
    finally:
        await node.close()


async def join_all(procs, timeout: float) -> None:
    """Join (else terminate) client processes without blocking the event loop: a listener in
    this process must keep serving their closes, or each join waits out its timeout."""
    def join() -> None:
        for pr in procs:
            pr.join(timeout)
            if pr.is_alive():
                pr.terminate()
    await asyncio.to_thread(join)


def wait_result(queue, proc, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except queue_mod.Empty:
            if not proc.is_alive() and queue.empty():
                raise RuntimeError(f"client process exited ({proc.exitcode}) without a result")
    raise TimeoutError("client process did not report in time")


def collect(queue, procs, n: int, timeout: float, key: str = "ok") -> list[dict]:
    """`n` messages from the workers (a failed worker's error is raised)."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("bench client processes did not report in time")
        try:
            msg = queue.get(timeout=1.0)
        except queue_mod.Empty:
            if not any(p.is_alive() for p in procs) and queue.empty():
                raise RuntimeError("bench client processes exited without a result")
            continue
        if msg.get("ok") is False:
            raise RuntimeError(f"bench client failed: {msg.get('error')}")
        out.append(msg)
    return out


PORT_ENV = {"RELAY_TRUESEAL_PUSH_PORT": "0", "RELAY_TRUESEAL_RECEIVE_PORT": "0",
             "RELAY_HEYA_PORT": "0", "RELAY_SYNC_PORT": "0", "RELAY_PPP_PORT": "0",
             "RELAY_SYNC_IROH_PORT": "0",
             "RELAY_METRICS_PORT_INGRESS": "0",
             "RELAY_METRICS_PORT_EGRESS": "0", "RELAY_METRICS_PORT_STREAM": "0",
             "RELAY_METRICS_PORT_COMPACT": "0", "RELAY_METRICS_PORT_PUSH": "0"}


def settings_for(args, data_dir: Path) -> config.Settings:
    s = config.load(getattr(args, "conf", None), data_dir=str(data_dir))
    for section, key in (("trueseal", "push_port"), ("trueseal", "receive_port"),
                         ("heya", "port"), ("ppp", "port"), ("sync", "port"), ("sync", "iroh_port"),
                         ("metrics", "ingress_port"),
                         ("metrics", "egress_port"), ("metrics", "stream_port"),
                         ("metrics", "compact_port")):
        obj = getattr(s, section, None)
        if obj is not None and hasattr(obj, key):
            setattr(obj, key, 0)
    return s


def write_conf(settings: config.Settings, path: Path) -> Path:
    """`settings` as a TOML file for a child `relay` role (`start_role(conf=path)`): the
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


def start_role(role: str, args, data_dir: Path, log_dir: Path,
                conf: Path | None = None) -> tuple[subprocess.Popen, dict]:
    """`relay <role>` as a child process; `conf` (else `args.conf`) is its settings file."""
    argv = [sys.executable, "-m", "relay.cli"]
    if conf or getattr(args, "conf", None):
        argv += ["--conf", str(conf or args.conf)]
    argv += ["--data-dir", str(data_dir), role]
    env = dict(os.environ, **PORT_ENV)
    log = open(log_dir / f"{role}.log", "w")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)   # our Ctrl-C is handled by us, not them
    children.append(proc)
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


def bench_spark(settings, name: str):
    """The bench's SparkSession (the stream's master and JVM options from `settings`),
    quiet: no console progress, ERROR logs."""
    from jobs.spark_session import get_spark
    spark = get_spark(settings.stream.master, name,
                      extra={"spark.ui.showConsoleProgress": "false"},
                      jvm_options=settings.stream.jvm_options)
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def cargo(what: str) -> str:
    """cargo's path, to build `what` (a benchmark peer); a clear error without it."""
    import shutil
    path = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(path).exists():
        raise RuntimeError(f"building {what} needs cargo (https://rustup.rs)")
    return path


def port_of(listening: dict, name: str) -> int:
    return int(listening[name].rsplit(":", 1)[1])


@contextlib.contextmanager
def child_ingress_and_stream(spark, settings, before_stream=None):
    """`relay ingress` as a child process, its settings from a TOML file written next to its
    data directory, and the inbox stream in this process on the same data directory. Yields
    (listening, query, sink, ingress Popen); stops the relay, then the stream.
    `before_stream(listening, proc)` runs once ingress is ready, before the stream starts."""
    from delta_tables.layout import Layout
    from jobs.inbox_stream import start_inbox_stream

    data_dir = Path(settings.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    conf = write_conf(settings, data_dir.with_name(data_dir.name + ".toml"))
    Layout.of(settings).ensure_shared_tables()
    proc, listening = start_role("ingress", None, data_dir, data_dir, conf=conf)
    query = None
    try:
        if before_stream is not None:
            before_stream(listening, proc)
        query, sink = start_inbox_stream(spark, settings)
        yield listening, query, sink, proc
        if query.exception():
            raise RuntimeError(f"stream failed: {query.exception()}")
    finally:
        stop_process(proc, 40)      # first the relay (pushes in flight need the stream) ...
        if proc in children:
            children.remove(proc)
        if query is not None:       # ... then the stream
            try:
                query.stop()
            except Exception:
                pass


# --- Spark and the machine while a section runs --------------------------------------------

def stop_spark(spark) -> None:
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


class CpuMeter:
    """CPU seconds used between `start()` and `stop()` by process trees (Linux /proc) and by
    the whole machine, as cores (seconds of CPU per second of wall clock)."""

    def __init__(self, **pids: int):
        self.pids = pids

    @staticmethod
    def _procs() -> dict[int, tuple[int, float]]:
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(d.name)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
        return out

    @staticmethod
    def _machine() -> tuple[float, float]:
        f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return float(sum(f) - f[3] - f[4]), float(sum(f))

    def _tree(self, procs, root: int) -> float:
        kids: dict[int, list[int]] = {}
        for pid, (ppid, _) in procs.items():
            kids.setdefault(ppid, []).append(pid)
        total, todo = 0.0, [root]
        while todo:
            pid = todo.pop()
            if pid in procs:
                total += procs[pid][1]
            todo += kids.get(pid, [])
        return total

    def _snap(self) -> dict:
        procs = self._procs()
        snap = {name: self._tree(procs, pid) for name, pid in self.pids.items()}
        snap["bench_process"] = time.process_time()   # its own threads only (not children)
        snap["_machine"] = self._machine()
        snap["_t"] = time.perf_counter()
        return snap

    def start(self) -> None:
        self.a = self._snap()

    def stop(self) -> dict:
        b = self._snap()
        wall = b["_t"] - self.a["_t"]
        busy = b["_machine"][0] - self.a["_machine"][0]
        total = b["_machine"][1] - self.a["_machine"][1]
        out = {k: rounded((b[k] - self.a[k]) / wall, 2) for k in b if not k.startswith("_")}
        out["machine_busy"] = rounded(busy / max(1.0, total) * (os.cpu_count() or 1), 2)
        out["machine_cores"] = os.cpu_count()
        return out


def jvm_pid() -> int | None:
    try:
        from pyspark import SparkContext
        return SparkContext._gateway.proc.pid
    except Exception:
        return None


def batches_after(sink, after_id: int) -> list:
    return [h for h in sink.history if h.batch_id > after_id and h.rows_in]


def durations_ms(query, ids: set[int]) -> dict[str, float | None]:
    """p50 of each part of Spark's durationMs (triggerExecution = latestOffset + planning +
    addBatch, i.e. foreachBatch, + WAL/commit log) over batches `ids` (numInputRows stays 0:
    the sink reads small batches' files itself)."""
    parts: dict[str, list[float]] = {}
    for pr in (dict(x) for x in query.recentProgress):
        if pr.get("batchId") in ids:
            for k, v in (pr.get("durationMs") or {}).items():
                parts.setdefault(k, []).append(v)
    return {k: rounded(percentile(v, 50)) for k, v in sorted(parts.items())}


def last_batch(sink) -> int:
    return sink.history[-1].batch_id if sink.history else -1
