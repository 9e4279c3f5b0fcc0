"""Two small pieces the protocol views share (`ppp_inbox.py`, `ppp_rooms.py`,
`sync_inbox.py`): who waits for an event's cursor, and batched notifications.

* `Waiters`: a reply that carries the stream's cursor (PUSH_ACK, ROOM_STORED) waits for the
  inbox row that assigns it. The waiter is taken *before* the landing append (the row may
  arrive before the append returns) and resolved by the view's `add`.
* `NotifyBatcher` (§8 "batch windows"): the first count for a key starts a `window` timer,
  later ones add to it, and when it fires `flush(key, count)` is called once; a window of 0
  flushes at once.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class Waiters:
    def __init__(self) -> None:
        self._by_id: dict[bytes, list[asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def wait(self, event_id: bytes, known: int | None) -> asyncio.Future:
        """Resolved with the event's cursor: `known` at once, else when `resolve` is called."""
        fut = asyncio.get_running_loop().create_future()
        if known is not None:
            fut.set_result(known)
        else:
            self._by_id.setdefault(event_id, []).append(fut)
        return fut

    def resolve(self, event_id: bytes, cursor: int) -> None:
        for fut in self._by_id.pop(event_id, ()):
            if not fut.done():
                fut.set_result(cursor)

    def forget(self, event_id: bytes, fut: asyncio.Future) -> None:
        mine = self._by_id.get(event_id)
        if mine is not None and fut in mine:
            mine.remove(fut)
            if not mine:
                del self._by_id[event_id]

    def cancel_all(self) -> None:
        for futs in self._by_id.values():
            for f in futs:
                f.cancel()
        self._by_id.clear()


class NotifyBatcher:
    def __init__(self, window: float, flush: Callable[[bytes, int], None]):
        self.window = window
        self._flush_to = flush
        self._counts: dict[bytes, int] = {}
        self._timers: dict[bytes, asyncio.TimerHandle] = {}

    def add(self, key: bytes, count: int) -> None:
        self._counts[key] = self._counts.get(key, 0) + count
        if self.window <= 0:
            self._flush(key)
        elif key not in self._timers:
            self._timers[key] = asyncio.get_running_loop().call_later(
                self.window, self._flush, key)

    def _flush(self, key: bytes) -> None:
        self._timers.pop(key, None)
        count = self._counts.pop(key, 0)
        if count > 0:
            self._flush_to(key, count)

    def drop(self, key: bytes) -> None:
        """Forget the key's pending count (nobody is left to tell)."""
        h = self._timers.pop(key, None)
        if h is not None:
            h.cancel()
        self._counts.pop(key, None)

    def cancel(self) -> None:
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        self._counts.clear()
