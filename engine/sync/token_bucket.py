"""Token buckets with governor's semantics (the crate 0k-sync limits with): a quota of N per
period allows a burst of N at once, then one more every period / N. Time comes in as an
argument (sans-I/O); callers pass a monotonic clock."""

from __future__ import annotations


class TokenBucket:
    def __init__(self, count: int, period_seconds: float, now: float):
        if count <= 0 or period_seconds <= 0:
            raise ValueError("a quota needs a positive count and period")
        self.burst = float(count)
        self.interval = period_seconds / count     # seconds per replenished cell
        self.tokens = self.burst
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) / self.interval)
            self.stamp = now

    def take(self, now: float) -> bool:
        """Spend one cell if there is one."""
        self._refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


class KeyedBuckets:
    """One bucket per key (device id, address), kept as one float: governor's own form, the
    generic cell rate algorithm. `_ready[key]` is the time the key's bucket is full again
    (its "theoretical arrival time"); a take at `now` passes if that time is at most
    (count - 1) cells ahead, and pushes it one cell further. Equal to `TokenBucket`'s
    decisions, at one float a key instead of an object with three: a flood of new device ids
    leaves its keys behind for a minute (until refilled), and each small object that
    outlives a flood keeps the page it landed on from being given back (issue 19).
    A key whose bucket is full again is the same as no key: `sweep` drops those, and a take
    that would hold more than `max_keys` sweeps first (governor's `retain_recent`)."""

    def __init__(self, count: int, period_seconds: float, max_keys: int = 100_000):
        if count <= 0 or period_seconds <= 0:
            raise ValueError("a quota needs a positive count and period")
        self.count, self.period = count, period_seconds
        self.interval = period_seconds / count
        self._tolerance = (count - 1) * self.interval
        self.max_keys = max_keys
        self._ready: dict[bytes, float] = {}

    def take(self, key: bytes, now: float) -> bool:
        ready = self._ready.get(key)
        if ready is None:
            if len(self._ready) >= self.max_keys:
                self.sweep(now)
            ready = now
        elif ready < now:
            ready = now
        if ready - now > self._tolerance:
            return False
        self._ready[key] = ready + self.interval
        return True

    def sweep(self, now: float) -> int:
        """Forget keys whose bucket is full again; returns how many."""
        full = [k for k, ready in self._ready.items() if ready <= now]
        for k in full:
            del self._ready[k]
        return len(full)

    def __len__(self) -> int:
        return len(self._ready)

    def __repr__(self) -> str:   # keys are device ids: never shown
        return f"KeyedBuckets(count={self.count}, period={self.period}, keys={len(self)})"
