"""`relay up` as an operator runs it, for the tests: a free port per listener and metrics
endpoint (RELAY_* variables), a data directory, stdout and stderr collected line by line, the
supervisor's JSON events (RELAY_LOG_FORMAT=json) read from stdout."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

# `relay up`'s processes by default: one ingress per protocol (ingress.process_per_protocol)
INGRESS_ROLES = ("ingress-trueseal", "ingress-heya", "ingress-ppp", "ingress-sync")
ROLES = INGRESS_ROLES + ("stream", "egress", "push", "compact")
# the variable that sets a role's metrics port (ingress-trueseal uses ingress's: trueseal push)
METRICS_PORT_VAR = {r: "RELAY_METRICS_PORT_" + ("INGRESS" if r == "ingress-trueseal" else
                                                r.upper().replace("-", "_")) for r in ROLES}
LISTENERS = ("TRUESEAL_PUSH", "TRUESEAL_RECEIVE", "HEYA", "PPP", "SYNC", "SYNC_IROH")


def _ephemeral_range() -> range:
    try:
        lo, hi = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
        return range(lo, hi + 1)
    except (OSError, ValueError):
        return range(32768, 61000)


_chosen: set[int] = set()   # every port handed out in this process: never the same twice


def free_port() -> int:
    """A port free now and below the kernel's ephemeral range. `relay up` binds some ports
    seconds after the test chose them (the roles after ingress start once it serves); a port
    from the ephemeral range could meanwhile be taken by any bind(0) or outgoing connection
    (the Spark JVM's, say), one from below it only by someone asking for that very port.
    Not one handed out before: a relay's ~15 ports drawn from 12,000 would otherwise repeat
    one in about 1% of relays, and its second role could not bind it."""
    eph = _ephemeral_range()
    top = min(eph.start, 32768)
    for _ in range(200):
        port = random.randrange(max(1024, top - 12000), top)
        if port in _chosen:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _chosen.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RelayUp:
    def __init__(self, data: Path, *, log_format: str = "json", **env: str):
        self.data = Path(data)
        self.ports = {name: free_port() for name in LISTENERS}
        self.metrics_ports = {role: free_port() for role in ROLES}
        self.env = dict(os.environ, RELAY_DATA_DIR=str(self.data), RELAY_LOG_FORMAT=log_format,
                        **{f"RELAY_{k}_PORT": str(v) for k, v in self.ports.items()},
                        **{METRICS_PORT_VAR[r]: str(p) for r, p in self.metrics_ports.items()},
                        **env)
        self.env.pop("RELAY_SUPERVISED", None)
        self.proc: subprocess.Popen | None = None
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._events: queue.Queue[dict] = queue.Queue()
        self.events: list[dict] = []

    def cli(self, *args: str) -> str:
        """Run another `relay` command against the same settings; its stdout."""
        return subprocess.run([sys.executable, "-m", "relay.cli", *args], env=self.env,
                              capture_output=True, text=True, check=True).stdout

    def start(self) -> "RelayUp":
        # Its own process group, as a shell job is: a test can signal the group like Ctrl-C.
        self.proc = subprocess.Popen([sys.executable, "-m", "relay.cli", "up"], env=self.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout, True),
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr, False),
                         daemon=True).start()
        return self

    def _pump(self, stream, into: list[str], events: bool) -> None:
        for line in stream:
            into.append(line)
            if events:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and "event" in msg:
                    self._events.put(msg)

    def wait_event(self, event: str, timeout: float = 240.0, *, nth: int = 1,
                   **fields) -> dict:
        """The `nth` event named `event` whose fields include `fields`."""
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in self.events if e["event"] == event
                     and all(e.get(k) == v for k, v in fields.items())]
            if len(found) >= nth:
                return found[nth - 1]
            left = deadline - time.monotonic()
            assert left > 0, f"no {event} in {timeout:.0f} s: {self.stdout[-20:]}"
            assert self.proc.poll() is None, f"relay up exited: {self.stdout[-20:]}"
            try:
                self.events.append(self._events.get(timeout=min(left, 1.0)))
            except queue.Empty:
                pass

    def ready(self, timeout: float = 240.0) -> dict:
        return self.wait_event("relay_ready", timeout)

    def stop(self, sig: int = signal.SIGTERM, *, group: bool = False,
             timeout: float = 180.0) -> int:
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout)
        time.sleep(0.2)   # let the pumps read the last lines
        while not self._events.empty():
            self.events.append(self._events.get_nowait())
        return code

    def kill(self) -> None:
        """Test cleanup: whatever is left of the group goes."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def _own_processes(self):
        """(pid, argv, environment) of every process running with this relay's environment
        (the roles, the Spark JVM and its Python workers all inherit RELAY_DATA_DIR)."""
        mark = f"RELAY_DATA_DIR={self.data}"
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = fh.read().decode(errors="replace").split("\0")
                if mark not in env:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    args = [a for a in fh.read().decode(errors="replace").split("\0") if a]
                if len(args) == 1:    # a title the process set: a role forked by the zygote
                    args = args[0].split()
            except OSError:
                continue
            yield int(pid), args, env

    def commands(self) -> list[str]:
        """The command line of each of this relay's processes, arguments joined by spaces."""
        return [" ".join(args).strip() for _, args, _ in self._own_processes()]

    def leftovers(self) -> list[int]:
        """Processes still running with this relay's environment."""
        return [pid for pid, _, _ in self._own_processes()]

    def role_pid(self, role: str) -> int | None:
        """The pid of this relay's process of `role` (ingress-heya: `ingress --protocol heya`)."""
        found = self._role_process(role)
        return found[0] if found else None

    def role_environ(self, role: str) -> dict[str, str] | None:
        """The environment of this relay's process of `role`, as it runs."""
        found = self._role_process(role)
        return dict(e.split("=", 1) for e in found[1] if "=" in e) if found else None

    def _role_process(self, role: str):
        base, _, protocol = role.partition("-")
        for pid, args, env in self._own_processes():
            if "relay.cli" not in args or base not in args:
                continue
            given = args[args.index("--protocol") + 1] if "--protocol" in args else ""
            if given == protocol:
                return pid, env
        return None

    @property
    def output(self) -> str:
        return "".join(self.stdout) + "".join(self.stderr)
