"""A bounded queue served round-robin by key: one flooding key cannot make others wait.

Used for new QUIC connections waiting to start (ingress/sync_quic.py), keyed by source
address: a plain FIFO put a real client's Initial behind every Initial a flood had queued
(the hostile-load suite saw cursor-sync round trips of 1.7-1.8 s against 0.4 s), each of
which costs a TLS handshake's CPU to start. Served one key at a time in turn, a new key
waits for at most one item of each other key.

Lanes (`lanes`, default 2): an item pushed with `lane=0` is served before every item of
lane 1, and so on; without `lane` it goes to the last. The listeners put a key in an earlier
lane from what they know of it (runtime/handshake_gate.py: an address that authenticated
lately, then one holding next to nothing). Round-robin alone let every flooding address take
a turn before a real client. A lane does not help against many addresses that look like the
client (each holding at most one connection, say): within a lane it still waits about one
turn per key. A key stays in the lane it entered until its queue empties.

Full (`capacity` items in all, or `per_key` of one key): the oldest item of the longest
queue is dropped, so the key that floods loses its own items first. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Hashable, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    def __init__(self, capacity: int, per_key: int, lanes: int = 2):
        if capacity < 1 or per_key < 1 or lanes < 1:
            raise ValueError("capacity, per_key and lanes must be at least 1")
        self.capacity = capacity
        self.per_key = per_key
        # per lane, keys in turn order: the first is served next
        self._lanes: list[dict[Hashable, deque[T]]] = [{} for _ in range(lanes)]
        self._len = 0
        self.dropped = 0

    def __len__(self) -> int:
        return self._len

    def push(self, key: Hashable, item: T, *, lane: int | None = None) -> T | None:
        """Queue `item` under `key` (in `lane`, 0 served first, if `key` is not queued yet;
        default the last); returns the item dropped to make room, if one was."""
        home = next((ln for ln in self._lanes if key in ln), None)
        if home is None:
            home = self._lanes[-1 if lane is None else lane]
        q = home.get(key)
        dropped = None
        if q is not None and len(q) >= self.per_key:
            dropped = q.popleft()
        elif self._len >= self.capacity:
            longest, of = max(((k, ln) for ln in self._lanes for k in ln),
                              key=lambda kl: len(kl[1][kl[0]]))
            dropped = of[longest].popleft()
            if not of[longest]:
                del of[longest]
        if dropped is not None:
            self._len -= 1
            self.dropped += 1
        if q is None or home.get(key) is not q:    # new, or emptied by the drop just now
            q = home[key] = q if q is not None else deque()
        q.append(item)
        self._len += 1
        return dropped

    def next_lane(self) -> int | None:
        """The lane `pop` would serve now (None: empty)."""
        return next((i for i, ln in enumerate(self._lanes) if ln), None)

    def pop(self) -> T:
        """The oldest item of the key whose turn it is (earlier lanes first); that key goes
        to the back of its lane."""
        lane = next((ln for ln in self._lanes if ln), None)
        if lane is None:
            raise IndexError("pop from an empty FairQueue")
        key = next(iter(lane))
        q = lane.pop(key)
        item = q.popleft()
        if q:
            lane[key] = q
        self._len -= 1
        return item

    def clear(self) -> None:
        for lane in self._lanes:
            lane.clear()
        self._len = 0
