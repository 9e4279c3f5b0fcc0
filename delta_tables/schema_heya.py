"""The Heya control-plane tables, declared once (same pattern as `schema.py`).

Heya messages live in the shared `inbox` (protocol "heya", mailbox = the 32-byte send token,
cursor = the Heya sequence number). What is Heya-only is control-plane state, kept in five
small append-only Delta tables whose rows are events; every ingress node hosting the Heya
listener folds them into an in-memory view at start and follows the others' commits
(`delta_tables/heya_state.py`), and the compaction job deletes the rows the fold no longer
needs (DEAU'd tokens, DALL'd mailboxes, removed push tokens, consumed inbox tokens).

Secrets (tokens, digests, push tokens) are binary columns: delta-rs writes no statistics for
those into the Delta log, so a deleted row's values leave with its data file. `at` orders the
rows of a table (strictly increasing in commit order: `control.py`) and is the
key compaction's MERGE joins on, so no token, certificate digest or push token is ever spelled
into a predicate that the Delta log would record. Other modules refer to columns through `H`.
"""

from __future__ import annotations

from .schema import _COMMON, Column, TableDef


class H:
    """Column names of the Heya control tables."""
    TOKEN = "token"
    OWNER = "owner"
    OP = "op"
    INBOX_TOKEN = "inbox_token"
    START_TIME = "start_time"
    END_TIME = "end_time"
    DEVICE_TOKEN = "device_token"
    UP_TO_SEQ = "up_to_seq"
    AT = "at"


# Values of the `op` column.
OP_INCO = "inco"
OP_DALL = "dall"
OP_AUTH = "auth"
OP_EXTD = "extd"
OP_DEAU = "deau"
OP_IOSA = "iosa"
OP_IOSD = "iosd"
# A DALL under way, in heya_send_tokens (token empty): from it on, until the owner registers
# again, no host mints a send token or registers a push token for the owner. It is written
# with the DALL's DEAUs, in the table an AUTH writes, so an AUTH racing a DALL on another
# host either is revoked by it or sees it (control.py's fence) and is refused.
OP_DALL_MARK = "dall"

_AT = Column(H.AT, "timestamp", doc="when; strictly increasing per table in commit order "
                                          "(fenced writers, control.py); the merge key")
_OWNER = Column(H.OWNER, "binary",
                doc="SHA-256 of the client certificate's DER: the Heya mailbox identity")

HEYA_INBOX_TOKENS = TableDef(
    "heya_inbox_tokens", (
        Column(H.TOKEN, "binary", doc="32 random bytes, single use (INCO)"),
        _AT,
    ),
    dict(_COMMON),
    doc="Inbox tokens minted by `relay heya inbox-token`. A token is consumed by the INCO row "
        "in heya_mailboxes that names it; compaction then deletes its row here.",
)

HEYA_MAILBOXES = TableDef(
    "heya_mailboxes", (
        _OWNER,
        Column(H.OP, "string", doc="inco | dall"),
        Column(H.INBOX_TOKEN, "binary", nullable=True, doc="the token an INCO consumed"),
        _AT,
    ),
    dict(_COMMON),
    doc="Certificates registered as mailboxes (INCO) and deregistered (DALL). One row both "
        "consumes the inbox token and registers the mailbox, so INCO is atomic.",
)

HEYA_SEND_TOKENS = TableDef(
    "heya_send_tokens", (
        Column(H.TOKEN, "binary", doc="32 random bytes; the inbox mailbox key of its messages"),
        _OWNER,
        Column(H.OP, "string", doc="auth | extd | deau | dall (a DALL under way; token empty)"),
        Column(H.START_TIME, "long", doc="unix seconds; SEND is refused before it"),
        Column(H.END_TIME, "long", doc="unix seconds; SEND is refused after it (extd: new end)"),
        _AT,
    ),
    dict(_COMMON),
    doc="Send tokens of each mailbox: minted (AUTH), extended (EXTD), revoked (DEAU, DALL); "
        "a `dall` row (empty token) marks a DALL under way.",
)

HEYA_PUSH_TOKENS = TableDef(
    "heya_push_tokens", (
        _OWNER,
        # binary, not string: delta-rs writes min/max stats of string columns into the log,
        # where a removed push token would outlive the row.
        Column(H.DEVICE_TOKEN, "binary", doc="iOS device push token, 1-64 visible ASCII"),
        Column(H.OP, "string", doc="iosa | iosd"),
        _AT,
    ),
    dict(_COMMON),
    doc="iOS push registrations per mailbox (IOSA / IOSD / DALL), listed by IOSL; the push "
        "job wakes them through APNs (egress/push/) and IOSDs a token APNs calls dead.",
)

HEYA_TRIMS = TableDef(
    "heya_trims", (
        Column(H.TOKEN, "binary"),
        Column(H.UP_TO_SEQ, "long", doc="messages of the token with seq <= this are deleted"),
        _AT,
    ),
    dict(_COMMON),
    doc="TRIM requests; compaction tombstones the inbox rows they cover.",
)

HEYA_TABLES = {t.name: t for t in (HEYA_INBOX_TOKENS, HEYA_MAILBOXES, HEYA_SEND_TOKENS,
                                   HEYA_PUSH_TOKENS, HEYA_TRIMS)}
