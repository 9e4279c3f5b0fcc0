"""Structured logs: one event vocabulary, and nothing in them that identifies a person or
carries ciphertext (envelope bytes, mailbox or relay keys, client addresses)."""

from __future__ import annotations

import ast
import base64
import json
from pathlib import Path

from relay.logs import EVENTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "ingress", "egress", "jobs", "relay", "delta_tables")
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
            problems.append(f"{path}:{call.lineno} event {event!r} is not in relay.logs.EVENTS")
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
