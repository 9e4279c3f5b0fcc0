"""`relay bench --peer`: our PPP relay and the public Nostr relay `nostr-relay` side by side.

Issue 20 compares us with the relay a person would otherwise pick for gift-wrapped events:
`nostr-relay` from PyPI (SQLite in WAL mode, one gunicorn/uvicorn worker). This command lets
every user check that comparison on their own machine:

* The peer is installed on first use into its own virtualenv `.venv-peer` next to ours
  (`pip install` of the `peer` extra in pyproject.toml, from PyPI): its dependencies
  (uvloop, httptools, ...) would otherwise change how our uvicorn runs.
* Ours runs as `relay up` runs PPP: `relay ingress` as a child process (PPP listener,
  landing commits with fsync) and the inbox stream in this process; NOTIFY window 0.
  The peer runs as `nostr-relay serve` with its shipped settings, its log at WARNING.
* The same client shapes against each (`peer_clients.py`, a process of its own, our
  virtualenv for PPP, the peer's for Nostr): 1, 16 and 64 senders each sending one event
  after another; then one sender and one recipient online, one event at a time.
* Rounds alternate the order (ours first, then the peer first, ...); each figure is the
  median over rounds, and `ours / peer` is printed beside it: for events/s above 1 is
  better for us, for milliseconds below 1 is.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from datetime import datetime, timezone
from pathlib import Path

from .harness import child_ingress_and_stream, machine, p50_p99, port_of, rounded, say, \
    settings_for, stop_process, stop_spark

REPO = Path(__file__).resolve().parents[2]
PEER_VENV = REPO / ".venv-peer"
CLIENTS = Path(__file__).with_name("peer_clients.py")
SENDERS = (1, 16, 64)
SECONDS = 5.0               # per senders shape
EVENTS = 100                # delivery shape, after 20 warm-up events
ROUNDS = 3
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


@contextlib.contextmanager
def peer_server(work: Path):
    """`nostr-relay serve` on a free loopback port with its shipped settings (one worker,
    SQLite WAL) and a fresh database; yields the port."""
    work.mkdir(parents=True, exist_ok=True)
    port = _free_port()
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
    log = open(work / "nostr-relay.log", "w")
    proc = subprocess.Popen([str(PEER_VENV / "bin" / "nostr-relay"), "-c",
                             str(work / "config.json"), "serve"], cwd=work, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(port, proc)
        yield port
    finally:
        stop_process(proc, 10)
        log.close()


@contextlib.contextmanager
def our_server(spark, settings):
    with child_ingress_and_stream(spark, settings) as (listening, _q, _sink, _proc):
        yield port_of(listening, "ppp")


def _clients(python: Path, protocol: str, port: int, *shape: str) -> dict:
    out = subprocess.run([str(python), str(CLIENTS), protocol, "--port", str(port), *shape],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{protocol} clients failed: {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _measure(python: Path, protocol: str, port: int, seconds: float, events: int) -> dict:
    res: dict = {}
    for n in SENDERS:
        r = _clients(python, protocol, port, "senders", "--clients", str(n),
                     "--seconds", str(seconds))
        res[f"senders_{n}"] = {"acked_per_s": rounded(r["acked_per_s"]),
                               "ack_ms": p50_p99(r["ack_ms"]), "acked": r["acked"]}
    r = _clients(python, protocol, port, "delivery", "--events", str(events))
    res["delivery_ms"] = p50_p99(r["delivery_ms"])
    return res


FIGURES = [(f"senders_{n}", key) for n in SENDERS for key in ("acked_per_s", "ack_ms.p50",
                                                               "ack_ms.p99")] \
    + [("delivery_ms", "p50"), ("delivery_ms", "p99")]


def _get(run: dict, figure: tuple[str, str]):
    v = run[figure[0]]
    for k in figure[1].split("."):
        v = v[k]
    return v


def summarize(rounds: list[dict]) -> dict:
    """Medians over rounds of each figure, and ours / peer."""
    out = {}
    for fig in FIGURES:
        ours = [_get(r["ours"], fig) for r in rounds if r.get("ours")]
        peer = [_get(r["peer"], fig) for r in rounds if r.get("peer")]
        o = statistics.median(ours) if ours else None
        p = statistics.median(peer) if peer else None
        out[f"{fig[0]}.{fig[1]}"] = {"ours": rounded(o, 2), "peer": rounded(p, 2),
                                     "ours_over_peer": rounded(o / p, 2) if o and p else None}
    return out


def main(args) -> int:
    from jobs.spark_session import get_spark

    out_path = Path(getattr(args, "out", None) or "bench-peer.json")
    rounds = max(1, int(getattr(args, "rounds", None) or ROUNDS))
    peer_env = ensure_peer()
    peer_python = peer_env / "bin" / "python"
    root = Path(tempfile.mkdtemp(prefix="relay-bench-peer-"))
    res: dict = {"started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "machine": machine(os.getloadavg()),
                 "peer": peer_requirement(), "seconds_per_shape": SECONDS,
                 "delivery_events": EVENTS, "rounds": []}
    base = settings_for(args, root / "unused")
    spark = get_spark(base.stream.master, "relay-bench-peer",
                      extra={"spark.ui.showConsoleProgress": "false"},
                      jvm_options=base.stream.jvm_options)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        for n in range(rounds):
            one: dict = {}
            order = ("ours", "peer") if n % 2 == 0 else ("peer", "ours")
            for who in order:
                say(f"round {n + 1} of {rounds}: {who}")
                work = root / f"round-{n + 1}" / who
                if who == "peer":
                    with peer_server(work) as port:
                        one["peer"] = _measure(peer_python, "nostr", port, SECONDS, EVENTS)
                else:
                    s = copy.deepcopy(base)
                    s.data_dir = str(work / "data")
                    s.heya.enabled = s.sync.enabled = False
                    s.ppp.notify_window_ms = 0
                    with our_server(spark, s) as port:
                        one["ours"] = _measure(Path(sys.executable), "ppp", port, SECONDS,
                                               EVENTS)
            res["rounds"].append(one)
    finally:
        stop_spark(spark)
    res["summary"] = summarize(res["rounds"])
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    say(f"{'figure':<28}{'ours':>12}{'peer':>12}{'ours/peer':>11}")
    for name, v in res["summary"].items():
        say(f"{name:<28}{v['ours']!s:>12}{v['peer']!s:>12}{v['ours_over_peer']!s:>11}")
    say(f"wrote {out_path}")
    return 0
