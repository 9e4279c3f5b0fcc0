"""The push job's table, declared once: `push_log`, one row per wake-up decision and outcome.

What it holds, for the capacity notebook and for the job's own restart: when, which
protocol and platform, the outcome, the provider's latency and the inbox-commit-to-answer
latency. Never a token, a mailbox or an owner: a device appears only as `device`, a keyed
BLAKE2b of (protocol, owner, platform, token) under a relay secret (`<data>/keys/push_device.key`),
so the job can match a wake-up's intent with its outcome after a crash and an analyst can
count distinct devices, but nobody holding the table can test a token or a pubkey against it.

Rows: `intent` (recorded before the provider request: a crash after it re-sends under the
same collapse id, never loses the wake-up), then one final outcome per wake-up: `sent`,
`unregistered` (the token was deleted), `failed`, `retry_exhausted`, `dry_run` (no
credentials for the platform), `unsupported` (a platform this relay cannot send to). A commit
of outcomes carries the Delta app-transaction marker (`relay-push`, inbox version): every
inbox row at or below it has had its wake-ups decided and recorded, so a restart reads on
from there: the mechanism of the stream's exactly-once writes (jobs/inbox_stream.py).
"""

from __future__ import annotations

from .schema import _COMMON, Column, TableDef


class PL:
    AT = "at"
    PROTOCOL = "protocol"
    PLATFORM = "platform"
    DEVICE = "device"
    TRIGGER = "trigger"
    OUTCOME = "outcome"
    REASON = "reason"
    ATTEMPTS = "attempts"
    WAKE_AT = "wake_at"
    LATENCY_MS = "latency_ms"
    INBOX_TO_PUSH_MS = "inbox_to_push_ms"


INTENT = "intent"
FINAL_OUTCOMES = ("sent", "unregistered", "failed", "retry_exhausted", "dry_run", "unsupported")

PUSH_LOG = TableDef(
    "push_log", (
        Column(PL.AT, "timestamp", doc="when the row was recorded"),
        Column(PL.PROTOCOL, "string", doc="ppp | heya | sync"),
        Column(PL.PLATFORM, "string", doc="apns | fcm | webpush (or what a client registered)"),
        Column(PL.DEVICE, "binary", doc="keyed hash of the device; never the token"),
        Column(PL.TRIGGER, "string", doc="message | deferred | knock"),
        Column(PL.OUTCOME, "string", doc="intent | " + " | ".join(FINAL_OUTCOMES)),
        Column(PL.REASON, "string", nullable=True, doc="the provider's reason, if any"),
        Column(PL.ATTEMPTS, "int", doc="provider requests made (0 for intent, dry_run)"),
        Column(PL.WAKE_AT, "timestamp", doc="the wake-up's time; its collapse id's input"),
        Column(PL.LATENCY_MS, "long", nullable=True, doc="the last provider request"),
        Column(PL.INBOX_TO_PUSH_MS, "long", nullable=True,
               doc="the inbox commit of the row that caused it (the commit's own "
                   "timestamp) -> the provider's answer"),
    ),
    dict(_COMMON),
    doc="Push wake-ups: intents and outcomes (delta_tables/schema_push.py).",
)
