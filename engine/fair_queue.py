"""A bounded queue served round-robin by key: one flooding key cannot make others wait.

Used for new QUIC connections waiting to start (ingress/sync_quic.py), keyed by source
address: a plain FIFO put a real client's Initial behind every Initial a flood had queued
(the hostile-load suite saw cursor-sync round trips of 1.7-1.8 s against 0.4 s), each of
which costs a TLS handshake's CPU to start. Served one key at a time in turn, a new key
waits for at most one item of each other key.

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
        self._queues: dict[Hashable, deque[T]] = {}   # in turn order: the first is served next
        self._len = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: Hashable, item: T) -> T | None:
        """Queue `item` under `key`; returns the item dropped to make room, if one was."""
        q = self._queues.get(key)
        dropped = None
        if q is not None and len(q) >= self.per_key:
            dropped = q.popleft()
        elif self._len >= self.capacity:
            longest = max(self._queues, key=lambda k: len(self._queues[k]))
            dropped = self._queues[longest].popleft()
            if not self._queues[longest]:
                del self._queues[longest]
        if dropped is not None:
            self._len -= 1
            self.dropped += 1
        if q is None:
            q = self._queues[key] = deque()
        q.append(item)
        self._len += 1
        return dropped

    def pop(self) -> T:
        """The oldest item of the key whose turn it is; that key goes to the back."""
        if not self._queues:
            raise IndexError("pop from an empty FairQueue")
        key = next(iter(self._queues))
        q = self._queues.pop(key)
        item = q.popleft()
        if q:
            self._queues[key] = q
        self._len -= 1
        return item

    def clear(self) -> None:
        self._queues.clear()
        self._len = 0
