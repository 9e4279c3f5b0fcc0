"""A share of one core for one kind of work, spent after the fact.

Why: a flood of new QUIC connections from many addresses passes every per-address limit,
and each one's Initial costs a TLS key exchange and signature (~4 ms of CPU here, in Python).
Started as fast as they arrive, they took ~90% of the cursor-sync listener's core for the
whole of the hostile suite's ramp: a real device's packets waited behind them, and the
micro-batch its PUSH_ACK waits for ran on what CPU was left (round trips of 1.3-7 s against
0.4 s, 2026-11-28). With a budget, new connections from addresses that are not known get at
most `share` of a core, measured, and the rest stays with the sessions and the stream.

The rule is the generic cell rate algorithm over seconds of work instead of cells: `ready`
is when the work done so far is paid for at `share` seconds per second; more may start while
that is at most `burst` seconds of work ahead (`wait(now)` says how long until then), and
`spend(seconds, now)` moves it on. Pure: the caller measures the work and passes its clock.
"""

from __future__ import annotations


class WorkBudget:
    def __init__(self, share: float, burst: float):
        if not 0 < share <= 1 or burst < 0:
            raise ValueError("share must be in (0, 1] and burst at least 0")
        self.share = share
        self.burst = burst
        self._ready = float("-inf")
        self.spent = 0.0          # seconds of work, in all (for metrics)

    def wait(self, now: float) -> float:
        """Seconds until more work may start (0: now; under a microsecond counts as now)."""
        wait = self._ready - now - self.burst / self.share
        return wait if wait > 1e-6 else 0.0

    def spend(self, seconds: float, now: float) -> None:
        """`seconds` of work were just done."""
        self._ready = max(self._ready, now) + seconds / self.share
        self.spent += seconds

    def __repr__(self) -> str:
        return f"WorkBudget(share={self.share}, burst={self.burst})"
