"""`relay up`: every role as its own child process on one machine, supervised.

Separate processes, not threads: a crash (or `kill -9`) of one role never takes the others
down, delta-rs must not be inherited across fork (DESIGN.md: children are spawned fresh), and
the same commands run the roles on separate machines. A child that dies is restarted with
backoff.

Ready: each role prints one `{"ready": role, "listening": ...}` line on its stdout when it
serves (the stream after its warm-up batch, jobs/stream_main.py); `relay up` says "ready"
once every role has, so a message sent from that moment is served at the normal latency.

Start order: the ingress roles first, the others once every ingress role is ready (or after
`INGRESS_HEAD_START_SECONDS`, if one is slow or failing). Ingress alone acks: a client's
message is durable once landed, and the stream picks it up when it starts. Started together
on a small machine, the Spark JVM and five more Python processes took the cores while the
listeners were still importing: the first PPP ack came ~11 s after start on 2 cores
(`relay bench --startup`), against ~2 s for a listener started alone.

Stopping: SIGINT (Ctrl-C in a terminal signals the whole process group) or SIGTERM reaches
`relay up`; its children ignore SIGINT (`RELAY_SUPERVISED`, relay/cli.py), so they are stopped
by `relay up` alone, one SIGTERM each, in data-flow order: ingress first (it stops accepting
and finishes the commits of pushes it is storing, so every acked envelope is in landing), then
the stream, egress and compaction.

Ingress is one process per protocol by default (`ingress.process_per_protocol`): a flood on
one listener, or a slow handshake, holds that process's event loop only, and the kernel
spreads the protocols over the cores. Nothing acked is lost: what is in landing and not yet in
the inbox is picked up by the next start. A child whose supervisor vanished (`kill -9` of
`relay up`) stops by itself.

Forked, not spawned: every Python role is forked from one zygote process that imported their
modules once (relay/zygote.py, `process.fork_roles`): the children share those pages (the
relay idle 1,128 -> 994 MiB PSS), and a role starts without importing anything. A forked
role's environment is the one it would have had spawned (`fork_env`), so the processes it
starts (the stream's JVM and Spark's Python workers) do not inherit the zygote's allocator.

Output: stdout carries what the relay tells its operator (where it listens, ready, stopped):
readable lines, or one JSON object per line when the log format is json (runtime/logs.py);
every process's logs go to the shared stderr.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping

from runtime import logs
from runtime.operator_errors import CONFIG
from runtime.config import Settings, process_roles
from .zygote import SUPERVISED_ENV, Zygote

STOP_TIMEOUT_SECONDS = 60.0
INGRESS_HEAD_START_SECONDS = 15.0

# The roles that hold client connections run on the C library's allocator. CPython's own
# (pymalloc) keeps a 1 MiB arena as long as one object in it lives, so a wave of connections
# that came and went left the process at its peak: 2,500 idle PPP WebSockets left ingress
# 73 MiB bigger for good, against 14 MiB with glibc's malloc and `malloc_trim`
# (runtime/memory_trim.py), for ~7% more CPU in that wave. An operator's PYTHONMALLOC wins.
# `relay up` sets it for those children, and for the zygote they are forked from (so push,
# compaction and the stream's driver, forked from it too, run on malloc as well: their work
# is mostly native code, Arrow and delta-rs).
# Run alone, the role re-executes itself with it (relay/cli.py), which costs a second
# interpreter start (~0.2 s of imports).
LISTENER_ROLES = ("ingress", "egress")
ALLOCATOR_ENV = {"PYTHONMALLOC": "malloc"}


def role_env(command: str, env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a process running `command` (a role's `relay` subcommand, `ingress`
    or `egress`...): with ALLOCATOR_ENV for a listener role, unless it chooses one already."""
    if command in LISTENER_ROLES and "PYTHONMALLOC" not in env:
        return {**env, **ALLOCATOR_ENV}
    return dict(env)


def child_env(command: str) -> dict[str, str]:
    """The environment of a child of this supervisor running `command` (or of the zygote,
    which the listener roles are forked from)."""
    return role_env(command, {**os.environ, SUPERVISED_ENV: str(os.getpid())})


def fork_env(command: str) -> dict[str, str | None]:
    """What a role forked from the zygote (whose environment is `child_env` of a listener)
    changes in its environment to have `child_env(command)`'s: the allocator variable, set or
    removed (None)."""
    return {"PYTHONMALLOC": child_env(command).get("PYTHONMALLOC")}


class Output:
    """The supervisor's own lines on stdout, readable or JSON (`fmt` from runtime/logs.py)."""

    def __init__(self, fmt: str):
        self.json = fmt == "json"
        self._lock = threading.Lock()

    def say(self, event: str, text: str, **fields) -> None:
        line = (json.dumps({"ts": round(time.time(), 3), "process": "up", "event": event,
                            **fields}) if self.json else f"relay: {text}")
        with self._lock:
            print(line, flush=True)


# What the zygote imports before forking a role (and keeps, for the roles forked after it).
LISTENER_MODULES = {"ppp": "ingress.ppp_app", "trueseal": "ingress.trueseal_push",
                    "heya": "ingress.heya", "sync": "ingress.sync_quic"}
ROLE_MODULES = {"egress": ["egress.service"], "push": ["egress.push.job"],
                "compact": ["jobs.compact", "runtime.metrics"], "stream": ["jobs.stream_main"]}


def preload(role: str) -> list[str] | None:
    """The modules the zygote imports before forking `role`; None: spawn it fresh."""
    if role.startswith("ingress"):
        protocol = role.partition("-")[2]
        return ["relay.cli", "ingress.service"] + (
            [LISTENER_MODULES[protocol]] if protocol else list(LISTENER_MODULES.values()))
    return ["relay.cli", *ROLE_MODULES[role]] if role in ROLE_MODULES else None


def command(role: str) -> list[str]:
    """The `relay` subcommand that runs a role: ingress-heya -> ingress --protocol heya."""
    if role.startswith("ingress-"):
        return ["ingress", "--protocol", role[len("ingress-"):]]
    return [role, "--loop"] if role == "compact" else [role]


class NotStarted:
    """A role the zygote could not fork, seen as a process that exited with 1."""
    returncode = 1
    pid = None

    def poll(self) -> int:
        return 1

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def send_signal(self, sig: int) -> None:
        pass

    kill = send_signal


class Child:
    def __init__(self, role: str, conf: str | None, data_dir: str, out: Output,
                 zygote: Zygote | None = None):
        self.role = role
        self.args = (["--conf", conf] if conf else []) + ["--data-dir", data_dir] + command(role)
        self.argv = [sys.executable, "-m", "relay.cli", *self.args]
        self.out = out
        self.zygote = zygote if preload(role) is not None else None
        self.proc = None      # subprocess.Popen, or zygote.ForkedProcess
        self.restarts = 0
        self.ready: dict | None = None
        self.on_ready = lambda: None

    def start(self) -> None:
        self.ready = None
        if self.zygote is not None:
            try:
                self.proc = self.zygote.spawn("relay.cli", self.args, preload(self.role),
                                              fork_env(command(self.role)[0]))
            except (OSError, RuntimeError) as exc:   # restarted with backoff, like an exit
                self.out.say("role_output", f"[{self.role}] not started: {exc}",
                             role=self.role, line=str(exc))
                self.proc = NotStarted()
                return
        else:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True,
                                         bufsize=1, env=child_env(command(self.role)[0]))
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
                listening = msg.get("listening", {})
                where = ", ".join(f"{k} on {v}" for k, v in listening.items())
                self.out.say("role_ready", f"{self.role} ready{': ' + where if where else ''}",
                             role=self.role, listening=listening)
                self.on_ready()
            elif line:
                self.out.say("role_output", f"[{self.role}] {line}", role=self.role,
                             line=line)


def run(settings: Settings, conf: str | None) -> int:
    out = Output(logs.resolve_format())
    data_dir = str(settings.data_path)
    os.makedirs(data_dir, exist_ok=True)
    started = time.monotonic()
    out.say("up_started", f"data directory {data_dir}", data_dir=data_dir)
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    # Data-flow order, which is also the stop order: every ingress first (it stops accepting
    # and finishes the commits of pushes it is storing), then the stream, egress, compaction.
    zygote = Zygote(child_env(LISTENER_ROLES[0])) if settings.process.fork_roles else None
    children = {role: Child(role, conf, data_dir, out, zygote)
                for role in process_roles(settings)}
    announced = threading.Event()

    def check_all_ready() -> None:
        if not announced.is_set() and all(c.ready for c in children.values()):
            announced.set()
            out.say("relay_ready", f"ready in {time.monotonic() - started:.1f}s "
                    "(every role serves)", seconds=round(time.monotonic() - started, 1))

    ingress = [c for c in children.values() if c.role.startswith("ingress")]
    head_start = threading.Event()

    def on_ready() -> None:
        if all(c.ready for c in ingress):
            head_start.set()
        check_all_ready()

    for child in children.values():
        child.on_ready = on_ready
    for child in ingress:
        child.start()
    if not ingress:
        head_start.set()
    deadline = time.monotonic() + INGRESS_HEAD_START_SECONDS
    while not (head_start.is_set() or stopping.is_set()) and time.monotonic() < deadline:
        head_start.wait(0.1)
    if not stopping.is_set():
        for child in children.values():
            if child.proc is None:
                child.start()
    backoff: dict[str, float] = {}
    config_error = False
    while not stopping.is_set():
        for child in children.values():
            if child.proc is None:
                continue
            code = child.proc.poll()
            if code == CONFIG and not stopping.is_set():
                # its one line says what to change (runtime/operator_errors.py); a restart
                # would only say it again
                out.say("role_config_error", f"{child.role} exited with {code}: its "
                        f"configuration must change; stopping", role=child.role, code=code)
                config_error = True
                stopping.set()
                break
            if code is not None and not stopping.is_set():
                delay = min(30.0, backoff.get(child.role, 0.5) * 2)
                backoff[child.role] = delay
                out.say("role_exited", f"{child.role} exited with {code}; restarting in "
                        f"{delay:.0f}s", role=child.role, code=code, restart_in=delay)
                stopping.wait(delay)
                if not stopping.is_set():
                    child.restarts += 1
                    child.start()
        stopping.wait(0.5)
    out.say("shutting_down", "shutting down")
    clean = True
    for role, child in children.items():
        proc = child.proc
        if proc is None:                # stopped before it was started
            continue
        if proc.poll() is None:   # a role waiting for its restart has nothing to stop
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            clean = clean and code == 0
        code = proc.returncode
        out.say("role_stopped", f"{role} stopped" + (f" (exit {code})" if code else ""),
                role=role, code=code)
    if zygote is not None:
        zygote.stop()
    return CONFIG if config_error else 0 if clean else 1
