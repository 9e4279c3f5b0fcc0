"""The cursor-sync control-plane tables, declared once (same pattern as `schema_heya.py`).

Blobs live in the shared `inbox` (protocol "sync", mailbox = the 32-byte group id, cursor = the
0k-sync cursor). What is sync-only is control state, kept in three small append-only Delta
tables whose rows are events, folded at start by `delta_tables/sync_state.py`:

* `sync_members`: who belongs to which group (create, join with the admitter, revoke);
* `sync_device_acks`: how far each device acknowledged its group's blobs (DELETE needs all);
* `sync_push`: push-notification registrations; the push job (egress/push/) wakes offline
  devices through them and unregisters a token its provider calls dead.

Ids, keys and push tokens are binary columns (no min/max statistics in the Delta log).
"""

from __future__ import annotations

from .schema import _COMMON, Column, TableDef


class S:
    """Column names of the sync control tables."""
    GROUP_ID = "group_id"
    DEVICE_ID = "device_id"
    OP = "op"
    ADMITTER = "admitter"
    CURSOR = "cursor"
    PLATFORM = "platform"
    TOKEN = "token"
    AT = "at"


OP_CREATE = "create"
OP_JOIN = "join"
OP_REVOKE = "revoke"
OP_REGISTER = "register"
OP_UNREGISTER = "unregister"

_GROUP = Column(S.GROUP_ID, "binary", doc="32-byte 0k-sync group id (the inbox mailbox)")
_DEVICE = Column(S.DEVICE_ID, "binary", doc="32-byte Ed25519 device key, proven per connection")
_AT = Column(S.AT, "timestamp", doc="when; strictly increasing per writer")

SYNC_MEMBERS = TableDef(
    "sync_members", (
        _GROUP, _DEVICE,
        Column(S.OP, "string", doc="create | join | revoke"),
        Column(S.ADMITTER, "binary", nullable=True,
               doc="join: the member whose admission was shown; revoke: who revoked"),
        _AT,
    ),
    dict(_COMMON),
    doc="Group membership events; a revoked device never rejoins that group.",
)

SYNC_DEVICE_ACKS = TableDef(
    "sync_device_acks", (
        _GROUP, _DEVICE,
        Column(S.CURSOR, "long", doc="the device holds every blob of the group up to here"),
        _AT,
    ),
    dict(_COMMON),
    doc="Per-device acknowledgement progress (PULL after_cursor, or an explicit Ack).",
)

SYNC_PUSH = TableDef(
    "sync_push", (
        _GROUP, _DEVICE,
        Column(S.OP, "string", doc="register | unregister"),
        Column(S.PLATFORM, "string", doc="e.g. apns, fcm (1-32 visible ASCII)"),
        Column(S.TOKEN, "binary", doc="the push token (UTF-8 bytes)"),
        _AT,
    ),
    dict(_COMMON),
    doc="Push registrations per device (REGISTER_PUSH / UNREGISTER_PUSH).",
)

SYNC_TABLES = {t.name: t for t in (SYNC_MEMBERS, SYNC_DEVICE_ACKS, SYNC_PUSH)}
