"""Token buckets with governor's semantics (the crate 0k-sync limits with): a quota of N per
period allows a burst of N at once, then one more every period / N. Time comes in as an
argument (sans-I/O); callers pass a monotonic clock."""

from __future__ import annotations

from collections import OrderedDict


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
    """One bucket per key (device id). Idle keys whose bucket has refilled are dropped once
    more than `max_keys` are held, so memory stays bounded (governor's `retain_recent`)."""

    def __init__(self, count: int, period_seconds: float, max_keys: int = 100_000):
        self.count, self.period = count, period_seconds
        self.max_keys = max_keys
        self._buckets: OrderedDict[bytes, TokenBucket] = OrderedDict()

    def take(self, key: bytes, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = TokenBucket(self.count, self.period, now)
            self._evict(now)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def _evict(self, now: float) -> None:
        if len(self._buckets) <= self.max_keys:
            return
        for key in [k for k, b in self._buckets.items() if b.full(now)]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)

    def __repr__(self) -> str:   # keys are device ids: never shown
        return f"KeyedBuckets(count={self.count}, period={self.period}, keys={len(self)})"
