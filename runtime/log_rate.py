"""At most one log line per key per interval, the next one saying how many were dropped.

Every log line a client can make repeat (a timeout, a refused connection, a bad frame) goes
through one: under attack the log holds a line per key every `interval` seconds, not one per
connection (issue 19: 1,065,315 ERROR lines in 80 s once).

The call stays an ordinary `log.<level>(...)` with its event, so tests/test_logs.py still
checks it; the limiter only says whether to make it, and what to add:

    quiet = LogRate(interval=10.0)
    ...
    if (dropped := quiet.allow("handshake_timeout")) is not None:
        log.info("handshake timed out", extra={"event": "handshake_timeout",
                                               "listener": name, "suppressed": dropped})

Keys are the shell's own names (an event, a listener, a reason), never anything a client
sends or is (addresses, tokens): the table of keys stays small, and nothing of a client is
kept. Lines dropped after the last one that was made are not reported later.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

INTERVAL = 10.0   # seconds between two lines of one key


class LogRate:
    def __init__(self, interval: float = INTERVAL, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self._next: dict[Hashable, float] = {}      # key -> when its next line may be made
        self._dropped: dict[Hashable, int] = {}

    def allow(self, key: Hashable) -> int | None:
        """None: drop this line (it is counted). Otherwise make it now, with the returned
        number of lines of `key` dropped since the last one made (its `suppressed` field)."""
        now = self.clock()
        if now < self._next.get(key, now):
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return None
        self._next[key] = now + self.interval
        return self._dropped.pop(key, 0)
