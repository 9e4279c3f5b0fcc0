"""PPP limits and rate budgets (spec 004 appendix C, authoritative over the prose).

Appendix C.2 constants keep their arithmetic form. Values the appendix does not fix are
marked with the section they come from, or as this relay's choice.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RateBudget:
    """At most `max_count` requests in any sliding window of `window_secs` seconds."""
    max_count: int
    window_secs: int


# --- C.2 public limits and TTLs ----------------------------------------------------------
KNOCK_TTL_SECS = 120
MAX_DELIVERY_TOKENS_PER_RECIPIENT = 100
MAX_EVENT_TTL_SECS = 30 * 24 * 60 * 60
MAX_CIPHERTEXT_SIZE = 64 * 1024
SEALED_TOKEN_RATE_LIMIT = RateBudget(max_count=2, window_secs=1)
SEALED_IP_RATE_LIMIT = RateBudget(max_count=120, window_secs=60)
SEALED_BODY_LIMIT_BYTES = 128 * 1024

# --- C.3 per-pubkey command budgets (sliding window) ------------------------------------------
DEFAULT_COMMAND_RATE_LIMIT = RateBudget(max_count=30, window_secs=60)
COMMAND_RATE_LIMITS: dict[str, RateBudget] = {
    "STORE": RateBudget(60, 60),
    "FETCH": RateBudget(30, 60),
    "ACK": RateBudget(60, 60),
    "STORE_BACKUP": RateBudget(5, 3600),
    "FETCH_BACKUP": RateBudget(5, 3600),
    "DISCOVER_ROOMS": RateBudget(120, 60),
    # Not in C.3 (contact discovery is §9 only): this relay's budgets against enumeration
    # (§9 DR-03), with at most 500 hashes a query (`discovery.py`).
    "DISCOVERY_QUERY": RateBudget(20, 3600),
    "DISCOVERY_PUBLISH": RateBudget(10, 3600),
    # Not in C.3 (carry groups are §8 only): a courier fetches and reports like a client
    # (FETCH's and ACK's budgets); a group changes rarely.
    "FETCH_CARRY": RateBudget(30, 60),
    "ACK_CARRY": RateBudget(60, 60),
    "REGISTER_CARRY_GROUP": RateBudget(20, 3600),
    "LEAVE_CARRY_GROUP": RateBudget(20, 3600),
}


def command_budget(cmd: str) -> RateBudget:
    """C.3: commands not listed use the default budget."""
    return COMMAND_RATE_LIMITS.get(cmd, DEFAULT_COMMAND_RATE_LIMIT)


# The quotas: the budgets with an hour's window bound what one identity may do in total, so
# they are counted across hosts, in the `ppp_budget_hits` control table
# (`PppControl.spend`, decision 0010). The per-minute budgets bound one host's work and
# stay in each host's memory (the session's `KeyedBudgets`).
QUOTA_WINDOW_SECS = 3600
QUOTAS: dict[str, RateBudget] = {cmd: b for cmd, b in COMMAND_RATE_LIMITS.items()
                                 if b.window_secs >= QUOTA_WINDOW_SECS}
# How long a hit is kept: the longest quota window (compaction drops older hits).
LONGEST_QUOTA_SECS = max(b.window_secs for b in QUOTAS.values())


# --- wire sizes (§5.1, §6, §4.5) ------------------------------------------------------------
CHALLENGE_LEN = 32          # §5.1 CHALLENGE nonce: bytes32
PUBKEY_LEN = 32
SIGNATURE_LEN = 64
EVENT_ID_LEN = 32           # §4.5: both forms are 32 bytes
DELIVERY_TOKEN_LEN = 12     # §6 / C.6 SealedNoteSubmit
REQUEST_ID_LEN = 6          # §5.x request ids: 6 random bytes, 12 hex characters

# --- not in appendix C ------------------------------------------------------------------------
# §6 "Backups": the backup-only body limit.
MAX_BACKUP_SIZE = 5 * 1024 * 1024
# §8 metadata protection: "configurable batch windows (default: 30s)" between storage and
# notification. The relay's default NOTIFY window (`ppp.notify_window_ms`).
DEFAULT_BATCH_WINDOW_SECS = 30
# FETCH page size: appendix C names `cursor?: FetchCursor` but no page size; this relay's
# choice, the same bound as FETCH_ROOM's "up to 100 messages" (§7.3).
FETCH_PAGE_SIZE = 100
# ACK: event ids counted per command (this relay's bound on one frame's work).
MAX_ACK_IDS = 1000
# FETCH_CARRY: a page is at most FETCH_PAGE_SIZE events and this many envelope bytes (at
# least one event): a courier on a poor link gets a reply it can finish, then the next.
CARRY_PAGE_BYTES = 1 << 20
