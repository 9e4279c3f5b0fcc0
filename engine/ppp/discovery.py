"""Contact discovery, pure (spec 004 §9): identifier normalisation, the peppered hash, the
relay's pepper schedule and the budgets. No I/O, no clock: `now` is passed in.

    normalized = lowercase(strip_whitespace(identifier))
      phone: E.164       "+" then 8-15 digits, first digit not 0; spaces, dashes, dots and
                         parentheses are dropped first ("+49 (30) 1234-5678" ->
                         "+493012345678"). A number without its "+country" prefix is refused:
                         the relay's users are in many countries, and guessing one would hash
                         a different person's number.
      email:             lowercase, whitespace removed, and dots removed from the local part
                         (§9 says so for every domain, not only for providers that ignore
                         them: "a.b@x.org" and "ab@x.org" hash the same). A "+tag" is kept.
    hash = BLAKE2b(32, in = normalized (UTF-8), key = relay_pepper)     (libsodium's
           crypto_generichash(32, normalized, pepper): the pepper is the key, as §2's kdf)

The pepper. §9 says "relay-provided, rotated" and "fetched from the relay on each discovery
cycle", and defines no command to fetch it; this relay adds DISCOVERY_PEPPER (authenticated,
no fields) -> DISCOVERY_PEPPER {pepper, pepper_id, rotates_at}. Peppers follow a schedule:
pepper_id = floor(unix_time / rotation_seconds), pepper = BLAKE2b(32, in =
"ppp-discovery-pepper-v1" || u64be(pepper_id), key = the relay's pepper seed), the seed a
32-byte secret in `<data>/keys/` (0600), never in a table: the hash table alone, stolen,
cannot be brute-forced without it. **Re-publishing**: a published set is filed under the
pepper it was hashed with; when the pepper rotates, queries use the new one and the old set
matches nothing (and compaction deletes it). A client fetches the pepper on each discovery
cycle (at least at `rotates_at`) and, when `pepper_id` changed, publishes its identifiers
again. A PUBLISH or QUERY naming a `pepper_id` other than the current one is refused ("stale
pepper"), so a client never files or asks with an expired pepper by mistake.

What this does not stop (§9's own table): whoever holds the pepper, the relay operator
included, can enumerate phone numbers offline; the budgets bound online enumeration only.
"""

from __future__ import annotations

import hashlib
import re
import struct

from .limits import RateBudget

PEPPER_DOMAIN = b"ppp-discovery-pepper-v1"
HASH_LEN = 32
MAX_QUERY_HASHES = 500         # hashes in one DISCOVERY_QUERY (an address book's worth)
MAX_PUBLISH_HASHES = 20        # one person's own phone numbers and addresses
MAX_MATCHES_PER_HASH = 5       # pubkeys returned for one hash (a shared or reused identifier)
# Per pubkey: `limits.COMMAND_RATE_LIMITS` (DISCOVERY_QUERY 20/h, DISCOVERY_PUBLISH 10/h);
# per client address for QUERY too, so many pubkeys from one address do not multiply it.
QUERY_IP_BUDGET = RateBudget(60, 3600)

_PHONE_JUNK = re.compile(r"[\s\-().]")
_E164 = re.compile(r"\+[1-9][0-9]{7,14}")


class IdentifierError(ValueError):
    """Not a phone number in E.164 form or an e-mail address."""


def normalize_phone(number: str) -> str:
    n = _PHONE_JUNK.sub("", number)
    if not _E164.fullmatch(n):
        raise IdentifierError("a phone number needs +country and 8-15 digits (E.164)")
    return n


def normalize_email(address: str) -> str:
    a = "".join(address.split()).lower()
    local, at, domain = a.rpartition("@")
    if not at or not local or not domain or "@" in local or "." not in domain:
        raise IdentifierError("not an e-mail address")
    local = local.replace(".", "")
    if not local:
        raise IdentifierError("not an e-mail address")
    return f"{local}@{domain}"


def normalize(identifier: str) -> str:
    """An e-mail address if it has an @, else a phone number."""
    return normalize_email(identifier) if "@" in identifier else normalize_phone(identifier)


def identifier_hash(normalized: str, pepper: bytes) -> bytes:
    if len(pepper) != 32:
        raise ValueError("the pepper is 32 bytes")
    return hashlib.blake2b(normalized.encode("utf-8"), digest_size=HASH_LEN,
                           key=pepper).digest()


def pepper_id(now: float, rotation_seconds: int) -> int:
    return int(now // rotation_seconds)


def pepper_for(seed: bytes, pid: int) -> bytes:
    return hashlib.blake2b(PEPPER_DOMAIN + struct.pack(">Q", pid), digest_size=32,
                           key=seed).digest()


def rotates_at(pid: int, rotation_seconds: int) -> int:
    return (pid + 1) * rotation_seconds
