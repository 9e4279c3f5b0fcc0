"""A long-running role's serving loop: start a node, serve until told to stop, close it, with
the role's /metrics exporter around it (`relay ingress` and `relay egress`).

Apart from `listener.py` so that the two import in one direction: `metrics.py` reads the
listeners' counters, and this module starts the exporter around the nodes that hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Iterator

from . import metrics
from .loop_lag import GcPauses, LoopLag
from .memory_trim import HeapTrimmer, take_over_collector


async def serve_until(node, stop: asyncio.Event, ready=None,
                      lag: LoopLag | None = None) -> None:
    """Run a node (anything with start / listening / listeners / close) until `stop` is set;
    meanwhile the memory of drained waves of its listeners' connections is given back
    (runtime/memory_trim.py) and the event loop's lateness is sampled (runtime/loop_lag.py;
    into `lag`'s histogram, the role's /metrics, when given)."""
    await node.start()
    with role_collector():
        trimmer = HeapTrimmer(lambda: [a for listener in node.listeners()
                                       for a in listener.admissions()])
        trimming = asyncio.create_task(trimmer.run(stop), name="heap-trimmer")
        lagging = asyncio.create_task((lag or LoopLag()).run(stop), name="loop-lag")
        if ready:
            ready(node.listening())
        try:
            await stop.wait()
        finally:
            await node.close()
            await trimming
            lagging.cancel()


@contextlib.contextmanager
def role_collector() -> Iterator[None]:
    """The cyclic collector as a role runs it, from the end of its start-up; undone on leaving
    (`relay bench` runs its in-process nodes this way, so it measures what a role runs).

    What start-up built (modules, Arrow and Delta handles, the app) lives as long as the
    process: out of the collector's sight (`gc.freeze`), a full collection (the heap
    trimmer's, or one the allocation of a wave of connections triggers) walks only what came
    after, not the ~90,000 objects of the imports each time (~60 ms of a stalled event loop
    on 2 cores). And full collections run on the heap trimmer's schedule, not on every
    quarter of heap growth (`take_over_collector`: a flood's connections grew it all the
    time, 0.4-0.75 s stops of the loop every 1.5-3 s)."""
    gc.freeze()
    give_back_collector = take_over_collector()
    try:
        yield
    finally:
        give_back_collector()
        gc.unfreeze()


async def run_role(settings, role: str, node, registry, stop: asyncio.Event,
                     ready=None) -> None:
    """`serve_until` with the role's /metrics exporter around it (runtime/metrics.py)."""
    exporter = metrics.serve_role(settings, role, registry)
    pauses = GcPauses(registry)
    try:
        await serve_until(node, stop, metrics.announce(ready, exporter, settings.metrics.bind),
                          LoopLag(registry))
    finally:
        pauses.stop()
        metrics.stop(exporter)
