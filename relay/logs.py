"""Structured JSON logs, one object per line, with a stable `event` vocabulary.

Every line: `ts` (unix seconds), `level`, `process` (ingress | egress | stream | compact | ...),
`logger`, `msg` (for people), `event` (for machines: one of `EVENTS`), and the call's fields.
Fields come from `extra={...}` at the call site; every relay log call names its event
(tests/test_logs.py checks the source and a traffic run against `EVENTS`).

What may never appear (envelope bytes, mailbox or relay keys, client addresses) is simply
never passed: fields are counts, sizes, reasons, ports, versions and exception type names.
As a second guard, bytes values are replaced by their length so a careless `extra` cannot
leak ciphertext or a key.
"""

from __future__ import annotations

import json
import logging
import sys

# The event vocabulary: name -> when it is logged (and its fields besides the standard ones).
EVENTS: dict[str, str] = {
    # listeners (ingress and egress shells)
    "listener_started": "a protocol listener is accepting (listener, port)",
    "connection_refused": "past max_connections, a connection was closed at once (listener)",
    "handshake_timeout": "a client did not finish its Noise handshake in time (listener)",
    # ingress
    "push_session_open": "a push session finished its handshake (debug)",
    "push_session_closed": "a push session ended (reason; debug)",
    "push_rejected": "a push was answered Error (reason: short_body | oversize, size)",
    "push_store_failed": "a landing commit failed; the connection is closed so the client "
                         "retries (size, error)",
    "commit_failed": "a group commit failed; its callers hear the error (rows)",
    "ingress_stopped": "ingress finished its last commits and stopped (rows)",
    # heya (ingress process)
    "heya_timeout": "a Heya connection timed out (waiting_for)",
    "heya_closed": "a Heya connection is closing (reason; debug)",
    "heya_refused": "a Heya command was refused (reason)",
    "heya_write_timeout": "a Heya client stopped reading replies; closed",
    "heya_store_failed": "a SEND's landing commit failed; closed, no RECV (size, error)",
    "heya_control_loaded": "the Heya control tables were loaded (mailboxes, send_tokens)",
    "heya_inbox_bootstrap": "the Heya inbox view was rebuilt (version, tokens)",
    "server_cert_created": "a listener's server certificate was created (listener, path)",
    "server_cert_recreated": "a listener's key without certificate was replaced by a new pair",
    # ppp (ingress process)
    "ppp_control_loaded": "the PPP control tables were loaded (delivery_tokens, backups)",
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
    "stream_stopped": "the stream stopped (batches)",
    # compaction
    "compaction_step": "one compaction step finished (msg says what it removed)",
    "compaction_run": "a compaction run finished (counts per kind, bytes_after, ms)",
    "compaction_failed": "a compaction run failed; the next one is on schedule (error)",
    "compaction_conflict": "a compaction commit lost a race and is retried (debug)",
    # keys, metrics
    "key_created": "the relay's static key was created (path)",
    "key_mode_fixed": "the key file was readable by others; mode set to 0600 (path, mode)",
    "metrics_started": "the /metrics endpoint is serving (port)",
    "metrics_unavailable": "the /metrics port could not be bound; the process runs without "
                           "it (port, error)",
}

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None)).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(),
               "process": self.process, "logger": record.name, "msg": record.getMessage()}
        for k, v in record.__dict__.items():
            if k not in _STD and not k.startswith("_"):
                out[k] = f"<{len(v)} bytes>" if isinstance(v, (bytes, bytearray)) else v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(out, default=str)


def setup(process: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("py4j", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
