"""Structured logs: one event vocabulary, and nothing in them that identifies a person or
carries ciphertext (envelope bytes, mailbox or relay keys, client addresses)."""

from __future__ import annotations

import ast
import asyncio
import base64
import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import logs
from runtime.logs import EVENTS
from relay_up_process import RelayUp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "delta_tables", "runtime", "jobs", "ingress", "egress", "relay")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}


def _log_calls():
    """Every `log.<level>(...)` / `logger.<level>(...)` call in the relay's own code."""
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in LEVELS and isinstance(node.func.value, ast.Name)
                        and node.func.value.id in ("log", "logger")):
                    yield path.relative_to(ROOT), node


def test_every_log_call_names_an_event_of_the_vocabulary():
    problems = []
    calls = 0
    for path, call in _log_calls():
        calls += 1
        extra = next((k.value for k in call.keywords if k.arg == "extra"), None)
        event = None
        if isinstance(extra, ast.Dict):
            for k, v in zip(extra.keys, extra.values):
                if isinstance(k, ast.Constant) and k.value == "event" \
                        and isinstance(v, ast.Constant):
                    event = v.value
        if event is None:
            problems.append(f"{path}:{call.lineno} logs without extra={{'event': ...}}")
        elif event not in EVENTS:
            problems.append(f"{path}:{call.lineno} event {event!r} is not in runtime.logs.EVENTS")
    assert calls > 20
    assert not problems, "\n".join(problems)


def _forbidden(traffic) -> dict[str, str]:
    """needle -> what it is, in every spelling a log line could carry it."""
    out = {"127.0.0.1": "a client address", "::1": "a client address"}
    for what, values in (("envelope", traffic.envelopes), ("mailbox key", traffic.mailboxes),
                         ("device private key", traffic.secrets),
                         ("relay key", traffic.relay_keys)):
        for v in values:
            out[v.hex()] = what
            out[base64.b64encode(v).decode()[:24]] = what
            printable = v[8:40].decode("latin-1")   # raw bytes, past any readable prefix
            out[json.dumps(printable)[1:-1]] = what
    return out


def test_traffic_logs_are_json_with_known_events_and_nothing_private(traffic):
    lines = traffic.log_lines
    assert len(lines) > 10
    events = set()
    for line in lines:
        rec = json.loads(line)
        assert {"ts", "level", "process", "logger", "msg"} <= rec.keys()
        assert rec.get("event") in EVENTS, line
        events.add(rec["event"])
    # the run exercised both shells, the stream and the metrics endpoints
    assert {"listener_started", "push_rejected", "push_session_open", "stream_batch",
            "egress_bootstrap", "receive_session_open", "metrics_started"} <= events
    text = "\n".join(lines)
    leaks = {what for needle, what in _forbidden(traffic).items() if needle in text}
    assert not leaks, f"logs carry: {sorted(leaks)}"


# --- the guards and the two formats, record by record ---------------------------------------

TEXT_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} (DEBUG|INFO |WARN |ERROR|CRIT ) \S+  ")


def _record(name, msg, args=(), level=logging.INFO, exc_info=None, **extra):
    rec = logging.LogRecord(name, level, __file__, 1, msg, args, exc_info)
    rec.__dict__.update(extra)
    return rec


def _filtered(rec):
    assert logs.RedactFilter().filter(rec) is True    # rewrites, never drops
    return rec


def _exc_info(exc):
    try:
        raise exc
    except type(exc):
        return sys.exc_info()


@pytest.mark.parametrize("client", ["127.0.0.1:48284", "[::1]:48284", "::1:48284",
                                    "[2001:db8::7]:48284", "2001:db8::7:48284",
                                    "[fe80::1%eth0]:48284", "::ffff:10.1.2.3"])
def test_filter_redacts_uvicorn_style_client_addresses(client):
    rec = _filtered(_record("uvicorn.error", '%s - "WebSocket %s" [accepted]', (client, "/v1/ws"),
                            color_message='\x1b[1m%s\x1b[0m - "WebSocket %s" [accepted]'))
    msg = rec.getMessage()
    assert msg == '<addr> - "WebSocket /v1/ws" [accepted]'
    assert "color_message" not in rec.__dict__
    for fmt in (logs.JsonFormatter("ingress"), logs.TextFormatter("ingress", color=True)):
        line = fmt.format(rec)
        assert "48284" not in line and "\x1b[1m" not in line and "color_message" not in line


def test_filter_redacts_fields_tuples_exceptions_hex_and_bytes_reprs():
    token = bytes(range(32))
    rec = _filtered(_record(
        "asyncio", "peer %r closed; token %s", (("::1", 50123, 0, 0), token.hex()),
        level=logging.ERROR, exc_info=_exc_info(ConnectionResetError(
            f"reset by ('10.9.8.7', 50124) for {token!r}")),
        peer="203.0.113.9:50125", peername=("198.51.100.4", 50126), size=12, raw=token,
        note="nothing to hide here"))
    line = logs.JsonFormatter("ingress").format(rec)
    out = json.loads(line)
    for needle in ("::1", "50123", "10.9.8.7", "50124", "203.0.113", "50125", "198.51.100",
                   "50126", token.hex(), "\\x00\\x01"):
        assert needle not in line, needle
    assert out["msg"] == "peer ('<addr>', 0, 0) closed; token <hex>"
    assert out["peer"] == "<addr>" and out["peername"] == "('<addr>')"
    assert out["raw"] == "<32 bytes>" and out["size"] == 12
    assert out["note"] == "nothing to hide here"
    assert out["exc"] == "ConnectionResetError: reset by ('<addr>') for <bytes>"
    # what is not an address stays: times, versions, timestamps, MACs
    for keep in ("19:03:22.369", "log4j 2.25.4", "ts 1718123456.369", "aa:bb:cc:dd:ee:ff",
                 "12:30", "batch 7 of 12"):
        assert logs.redact(keep) == keep


def test_json_format_keeps_todays_keys_and_one_line_exceptions():
    rec = _record("relay.ingress", "listener started", event="listener_started",
                  listener="heya", port=8337)
    out = json.loads(logs.JsonFormatter("ingress").format(rec))
    assert list(out) == ["ts", "level", "process", "logger", "msg", "event", "listener", "port"]
    assert out["level"] == "info" and out["process"] == "ingress"
    assert out["logger"] == "relay.ingress" and out["msg"] == "listener started"
    err = _record("relay.stream", "batch failed", level=logging.WARNING,
                  exc_info=_exc_info(ValueError("bad\nrow")), event="stream_batch")
    line = logs.JsonFormatter("stream").format(err)
    assert "\n" not in line and "Traceback" not in line
    out = json.loads(line)
    assert out["level"] == "warning" and out["exc"] == "ValueError: bad\nrow"
    assert "traceback" not in out
    deep = json.loads(logs.JsonFormatter("stream", tracebacks=True).format(err))
    assert deep["traceback"].startswith("Traceback") and "ValueError" in deep["traceback"]


def test_text_format_is_one_readable_line_with_colour_only_when_asked():
    rec = _record("relay.ingress", "listener started", event="listener_started",
                  listener="heya", port=8337)
    line = logs.TextFormatter("ingress").format(rec)
    assert TEXT_LINE.match(line), line
    assert line[13:] == "INFO  ingress  listener started  listener=heya port=8337"
    coloured = logs.TextFormatter("ingress", color=True).format(rec)
    assert coloured[13:] == ("\x1b[32mINFO \x1b[0m ingress  listener started  "
                             "listener=heya port=8337")
    err = _record("uvicorn.error", "Exception in ASGI application\n\x1b[31mred", (),
                  level=logging.ERROR, exc_info=_exc_info(RuntimeError("boom\nagain")),
                  reason="two words", count=3)
    line = logs.TextFormatter("ingress").format(err)
    assert "\n" not in line and "\x1b" not in line and "Traceback" not in line
    assert line[13:] == ('ERROR ingress  Exception in ASGI application\\n\\x1b[31mred  '
                         'reason="two words" count=3 logger=uvicorn.error  '
                         'exc=RuntimeError: boom\\nagain')
    warn = logs.TextFormatter("stream").format(_record("relay.x", "slow", level=logging.WARNING))
    assert warn[13:] == "WARN  stream  slow"
    deep = logs.TextFormatter("stream", tracebacks=True).format(err)
    assert deep.splitlines()[1].strip() == "Traceback (most recent call last):"


def test_resolve_format_auto_json_text_on_a_real_terminal(monkeypatch):
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty, os.fdopen(master, "rb", buffering=0):
        r, w = os.pipe()
        with os.fdopen(r, "rb"), os.fdopen(w, "w") as pipe:
            monkeypatch.delenv("RELAY_LOG_FORMAT", raising=False)
            monkeypatch.delenv("NO_COLOR", raising=False)
            assert logs.resolve_format(None, tty) == "text"
            assert logs.resolve_format(None, pipe) == "json"
            assert logs.resolve_format("auto", pipe) == "json"
            assert logs.resolve_format(" TEXT ", pipe) == "text"
            assert logs.resolve_format("json", tty) == "json"
            monkeypatch.setenv("RELAY_LOG_FORMAT", "text")
            assert logs.resolve_format(None, pipe) == "text"
            assert logs.resolve_format("", pipe) == "text"
            assert logs.resolve_format("json", pipe) == "json"
            assert logs.use_color(tty) and not logs.use_color(pipe)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not logs.use_color(tty)
    with pytest.raises(ValueError, match="RELAY_LOG_FORMAT"):
        logs.resolve_format("yaml")


def test_child_stderr_lines_become_records():
    jvm = ('{"ts": 1718123456.25, "level": "warning", "process": "stream", '
           '"logger": "org.apache.spark.scheduler.DAGScheduler", "msg": "slow", "exc": "x: y"}')
    rec = logs.child_record(jvm + "\n", "spark.stderr")
    assert (rec.name, rec.levelno, rec.getMessage(), rec.exc) == (
        "org.apache.spark.scheduler.DAGScheduler", logging.WARNING, "slow", "x: y")
    assert rec.created == 1718123456.25 and round(rec.msecs) == 250
    out = json.loads(logs.JsonFormatter("stream").format(rec))
    assert out == {"ts": 1718123456.25, "level": "warning", "process": "stream",
                   "logger": "org.apache.spark.scheduler.DAGScheduler", "msg": "slow",
                   "exc": "x: y"}
    text = logs.TextFormatter("stream").format(rec)
    assert text[13:] == ("WARN  stream  slow  logger=org.apache.spark.scheduler.DAGScheduler"
                         "  exc=x: y")
    raw = logs.child_record('Exception in thread "main" at 10.0.0.1:7077\n', "spark.stderr")
    assert (raw.name, raw.levelno) == ("spark.stderr", logging.WARNING)
    assert json.loads(logs.JsonFormatter("stream").format(_filtered(raw)))["msg"] == \
        'Exception in thread "main" at <addr>'
    assert logs.child_record("WARNING: Using incubator modules: jdk.incubator.vector\n",
                             "spark.stderr") is None
    assert logs.child_record("   \n", "spark.stderr") is None


# --- setup() in a real process --------------------------------------------------------------

SETUP_SCRIPT = r'''
import logging, sys, threading, warnings
from runtime import logs
logs.setup("ingress")
logging.getLogger("uvicorn.error").info('%s - "WebSocket %s" [accepted]', "127.0.0.1:48284",
                                        "/v1/ws", extra={"color_message": "\x1b[1mx"})
logging.getLogger("uvicorn.error").info("connection open")
logging.getLogger("websockets.server").info("connection open")
logging.getLogger("quic").info("[abcd] Network path ('::1', 48285) discovered")
logging.getLogger("uvicorn.error").warning("Invalid HTTP request from %s", "[::1]:48286")
logging.getLogger("relay.ingress").info("listener started",
                                        extra={"event": "listener_started", "port": 8337})
warnings.warn("a library's warning")
t = threading.Thread(target=lambda: 1 / 0, name="worker")
t.start(); t.join()
raise RuntimeError("gave up on 10.0.0.1:48287")
'''


def _run_setup_script(env_extra, stderr=subprocess.PIPE):
    env = dict(os.environ, **env_extra)
    env.pop("NO_COLOR", None) if "NO_COLOR" not in env_extra else None
    return subprocess.run([sys.executable, "-c", SETUP_SCRIPT], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=stderr, timeout=60)


def test_setup_json_process_quiets_libraries_and_keeps_one_line_per_record():
    p = _run_setup_script({"RELAY_LOG_FORMAT": "json"})
    assert p.returncode == 1
    err = p.stderr.decode()
    recs = [json.loads(line) for line in err.splitlines()]
    assert [(r["logger"], r.get("event")) for r in recs] == [
        ("uvicorn.error", None), ("relay.ingress", "listener_started"), ("py.warnings", None),
        ("relay.logs", "uncaught_exception"), ("relay.logs", "uncaught_exception")]
    assert recs[0]["msg"] == "Invalid HTTP request from <addr>"
    assert recs[3]["thread_name"] == "worker" and recs[3]["exc"] == \
        "ZeroDivisionError: division by zero"
    assert recs[4]["exc"] == "RuntimeError: gave up on <addr>"
    assert all(r["process"] == "ingress" for r in recs)
    for needle in ("4828", "127.0.0.1", "::1", "10.0.0.1", "Traceback", "color_message",
                   "\x1b"):
        assert needle not in err, needle


def test_the_level_comes_from_relay_log_level_and_warnings_stay_at_any_level():
    p = _run_setup_script({"RELAY_LOG_FORMAT": "json", "RELAY_LOG_LEVEL": "warning"})
    recs = [json.loads(line) for line in p.stderr.decode().splitlines()]
    assert [r["level"] for r in recs] == ["warning", "warning", "critical", "critical"]
    assert "listener_started" not in {r.get("event") for r in recs}    # INFO: not logged
    assert logs.resolve_level("DEBUG") == "DEBUG"
    assert logs.resolve_level("loud") == "INFO"                        # unknown: the default


CHILD_SCRIPT = r'''
import logging, subprocess, sys
from runtime import logs
logs.setup("stream")
child = ("import sys; w = sys.stderr.write; "
         "w('{\"ts\": 1.5, \"level\": \"error\", \"logger\": \"org.x.Y\", \"msg\": \"m\"}\\n'); "
         "w('WARNING: Using incubator modules: jdk.incubator.vector\\n'); "
         "w('Traceback (most recent call last):\\n  raw from 10.0.0.1:99\\n')")
with logs.child_stderr("child.stderr"):
    p = subprocess.Popen([sys.executable, "-c", child])
    logging.getLogger("relay.x").info("meanwhile", extra={"event": "stream_stopped"})
p.wait()
logging.getLogger("relay.x").info("after", extra={"event": "stream_stopped"})
import time; time.sleep(0.5)
'''


def test_child_stderr_comes_back_as_records_of_this_process():
    env = dict(os.environ, RELAY_LOG_FORMAT="json")
    p = subprocess.run([sys.executable, "-c", CHILD_SCRIPT], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    recs = [json.loads(line) for line in p.stderr.splitlines()]
    assert sorted((r["logger"], r["level"], r["msg"]) for r in recs) == sorted([
        ("relay.x", "info", "meanwhile"), ("relay.x", "info", "after"),
        ("org.x.Y", "error", "m"),
        ("child.stderr", "warning", "Traceback (most recent call last):"),
        ("child.stderr", "warning", "  raw from <addr>")])
    assert all(r["process"] == "stream" for r in recs)


def test_setup_text_process_colours_a_terminal_unless_no_color():
    for env, coloured in (({}, True), ({"NO_COLOR": "1"}, False)):
        master, slave = os.openpty()
        try:
            p = subprocess.Popen([sys.executable, "-c", SETUP_SCRIPT], cwd=ROOT,
                                 env={**{k: v for k, v in os.environ.items()
                                         if k not in ("NO_COLOR", "RELAY_LOG_FORMAT")}, **env},
                                 stdout=subprocess.DEVNULL, stderr=slave)
            os.close(slave)
            chunks = []
            while True:
                try:
                    data = os.read(master, 65536)
                except OSError:   # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            assert p.wait(timeout=60) == 1
        finally:
            os.close(master)
        lines = b"".join(chunks).decode().replace("\r\n", "\n").splitlines()
        assert len(lines) == 5, lines
        plain = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in lines]
        assert all(TEXT_LINE.match(line) for line in plain), plain
        assert plain[1][13:] == "INFO  ingress  listener started  port=8337"
        assert plain[4][13:] == ("CRIT  ingress  uncaught exception  thread_name=MainThread  "
                                 "exc=RuntimeError: gave up on <addr>")
        assert ("\x1b[32mINFO \x1b[0m" in lines[1]) is coloured
        assert sum("\x1b[" in line for line in lines) == (5 if coloured else 0)


# --- the driver JVM's log4j2 configuration (conf/log4j2.properties) -------------------------

JAVA_PROBE = r'''
import org.apache.logging.log4j.LogManager;
public class Probe {
  public static void main(String[] a) {
    LogManager.getLogger("relay.probe").warn("hello \"quoted\"\nfrom 10.1.2.3:4567");
    LogManager.getLogger("relay.probe").error("failed",
        new IllegalStateException("bad\nthing at 10.9.8.7:6543"));
    LogManager.getLogger("relay.probe").info("info is below the root level");
    for (String noisy : a) {
      LogManager.getLogger(noisy).warn("noise");
      LogManager.getLogger(noisy).error("kept");
    }
  }
}
'''
NOISY = ["org.apache.hadoop.util.NativeCodeLoader",
         "org.apache.spark.sql.execution.streaming.runtime.ResolveWriteToStream",
         "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
         "org.apache.spark.scheduler.DAGScheduler"]


def _java_probe(tmp_path, appender):
    import pyspark
    jars = Path(pyspark.__file__).parent / "jars"
    cp = os.pathsep.join(str(next(jars.glob(f"log4j-{part}-2*.jar"))) for part in ("api", "core"))
    (tmp_path / "Probe.java").write_text(JAVA_PROBE)
    from jobs.spark_session import LOG4J2_CONF
    p = subprocess.run(["java", "-cp", cp, f"-Dlog4j2.configurationFile={LOG4J2_CONF.as_uri()}",
                        f"-Drelay.log.appender={appender}", "-Drelay.log.process=stream",
                        str(tmp_path / "Probe.java"), *NOISY],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == ""
    return p.stderr.splitlines()


def test_log4j2_json_lines_are_ours(tmp_path):
    lines = _java_probe(tmp_path, "json")
    recs = [json.loads(line) for line in lines]
    assert [list(r) for r in recs[:1]] == [["ts", "level", "process", "logger", "msg"]]
    assert recs[0]["level"] == "warning" and recs[0]["process"] == "stream"
    assert recs[0]["msg"] == 'hello "quoted"\nfrom <addr>'
    assert abs(recs[0]["ts"] - time.time()) < 120
    assert recs[1]["level"] == "error" and \
        recs[1]["exc"] == "java.lang.IllegalStateException: bad\nthing at <addr>"
    # the known-noise loggers say only errors; INFO is below the root level
    assert [(r["logger"], r["msg"]) for r in recs[2:]] == [(n, "kept") for n in NOISY]
    # and a relay process turns each of them into its own record
    rec = logs.child_record(lines[1], "spark.stderr")
    assert (rec.name, rec.levelno, rec.exc) == ("relay.probe", logging.ERROR, recs[1]["exc"])


def test_log4j2_text_lines_look_like_ours(tmp_path):
    lines = _java_probe(tmp_path, "text")
    assert all(TEXT_LINE.match(line) for line in lines), lines
    assert lines[0][13:] == 'WARN  stream  hello "quoted"\\nfrom <addr>  logger=relay.probe'
    assert lines[1][13:] == ("ERROR stream  failed  logger=relay.probe  "
                             "exc=java.lang.IllegalStateException: bad\\nthing at <addr>")
    assert len(lines) == 2 + len(NOISY)
    coloured = _java_probe(tmp_path, "color")
    assert "\x1b[33mWARN \x1b[m" in coloured[0]


# --- end to end: `relay up`, all four protocols, every line of every process ----------------

HEYA_END = 2220385707


class _Used:
    """What the clients used: every secret (to look for in the logs) and every source port."""

    def __init__(self):
        self.secrets: dict[str, bytes] = {}
        self.ports: set[int] = set()

    def secret(self, what: str, value: bytes) -> bytes:
        self.secrets[what] = bytes(value)
        return value

    def port(self, sockname) -> None:
        self.ports.add(sockname[1])


def test_relay_up_logs_no_address_port_key_token_or_envelope(tmp_path):
    """`relay up` (RELAY_LOG_FORMAT=json), one message through each protocol, SIGTERM; then
    the whole stdout and stderr of every process: each stderr line a JSON record, no client
    address or source port, no key, token or envelope in any spelling, no traceback."""
    relay = RelayUp(tmp_path / "data", RELAY_TRIGGER_INTERVAL_MS="100")
    relay.env.pop("NO_COLOR", None)
    p = relay.ports
    push, recv, heya, ppp, sync = (p[k] for k in ("TRUESEAL_PUSH", "TRUESEAL_RECEIVE", "HEYA",
                                                  "PPP", "SYNC"))
    own_ports = {*p.values(), *relay.metrics_ports.values()}
    used = _Used()
    relay_pub = bytes.fromhex(relay.cli("keys").split()[1])
    inbox_token = used.secret("heya inbox token", bytes.fromhex(
        relay.cli("heya", "inbox-token").split()[0]))
    try:
        relay.start()
        relay.ready(timeout=180)
        asyncio.run(_all_protocols(used, tmp_path, relay_pub, inbox_token, push, recv, heya,
                                   ppp, sync))
        code = relay.stop(signal.SIGTERM, timeout=120)
    finally:
        relay.kill()
    out, err = relay.stdout, relay.stderr
    assert code == 0, "".join(err[-20:])
    stdout, stderr = "".join(out), "".join(err)
    everything = stdout + stderr
    (tmp_path / "stdout.log").write_text(stdout)   # for a person when this fails
    (tmp_path / "stderr.log").write_text(stderr)

    records = []
    for line in stderr.splitlines():
        rec = json.loads(line)   # every line of stderr is a JSON record
        assert {"ts", "level", "process", "logger", "msg"} <= rec.keys(), line
        assert rec.get("event") is None or rec["event"] in EVENTS, line
        records.append(rec)
    processes = {r["process"] for r in records}
    assert {"egress", "stream"} <= processes and "ingress-trueseal" in processes, processes
    events = {r.get("event") for r in records}
    assert {"listener_started", "stream_batch", "stream_stopped"} <= events, events
    assert "uncaught_exception" not in events
    assert not [r for r in records if r["level"] == "critical"]

    assert "Traceback" not in everything
    assert "\x1b" not in everything
    # our listeners' own address is fine (`relay up` says where it listens); nothing else
    addrs = {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", everything)}
    assert addrs <= own_ports, addrs - own_ports
    assert "::1" not in everything and "localhost:" not in everything
    assert len(used.ports) >= 8
    for port in used.ports:
        assert not re.search(rf"(?<![\w.]){port}(?!\w)", everything), f"source port {port}"
    for what, value in used.secrets.items():
        needles = {value.hex(), value.hex().upper(), base64.b64encode(value).decode()[:24],
                   base64.urlsafe_b64encode(value).decode()[:24], repr(value)[2:40]}
        raw = value.decode("latin-1")
        needles |= {raw[i:i + 12] for i in range(0, max(1, len(raw) - 11), 4)}
        needles |= {json.dumps(n)[1:-1] for n in list(needles)}
        found = [n for n in needles if len(n) >= 12 and n in everything]
        assert not found, f"{what} in the logs: {found[:3]}"


async def _all_protocols(used: _Used, tmp_path, relay_pub, inbox_token, push, recv, heya, ppp,
                         sync):
    await asyncio.wait_for(asyncio.gather(
        _trueseal(used, relay_pub, push, recv), _heya(used, tmp_path, inbox_token, heya),
        _ppp(used, ppp), _sync(used, sync)), 90)


async def _trueseal(used, relay_pub, push, recv):
    from trueseal_client import ACK, NK, XX, AsyncClient, deliver_ack_frame, keypair, push_frame
    priv, pub = keypair()
    used.secret("trueseal device private key", priv)
    used.secret("trueseal device public key", pub)
    envelope = used.secret("trueseal envelope", b"trueseal-envelope-" + os.urandom(8).hex()
                           .encode() + os.urandom(32))
    c = await AsyncClient.connect(push, NK, relay_pub)
    used.port(c.writer.get_extra_info("sockname"))
    c.send(push_frame(pub, envelope))
    assert await c.recv_frame(timeout=30) == ACK
    c.close()
    r = await AsyncClient.connect(recv, XX, relay_pub, static_priv=priv)
    used.port(r.writer.get_extra_info("sockname"))
    while True:
        plain = await r.recv_frame(timeout=60)
        if plain[0] == 0x02:
            break
    assert plain[5 + 8:] == envelope
    r.send(deliver_ack_frame(int.from_bytes(plain[5:13], "big")))
    await asyncio.sleep(0.2)
    r.close()


async def _heya(used, tmp_path, inbox_token, port):
    from heya_client import Cert, HeyaClient, recv_line, send_line
    alice, bob = Cert(tmp_path / "heya", "alice"), Cert(tmp_path / "heya", "bob")
    used.secret("heya receiver certificate digest", alice.digest)
    used.secret("heya sender certificate digest", bob.digest)
    i_hex = inbox_token.hex().encode()
    a = await HeyaClient.connect(port, alice)
    used.port(a.writer.get_extra_info("sockname"))
    a.send(b"INCO " + i_hex + b"\n")
    await a.expect(b"INCO " + i_hex + b"\n")
    a.send(b"AUTH 0 %d\n" % HEYA_END)
    await a.expect(b"AUTH ")
    t_hex = await a.read_exact(64)
    await a.expect(b" 0 %d\n" % HEYA_END)
    used.secret("heya send token", bytes.fromhex(t_hex.decode()))
    body = used.secret("heya message", b"heya-body-" + os.urandom(8).hex().encode())
    b = await HeyaClient.connect(port, bob)
    used.port(b.writer.get_extra_info("sockname"))
    b.send(send_line(t_hex, body))
    await b.expect(recv_line(body))
    await a.expect(b"HAVE " + t_hex + b" 1\n", timeout=60)
    a.send(b"WANT " + t_hex + b" 0\n")
    await a.expect(b"GIVE " + t_hex + b" 0 %d\n" % len(body) + body + b"\n")
    for c in (a, b):
        c.send(b"QUIT\n")
        assert await c.closed_by_server()


async def _ppp(used, port):
    from nacl.signing import SigningKey
    from ppp_wire import Ws, giftwrap, pack, unpack
    a_sk, b_sk = SigningKey.generate(), SigningKey.generate()
    for who, sk in (("alice", a_sk), ("bob", b_sk)):
        used.secret(f"ppp {who} public key", bytes(sk.verify_key))
        used.secret(f"ppp {who} private key", bytes(sk))
    token = used.secret("ppp delivery token", os.urandom(12))
    b = await Ws.login(port, b_sk)
    used.port(b.conn.local_address)
    assert await b.call({"cmd": "REGISTER_DELIVERY_TOKEN", "delivery_token": token}) == \
        {"cmd": "DELIVERY_TOKEN_REGISTERED"}
    a = await Ws.login(port, a_sk)
    used.port(a.conn.local_address)
    event, event_id = giftwrap(bytes(b_sk.verify_key))
    used.secret("ppp event", event)
    used.secret("ppp event id", event_id)
    assert await a.call({"cmd": "STORE", "event": event}) == {"cmd": "STORED",
                                                               "event_id": event_id}
    now = int(time.time())
    note = {"delivery_token": token, "ephemeral_pk": os.urandom(32), "nonce": os.urandom(24),
            "ciphertext": os.urandom(1040), "created_at": now, "expires_at": now + 3600}
    for k in ("ephemeral_pk", "nonce", "ciphertext"):
        used.secret(f"ppp sealed {k}", note[k])

    def submit():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            c.connect()
            used.port(c.sock.getsockname())
            c.request("POST", "/v1/note/submit", body=pack(note),
                      headers={"Content-Type": "application/msgpack"})
            r = c.getresponse()
            return r.status, r.read()
        finally:
            c.close()
    status, body = await asyncio.to_thread(submit)
    assert status == 200 and unpack(body)["cmd"] == "STORED"
    deadline = time.monotonic() + 60
    while True:   # both in the inbox once the stream committed them
        got = await b.call({"cmd": "FETCH", "since": 0})
        if len(got["events"]) == 2 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    assert got["cmd"] == "EVENTS" and len(got["events"]) == 2
    await a.close()
    await b.close()


async def _sync(used, port):
    from sync_client import Device, device_session, group_id, pull, push
    g, dev = group_id(os.urandom(16)), Device()
    used.secret("sync group id", g)
    used.secret("sync device id", dev.id)
    c, welcome = await device_session(port, dev, g, version=1)
    used.port(c.proto._transport.get_extra_info("sockname"))
    assert welcome[0] == "Welcome"
    blob_id = used.secret("sync blob id", os.urandom(16))
    payload = used.secret("sync payload", b"sync-payload-" + os.urandom(8).hex().encode())
    ack = await c.request(push(blob_id, payload, 0))
    assert ack[:2] == ["PushAck", blob_id]
    page = await c.request(pull(0, 10))
    assert [bytes(e[2]) for e in page[1]] == [payload]
    await c.close()


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    # `relay keys | head -1`, as an operator types it: head exits after one line.
    out = subprocess.run(f"{sys.executable} -m relay.cli --data-dir {tmp_path} keys | head -c1",
                         shell=True, capture_output=True, text=True, timeout=120)
    assert out.stdout == "t"
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
