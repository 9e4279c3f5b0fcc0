"""A bounded queue served round-robin by key: one flooding key cannot make others wait.

Used for new QUIC connections waiting to start (ingress/sync_quic.py), keyed by source
address: a plain FIFO put a real client's Initial behind every Initial a flood had queued
(the hostile-load suite saw cursor-sync round trips of 1.7-1.8 s against 0.4 s), each of
which costs a TLS handshake's CPU to start. Served one key at a time in turn, a new key
waits for at most one item of each other key.

Two lanes: an item pushed with `light=True` (its key holds next to nothing yet: the listener
says, from its admission counts) is served before every other. This helps a real client
against addresses that each hold several connections: round-robin alone let every one of them
take a turn before it. It does not help against many addresses that each hold at most one
(the hostile suite's 253-address flood): they share the light lane with the real client, which
still waits about one turn per flooding address. A key stays in the lane it entered until its
queue empties.

Full (`capacity` items in all, or `per_key` of one key): the oldest item of the longest
queue is dropped, so the key that floods loses its own items first. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, capacity: int, per_key: int):
        if capacity < 1 or per_key < 1:
            raise ValueError("capacity and per_key must be at least 1")
        self.capacity = capacity
        self.per_key = per_key
        # per lane, in turn order: the first is served next
        self._light: dict[Hashable, deque[T]] = {}
        self._queues: dict[Hashable, deque[T]] = {}
        self._len = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: Hashable, item: T, *, light: bool = False) -> T | None:
        """Queue `item` under `key` (`light`: in the lane served first, if `key` is not
        queued yet); returns the item dropped to make room, if one was."""
        if key in self._light:
            lane = self._light
        elif key in self._queues:
            lane = self._queues
        else:
            lane = self._light if light else self._queues
        q = lane.get(key)
        dropped = None
        if q is not None and len(q) >= self.per_key:
            dropped = q.popleft()
        elif self._len >= self.capacity:
            longest, of = max(((k, ln) for ln in (self._queues, self._light) for k in ln),
                              key=lambda kl: len(kl[1][kl[0]]))
            dropped = of[longest].popleft()
            if not of[longest]:
                del of[longest]
        if dropped is not None:
            self._len -= 1
            self.dropped += 1
        if q is None or lane.get(key) is not q:    # new, or emptied by the drop just now
            q = lane[key] = q if q is not None else deque()
        q.append(item)
        self._len += 1
        return dropped

    def pop(self) -> T:
        """The oldest item of the key whose turn it is (light keys first); that key goes to
        the back of its lane."""
        lane = self._light or self._queues
        if not lane:
            raise IndexError("pop from an empty FairQueue")
        key = next(iter(lane))
        q = lane.pop(key)
        item = q.popleft()
        if q:
            lane[key] = q
        self._len -= 1
        return item

    def clear(self) -> None:
        self._light.clear()
        self._queues.clear()
        self._len = 0
