"""Give a drained wave of connections' memory back to the operating system.

A flood of connections that ends leaves the process as big as at its peak: glibc keeps
freed memory in its arenas for reuse, and dropped connections used to be reference cycles
(uvicorn's and aioquic's objects, our own callbacks) freed only by the cyclic collector.
Issue 19 saw the ingress stay 20-30% bigger after each wave of idle connections left. The
listeners now break their cycles when a connection ends (tests/test_reference_cycles.py:
asyncio's socket transport keeps one of 5 objects), so what a wave held is freed as it
leaves and returning it is mostly `malloc_trim`'s work; a collection of ~600,000 objects in
cycles had stopped the loop for 1.2-1.7 s.

Before each `malloc_trim` CPython's attribute cache is emptied: it holds the names it was asked
for, and names built at run time (aioquic builds six per connection) stay scattered over a
wave's memory, each keeping a page (`CLEAR_TYPE_CACHE`; the hostile suite's cursor-sync
waves: +8.6% -> +3.0% after idle handshakes from 253 addresses).

`HeapTrimmer` watches the listeners' admission counters (`engine/admission.py`) once a
second. When at least `wave` connections have ended since the last trim and what is held
now is at most half of the most held since then (the wave has drained), it runs a full
collection and then glibc's `malloc_trim(0)` on a thread (it walks the heap; the event loop
keeps serving), and once more `AGAIN_AFTER_SECONDS` later; for `TAIL_SECONDS` after that
(a flood's tail of timeouts), every `AGAIN_AFTER_SECONDS`, again whenever a quarter of a
wave ended since the last, else `malloc_trim` alone, until a new wave builds. Nothing
happens under steady load: connections that come and go at a constant level never halve
the peak. Between trims, once `wave` connections have ended and are no longer ending by
the hundred, it runs `malloc_trim` alone (`return_due`), at most every
`AGAIN_AFTER_SECONDS`: a flood refused, evicted and timed out piecemeal may never halve its
peak. Where the C library is not glibc,
only the collection runs.

**Full collections on a schedule** (`take_over_collector`). CPython starts a full
collection by itself whenever the objects that survived into the oldest generation grew by
a quarter, and a full collection walks every one of them with the event loop stopped. A
flood of connections grows that generation all the time: the hostile suite measured a PPP
ingress holding ~4,500 half-sent requests (~370,000 objects) collect fully every 1.5-3 s,
0.4-0.75 s each, 2.4 s of a 5.8 s hold, and a real client's round trip (a dozen steps, each
waiting for the loop) took 1.3-2.2 s instead of 0.25 s. So the role's young and middle
collections stay CPython's (small: a flood's objects survive them, so larger generations
only make longer stops), and full ones run only here: after a drained wave (the trim), or
after `FULL_AFTER_ENDED` connections ended since the last one or `FULL_EVERY_SECONDS`, at a
moment connections are not ending by the hundred (a flood's drain is when the clients still
connected wait most), or regardless once `OVERDUE` times either. With it the loop's stops
in that hold fell to 0.1-0.6 s and its CPU by a quarter; the round trip did not clearly
shorten (the rest is measured in the README's hostile-suite section). What cyclic garbage is
left (asyncio's socket transport: 5 objects a connection) is returned in one stop, not in a
stop per quarter of growth.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import sys
import time
from typing import Callable, Iterable

from engine.admission import Admission
from runtime.teardown import TEARDOWN

log = logging.getLogger("relay.memory")

WAVE = 256                 # connections ended since the last trim before another is worth it
CHECK_EVERY_SECONDS = 1.0
# One more trim this long after a wave's: what the wave held is not all free when its slots
# are (uvicorn still closing WebSockets, aioquic's connections draining their timers); the
# hostile-load suite saw a PPP ingress stay 54% above its level for 10 s with one trim.
AGAIN_AFTER_SECONDS = 3.0
# ... and for this long after a wave's trim, every AGAIN_AFTER_SECONDS: another trim when a
# quarter of a wave ended since the last, else `malloc_trim` alone. The wave's tail,
# connections started as it ended, ends by its listeners' deadlines (a handshake's 5-10 s,
# a HELLO's 10 s), and what the wave freed keeps coming back to the C library for seconds;
# the hostile suite saw the sync listener 13-16% above its level 11 s after a flood, with
# 100 dead handshakes ending after its last trim and nothing given back until the next
# full collection or `return_due` (a wave of 256 ended).
TAIL_SECONDS = 25.0
FULL_AFTER_ENDED = 10_000  # connections ended since the last full collection
FULL_EVERY_SECONDS = 60.0  # and at least this often
OVERDUE = 5                # waiting for calm at most this many times either
_NEVER = 1 << 30           # CPython's own full collections: after this many middle ones


def take_over_collector() -> Callable[[], None]:
    """Leave full collections to `HeapTrimmer.run` (see the module); returns the undo."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], _NEVER)
    return lambda: gc.set_threshold(*before)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()
# CPython's attribute cache (4,096 entries) keys on the name's address and holds the name: an
# attribute looked up by a string built at run time (aioquic's transport parameters, six a
# connection; our request dispatch) stays alive in it, allocated in the middle of a wave's
# memory, and each such string keeps a page of the C heap from being given back.
CLEAR_TYPE_CACHE: Callable[[], None] = getattr(sys, "_clear_type_cache", lambda: None)


class HeapTrimmer:
    def __init__(self, admissions: Callable[[], Iterable[Admission]], *, wave: int = WAVE,
                 check_every: float = CHECK_EVERY_SECONDS,
                 again_after: float = AGAIN_AFTER_SECONDS,
                 tail_seconds: float = TAIL_SECONDS,
                 full_after_ended: int = FULL_AFTER_ENDED,
                 full_every: float = FULL_EVERY_SECONDS,
                 ends_queued: Callable[[], int] = TEARDOWN.__len__):
        self._admissions = admissions
        self._ends_queued = ends_queued
        self.wave = wave
        self.check_every = check_every
        self.again_after = again_after
        self.tail_seconds = tail_seconds
        self.full_after_ended = full_after_ended
        self.full_every = full_every
        self._again_at: float | None = None
        self._again_first = False  # the first check after a wave's trim trims regardless
        self._wave_trimmed_at = 0.0
        self._held_at_wave = 0     # connections held at the wave's trim
        self._released_at_again = 0
        self.trims = 0            # for tests and metrics
        self.full_collections = 0  # all of them, the trims' included
        self._released_at_trim = self._released_at_full = self._released_at_check = \
            self._released()
        self._full_at = time.monotonic()
        self.draining = False     # connections ended by the hundred at the last check
        self._released_at_return = self._released_at_trim
        self._returned_at = time.monotonic()
        self.returns = 0          # malloc_trim alone, between trims (for tests)

    def _released(self) -> int:
        return sum(a.released for a in self._admissions())

    def _held(self) -> int:
        return sum(a.total for a in self._admissions())

    def due(self) -> bool:
        """A wave of at least `wave` connections ended, what is held fell to half its peak
        (the peaks are then measured afresh) and the wave has stopped draining (fewer than a
        quarter of `wave` ended since the last check, and none of their ends still queued
        for the application, `runtime/teardown.py`): the collection's stop of the loop
        does not fall on the thousands of closes of a flood that leaves, which the clients
        still connected already wait behind. A flood that leaves at once frees its slots in
        one check but is torn down over the next second or two (more on a slower machine);
        collected then, the trim walked every connection still queued, alive, and its
        teardown freed more cycles after it."""
        admissions = list(self._admissions())
        released = sum(a.released for a in admissions)
        ended = released - self._released_at_trim
        draining = (released - self._released_at_check >= self.wave // 4
                    or self._ends_queued() > 0)
        self._released_at_check = released
        self.draining = draining
        held = sum(a.total for a in admissions)
        peak = sum(a.peak for a in admissions)
        if ended < self.wave or held * 2 > peak or draining:
            return False
        self._released_at_trim += ended
        for a in admissions:
            a.reset_peak()
        return True

    def full_due(self, now: float) -> bool:
        """A scheduled full collection (see the module) is due: `full_after_ended`
        connections ended since the last one, or `full_every` seconds passed, and connections
        are not ending by the hundred right now (`due` measured it); overdue (`OVERDUE`
        times either), it runs whatever the load."""
        ended = self._released() - self._released_at_full
        waited = now - self._full_at
        if ended >= self.full_after_ended * OVERDUE or waited >= self.full_every * OVERDUE:
            return True
        return (ended >= self.full_after_ended or waited >= self.full_every) \
            and not self.draining

    def return_due(self, now: float) -> bool:
        """At least `wave` connections ended since memory was last given back, they are no
        longer ending by the hundred, and `again_after` passed: give back what their closes
        freed, with `malloc_trim` alone. The listeners' connections are freed by reference
        counting as they end (tests/test_reference_cycles.py), so this needs no collection
        and no stop of the loop; the wave's trim (`due`) waits for the peak to halve, which
        a flood that is refused, evicted and timed out piecemeal may take long to reach, and
        meanwhile the freed memory stayed in the C library's free lists."""
        return (MALLOC_TRIM is not None and not self.draining
                and self._released() - self._released_at_return >= self.wave
                and now - self._returned_at >= self.again_after)

    async def give_back(self) -> None:
        await self._malloc_trim()
        self.returns += 1

    async def _malloc_trim(self) -> None:
        self._released_at_return, self._returned_at = self._released(), time.monotonic()
        CLEAR_TYPE_CACHE()   # ~12 us; the lookups after it fill the cache again
        if MALLOC_TRIM is not None:
            await asyncio.to_thread(MALLOC_TRIM, 0)

    def collect(self) -> int:
        self._released_at_full, self._full_at = self._released(), time.monotonic()
        self.full_collections += 1
        return gc.collect()

    async def trim(self) -> None:
        started = time.monotonic()
        self._released_at_again = self._released()
        collected = self.collect()
        await self._malloc_trim()
        self.trims += 1
        log.info("memory given back after a wave of connections", extra={
            "event": "memory_trimmed", "collected": collected,
            "seconds": round(time.monotonic() - started, 3)})

    async def _trim_tail(self) -> None:
        """Once more `again_after` after a wave's trim; then, while the wave's tail lasts
        (`tail_seconds`) or keeps ending, a trim whenever a quarter of a wave ended since the
        last, else `malloc_trim` alone (no stop of the loop): a flood's tail (handshake and
        hello timeouts, evictions) ends seconds after the wave drained, and what it held
        would otherwise stay in the C library's free lists (or its cycles wait for the
        scheduled full collection: up to a minute)."""
        if self._held() > self._held_at_wave + self.wave // 4:
            # a new wave is building (the next flood): no trims in it, each a full collection
            # that stops the loop for the clients it already slows; it gets its own when it
            # drains (`due`)
            self._again_at = None
            return
        ending = self._released() - self._released_at_again >= self.wave // 4
        if ending or self._again_first:
            await self.trim()
        else:
            await self.give_back()
        self._again_first = False
        now = time.monotonic()
        in_tail = now - self._wave_trimmed_at < self.tail_seconds
        self._again_at = now + self.again_after if ending or in_tail else None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.check_every)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                break
            if self.due():
                await self.trim()
                self._held_at_wave = self._held()
                self._wave_trimmed_at = time.monotonic()
                self._again_at = self._wave_trimmed_at + self.again_after
                self._again_first = True
            elif self._again_at is not None and time.monotonic() >= self._again_at:
                await self._trim_tail()
            elif self.full_due(time.monotonic()):
                self.collect()
            elif self.return_due(time.monotonic()):
                await self.give_back()
