"""`relay bench --peer [nostr-relay | nostr-rs-relay]`: our PPP relay and a public Nostr relay
side by side.

Two peers, each a relay a person would otherwise pick for gift-wrapped events:

* `nostr-relay` from PyPI (Python; SQLite in WAL mode, one gunicorn/uvicorn worker),
  installed on first use into its own virtualenv `.venv-peer` next to ours (`pip install`
  of the `peer` extra in pyproject.toml): its dependencies (uvloop, httptools, ...) would
  otherwise change how our uvicorn runs. Run as `nostr-relay serve` with its shipped
  settings, its log at WARNING.
* `nostr-rs-relay` (Rust; tokio, SQLite in WAL mode), built once with cargo into a cache
  outside the repository and run with its shipped config.toml (peer_rs.py).

Ours runs as `relay up` runs PPP: `relay ingress` as a child process (PPP listener, landing
commits with fsync) and the inbox stream in this process; NOTIFY window 0. The same client
shapes against each (`peer_clients.py`, a process of its own, our virtualenv for PPP,
`.venv-peer`'s for Nostr against either peer): 1, 16 and 64 senders each sending one event
after another; then one sender and one recipient online, one event at a time. Each round
and side also measures

* start to first ack: from spawning the relay (ours: `relay ingress`, the stream's Spark
  session already up) to the first acked event of a client that was ready before it;
* idle memory (PSS and RSS of the relay's process tree, IDLE_S after that first ack; ours
  also reports the stream's JVM beside it);
* CPU per acked event in each senders shape (the relay's process tree; ours: the ingress
  tree that acks, with the stream's CPU beside it);
* a crash check: CRASH_SENDERS senders, the relay SIGKILLed under them, then every acked id
  looked for (ours in the Delta tables on disk, the peer's by REQ after a restart on its
  database).

Rounds alternate the order (ours first, then the peer first, ...); each figure is the
median over rounds, and `ours / peer` is printed beside it: for events/s above 1 is better
for us, for milliseconds, CPU and memory below 1 is. What each side has made durable when
it acks is stated in the results (`durability`).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from . import peer_rs
from .harness import CpuMeter, bench_spark, child_ingress_and_stream, jvm_pid, machine, \
    p50_p99, port_of, rounded, say, settings_for, stop_process, stop_spark
from .startup import memory_mib

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".venv-peer"
CLIENTS = Path(__file__).with_name("peer_clients.py")
SENDERS = (1, 16, 64)
SECONDS = 5.0               # per senders shape
EVENTS = 100                # delivery shape, after 20 warm-up events
ROUNDS = 3
IDLE_S = 2.0                # after the first ack, before idle memory is read
CRASH_SENDERS = 16          # the crash check: senders under which the relay is killed
CRASH_AFTER_S = 3.0
# The validators nostr-relay ships enabled (its config.yaml).
PEER_VALIDATORS = ["nostr_relay.validators.is_not_too_large", "nostr_relay.validators.is_signed",
                   "nostr_relay.validators.is_recent", "nostr_relay.validators.is_not_hellthread"]


def peer_requirement() -> list[str]:
    """The `peer` extra of pyproject.toml: the one place its version is pinned."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["peer"]


def ensure_peer() -> Path:
    """The peer's virtualenv, created and installed from PyPI on first use."""
    exe = PEER_VENV / "bin" / "nostr-relay"
    if not exe.exists():
        req = peer_requirement()
        say(f"installing the peer ({', '.join(req)}) into {PEER_VENV} ...")
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "-q", *req], check=True)
    return PEER_VENV


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the peer exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the peer did not open its port within 60 s")


def _start_nostr_relay(work: Path, port: int) -> subprocess.Popen:
    """`nostr-relay serve` on 127.0.0.1:`port` with its shipped settings (one worker, SQLite
    WAL) and a fresh database in `work`."""
    conf = {   # JSON is YAML: the peer reads this file as its config.yaml
        "storage": {"sqlalchemy.url": f"sqlite+aiosqlite:///{work / 'nostr.sqlite3'}",
                    "num_concurrent_reqs": 10, "num_concurrent_adds": 2,
                    "validators": PEER_VALIDATORS},
        "gunicorn": {"bind": f"127.0.0.1:{port}", "workers": 1, "loglevel": "warning",
                     "reload": False},
        "authentication": {"enabled": False},
        "message_timeout": 1800, "subscription_limit": 32, "max_limit": 6000,
        "hellthread_limit": 100,
        "logging": {"version": 1, "root": {"level": "WARNING"},
                    "loggers": {"nostr_relay": {"level": "WARNING"}}},
    }
    (work / "config.json").write_text(json.dumps(conf))
    with open(work / "nostr-relay.log", "a") as log:
        return subprocess.Popen([str(PEER_VENV / "bin" / "nostr-relay"), "-c",
                                 str(work / "config.json"), "serve"], cwd=work, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


@dataclass(frozen=True)
class Peer:
    name: str
    version: str
    durability: str
    ensure: Callable[[], object]              # install or build it (once)
    start: Callable[[Path, int], subprocess.Popen]


OURS_DURABILITY = (
    "STORED after the event's landing commit: the Parquet data file, the Delta commit file "
    "and the table directory are fsynced before the reply (delta_tables/direct_append.py); "
    "an acked event survives a kill of the process and a power loss.")
PEERS = {
    "nostr-relay": Peer(
        "nostr-relay", peer_requirement()[0].split("==")[1],
        "OK after the event's SQLite transaction commits (nostr_relay/storage/db.py "
        "add_event: `async with db.begin()`), in WAL mode with synchronous=NORMAL "
        "(its _set_sqlite_pragma): the commit is written to the WAL file but not fsynced; "
        "SQLite fsyncs the WAL only at a checkpoint. An acked event survives a kill of the "
        "process, not a power loss or kernel crash before the next checkpoint.",
        ensure_peer, _start_nostr_relay),
    peer_rs.NAME: Peer(peer_rs.NAME, peer_rs.VERSION, peer_rs.DURABILITY,
                       lambda: peer_rs.build(say), peer_rs.start),
}


def _cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by the process trees rooted at `pids` (Linux /proc)."""
    meter = CpuMeter()
    procs = meter._procs()
    return sum(meter._tree(procs, pid) for pid in pids)


class _FirstAck:
    """A `first-ack` client, started and ready (imports done) before the relay starts."""

    def __init__(self, python: Path, protocol: str):
        self.proc = subprocess.Popen([str(python), str(CLIENTS), protocol, "--port", "0",
                                      "first-ack"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip():
            raise RuntimeError(f"first-ack client: {self.proc.stderr.read()[-2000:]}")

    def port(self, port: int) -> None:
        self.proc.stdin.write(f"{port}\n")
        self.proc.stdin.flush()

    def acked_at(self) -> float:
        out, err = self.proc.communicate(timeout=120)
        if self.proc.returncode != 0:
            raise RuntimeError(f"first-ack client failed: {err.strip()[-2000:]}")
        return json.loads(out.strip().splitlines()[-1])["acked_at"]


def _clients(python: Path, protocol: str, port: int, *shape: str, stdin: str | None = None) \
        -> dict:
    out = subprocess.run([str(python), str(CLIENTS), protocol, "--port", str(port), *shape],
                         capture_output=True, text=True, timeout=600, input=stdin)
    if out.returncode != 0:
        raise RuntimeError(f"{protocol} clients failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(python: Path, protocol: str, port: int, pids: list[int], seconds: float,
             events: int, stream_pids: list[int] | None = None) -> dict:
    """The senders shapes and the delivery shape, with the CPU the relay's processes
    (`pids`; ours: the ingress tree that acks) used per acked event in each senders shape.
    `stream_pids` (ours): the inbox stream's JVM, whose CPU is reported beside it (with
    this process's own, the stream's driver)."""
    res: dict = {}
    for n in SENDERS:
        cpu0 = _cpu_seconds(pids)
        st0 = (_cpu_seconds(stream_pids) + time.process_time()) if stream_pids else 0.0
        r = _clients(python, protocol, port, "senders", "--clients", str(n),
                     "--seconds", str(seconds))
        cpu = _cpu_seconds(pids) - cpu0
        res[f"senders_{n}"] = {"acked_per_s": rounded(r["acked_per_s"]),
                               "ack_ms": p50_p99(r["ack_ms"]), "acked": r["acked"],
                               "cpu_us_per_event": rounded(cpu / max(1, r["acked"]) * 1e6)}
        if stream_pids:
            st = _cpu_seconds(stream_pids) + time.process_time() - st0
            res[f"senders_{n}"]["stream_cpu_us_per_event"] = rounded(
                st / max(1, r["acked"]) * 1e6)
    r = _clients(python, protocol, port, "delivery", "--events", str(events))
    res["delivery_ms"] = p50_p99(r["delivery_ms"])
    return res


def _memory(pid: int) -> dict:
    m = memory_mib(pid)
    return {"pss_mib": m["pss_mib"], "rss_mib": m["rss_mib"]}


def _idle(pid: int) -> dict:
    """Memory of the relay's process tree IDLE_S after its first ack, before any load."""
    time.sleep(IDLE_S)
    return _memory(pid)


def _crash_load(python: Path, protocol: str, port: int, proc: subprocess.Popen) -> list[str]:
    """CRASH_SENDERS senders against the relay, which is SIGKILLed (its whole process
    group) CRASH_AFTER_S into their run: the ids acked before the kill."""
    client = subprocess.Popen([str(python), str(CLIENTS), protocol, "--port", str(port),
                               "crash", "--clients", str(CRASH_SENDERS), "--seconds",
                               str(CRASH_AFTER_S + 20)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(CRASH_AFTER_S)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    out, err = client.communicate(timeout=120)
    if client.returncode != 0:
        raise RuntimeError(f"crash clients failed: {err.strip()[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])["acked_ids"]


def _landed_ids(data_dir: Path) -> set[str]:
    """Every event id in the relay's Delta tables on disk (landing generations and inbox),
    read with delta-rs as any reader would after the crash."""
    from deltalake import DeltaTable

    from delta_tables import query
    found: set[str] = set()
    for log_dir in (data_dir / "tables").rglob("_delta_log"):
        table = DeltaTable(str(log_dir.parent))
        if "event_id" in [f.name for f in table.schema().fields]:
            for b in query.read(table, ["event_id"]).column(0).to_pylist():
                found.add(bytes(b).hex())
    return found


def fsync_floor_ms(where: Path, n: int = 50) -> dict:
    """What a durable ack costs on this disk at least: a new 1 KiB file written and fsynced,
    then its directory fsynced (a landing commit does this for its data file and its commit
    file: direct_append.py), p50/p99 over `n`. The peer's SQLite in WAL mode with
    synchronous=NORMAL does no fsync before it answers, so this is a floor ours pays and the
    peer does not."""
    where.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fd = os.open(where / f"f{i}", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"x" * 1024)
            os.fsync(fd)
        finally:
            os.close(fd)
        d = os.open(where, os.O_RDONLY)
        try:
            os.fsync(d)
        finally:
            os.close(d)
        out.append((time.perf_counter() - t0) * 1000)
    return p50_p99(out) | {"what": "write 1 KiB + fsync file + fsync directory"}


def _verdict(acked: list[str], found) -> dict:
    lost = [i for i in acked if i not in set(found)]
    return {"acked_before_kill": len(acked), "lost": len(lost)}


def peer_round(peer: Peer, python: Path, work: Path, seconds: float, events: int) -> dict:
    """One round of the peer: start to first ack, idle memory, the shapes, then the crash
    check (kill -9 under load, restart on the same database, REQ the acked ids)."""
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    first = _FirstAck(python, "nostr")
    t0 = time.monotonic()
    proc = peer.start(work, port)
    try:
        first.port(port)
        res: dict = {"start": {"first_ack_ms": rounded((first.acked_at() - t0) * 1000)}}
        res["idle"] = _idle(proc.pid)
        res.update(_measure(python, "nostr", port, [proc.pid], seconds, events))
        acked = _crash_load(python, "nostr", port, proc)
    finally:
        stop_process(proc, 10)
    proc = peer.start(work, port)
    try:
        _wait_port(port, proc)
        found = _clients(python, "nostr", port, "stored", stdin=json.dumps(acked))["found"]
    finally:
        stop_process(proc, 10)
    res["crash"] = _verdict(acked, found)
    return res


def our_round(spark, settings, seconds: float, events: int) -> dict:
    """One round of ours, as `relay up` runs PPP (ingress child + the stream here): start to
    first ack is `relay ingress`'s (spawn -> first STORED; the stream's Spark session is
    already up, `relay bench --startup` measures the whole relay's), idle memory its
    process tree's, then the shapes, then the crash check (the ingress process group
    SIGKILLed under load; the acked ids read from the tables on disk)."""
    python = Path(sys.executable)
    first = _FirstAck(python, "ppp")
    res: dict = {}

    def ready(listening, _proc) -> None:
        first.port(port_of(listening, "ppp"))
        res["start"] = {"first_ack_ms": rounded((first.acked_at() - t0) * 1000)}

    t0 = time.monotonic()
    with child_ingress_and_stream(spark, settings, before_stream=ready) as \
            (listening, _q, _sink, proc):
        port = port_of(listening, "ppp")
        res["idle"] = _idle(proc.pid)
        jvm = jvm_pid()
        res["stream_jvm_idle"] = _memory(jvm) if jvm else None
        res.update(_measure(python, "ppp", port, [proc.pid], seconds, events,
                            stream_pids=[jvm] if jvm else None))
        acked = _crash_load(python, "ppp", port, proc)
    res["crash"] = _verdict(acked, _landed_ids(Path(settings.data_dir)))
    return res


FIGURES = [(f"senders_{n}", key) for n in SENDERS for key in ("acked_per_s", "ack_ms.p50",
                                                               "ack_ms.p99")] \
    + [("delivery_ms", "p50"), ("delivery_ms", "p99")] \
    + [(f"senders_{n}", "cpu_us_per_event") for n in SENDERS] \
    + [("idle", "pss_mib"), ("idle", "rss_mib"), ("start", "first_ack_ms")]


def _get(run: dict, figure: tuple[str, str]):
    v = run.get(figure[0])
    for k in figure[1].split("."):
        v = v.get(k) if isinstance(v, dict) else None
    return v


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of each figure, and ours / peer; the crash check's counts summed
    over the rounds."""
    out = {}
    for fig in FIGURES:
        ours = [v for r in rounds if (v := _get(r.get("ours") or {}, fig)) is not None]
        peer = [v for r in rounds if (v := _get(r.get("peer") or {}, fig)) is not None]
        if not ours and not peer:
            continue
        o = statistics.median(ours) if ours else None
        p = statistics.median(peer) if peer else None
        out[f"{fig[0]}.{fig[1]}"] = {"ours": rounded(o, 2), "peer": rounded(p, 2),
                                     "ours_over_peer": rounded(o / p, 2) if o and p else None}
    for who in ("ours", "peer"):
        checks = [r[who]["crash"] for r in rounds if (r.get(who) or {}).get("crash")]
        if checks:
            out.setdefault("crash", {})[who] = {
                k: sum(c[k] for c in checks) for k in ("acked_before_kill", "lost")}
    return out


def targets(summary: dict) -> dict:
    """The comparison's targets: ours / peer >= 1 in acked/s at 16 and 64 senders; with one
    sender, ack p50 and delivery p50 within 2x of the peer's; nothing acked lost."""
    def ratio(name):
        return (summary.get(name) or {}).get("ours_over_peer")
    out = {}
    for name, bound, better in (("senders_16.acked_per_s", 1.0, "min"),
                                ("senders_64.acked_per_s", 1.0, "min"),
                                ("senders_1.ack_ms.p50", 2.0, "max"),
                                ("delivery_ms.p50", 2.0, "max")):
        r = ratio(name)
        ok = None if r is None else (r >= bound if better == "min" else r <= bound)
        out[name] = {"ours_over_peer": r, "target": f"{'>=' if better == 'min' else '<='} "
                     f"{bound}", "met": ok}
    crash = summary.get("crash") or {}
    out["crash.lost"] = {"ours": (crash.get("ours") or {}).get("lost"),
                         "peer": (crash.get("peer") or {}).get("lost"), "target": 0,
                         "met": all((crash.get(w) or {}).get("lost") == 0
                                    for w in ("ours", "peer"))}
    return out


def main(args) -> int:
    peer = PEERS[args.peer if isinstance(args.peer, str) else "nostr-relay"]
    peer.ensure()
    if getattr(args, "build_only", False):
        say(f"{peer.name} {peer.version} is ready")
        return 0
    client_env = ensure_peer()     # the Nostr clients run in the nostr-relay's virtualenv
    peer_python = client_env / "bin" / "python"
    default_out = "bench-peer.json" if peer.name == "nostr-relay" \
        else f"bench-peer-{peer.name}.json"
    out_path = Path(getattr(args, "out", None) or default_out)
    rounds = max(1, int(getattr(args, "rounds", None) or ROUNDS))
    root = Path(tempfile.mkdtemp(prefix="relay-bench-peer-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(os.getloadavg()),
                 "peer": [f"{peer.name}=={peer.version}"], "seconds_per_shape": SECONDS,
                 "delivery_events": EVENTS,
                 "durability": {"ours": OURS_DURABILITY, "peer": peer.durability},
                 "rounds": []}
    res["disk_fsync_ms"] = fsync_floor_ms(root / "fsync")
    spark = bench_spark(settings_for(args, root / "unused"), "relay-bench-peer")
    try:
        for n in range(rounds):
            one: dict = {}
            order = ("ours", "peer") if n % 2 == 0 else ("peer", "ours")
            for who in order:
                say(f"round {n + 1} of {rounds}: {who}")
                work = root / f"round-{n + 1}" / who
                if who == "peer":
                    one["peer"] = peer_round(peer, peer_python, work, SECONDS, EVENTS)
                else:
                    s = copy.deepcopy(base)
                    s.data_dir = str(work / "data")
                    s.heya.enabled = s.sync.enabled = False
                    s.ppp.notify_window_ms = 0
                    one["ours"] = our_round(spark, s, SECONDS, EVENTS)
            res["rounds"].append(one)
    finally:
        stop_spark(spark)
    res["summary"] = summarize(res["rounds"])
    res["targets"] = targets(res["summary"])
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    say(f"{'figure':<32}{'ours':>12}{'peer':>12}{'ours/peer':>11}")
    for name, v in res["summary"].items():
        if name != "crash":
            say(f"{name:<32}{v['ours']!s:>12}{v['peer']!s:>12}{v['ours_over_peer']!s:>11}")
    say(f"crash check (acked before kill -9, lost): {res['summary'].get('crash')}")
    say(f"wrote {out_path}")
    return 0
