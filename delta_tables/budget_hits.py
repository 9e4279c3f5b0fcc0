"""Hourly quotas as data: the fold of `ppp_budget_hits` rows (decision 0010), pure.

A row is one command allowed under a quota (`engine/ppp/limits.QUOTAS`) on some host; the
hits of a (caller, command) in the last window are its spent quota, whichever hosts allowed
them. The allow itself is `PppControl.spend`, a fenced change of this table, so two hosts
racing for a quota's last hit cannot both win.

Rows name the caller by `pubkey_hash`, a BLAKE2b-128 of the pubkey keyed with the table's
Delta id (made once, when the first host created the table, so every host derives the same
key): no pubkey is spelled in the rows, and the hashes of one deployment match no other's.
It is a salt, not a secret: someone holding the whole table, log included, can still test
a pubkey they know against it. The hosts share no secret to key it with.

`needed_at(now)`: the hits inside the longest quota window; compaction deletes the rest.
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass, field

from engine.ppp.limits import LONGEST_QUOTA_SECS

_PERSON = b"ppp-budget-hits"


def pubkey_hash(table_id: str, pubkey: bytes) -> bytes:
    """What a hit row keeps of its caller (module docstring)."""
    return hashlib.blake2b(pubkey, digest_size=16, key=table_id.encode()[:64],
                           person=_PERSON).digest()


@dataclass
class BudgetHits:
    # (pubkey_hash, command) -> the `at` of its hits (unix µs), ascending
    hits: dict[tuple[bytes, str], list[int]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"BudgetHits(keys={len(self.hits)})"

    def row(self, key: bytes, cmd: str, at: int) -> None:
        bisect.insort(self.hits.setdefault((key, cmd), []), at)

    def count(self, key: bytes, cmd: str, since: int) -> int:
        """Hits of (key, cmd) after `since` (unix µs)."""
        ats = self.hits.get((key, cmd))
        return 0 if ats is None else len(ats) - bisect.bisect_right(ats, since)

    def sweep(self, before: int) -> int:
        """Forget the hits at or before `before` (unix µs); returns the keys dropped."""
        gone = []
        for k, ats in self.hits.items():
            del ats[:bisect.bisect_right(ats, before)]
            if not ats:
                gone.append(k)
        for k in gone:
            del self.hits[k]
        return len(gone)

    def needed_at(self, now: float) -> set[int]:
        """The `at` of every hit inside the longest quota window before `now` (seconds)."""
        since = int((now - LONGEST_QUOTA_SECS) * 1_000_000)
        return {at for ats in self.hits.values() for at in ats if at > since}
