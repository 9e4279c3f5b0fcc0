"""runtime/loop_lag.py: a loop kept busy shows as lateness, a collection as a pause, both in
the role's registry."""

from __future__ import annotations

import asyncio
import gc
import time

from prometheus_client import CollectorRegistry

from runtime.loop_lag import GcPauses, LoopLag


def test_a_blocked_loop_is_seen_late_and_an_idle_one_is_not():
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval=0.01)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(lag.run(stop))
        await asyncio.sleep(0.1)
        idle_worst = lag.worst
        time.sleep(0.3)                      # a callback that holds the loop
        await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 1)
        return idle_worst

    idle_worst = asyncio.run(main())
    assert idle_worst < 0.1
    assert lag.worst >= 0.25
    late = registry.get_sample_value("relay_event_loop_lag_seconds_bucket", {"le": "0.25"})
    count = registry.get_sample_value("relay_event_loop_lag_seconds_count")
    assert count == lag.samples and count - late == 1     # the one sample past 250 ms


def test_each_collection_is_timed_by_generation_until_stopped():
    registry = CollectorRegistry()
    pauses = GcPauses(registry)
    try:
        gc.collect()
        full = registry.get_sample_value("relay_gc_pause_seconds_count", {"generation": "2"})
        assert full >= 1
    finally:
        pauses.stop()
    gc.collect()
    assert registry.get_sample_value("relay_gc_pause_seconds_count",
                                     {"generation": "2"}) == full
