"""The PPP control-plane tables, declared once (same pattern as `schema.py`, `schema_heya.py`).

PPP events live in the shared `inbox` (protocol "ppp", mailbox = recipient pubkey). What is
PPP-only is control-plane state, in two small append-only tables whose rows are events,
folded into memory by the owner (the ingress node hosting the PPP listener) at start
(`delta_tables/ppp_state.py`):

* delivery tokens (spec 004 §6): registered / deregistered per recipient; durable, so sealed
  submissions keep routing after a restart;
* backups (§6 "Backups"): one opaque blob per pubkey, upserted with a version counter;
* rooms and groups (§7): a row per CREATE_ROOM / UPDATE_ROOM carrying the room's whole
  relay-visible record (its after-image), so the newest row of a room is all its state;
* room member tokens (§7.3): registered, revoked, or marked by a key rotation with the end
  of their grace period. Room *messages* are inbox rows (protocol `ppp_room`);
* contact discovery (§9): peppered identifier hashes -> the pubkey that published them,
  filed under the pepper they were made with. Never an identifier, never the pepper;
* push registrations (REGISTER_PUSH): keyed (pubkey, token) as the spec asks, several per
  pubkey; a row is deregistered when the provider says the token is dead (the push job asks
  this process to, `ingress/push_desk.py`);
* budget hits (decision 0010): one row per command charged to an hourly quota
  (`engine/ppp/limits.QUOTAS`), so every host counts one identity's quota together. The
  pubkey is not kept: `pubkey_hash` is a keyed BLAKE2b of it (`budget_hits.py`);
* carry groups (§8): a row per registration (the signer's consent to that definition) and
  per leave, folded by `engine/ppp/carry.py`. Sig bytes are not kept: a row is only
  written after the signature was checked.

Tokens, pubkeys and ciphertext are binary columns: delta-rs writes no statistics for those
into the Delta log, so a removed row's values leave with its data file. `at` orders a
table's rows (strictly increasing per writer) and is the key a reader uses to fetch one row
(a backup's ciphertext), so no token or pubkey is spelled into a predicate. Other modules
refer to columns through `Q`.
"""

from __future__ import annotations

from .schema import _COMMON, Column, TableDef


class Q:
    """Column names of the PPP control tables."""
    TOKEN = "token"
    RECIPIENT = "recipient"
    PUBKEY = "pubkey"
    OP = "op"
    CIPHERTEXT = "ciphertext"
    VERSION = "version"
    AT = "at"
    ROOM_ID = "room_id"
    ADMIN = "admin"
    ROOM_TYPE = "room_type"
    S2_CELL = "s2_cell_id"
    S2_COARSE = "s2_coarse_id"
    GATED = "gated"
    PROXIMITY = "proximity_required"
    BLE = "ble_enabled"
    MAX_MEMBERS = "max_members"
    CREATED_AT = "created_at"
    EXPIRES_AT = "expires_at"
    GRACE_UNTIL = "grace_until"
    HASH = "hash"
    PEPPER_ID = "pepper_id"
    PLATFORM = "platform"
    GROUP_ID = "group_id"
    MEMBERS = "members"
    COURIERS = "couriers"
    PUBKEY_HASH = "pubkey_hash"
    CMD = "cmd"


OP_REGISTER = "register"
OP_DEREGISTER = "deregister"
OP_STORE = "store"
OP_DELETE = "delete"
OP_CREATE = "create"
OP_UPDATE = "update"
OP_REVOKE = "revoke"
OP_ROTATE = "rotate"
OP_BAN = "ban"
OP_MEMBER = "member"        # a pubkey the relay knows as a room member (admitted, or proved a token)
OP_UNMEMBER = "unmember"    # forgotten again (kicked)
OP_PUBLISH = "publish"
OP_CLEAR = "clear"

_AT = Column(Q.AT, "timestamp", doc="when; strictly increasing per writer; the row's key")

PPP_DELIVERY_TOKENS = TableDef(
    "ppp_delivery_tokens", (
        Column(Q.TOKEN, "binary", doc="12-byte delivery token (§6)"),
        Column(Q.RECIPIENT, "binary", doc="Ed25519 pubkey the token routes to"),
        Column(Q.OP, "string", doc="register | deregister"),
        _AT,
    ),
    dict(_COMMON),
    doc="REGISTER_DELIVERY_TOKEN / DEREGISTER_DELIVERY_TOKEN, in order.",
)

PPP_BACKUPS = TableDef(
    "ppp_backups", (
        Column(Q.PUBKEY, "binary"),
        Column(Q.OP, "string", doc="store | delete"),
        Column(Q.CIPHERTEXT, "binary", nullable=True, doc="opaque backup blob (store only)"),
        Column(Q.VERSION, "long", doc="the version a store created; 0 for delete"),
        _AT,
    ),
    dict(_COMMON),
    doc="STORE_BACKUP / DELETE_BACKUP. The newest store of a pubkey after its last delete is "
        "its backup; `at` (unix µs) is the server-stamped stored_at.",
)

PPP_ROOMS = TableDef(
    "ppp_rooms", (
        Column(Q.ROOM_ID, "binary", doc="16-byte room id (§7.1)"),
        Column(Q.OP, "string", doc="create | update | delete (DELETE_GROUP's commit point)"),
        Column(Q.ADMIN, "binary", doc="the creator's Ed25519 pubkey: the room's admin"),
        Column(Q.ROOM_TYPE, "string", doc="room | group (§7.6)"),
        Column(Q.S2_CELL, "string", nullable=True, doc="fine S2 cell token; null: a group"),
        Column(Q.S2_COARSE, "string", nullable=True, doc="coarse S2 cell token"),
        Column(Q.GATED, "bool"),
        Column(Q.PROXIMITY, "bool", doc="reserved by the spec; kept and shown"),
        Column(Q.BLE, "bool", doc="knock / admit allowed"),
        Column(Q.MAX_MEMBERS, "int", doc="1-100"),
        Column(Q.CREATED_AT, "timestamp"),
        Column(Q.EXPIRES_AT, "timestamp", doc="a group: 9999-12-31T23:59:59Z"),
        _AT,
    ),
    dict(_COMMON),
    doc="CREATE_ROOM / UPDATE_ROOM / CREATE_GROUP / DELETE_GROUP: each row is the room's "
        "whole record after the change (a delete row: the record it deleted). No name or "
        "description is kept (the relay shows none).",
)

PPP_ROOM_TOKENS = TableDef(
    "ppp_room_tokens", (
        Column(Q.ROOM_ID, "binary"),
        Column(Q.TOKEN, "binary", nullable=True,
               doc="register: the 12-byte member token; ban: the banned 32-byte pubkey"),
        Column(Q.OP, "string", doc="register | revoke | rotate | ban"),
        Column(Q.GRACE_UNTIL, "timestamp", nullable=True,
               doc="rotate: tokens registered before it stay valid until then"),
        _AT,
    ),
    dict(_COMMON),
    doc="REGISTER_TOKEN / REVOKE_TOKENS / ROTATE_ROOM_KEY / BAN_MEMBER, in order.",
)

PPP_DISCOVERY = TableDef(
    "ppp_discovery", (
        Column(Q.PUBKEY, "binary", doc="the publisher (the authenticated caller)"),
        Column(Q.OP, "string", doc="clear (starts a publish: the set before is gone) | publish"),
        Column(Q.HASH, "binary", nullable=True,
               doc="BLAKE2b-256(normalized identifier, key = pepper) (§9); publish only"),
        Column(Q.PEPPER_ID, "long", doc="the pepper the hashes were made with"),
        _AT,
    ),
    dict(_COMMON),
    doc="DISCOVERY_PUBLISH: a clear row and one row per hash, in one commit.",
)

PPP_PUSH_TOKENS = TableDef(
    "ppp_push_tokens", (
        Column(Q.PUBKEY, "binary", doc="the Ed25519 pubkey woken"),
        Column(Q.PLATFORM, "string", doc="apns | fcm | webpush"),
        Column(Q.TOKEN, "binary", doc="the provider's token (UTF-8), never logged"),
        Column(Q.OP, "string", doc="register | deregister"),
        _AT,
    ),
    dict(_COMMON),
    doc="REGISTER_PUSH, and the push job's removal of tokens its provider calls dead.",
)

PPP_CARRY_GROUPS = TableDef(
    "ppp_carry_groups", (
        Column(Q.GROUP_ID, "binary", doc="the carry group's random 16-byte id (§8)"),
        Column(Q.PUBKEY, "binary", doc="who signed the row: the owner, a member or a courier"),
        Column(Q.OP, "string", doc="register | leave"),
        Column(Q.MEMBERS, "binary", nullable=True,
               doc="register: the member keys (32 bytes each), sorted"),
        Column(Q.COURIERS, "binary", nullable=True,
               doc="register: the courier keys (32 bytes each), sorted"),
        _AT,
    ),
    dict(_COMMON),
    doc="REGISTER_CARRY_GROUP and LEAVE_CARRY_GROUP, folded by engine/ppp/carry.py.",
)

PPP_BUDGET_HITS = TableDef(
    "ppp_budget_hits", (
        Column(Q.PUBKEY_HASH, "binary",
               doc="keyed BLAKE2b-128 of the caller's pubkey (delta_tables/budget_hits.py)"),
        Column(Q.CMD, "string", doc="the command charged: a quota of engine/ppp/limits.py"),
        _AT,
    ),
    dict(_COMMON),
    doc="One row per command allowed under an hourly quota, on any host; compaction drops "
        "the rows older than the longest quota window.",
)

PPP_TABLES = {t.name: t for t in (PPP_DELIVERY_TOKENS, PPP_BACKUPS, PPP_ROOMS,
                                  PPP_ROOM_TOKENS, PPP_DISCOVERY, PPP_PUSH_TOKENS,
                                  PPP_CARRY_GROUPS, PPP_BUDGET_HITS)}
