"""The PPP control-plane tables, declared once (same pattern as `schema.py`, `schema_heya.py`).

PPP events live in the shared `inbox` (protocol "ppp", mailbox = recipient pubkey). What is
PPP-only is control-plane state, in two small append-only tables whose rows are events,
folded into memory by the owner (the ingress node hosting the PPP listener) at start
(`delta_tables/ppp_state.py`):

* delivery tokens (spec 004 §6): registered / deregistered per recipient; durable, so sealed
  submissions keep routing after a restart;
* backups (§6 "Backups"): one opaque blob per pubkey, upserted with a version counter.

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


OP_REGISTER = "register"
OP_DEREGISTER = "deregister"
OP_STORE = "store"
OP_DELETE = "delete"

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

PPP_TABLES = {t.name: t for t in (PPP_DELIVERY_TOKENS, PPP_BACKUPS)}
