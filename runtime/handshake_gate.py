"""Handshake work in turns on the event loop: addresses that proved themselves lately first,
then addresses holding next to nothing, then the rest one address at a time.

Why: a handshake step's CPU (TLS's key exchange, signature and the client's CertificateVerify;
Noise's Diffie-Hellmans: 1-2 ms each here, in Python) is where a flood of new connections
spends a listener's event loop. Run as their bytes arrived, a flood from 253 addresses put a
real client's handshakes behind hundreds of theirs: its round trips took 4-5 s in the hostile
suite's ramp (Heya idle handshakes, trueseal receive abandoned handshakes). Through the gate,
each step of a handshake waits in a `FairQueue` (engine/fair_queue.py) keyed by address and
`STEPS_PER_TURN` of them run per event-loop turn, between everything else the loop has to do,
so open sessions keep being served and a known client's handshake goes ahead of the flood.
The TCP listeners queue the opening of an accepted connection here too (its transport and
protocol: runtime/listener.py), so accepting stays cheap and a flood's connections do not
keep a known client's connect waiting in the kernel's listen queue. Idle, a step waits one
loop turn (microseconds).

Lanes (`Listener.handshake_lane`): 0, an address one of whose connections authenticated within
`KNOWN_SECONDS` (`Known`) and that has at most `LIGHT_HOLDS` connections in their handshake;
1, an address holding at most `LIGHT_HOLDS` connections in all; 2, the rest. Anyone can
authenticate on these protocols (a fresh key is enough), so lane 0 is no privilege an attacker
cannot buy, but buying it costs a whole handshake per address, and an address flooding
handshakes falls back to lane 2 by the count it holds.

Full (`capacity` steps, or `per_key` of one address), the oldest step of the address with the
most queued is dropped and its connection closed (`drop`): the flood loses its own first.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections import OrderedDict
from typing import Callable, Hashable

from engine.fair_queue import FairQueue

STEPS_PER_TURN = 8          # steps run per event-loop turn (a handshake's ~1-2 ms,
                            # an opening's ~0.2 ms)
CAPACITY = 8192             # steps waiting, all addresses together
PER_KEY = 64                # steps waiting of one address
LANES = 3
KNOWN_SECONDS = 600.0       # how long an address that authenticated stays known
KNOWN_CAPACITY = 65536      # addresses remembered (~150 bytes each); the oldest forgotten
LIGHT_HOLDS = 2             # connections an address may hold and still be light (a client
                            # keeps a receive or mailbox session while it sends on another)


class Known:
    """Addresses one of whose connections authenticated within `ttl` seconds: at most
    `capacity` of them, the least recently seen forgotten first. Held in memory only, and
    as keyed hashes (BLAKE2b with a key made at start): the relay keeps no list of its
    clients' addresses for ten minutes, only a way to recognise one it is shown again."""

    def __init__(self, ttl: float = KNOWN_SECONDS, capacity: int = KNOWN_CAPACITY):
        self.ttl = ttl
        self.capacity = capacity
        self._key = os.urandom(32)
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def _digest(self, key: Hashable) -> bytes:
        return hashlib.blake2b(str(key).encode(), key=self._key, digest_size=16).digest()

    def add(self, key: Hashable, now: float) -> None:
        digest = self._digest(key)
        self._seen[digest] = now
        self._seen.move_to_end(digest)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def knows(self, key: Hashable, now: float) -> bool:
        digest = self._digest(key)
        seen = self._seen.get(digest)
        if seen is None:
            return False
        if now - seen > self.ttl:
            del self._seen[digest]
            return False
        return True

    def __len__(self) -> int:
        return len(self._seen)


class HandshakeGate:
    """Runs handshake steps a few per loop turn, in the order of their lanes and addresses.
    `lane_of(key)` says a new address's lane when it has nothing queued (see the module)."""

    def __init__(self, lane_of: Callable[[Hashable], int], *, capacity: int = CAPACITY,
                 per_key: int = PER_KEY, steps_per_turn: int = STEPS_PER_TURN):
        self.lane_of = lane_of
        self.steps_per_turn = steps_per_turn
        self._queue: FairQueue[tuple[Callable[[], object], Callable[[], object]]] = \
            FairQueue(capacity, per_key, lanes=LANES)
        self._scheduled = False
        self.closed = False
        self.run_steps = 0          # counters for metrics and tests
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, key: Hashable, run: Callable[[], object],
               drop: Callable[[], object]) -> None:
        """Queue one step: `run()` on its turn, or `drop()` if it is pushed out (queue full)
        or the gate closes first."""
        if self.closed:
            drop()
            return
        dropped = self._queue.push(key, (run, drop), lane=self.lane_of(key))
        if dropped is not None:
            self.dropped += 1
            dropped[1]()
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    async def turn(self, key: Hashable) -> bool:
        """Wait for this address's turn (a coroutine shell's step runs right after): True,
        or False if the step was dropped (the caller closes the connection)."""
        fut = asyncio.get_running_loop().create_future()

        def run() -> bool:
            if fut.done():         # cancelled while it waited
                return False
            fut.set_result(True)
            return True

        def drop() -> None:
            if not fut.done():
                fut.set_result(False)

        self.submit(key, run, drop)
        return await fut

    def _turn(self) -> None:
        self._scheduled = False
        ran = 0
        while self._queue and ran < self.steps_per_turn:
            run, _ = self._queue.pop()
            if run() is not False:    # a step whose connection is gone returns False: free
                ran += 1
        self.run_steps += ran
        if self._queue and not self.closed:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    def close(self) -> None:
        """Drop every waiting step (the listener is closing)."""
        self.closed = True
        while self._queue:
            _, drop = self._queue.pop()
            drop()
