"""relay/zygote.py: roles forked from one process that imported their code, as `relay up`
runs them. A real zygote process, real forks, a real trueseal listener on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from relay.up import LISTENER_MODULES, fork_env, preload
from relay.zygote import Zygote
from runtime.config import INGRESS_PROTOCOLS

MARK = "RELAY_ZYGOTE_TEST_MARK"


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, MARK: str(tmp_path), "RELAY_SUPERVISED": str(os.getpid()),
            "PYTHONMALLOC": "malloc", "RELAY_TRUESEAL_PUSH_PORT": "0",
            "RELAY_METRICS_PORT_INGRESS": "0", "RELAY_BIND": "127.0.0.1"}


def _ready_line(proc, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        msg = json.loads(line) if line.startswith("{") else {}
        if "ready" in msg:
            return msg
    raise AssertionError("no ready line")


def _rollup(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0].rstrip(":")] = int(parts[1])
    return out


def _running(pid: int) -> bool:
    """Not exited (an orphan's exit may wait as a zombie for a container's init to reap it)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def zygote(tmp_path):
    z = Zygote(_env(tmp_path))
    yield z
    z.stop()


def test_a_forked_role_serves_shares_the_imports_and_reports_its_exit(zygote, tmp_path):
    data = tmp_path / "data"
    args = ["--data-dir", str(data), "ingress", "--protocol", "trueseal"]
    child = zygote.spawn("relay.cli", args, preload("ingress-trueseal"))
    ready = _ready_line(child)
    assert ready["ready"] == "ingress-trueseal"
    host, port = ready["listening"]["trueseal_push"].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()   # it accepts
    # ps, the bench and the tests name it by its command line; its environment is readable
    cmdline = open(f"/proc/{child.pid}/cmdline", "rb").read().split(b"\0")[0].decode()
    assert cmdline.split()[-5:] == args[-5:] and "-m relay.cli" in cmdline
    assert f"{MARK}={tmp_path}".encode() in open(f"/proc/{child.pid}/environ", "rb").read()
    # the imported modules' pages are the zygote's, shared: most of what it maps is not its own
    mem = _rollup(child.pid)
    assert mem["Shared_Clean"] + mem["Shared_Dirty"] > 20 * 1024, mem
    assert mem["Pss"] < 0.75 * mem["Rss"], mem
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.send_signal(signal.SIGTERM)          # stopped as `relay up` stops it: cleanly
    assert child.wait(timeout=30) == 0
    # a second one, killed, reports the signal as Popen would
    child = zygote.spawn("relay.cli", args, preload("ingress-trueseal"))
    _ready_line(child)
    child.kill()
    assert child.wait(timeout=30) == -signal.SIGKILL


def test_every_role_is_forked_with_its_modules_preloaded():
    assert set(LISTENER_MODULES) == set(INGRESS_PROTOCOLS)
    for protocol, module in LISTENER_MODULES.items():
        assert module in preload(f"ingress-{protocol}")
    assert set(LISTENER_MODULES.values()) <= set(preload("ingress"))   # one process, all
    assert all(preload(r) for r in ("egress", "push", "compact"))
    assert "jobs.stream_main" in preload("stream")


def test_a_forked_role_gets_the_environment_it_would_have_spawned(tmp_path, monkeypatch):
    # The zygote runs on malloc for the listeners; the stream forked from it must not pass
    # that on to its JVM and Spark's Python workers (relay/up.py fork_env).
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    assert fork_env("stream") == {"PYTHONMALLOC": None}
    assert fork_env("ingress") == {"PYTHONMALLOC": "malloc"}
    monkeypatch.setenv("PYTHONMALLOC", "pymalloc_debug")         # an operator's choice wins
    assert fork_env("stream") == fork_env("ingress") == {"PYTHONMALLOC": "pymalloc_debug"}

    (tmp_path / "envdump.py").write_text(
        "import json, os\n"
        "def main(argv):\n"
        "    print(json.dumps({k: os.environ.get(k) for k in argv}), flush=True)\n")
    env = {**_env(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    z = Zygote(env)
    try:
        names = ["PYTHONMALLOC", "RELAY_ZYGOTE_TEST_SET"]
        child = z.spawn("envdump", names, ["envdump"],
                        {"PYTHONMALLOC": None, "RELAY_ZYGOTE_TEST_SET": "yes"})
        assert child.wait(timeout=30) == 0
        assert json.loads(child.stdout.read()) == {"PYTHONMALLOC": None,
                                                   "RELAY_ZYGOTE_TEST_SET": "yes"}
        child = z.spawn("envdump", names, ["envdump"])
        assert child.wait(timeout=30) == 0
        assert json.loads(child.stdout.read()) == {"PYTHONMALLOC": "malloc",
                                                   "RELAY_ZYGOTE_TEST_SET": None}
    finally:
        z.stop()


def test_a_module_that_cannot_be_imported_fails_that_start_only(zygote, tmp_path):
    with pytest.raises(RuntimeError, match="ModuleNotFoundError"):
        zygote.spawn("relay.cli", ["keys"], ["no_such_module_here"])
    child = zygote.spawn("relay.cli", ["--data-dir", str(tmp_path / "d"), "keys"],
                         ["relay.cli"])
    assert child.wait(timeout=60) == 0
    assert child.stdout.read().startswith("trueseal ")


def test_group_signals_leave_the_zygote_and_closing_its_socket_stops_everything(tmp_path):
    z = Zygote(_env(tmp_path))
    child = z.spawn("relay.cli", ["--data-dir", str(tmp_path / "data"), "ingress", "--protocol",
                     "trueseal"], preload("ingress-trueseal"))
    _ready_line(child)
    # Ctrl-C or `kill -TERM -<group>` reach the zygote as well: it stays for `relay up`
    for sig in (signal.SIGINT, signal.SIGTERM):
        os.kill(z.proc.pid, sig)
    time.sleep(0.5)
    assert z.proc.poll() is None and z.alive()
    # `relay up` gone (its end closed): the zygote exits and its child stops by itself
    z.ctl.shutdown(socket.SHUT_RDWR)
    assert z.proc.wait(timeout=10) == 0
    deadline = time.monotonic() + 15
    while _running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(child.pid)
    z.ctl.close()
