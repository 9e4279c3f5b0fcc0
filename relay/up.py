"""`relay up`: every role as its own child process on one machine, supervised.

Separate processes, not threads: a crash (or `kill -9`) of one role never takes the others
down, delta-rs must not be inherited across fork (DESIGN.md: children are spawned fresh), and
the same commands run the roles on separate machines. A child that dies is restarted with
backoff. On SIGINT/SIGTERM the children are stopped in data-flow order: ingress first (it
stops accepting and finishes the commits of pushes it is storing, so every acked envelope is in
landing), then the stream, egress and compaction. Nothing acked is lost: what is in landing and
not yet in the inbox is picked up by the next start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from .config import Settings

ROLES = [("ingress", []), ("stream", []), ("egress", []), ("compact", ["--loop"])]
STOP_ORDER = ["ingress", "stream", "egress", "compact"]


class Child:
    def __init__(self, role: str, extra: list[str], conf: str | None, data_dir: str):
        self.role = role
        self.argv = [sys.executable, "-m", "relay.cli"] + (["--conf", conf] if conf else []) + [
            "--data-dir", data_dir, role] + extra
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.ready: dict | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True, bufsize=1)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            line = line.rstrip()
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "ready" in msg:
                self.ready = msg
                where = ", ".join(f"{k} on {v}" for k, v in msg["listening"].items())
                print(f"relay: {self.role} ready{': ' + where if where else ''}", flush=True)
            else:
                print(f"[{self.role}] {line}", flush=True)


def run(settings: Settings, conf: str | None) -> int:
    data_dir = str(settings.data_path)
    os.makedirs(data_dir, exist_ok=True)
    print(f"relay: data directory {data_dir}", flush=True)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    children = {role: Child(role, extra, conf, data_dir) for role, extra in ROLES}
    for child in children.values():
        child.start()
    backoff: dict[str, float] = {}
    while not stopping.is_set():
        for child in children.values():
            code = child.proc.poll()
            if code is not None and not stopping.is_set():
                delay = min(30.0, backoff.get(child.role, 0.5) * 2)
                backoff[child.role] = delay
                print(f"relay: {child.role} exited with {code}; restarting in {delay:.0f}s",
                      flush=True)
                stopping.wait(delay)
                if not stopping.is_set():
                    child.restarts += 1
                    child.start()
        stopping.wait(0.5)
    print("relay: shutting down", flush=True)
    for role in STOP_ORDER:
        proc = children[role].proc
        if proc and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"relay: {role} stopped", flush=True)
    return 0
