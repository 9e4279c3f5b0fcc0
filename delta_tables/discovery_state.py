"""Contact discovery as data: the fold of `ppp_discovery` rows (spec 004 §9), pure.

A publish is one commit: a `clear` row (the publisher's previous set is gone) and a
`publish` row per hash, each filed under the pepper it was made with. Queries match only the
current pepper's hashes (`engine/ppp/discovery.py`: peppers rotate on a schedule, and a
client re-publishes under the new one). `needed_at()`: the rows of every publisher's latest
set, unless it was made with a pepper older than the newest any publisher has used: that
pepper has certainly rotated away, its sets match nothing any more, and compaction deletes
them (no clock needed; a set of the last pepper used waits for the first publish under a
newer one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.ppp.discovery import MAX_MATCHES_PER_HASH

from .schema_ppp import OP_CLEAR, OP_PUBLISH, PPP_DISCOVERY


@dataclass
class _Set:
    pepper_id: int
    hashes: set[bytes] = field(default_factory=set)
    rows: list[int] = field(default_factory=list)


@dataclass
class DiscoveryState:
    sets: dict[bytes, _Set] = field(default_factory=dict)                 # pubkey -> its set
    by_hash: dict[tuple[int, bytes], set[bytes]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"DiscoveryState(publishers={len(self.sets)})"

    def row(self, op: str, pubkey: bytes, hash_: bytes | None, pepper_id: int, at: int) -> None:
        if op == OP_CLEAR:
            old = self.sets.pop(pubkey, None)
            if old is not None:
                for h in old.hashes:
                    mine = self.by_hash.get((old.pepper_id, h))
                    if mine is not None:
                        mine.discard(pubkey)
                        if not mine:
                            del self.by_hash[(old.pepper_id, h)]
            self.sets[pubkey] = _Set(pepper_id, rows=[at])
        elif op == OP_PUBLISH and hash_ is not None:
            s = self.sets.setdefault(pubkey, _Set(pepper_id))
            if s.pepper_id != pepper_id:
                return    # never written by the owner: a publish follows its clear
            s.hashes.add(hash_)
            s.rows.append(at)
            self.by_hash.setdefault((pepper_id, hash_), set()).add(pubkey)

    def matches(self, hashes, pepper_id: int) -> list[tuple[bytes, bytes]]:
        out = []
        for h in dict.fromkeys(hashes):     # each hash once, in the asker's order
            for pk in sorted(self.by_hash.get((pepper_id, h), ()))[:MAX_MATCHES_PER_HASH]:
                out.append((h, pk))
        return out

    def needed_at(self) -> dict[str, set[int]]:
        newest = max((s.pepper_id for s in self.sets.values()), default=0)
        return {PPP_DISCOVERY.name: {at for s in self.sets.values()
                                     if s.pepper_id == newest for at in s.rows}}
