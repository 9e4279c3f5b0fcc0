"""A sliding-window rate limiter: at most `max_count` hits per key in any `window` seconds.

Sans-I/O: the caller passes `now` (seconds, any monotonic origin), so tests step time
exactly. Memory is one timestamp per allowed hit in the window per key; a key whose window
emptied is dropped by `sweep` (the shell calls it now and then), so idle keys cost nothing.
A refused hit is not recorded: a client hammering past its budget cannot push its own
window forward forever.
"""

from __future__ import annotations

from collections import deque
from typing import Hashable


class SlidingWindowLimiter:
    def __init__(self, max_count: int, window: float):
        if max_count < 1 or window <= 0:
            raise ValueError("max_count must be >= 1 and window > 0")
        self.max_count = max_count
        self.window = window
        self._hits: dict[Hashable, deque[float]] = {}

    def _trim(self, q: deque[float], now: float) -> None:
        edge = now - self.window
        while q and q[0] <= edge:
            q.popleft()

    def allow(self, key: Hashable, now: float) -> bool:
        """Record a hit for `key` at `now` and return True, or return False (nothing
        recorded) if `max_count` hits already fall in (now - window, now]."""
        q = self._hits.get(key)
        if q is None:
            self._hits[key] = deque([now])
            return True
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
