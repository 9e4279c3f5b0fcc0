"""How late the event loop runs what is due: the one figure that says whether a role's
clients are waiting on its CPU.

A client's round trip is a chain of steps (connect, upgrade, login, store, fetch ...), each
of which waits for the loop to come round to it. When one turn of the loop runs hundreds of
callbacks (a wave of deadlines firing together, a burst of accepts), every step of every
client waits that long, and a dozen steps turn a 100 ms turn into a second. `LoopLag`
sleeps `interval` again and again and records how much later than asked it woke: a
histogram (`relay_event_loop_lag_seconds`) and the worst so far. One cause
it cannot see is measured apart: the cyclic garbage collector's pauses
(`relay_gc_pause_seconds{generation}`), which stop the loop for as long as it walks what
thousands of connections left behind."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry, Histogram

INTERVAL_SECONDS = 0.05
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 interval: float = INTERVAL_SECONDS):
        self.interval = interval
        self.samples = 0
        self.worst = 0.0
        self._histogram = Histogram(
            "relay_event_loop_lag_seconds",
            "how much later than due the role's event loop ran a timer (sampled every "
            f"{interval * 1000:.0f} ms)", buckets=BUCKETS, registry=registry) \
            if registry is not None else None

    def observe(self, late: float) -> None:
        late = max(0.0, late)
        self.samples += 1
        self.worst = max(self.worst, late)
        if self._histogram is not None:
            self._histogram.observe(late)

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.observe(loop.time() - due)


class GcPauses:
    """Times each collection of the cyclic garbage collector (`gc.callbacks`), by
    generation; `stop()` unhooks it."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self._started = 0.0
        self._histogram = Histogram(
            "relay_gc_pause_seconds", "how long each cyclic garbage collection stopped the "
            "process", ["generation"], buckets=BUCKETS, registry=registry) \
            if registry is not None else None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        if self._histogram is not None:
            self._histogram.labels(str(info.get("generation", ""))).observe(took)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
