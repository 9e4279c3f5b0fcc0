"""Give a drained wave of connections' memory back to the operating system.

A flood of connections that ends leaves the process as big as at its peak: dropped
connections are reference cycles (asyncio transports, aioquic's timers, uvicorn's protocol
objects) freed only by the cyclic collector, and glibc keeps freed memory in its arenas for
reuse. Issue 19 saw the ingress stay 20-30% bigger after each wave of idle connections left.

`HeapTrimmer` watches the listeners' admission counters (`engine/admission.py`) once a
second. When at least `wave` connections have ended since the last trim and what is held
now is at most half of the most held since then (the wave has drained), it runs a full
collection and then glibc's `malloc_trim(0)` on a thread (it walks the heap; the event loop
keeps serving), and once more `AGAIN_AFTER_SECONDS` later. Nothing happens under steady
load: connections that come and go at a constant level never halve the peak. Where the C library is not glibc, only the collection
runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from typing import Callable, Iterable

from engine.admission import Admission

log = logging.getLogger("relay.memory")

WAVE = 256                 # connections ended since the last trim before another is worth it
CHECK_EVERY_SECONDS = 1.0
# One more trim this long after a wave's: what the wave held is not all free when its slots
# are (uvicorn still closing WebSockets, aioquic's connections draining their timers); the
# hostile-load suite saw a PPP ingress stay 54% above its level for 10 s with one trim.
AGAIN_AFTER_SECONDS = 3.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None (another C library)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


class HeapTrimmer:
    def __init__(self, admissions: Callable[[], Iterable[Admission]], *, wave: int = WAVE,
                 check_every: float = CHECK_EVERY_SECONDS,
                 again_after: float = AGAIN_AFTER_SECONDS):
        self._admissions = admissions
        self.wave = wave
        self.check_every = check_every
        self.again_after = again_after
        self._again_at: float | None = None
        self.trims = 0            # for tests and metrics
        self._released_at_trim = self._released()

    def _released(self) -> int:
        return sum(a.released for a in self._admissions())

    def due(self) -> bool:
        """A wave of at least `wave` connections ended and what is held fell to half its peak
        (the peaks are then measured afresh)."""
        admissions = list(self._admissions())
        ended = sum(a.released for a in admissions) - self._released_at_trim
        held = sum(a.total for a in admissions)
        peak = sum(a.peak for a in admissions)
        if ended < self.wave or held * 2 > peak:
            return False
        self._released_at_trim += ended
        for a in admissions:
            a.reset_peak()
        return True

    async def trim(self) -> None:
        started = time.monotonic()
        collected = gc.collect()
        if MALLOC_TRIM is not None:
            await asyncio.to_thread(MALLOC_TRIM, 0)
        self.trims += 1
        log.info("memory given back after a wave of connections", extra={
            "event": "memory_trimmed", "collected": collected,
            "seconds": round(time.monotonic() - started, 3)})

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
                self._again_at = time.monotonic() + self.again_after
            elif self._again_at is not None and time.monotonic() >= self._again_at:
                self._again_at = None
                await self.trim()
