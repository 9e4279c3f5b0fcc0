"""Logs: one line per record on stderr, JSON for machines or text for a person, with a stable
`event` vocabulary, and nothing in them that identifies a client or carries ciphertext.

The format is `RELAY_LOG_FORMAT` (`resolve_format`): `auto` (default: `text` when stderr is a
terminal, else `json`), `json` or `text`.

* json, one object per line: `ts` (unix seconds), `level`, `process` (ingress | egress |
  stream | compact | ...), `logger`, `msg` (for people), `event` (for machines: one of
  `EVENTS`), the call's fields and, with an exception, `exc` (its type and message).
* text: `19:03:22.369 INFO  ingress  listener started  listener=heya port=8337`: local time,
  level (coloured when stderr is a terminal and `NO_COLOR` is unset), process, message, the
  fields (not the event), `logger=` for other libraries' records, `exc=`.
Every record is one line; only at level DEBUG does an exception also carry its traceback
(json: a `traceback` field; text: indented lines after the record).

Fields come from `extra={...}` at the call site; every relay log call names its event
(tests/test_logs.py checks the source and a traffic run against `EVENTS`). Records of other
libraries have no event; they pass the same guards.

What may never appear (envelope bytes, keys, tokens, client addresses and ports) is simply
never passed: fields are counts, sizes, reasons, ports of our listeners, versions and
exception type names. By construction, besides:
* the libraries that log per connection (uvicorn's access and WebSocket "[accepted]" /
  "connection open" records with the client's address, websockets, aioquic, asyncio) are held
  at WARNING (`QUIET`), whatever the level;
* `RedactFilter` on the handler rewrites every record (message, string fields, exception
  text, traceback), ours, other libraries' and child processes' alike (`redact`):
  - secrets the process planted (`plant`: its static keys, the pepper seed, VAPID and APNs
    keys, OAuth2 and JWT bearer tokens, AWS credentials from the environment) in every
    spelling (`spellings`: text, hex, base64, base64url, URL-quoted) become `<secret>`;
  - URLs keep scheme and host: path, query and fragment become `/...` (a Web Push
    capability, an APNs device token); a request line without scheme keeps its method;
  - credentials by name (`Bearer x`, `token=x`, `"access_token": "x"`, `password: x`, AWS
    headers) become `<secret>`;
  - IP addresses (v4, v6, bracketed, with a `:port`, or a `(host, port)` tuple) become
    `<addr>`, runs of 24+ hex digits with a letter (or any 32+) `<hex>`, bytes reprs `<bytes>`, base64 runs of 20+
    characters mixing upper, lower case and digits `<secret>`; ANSI escapes (delta-rs's
    error text) are removed and uvicorn's `color_message` is dropped;
* bytes values are replaced by their length, so a careless `extra` cannot leak ciphertext;
* child processes' stderr (Spark's JVM and its Python workers, `child_stderr`) comes back as
  records of this process: the JVM writes one JSON object per line (conf/log4j2.properties),
  anything else becomes a record of its own, through the same filter and format.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import logging
import os
import re
import sys
import threading
import time
import traceback
import urllib.parse
from dataclasses import dataclass

FORMAT_ENV = "RELAY_LOG_FORMAT"
FORMATS = ("auto", "json", "text")
LEVEL_ENV = "RELAY_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
# `all`: the libraries of QUIET log at the root level too (what the secret-scan suite runs
# with, tests/test_secret_logs.py); unset or anything else: they stay at WARNING.
LIBRARIES_ENV = "RELAY_LOG_LIBRARIES"

EVENTS: dict[str, str] = {
    # listeners (ingress and egress shells)
    "listener_started": "a protocol listener is accepting (listener, port)",
    "connection_refused": "past ppp.max_connections WebSockets, an upgrade was refused (HTTP "
                          "403); admission refusals are admission_refused (listener, "
                          "suppressed)",
    "handshake_timeout": "a client did not finish its Noise handshake in time (listener)",
    "session_timeout": "a trueseal client went silent past a deadline after its handshake; "
                       "closed (listener, waiting_for: idle | frame | write, suppressed)",
    "admission_refused": "a connection was refused a slot; closed (listener, stage, reason: "
                         "address_cap | identity_cap | stage_full | total_full | gone, "
                         "suppressed)",
    "memory_trimmed": "a wave of connections drained: collected and malloc_trim'd "
                      "(runtime/memory_trim.py)",
    "connection_evicted": "a connection lost its slot to a newcomer: the idlest of its "
                          "address or identity at their cap, or of the address holding the "
                          "most in a full stage (listener, stage, suppressed)",
    "listener_paused": "a listener stopped accepting: descriptors near the process limit "
                       "(listener, reason, suppressed)",
    "listener_resumed": "a paused listener accepts again (listener, paused_seconds, "
                        "suppressed)",
    "accept_failed": "accept() failed for another reason than resources (listener, error, "
                     "suppressed)",
    "open_files_limit": "the process's descriptor limit after raising it at start (soft, "
                        "hard)",
    # ingress
    "push_session_open": "a push session finished its handshake (debug)",
    "push_session_closed": "a push session ended (reason; debug)",
    "push_rejected": "a push was answered Error (reason: short_body | oversize, size)",
    "push_store_failed": "a landing commit failed; the connection is closed so the client "
                         "retries (size, error)",
    "commit_failed": "a group commit failed; its callers hear the error (rows)",
    "ingress_stopped": "ingress finished its last commits and stopped (rows)",
    "landing_seal_failed": "sealing an idle landing generation by age failed; the next commit "
                           "or tick retries (error)",
    "node_id_taken": "an ingress process refused to start: its node id is another's, already "
                     "running, or leased by a live process on any host "
                     "(delta_tables/node_claim.py, node_lease.py)",
    "lease_lost": "another process took this node's lease over: the node stopped writing "
                  "and stops (delta_tables/node_lease.py)",
    "lease_renew_failed": "a node's lease heartbeat failed; retried at the next one (node, "
                          "error)",
    # the peer channel between hosts (runtime/peer_link.py)
    "peer_listening": "the trueseal push ingress accepts peer channels and lists its key "
                      "and endpoint in the store (port, node)",
    "peer_connected": "a peer channel opened (peer: the other host's node name)",
    "peer_disconnected": "a peer channel ended (peer, reason)",
    "peer_rejected": "a host dialled with a key the store does not list for a live node; "
                     "closed without an answer (reason)",
    "peer_handshake_failed": "a peer channel's Noise handshake failed or timed out (peer, "
                             "reason)",
    "peer_expired": "a peer's registration or lease expired: its channel was closed (peer)",
    "peer_dial_failed": "egress could not reach a listed peer; dialled again at the next "
                        "refresh (peer, error)",
    "peer_list_failed": "reading the live peers from the store failed; the last list is "
                        "kept (error)",
    "peer_register_failed": "renewing this process's peer registration failed; retried at "
                            "the next beat (error)",
    # heya (ingress process)
    "heya_timeout": "a Heya connection timed out (waiting_for)",
    "heya_closed": "a Heya connection is closing (reason; debug)",
    "heya_refused": "a Heya command was refused (reason)",
    "heya_write_timeout": "a Heya client stopped reading replies; closed",
    "heya_store_failed": "a SEND's landing commit failed; closed, no RECV (size, error)",
    "heya_control_loaded": "the Heya control tables were loaded (mailboxes, send_tokens)",
    "control_refresh_failed": "a Heya, PPP or cursor-sync host could not fold the other "
                              "hosts' control changes this round; tried again next (error)",
    "heya_inbox_bootstrap": "the Heya inbox view was rebuilt (version, tokens)",
    "server_cert_created": "a listener's server certificate was created (listener, path)",
    "server_cert_recreated": "a listener's key without certificate was replaced by a new pair",
    # ppp (ingress process)
    "ppp_control_loaded": "the PPP control tables were loaded (delivery_tokens, backups, "
                          "rooms)",
    "ppp_inbox_bootstrap": "the PPP inbox view was rebuilt (version, rows, pending)",
    "ppp_command_refused": "a PPP command got a failure reply (cmd, reason, request_id)",
    "ppp_command_failed": "a PPP command raised; answered as internal error (cmd, "
                          "request_id, error)",
    "ppp_store_failed": "a STORE's landing commit failed; STORE_FAIL (error)",
    "ppp_ack_failed": "an ACK's rows could not be written; the events stay pending (error)",
    "ppp_handshake_timeout": "a PPP WebSocket did not authenticate in time; closed",
    "ppp_http_auth_refused": "a PPP polling request had a bad/old/replayed signature "
                             "(request_id)",
    "ppp_sealed": "a sealed submission's coarse outcome (outcome only: no id, IP or token)",
    "ppp_sealed_room": "a sealed room submission's coarse outcome (outcome only: no room, "
                       "token or IP)",
    "ppp_rooms_bootstrap": "the PPP room view was rebuilt (version, rows)",
    "ppp_client_closed": "a PPP connection was closed below the app (reason: head_timeout | "
                         "body_timeout | frame_timeout | write_timeout | auth_too_large, "
                         "suppressed)",
    "ppp_bad_request": "a PPP client sent bytes uvicorn refused; uvicorn's own warning is "
                       "dropped (what: invalid_http | unsupported_upgrade | invalid_utf8 | "
                       "concurrency_limit, suppressed)",
    "ppp_client_gone": "a PPP client left inside a request body; a normal event (where: "
                       "sealed | polling, suppressed)",
    # sync: cursor-sync over QUIC (ingress process)
    "sync_control_loaded": "the sync control tables were loaded (groups)",
    "sync_inbox_bootstrap": "the sync inbox view was rebuilt (version, blobs, groups)",
    "sync_session_open": "a sync connection's HELLO was accepted (version)",
    "sync_hello_timeout": "no HELLO within sync.hello_timeout_seconds; closed (code 3)",
    "sync_auth_failed": "a sync connection failed the Ed25519 challenge; closed (code 3)",
    "sync_refused": "a sync request was refused: empty FIN or ERROR (code, reason, request)",
    "sync_store_failed": "a PUSH or ack progress was not stored (error)",
    "sync_member_changed": "group membership changed (op: created | joined | revoke)",
    "sync_blob_deleted": "a DELETE acknowledged by every device removed a blob",
    "sync_task_failed": "a sync connection's request loop raised; closed",
    "sync_handshake_timeout": "a QUIC handshake was not done within "
                              "sync.handshake_timeout_seconds: its state dropped, nothing sent "
                              "(suppressed)",
    "sync_address_validation": "new sync connections must (on=true) or need not (on=false) "
                               "echo a QUIC Retry first (handshakes under way, suppressed)",
    "sync_quic_error": "aioquic closed a sync connection for a protocol error; its own line, "
                       "which names the connection id, is dropped (error_code, suppressed)",
    # egress
    "egress_bootstrap": "egress rebuilt its pending view from inbox minus acks (version, rows)",
    "egress_rebuild": "the inbox tail lost its place (log cleaned up) and rebuilt",
    "egress_poll_failed": "one poll of the inbox log failed; the next one retries",
    "receive_session_open": "a device session finished its handshake (debug)",
    "receive_session_closed": "a device session ended (reason; debug)",
    "receive_task_failed": "a task of a receive session failed (task)",
    "heartbeat_timeout": "a device did not answer a heartbeat; closed",
    "deliver_skipped": "an envelope too large for one frame was not delivered (size)",
    "ack_ignored": "a DeliverAck for a blob not pending in this session (debug)",
    "ack_failed": "an ack could not be made durable; the envelope is redelivered (error)",
    "egress_stopped": "egress stopped (delivered, acked)",
    # stream
    "stream_batch": "a micro-batch committed (batch_id, rows_in, accepted, rejected, ms)",
    "stream_batch_replay_skipped": "a replayed micro-batch was already committed (batch_id)",
    "stream_writer_lost": "another stream committed to the inbox since this one built its "
                          "cursor cache: it stops (expected, found)",
    "stream_direct_append_off": "a table's protocol asks more of writers than a direct append "
                                "does: the sink commits to it through delta-rs (table, reason)",
    "stream_stopped": "the stream stopped (batches)",
    "stream_state_partitions": "which executor holds each state partition (executors)",
    "python_daemons_stopped": "the Python daemons Spark used only to start the query were "
                              "stopped (modules; jobs/python_daemons.py)",
    "python_daemons_kept": "they could not be stopped (Spark's internals differ): the stream "
                           "runs on with them",
    # compaction
    "compaction_step": "one compaction step finished (msg says what it removed)",
    "compaction_run": "a compaction run finished (counts per kind, bytes_after, ms)",
    "compaction_failed": "a compaction run failed; the next one is on schedule (error)",
    "compaction_conflict": "a compaction commit lost a race and is retried (debug)",
    # push wake-ups (egress/push/job.py, runtime/push_desk.py)
    "push_started": "the push job restored its place (inbox_version, marker, unsure, "
                    "window_seconds, dry_run: platforms without credentials)",
    "push_dry_run": "a platform has no credentials: its wake-ups are recorded, not sent "
                    "(platform, why)",
    "push_outcome": "a wake-up was not delivered (platform, outcome, reason, attempts, "
                    "protocol); never the token",
    "push_rebuild": "the push job lagged past the inbox log and read its snapshot",
    "push_step_failed": "a push step failed and is retried (failures, error)",
    "push_stop_unrecorded": "outcomes could not be recorded at stop; a restart re-sends "
                            "under the same collapse ids (error)",
    "push_stopped": "the push job stopped (rows, outcomes)",
    "push_desk_refused": "a push desk got a request it could not read; that connection ends "
                         "(error)",
    # keys, metrics
    "key_created": "the relay's static key was created (path)",
    "key_mode_fixed": "the key file was readable by others; mode set to 0600 (path, mode)",
    "metrics_started": "the /metrics endpoint is serving (port)",
    "metrics_unavailable": "the /metrics port could not be bound; the process runs without "
                           "it (port, error)",
    # operator-facing failures (runtime/operator_errors.py)
    "operator_error": "a command stopped on a failure an operator can fix, said in one line "
                      "(what: config | credentials | bucket | endpoint | port_in_use | "
                      "disk_full | certificate | permission, exit_code: 2 for configuration)",
    # logging itself
    "uncaught_exception": "an exception nobody caught ended a thread or the process "
                          "(thread_name, exc)",
}

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}

# Libraries that would log a record per connection or request (with the peer's address, a
# connection id or a path): WARNING and above only, whatever the root level.
QUIET = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "websockets", "quic",
         "http3", "aioquic", "asyncio", "py4j", "hpack", "h2")

log = logging.getLogger("relay.logs")
# Credentials a process may hold in its environment: planted (`plant`) at `setup`.
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


# --- redaction --------------------------------------------------------------------------------

REDACTED_ADDR = "<addr>"
# what may follow an address: `:port`, or `', port` inside a repr'd (host, port) tuple
_PORT = r"(?::\d{1,5}(?!\d)|(?P<q>['\"])\s*,\s*\d{1,5}(?!\d))?"
_V4 = re.compile(r"(?<![\w.])(?P<a>(?:\d{1,3}\.){3}\d{1,3})(?!\w)" + _PORT)
_V6 = re.compile(r"(?<![\w:.%])\[?(?P<a>[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}"
                 r"(?:\.\d{1,3}){0,3}(?:%[\w.-]+)?)\]?" + _PORT + r"(?![\w:])")
# 24+ hex digits (a 12-byte delivery or member token) with a letter and a digit among them,
# or any 32+: a long decimal number stays
_HEX = re.compile(r"(?<![0-9A-Fa-f])(?=[0-9]*[A-Fa-f])(?=[A-Fa-f]*[0-9])[0-9A-Fa-f]{24,}"
                  r"(?![0-9A-Fa-f])|(?<![0-9A-Fa-f])[0-9A-Fa-f]{32,}(?![0-9A-Fa-f])")
_BYTES = re.compile(r"(?<!\w)b(['\"])(?:\\.|(?!\1)[^\\])*\1")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _addr(m: re.Match) -> str:
    a = m.group("a")
    head, _, tail = a.rpartition(":")
    if _is_ip(a) or (":" in a and tail.isdigit() and _is_ip(head)):   # v6 "addr:port" unbracketed
        return REDACTED_ADDR + (m.group("q") or "")
    return m.group(0)


# --- known secrets: what a process holds, planted here in every spelling it could be logged in

_MIN_SECRET = 8          # shorter values would redact ordinary words and numbers
_secrets: set[str] = set()
_secret_re: re.Pattern | None = None
_secret_lock = threading.Lock()


def spellings(value: bytes | str) -> set[str]:
    """Every way `value` could reach a log line: as text; its bytes in hex (either case), in
    base64 and base64url (padded or not, and a prefix of 16+ characters, as a log line may
    cut it short) and each of those URL-quoted."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    forms = {value} if isinstance(value, str) else set()
    forms |= {raw.hex(), raw.hex().upper()}
    for enc in (base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()):
        forms |= {enc, enc.rstrip("=")}
    forms |= {urllib.parse.quote(f, safe=safe) for f in list(forms) for safe in ("", "/")}
    return {f for f in forms if len(f) >= _MIN_SECRET}


def plant(*values: bytes | str | None) -> None:
    """Register secrets this process holds (keys, bearer tokens, credentials): every record
    afterwards has each of their `spellings` replaced by `<secret>`. Values shorter than
    8 bytes, None and empty ones are ignored."""
    global _secret_re
    forms: set[str] = set()
    for v in values:
        if v and len(v) >= _MIN_SECRET:
            forms |= spellings(v)
    if not forms - _secrets:
        return
    with _secret_lock:
        _secrets.update(forms)
        # longest first, so a whole spelling goes before a prefix of another
        _secret_re = re.compile("|".join(re.escape(f) for f in sorted(
            _secrets, key=len, reverse=True)))


def planted() -> int:
    """How many spellings are registered (tests)."""
    return len(_secrets)


def forget_planted() -> None:
    """Drop every registered secret (tests)."""
    global _secret_re
    with _secret_lock:
        _secrets.clear()
        _secret_re = None


# URLs: scheme and host stay (a request log says where and with what status); the path, query
# and fragment go: a Web Push capability, an APNs device token, a signed query
_URL = re.compile(r"(?i)\b((?:https?|wss?)://)(?:[^\s/?#@\"'<>]*@)?([^\s/?#\"'<>]*)"
                  r"([/?#][^\s\"'<>]*)?")
# an HTTP request line without the scheme (urllib3, uvicorn's access log): method, then the path
_REQUEST_PATH = re.compile(r"\b(GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) /[^\s\"']*")
# credentials by name: `Authorization: Bearer x`, `token=x`, `"access_token": "x"`
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")
_NAMED = re.compile(
    r"(?i)(?<![A-Za-z0-9])((?:authorization|password|passwd|secret|secret_access_key|"
    r"session_token|security_token|access_token|id_token|refresh_token|token|api_key|"
    r"private_key|assertion|client_secret|x-amz-security-token|x-amz-credential|"
    r"x-amz-signature|signature|credential)[\"']?\s*[:=]\s*[\"']?)(?!<)[^\s\"',;&}<]{4,}")
# base64 / base64url runs of 20+ characters mixing upper case, lower case and digits: keys,
# tokens and ciphertext; words, names and paths rarely mix all three so long
_B64 = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_-]{20,}={0,2}(?![A-Za-z0-9+/_=-])")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def _b64(m: re.Match) -> str:
    run = m.group(0)
    if not (any(c.isupper() for c in run) and any(c.islower() for c in run) and
            any(c.isdigit() for c in run)):
        return run
    if "/" in run and not ("+" in run or run.endswith("=")):
        # a path (`/tmp/pytest-of-root/test_Foo0/data`) has short lowercase parts; a base64
        # run with a slash has long mixed ones
        parts = [p for p in run.split("/") if p]
        if any(len(p) >= 3 and (p.islower() or p.isdigit()) for p in parts):
            return run
    return "<secret>"


def _url(m: re.Match) -> str:
    return m.group(1) + m.group(2) + ("/..." if m.group(3) else "")


def redact(text: str) -> str:
    """`text` without planted secrets, URL paths and queries, credentials by name, ANSI
    escapes, IP addresses (and their ports), long hex runs, base64 runs or bytes reprs."""
    if _secret_re is not None:
        text = _secret_re.sub("<secret>", text)
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "//" in text:
        text = _URL.sub(_url, text)
    if " /" in text:
        text = _REQUEST_PATH.sub(lambda m: m.group(1) + " /...", text)
    text = _BEARER.sub(lambda m: m.group(1) + " <secret>", text)
    text = _NAMED.sub(lambda m: m.group(1) + "<secret>", text)
    if "." in text or ":" in text:
        text = _V6.sub(_addr, text)     # first: "::ffff:127.0.0.1" is one address
        text = _V4.sub(_addr, text)
    text = _HEX.sub("<hex>", text)
    text = _BYTES.sub("<bytes>", text)
    return _B64.sub(_b64, text)


def _plain(v) -> bool:
    return v is None or isinstance(v, (bool, int, float, bytes, bytearray))


class RedactFilter(logging.Filter):
    """The second guard, on the handler: rewrites each record's message and fields through
    `redact` (a string field stays a string; any other value that would render with an
    address becomes its redacted text) and drops uvicorn's `color_message`. Never drops a
    record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("color_message", None)
        try:
            msg = record.getMessage()
        except Exception:   # a call's bad %-args: keep what it says, not a logging error
            msg = f"{record.msg} <args not rendered>"
        record.msg, record.args = redact(msg), None
        for k, v in list(record.__dict__.items()):
            if k in _STD or k.startswith("_") or _plain(v):
                continue
            text = v if isinstance(v, str) else str(v)
            clean = redact(text)
            if clean != text or isinstance(v, str):
                record.__dict__[k] = clean
        return True


# --- formats --------------------------------------------------------------------------------

def resolve_format(value: str | None = None, stream=None) -> str:
    """`json` or `text`: what a `RELAY_LOG_FORMAT` / `--log-format` value means for `stream`
    (default stderr). None or "" reads `RELAY_LOG_FORMAT` (unset: auto); `auto` is `text` on
    a terminal, else `json`. Any other value raises ValueError."""
    if not value:
        value = os.environ.get(FORMAT_ENV) or "auto"
    fmt = value.strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"{FORMAT_ENV} / --log-format must be one of {', '.join(FORMATS)}, "
                         f"not {value!r}")
    if fmt == "auto":
        return "text" if _isatty(stream if stream is not None else sys.stderr) else "json"
    return fmt


def use_color(stream=None) -> bool:
    """Colour the level in text lines: `stream` (default stderr) is a terminal and `NO_COLOR`
    is unset or empty (no-color.org)."""
    return _isatty(stream if stream is not None else sys.stderr) and not os.environ.get(
        "NO_COLOR")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _fields(record: logging.LogRecord):
    for k, v in record.__dict__.items():
        if k not in _STD and not k.startswith("_"):
            yield k, (f"<{len(v)} bytes>" if isinstance(v, (bytes, bytearray)) else v)


def _exc(record: logging.LogRecord, full: bool) -> tuple[str | None, str | None]:
    """(type: message, traceback if `full`) of the record's exception, redacted."""
    ei = record.exc_info
    if not ei or ei[0] is None:
        return None, None
    line = "".join(traceback.format_exception_only(ei[0], ei[1])).strip()
    tb = "".join(traceback.format_exception(*ei)).rstrip() if full else None
    return redact(line), (redact(tb) if tb else None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (the keys of the module docstring)."""

    def __init__(self, process: str, tracebacks: bool = False):
        super().__init__()
        self.process = process
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "process": self.process, "logger": record.name, "msg": record.getMessage()}
        out.update(_fields(record))
        exc, tb = _exc(record, self.tracebacks)
        if exc is not None:
            out["exc"] = exc
        if tb is not None:
            out["traceback"] = tb
        return json.dumps(out, default=str)


_ESCAPES = {i: f"\\x{i:02x}" for i in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
_ESCAPES.update({ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x2028: "\\u2028",
                 0x2029: "\\u2029"})


def _oneline(text: str) -> str:
    """No line breaks and no terminal control sequences (ESC is escaped too)."""
    return text.translate(_ESCAPES)


def _text_value(v) -> str:
    text = _oneline(v if isinstance(v, str) else
                    json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else str(v))
    if not text or any(c in text for c in ' "='):
        return '"' + text.replace('"', '\\"') + '"'
    return text


class TextFormatter(logging.Formatter):
    """`19:03:22.369 INFO  ingress  listener started  listener=heya port=8337`."""

    LEVELS = {"WARNING": "WARN", "CRITICAL": "CRIT"}
    COLORS = {"DEBUG": "36", "INFO": "32", "WARNING": "33", "ERROR": "31", "CRITICAL": "31"}

    def __init__(self, process: str, color: bool = False, tracebacks: bool = False):
        super().__init__()
        self.process = process
        self.color = color
        self.tracebacks = tracebacks

    def formatTime(self, record, datefmt=None) -> str:   # noqa: N802 (logging's name)
        return time.strftime("%H:%M:%S", time.localtime(record.created)) + \
            f".{int(record.msecs):03d}"

    def format(self, record: logging.LogRecord) -> str:
        level = f"{self.LEVELS.get(record.levelname, record.levelname):<5}"
        if self.color:
            level = f"\033[{self.COLORS.get(record.levelname, '0')}m{level}\033[0m"
        line = (f"{self.formatTime(record)} {level} {self.process}  "
                f"{_oneline(record.getMessage())}")
        fields = [f"{k}={_text_value(v)}" for k, v in _fields(record)
                  if k not in ("event", "exc")]
        if record.name != "relay" and not record.name.startswith("relay."):
            fields.append(f"logger={record.name}")
        if fields:
            line += "  " + " ".join(fields)
        exc, tb = _exc(record, self.tracebacks)
        if exc is None and isinstance(record.__dict__.get("exc"), str):
            exc = record.__dict__["exc"]   # a child's record (the JVM's exception, one line)
        if exc is not None:
            line += f"  exc={_oneline(exc)}"
        if tb is not None:
            line += "\n" + "\n".join("    " + _oneline(t) for t in tb.splitlines())
        return line


# --- setup ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Active:
    """What `setup` chose for this process (read by jobs/spark_session.py for the JVM)."""
    process: str
    format: str          # json | text
    color: bool
    level: int
    handler: logging.Handler


_active: Active | None = None


def active() -> Active | None:
    return _active


def resolve_level(value: str | None) -> str:
    """A `RELAY_LOG_LEVEL` / `--log-level` value as a logging level name: one of `LEVELS`
    (any case); None or "" reads `RELAY_LOG_LEVEL`; unset or unknown: INFO."""
    value = (value if value else os.environ.get(LEVEL_ENV, "")).strip().lower()
    return value.upper() if value in LEVELS else "INFO"


def libraries_loud() -> bool:
    """`RELAY_LOG_LIBRARIES=all`: the QUIET libraries log at the root level (and the
    listeners that hold them down by their own settings let them, ingress/ppp_app.py and
    ingress/sync_quic.py)."""
    return os.environ.get(LIBRARIES_ENV, "").strip().lower() == "all"


def setup(process: str, level: str | None = None) -> None:
    """This process's logging: one handler on stderr in the `RELAY_LOG_FORMAT` format at the
    `RELAY_LOG_LEVEL` level (INFO) unless `level` says, with `RedactFilter`; `QUIET` libraries
    at WARNING; warnings and uncaught exceptions as records."""
    global _active
    fmt = resolve_format(None)
    root = logging.getLogger()
    root.setLevel(resolve_level(level))
    debug = root.level <= logging.DEBUG
    color = fmt == "text" and use_color(sys.stderr)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process, tracebacks=debug) if fmt == "json" else
                         TextFormatter(process, color=color, tracebacks=debug))
    handler.addFilter(RedactFilter())
    root.handlers[:] = [handler]
    loud = libraries_loud()
    for name in QUIET:
        quiet = logging.getLogger(name)
        quiet.setLevel(logging.NOTSET if loud else logging.WARNING)
        quiet.handlers[:] = []
        quiet.propagate = True
    logging.captureWarnings(True)   # warnings.warn: a record, not two raw lines on stderr
    plant(*(os.environ.get(v) for v in CREDENTIAL_ENV))
    sys.excepthook = _uncaught
    threading.excepthook = lambda a: _uncaught(a.exc_type, a.exc_value, a.exc_traceback,
                                               a.thread)
    _active = Active(process, fmt, color, root.level, handler)


def _uncaught(exc_type, exc, tb, thread=None) -> None:
    """sys.excepthook / threading.excepthook: one record (type and message), not a
    traceback on stderr (at DEBUG the record carries it)."""
    if exc_type is SystemExit:
        return
    name = (thread or threading.current_thread()).name
    log.critical("uncaught exception", exc_info=(exc_type, exc, tb),
                 extra={"event": "uncaught_exception", "thread_name": name})


# --- child processes' stderr ------------------------------------------------------------------

# Lines a child writes that say nothing to an operator. The JDK prints the first at every start
# because Spark's launcher always adds --add-modules=jdk.incubator.vector (spark-launcher's
# JavaModuleOptions); it cannot be switched off.
CHILD_NOISE = ("WARNING: Using incubator modules: jdk.incubator.vector",)
_LEVELNO = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
            "warn": logging.WARNING, "warning": logging.WARNING, "error": logging.ERROR,
            "fatal": logging.CRITICAL, "critical": logging.CRITICAL}


def child_record(line: str, source: str) -> logging.LogRecord | None:
    """The record for one line a child wrote on stderr: a JSON object with ts, level, logger
    and msg (the JVM's lines under conf/log4j2.properties, or another relay process's) keeps
    them and its other fields; any other line is a WARNING of logger `source`; known noise
    (`CHILD_NOISE`) and blank lines are None."""
    line = line.rstrip("\r\n")
    if not line.strip() or any(line.startswith(n) for n in CHILD_NOISE):
        return None
    obj = None
    if line.startswith("{"):
        try:
            obj = json.loads(line)
        except ValueError:
            pass
    if isinstance(obj, dict) and {"ts", "level", "logger", "msg"} <= obj.keys():
        levelno = _LEVELNO.get(str(obj["level"]).lower(), logging.WARNING)
        try:
            created = float(obj["ts"])
        except (TypeError, ValueError):
            created = None
        rec = logging.makeLogRecord({"name": str(obj["logger"]), "msg": str(obj["msg"]),
                                     "levelno": levelno,
                                     "levelname": logging.getLevelName(levelno)})
        if created is not None:
            rec.created, rec.msecs = created, (created % 1) * 1000
        for k, v in obj.items():
            if k not in _STD and k not in ("ts", "level", "logger", "msg"):
                rec.__dict__[k] = v
        return rec
    return logging.makeLogRecord({"name": source, "msg": line, "levelno": logging.WARNING,
                                  "levelname": "WARNING"})


@contextlib.contextmanager
def child_stderr(source: str):
    """Processes started inside this block write their stderr into a pipe that a thread of
    ours reads: each line becomes a record (`child_record`) of this process's handler, so it
    gets our format, our filter and one line per record, also after the block. Without
    `setup` (tests, notebooks) this does nothing. While the block runs, this process's own
    records go to the real stderr as before."""
    act = _active
    if act is None or not isinstance(act.handler, logging.StreamHandler):
        yield
        return
    handler = act.handler
    read_fd, write_fd = os.pipe()
    saved = os.dup(2)
    own = open(os.dup(saved), "w", buffering=1, encoding="utf-8", errors="replace")
    threading.Thread(target=_pump, args=(read_fd, source, handler), daemon=True,
                     name=f"{source}-stderr").start()
    sys.stderr.flush()
    old = handler.setStream(own)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        handler.setStream(old)
        own.close()


def _pump(read_fd: int, source: str, handler: logging.Handler) -> None:
    root = logging.getLogger()
    with open(read_fd, "rb") as pipe:
        for raw in pipe:
            rec = child_record(raw.decode("utf-8", "replace"), source)
            if rec is not None and rec.levelno >= root.getEffectiveLevel():
                handler.handle(rec)
