"""A sliding-window rate limiter: at most `max_count` hits per key in any `window` seconds.

Sans-I/O: the caller passes `now` (seconds, any monotonic origin), so tests step time
exactly. Memory is one timestamp per allowed hit in the window per key; a key whose window
emptied is dropped by `sweep` (the shell calls it now and then), so idle keys cost nothing.
A refused hit is not recorded: a client hammering past its budget cannot push its own
window forward forever.

Keys are bounded too (`max_keys`, `MAX_KEYS` by default): a limiter keyed by PPP pubkey
would otherwise keep every fresh key that sent one command for the whole window (an hour
for the discovery budget per address), and fresh keys cost an attacker nothing. PPP's hourly
per-pubkey quotas are not kept here: they are counted across hosts in a control table
(`PppControl.spend`). Past the
cap the key hit least recently is forgotten, so its next hit starts a fresh window: a
budget per key cannot hold back an attacker who makes new keys anyway, and what stops
those is the per-address budgets. A key's hits are a plain list (64 bytes for one hit;
a deque is 760), so `MAX_KEYS` keys of one hit each are ~20 MB at most.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from typing import Hashable

# Keys one limiter keeps at most (module docstring): far more than the clients of one
# process hitting one budget within its window.
MAX_KEYS = 100_000


class SlidingWindowLimiter:
    def __init__(self, max_count: int, window: float, max_keys: int = MAX_KEYS):
        if max_count < 1 or window <= 0 or max_keys < 1:
            raise ValueError("max_count and max_keys must be >= 1 and window > 0")
        self.max_count = max_count
        self.window = window
        self.max_keys = max_keys
        self.forgotten = 0    # keys dropped at the cap with hits still in their window
        # key -> its hits in the window, oldest first; the keys least recently hit first
        self._hits: OrderedDict[Hashable, list[float]] = OrderedDict()

    def _trim(self, q: list[float], now: float) -> None:
        del q[:bisect.bisect_right(q, now - self.window)]

    def allow(self, key: Hashable, now: float) -> bool:
        """Record a hit for `key` at `now` and return True, or return False (nothing
        recorded) if `max_count` hits already fall in (now - window, now]."""
        q = self._hits.get(key)
        if q is None:
            if len(self._hits) >= self.max_keys:
                self._hits.popitem(last=False)
                self.forgotten += 1
            self._hits[key] = [now]
            return True
        self._hits.move_to_end(key)
        self._trim(q, now)
        if len(q) >= self.max_count:
            return False
        q.append(now)
        return True

    def remaining(self, key: Hashable, now: float) -> int:
        q = self._hits.get(key)
        if q is None:
            return self.max_count
        self._trim(q, now)
        return self.max_count - len(q)

    def sweep(self, now: float) -> int:
        """Drop keys with no hit in the window; returns how many were dropped."""
        stale = [k for k, q in self._hits.items() if not q or q[-1] <= now - self.window]
        for k in stale:
            del self._hits[k]
        return len(stale)

    def __len__(self) -> int:
        return len(self._hits)

    def __repr__(self) -> str:   # keys may be pubkeys, tokens or IPs: never shown
        return f"SlidingWindowLimiter({self.max_count}/{self.window}s, keys={len(self._hits)})"


class KeyedBudgets:
    """One limiter per budget name (a PPP command, "sealed_ip", ...), created on first use."""

    def __init__(self, budgets):
        """`budgets(name) -> object with max_count and window_secs`."""
        self._budgets = budgets
        self._limiters: dict[str, SlidingWindowLimiter] = {}

    def limiter(self, name: str) -> SlidingWindowLimiter:
        lim = self._limiters.get(name)
        if lim is None:
            b = self._budgets(name)
            lim = self._limiters[name] = SlidingWindowLimiter(b.max_count, b.window_secs)
        return lim

    def allow(self, name: str, key: Hashable, now: float) -> bool:
        return self.limiter(name).allow(key, now)

    def sweep(self, now: float) -> int:
        return sum(lim.sweep(now) for lim in self._limiters.values())

    def __len__(self) -> int:
        """Keys held, all budgets together."""
        return sum(len(lim) for lim in self._limiters.values())
