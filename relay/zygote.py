"""Fork the relay's Python roles from one process that imported their code once.

`relay up` runs eight Python roles. Spawned fresh, each imported pyarrow, deltalake, fastapi,
aioquic, ... for itself: ~52-73 MiB of private memory apiece before it did any work, most
of the relay's idle memory outside the JVM (issue 20). A child forked from a process that
has imported them shares those pages with it copy-on-write; `gc.freeze()` before each fork
keeps the collector from writing to them. Importing the same modules in seven processes
measured 413 MiB PSS spawned, 224 for a zygote and seven forks; `relay up` idle went from
1,128 to 994 MiB (`relay bench --startup`, README).

delta-rs must not be inherited across fork (DESIGN.md): its tokio runtime is created on
first use, and the zygote only imports, never opens a table or starts a thread of its own.
(pyarrow's and delta-rs's jemalloc start an idle background thread at import; jemalloc
takes its locks around fork, so the child's allocator is consistent.)

Protocol, over a SOCK_SEQPACKET socket pair (one datagram per message, JSON):
  supervisor -> zygote  {"main": module, "argv": [...], "preload": [modules],
                         "env": {name: value or null}} + the write end of the child's stdout
                        pipe (SCM_RIGHTS); the child sets (null: removes) the `env` variables
                        and runs `module.main(argv)`, as `python -m module argv...` would
  zygote -> supervisor  {"pid": n} or {"error": text}; later {"exited": n, "code": c}
                        (c as subprocess's returncode: -signal when killed)
The zygote exits when the supervisor's end closes. Its children then find their parent gone
and stop by themselves, as a role whose supervisor vanished does (relay/cli.py).

`ForkedProcess` is the supervisor's handle on such a child, with the part of
`subprocess.Popen` that relay/up.py uses (pid, stdout, poll, wait, send_signal, kill).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from typing import Mapping

# Room in the zygote's command line for a child's title: on Linux a process can show a new
# command line only within the bytes of its original one (setproctitle, SPT_NOENV keeps
# /proc/<pid>/environ intact), and `ps`, `relay bench --startup` and the tests name a role
# by its command line.
TITLE_ROOM = 1024
SUPERVISED_ENV = "RELAY_SUPERVISED"   # set for `relay up`'s children: the supervisor's pid


def _title(text: str) -> None:
    try:
        import setproctitle
    except ImportError:          # the title is for people and tools; the role runs without it
        return
    setproctitle.setproctitle(text[:TITLE_ROOM])


class _Child:
    """What a forked child runs once it has left the zygote's loop."""

    def __init__(self, main: str, argv: list[str], stdout_fd: int, env: dict | None = None):
        self.main = main
        self.argv = argv
        self.stdout_fd = stdout_fd
        self.env = env or {}

    def run(self) -> None:
        os.dup2(self.stdout_fd, 1)
        os.close(self.stdout_fd)
        # The environment the role's own children get (the stream's JVM and Spark's Python
        # workers): the one it would have had spawned. The allocator of this interpreter,
        # chosen when the zygote started, stays.
        for name, value in self.env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        # A role started by `relay up` watches its parent and stops when it is gone: that is
        # the zygote now, which exits when `relay up` does.
        os.environ[SUPERVISED_ENV] = str(os.getppid())
        # The imports stay frozen: a full collection writes to every object it walks, which
        # would copy their pages into this process.
        _title(" ".join([sys.executable, "-m", self.main, *self.argv]))
        sys.argv = [sys.argv[0], *self.argv]
        # SystemExit and exceptions end the interpreter as usual
        importlib.import_module(self.main).main(self.argv)


def serve(ctl: socket.socket) -> _Child | None:
    """The zygote's loop. Returns None when the supervisor is gone, or, in a forked child,
    what that child must run (so it leaves this loop's frames before running its role)."""
    # Ctrl-C, or a SIGTERM to the whole group (`timeout`, a service manager), reaches the zygote
    # too: it stays until `relay up` has stopped the roles and closes the socket, so each
    # role's exit is still reported.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ, "ctl")
    sel.register(wake_r, selectors.EVENT_READ, "child")
    children: set[int] = set()

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            _send(ctl, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})

    while True:
        for key, _ in sel.select():
            if key.data == "child":
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
                reap()
                continue
            try:
                data, fds, _, _ = socket.recv_fds(ctl, 65536, 4)
            except ConnectionError:
                data, fds = b"", []
            if not data:
                return None
            try:
                msg = json.loads(data)
                for module in msg.get("preload", ()):
                    importlib.import_module(module)
            except Exception as exc:   # a module that fails to import fails this role's start
                for fd in fds:
                    os.close(fd)
                _send(ctl, {"error": f"{type(exc).__name__}: {exc}"})
                continue
            gc.collect()
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                sel.close()
                ctl.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.close(wake_r)
                os.close(wake_w)
                return _Child(msg["main"], msg["argv"], fds[0], msg.get("env"))
            for fd in fds:
                os.close(fd)
            children.add(pid)
            _send(ctl, {"pid": pid})


def _send(ctl: socket.socket, msg: dict) -> None:
    try:
        ctl.send(json.dumps(msg).encode())
    except OSError:      # the supervisor is gone: the next read of the socket ends the loop
        pass


class Zygote:
    """The supervisor's side: starts the zygote process and forks roles from it."""

    def __init__(self, env: Mapping[str, str]):
        self.env = {**env, "SPT_NOENV": "1"}
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()        # one fork request at a time
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._reply: dict | None = None
        self._alive = False

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relay.zygote", str(theirs.fileno()), "." * TITLE_ROOM],
            pass_fds=[theirs.fileno()], env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL)
        theirs.close()
        self.ctl = ours
        self._alive = True
        threading.Thread(target=self._read, args=(ours,), name="zygote-reader",
                         daemon=True).start()

    def _read(self, ctl: socket.socket) -> None:
        while True:
            try:
                data = ctl.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            with self._cond:
                if "exited" in msg:
                    self._exits[msg["exited"]] = msg["code"]
                else:
                    self._reply = msg
                self._cond.notify_all()
        with self._cond:
            if self.ctl is ctl:
                self._alive = False
                self._reply = self._reply or {"error": "the zygote exited"}
            self._cond.notify_all()

    def spawn(self, main: str, argv: list[str], preload: list[str],
              env: Mapping[str, str | None] | None = None) -> "ForkedProcess":
        """A child running `main.main(argv)` (`main` a module), forked once the zygote has
        imported `preload`, with the variables of `env` set in its environment (None:
        removed)."""
        with self._lock:
            if not self._alive:
                self._start()
            r, w = os.pipe()
            with self._cond:
                self._reply = None
            try:
                request = {"main": main, "argv": argv, "preload": preload,
                           "env": dict(env or {})}
                socket.send_fds(self.ctl, [json.dumps(request).encode()], [w])
            finally:
                os.close(w)
            with self._cond:
                self._cond.wait_for(lambda: self._reply is not None, timeout=120)
                reply = self._reply or {"error": "no answer from the zygote"}
            if "pid" not in reply:
                os.close(r)
                raise RuntimeError(f"forking {main} {' '.join(argv)}: {reply['error']}")
            return ForkedProcess(self, reply["pid"], os.fdopen(r, "r", buffering=1))

    def returncode(self, pid: int) -> int | None:
        with self._cond:
            return self._exits.get(pid)

    def wait(self, pid: int, timeout: float | None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or not self._alive, timeout)

    def alive(self) -> bool:
        return self._alive

    def stop(self) -> None:
        """Close the supervisor's end: the zygote exits (its children are stopped already)."""
        with self._lock:
            if self.proc is None:
                return
            try:
                self.ctl.shutdown(socket.SHUT_RDWR)   # wakes our reader; the zygote reads EOF
            except OSError:
                pass
            self.ctl.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ForkedProcess:
    """A role forked by the zygote, seen from `relay up` as a `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int, stdout):
        self.zygote = zygote
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid)
            if self.returncode is None and not self.zygote.alive():
                # The zygote died: its children were reparented and stop by themselves
                # (they watch their parent); tell this one now, and count it as exited.
                self.send_signal(signal.SIGTERM)
                self.returncode = -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self.zygote.wait(self.pid, timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self.zygote.returncode(self.pid) is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def main() -> None:
    fd = int(sys.argv[1])
    _title("relay zygote (forks the Python roles of relay up)")
    ctl = socket.socket(fileno=fd)
    from runtime import config
    config.adapter()   # the settings validator, built once here rather than in every role
    child = serve(ctl)
    if child is not None:
        child.run()


if __name__ == "__main__":
    main()
