"""runtime/memory_trim.py: the heap is trimmed after a drained wave of connections, never under
steady load; full collections run on the trimmer's schedule, not CPython's."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import pytest

from engine.admission import Admission, Cap, Limits
from runtime.memory_trim import HeapTrimmer, take_over_collector


def _admission() -> Admission:
    cap = Cap(20_000, 20_000)
    return Admission(Limits(20_000, cap, cap, cap))


def _open(adm: Admission, n: int, address: str = "10.0.0.2") -> list:
    return [adm.admit(address, 0).ticket for _ in range(n)]


@contextlib.asynccontextmanager
async def running(trimmer: HeapTrimmer):
    """The trimmer's loop, stopped on the way out."""
    stop = asyncio.Event()
    task = asyncio.create_task(trimmer.run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 1)


async def until_trims(trimmer: HeapTrimmer, n: int, tries: int = 500) -> None:
    """Poll for the `n`th trim: a full collection and malloc_trim in the test process, with
    Spark's heap in it, can take longer than `again_after`."""
    for _ in range(tries):
        if trimmer.trims >= n:
            return
        await asyncio.sleep(0.01)


def test_a_drained_wave_is_due_once_and_steady_churn_never():
    adm, other = _admission(), _admission()
    trimmer = HeapTrimmer(lambda: [adm, other], wave=256)
    steady = _open(adm, 300, "10.0.0.9")
    for _ in range(10):                      # 2,000 come and go over a level of 300
        churn = _open(other, 100)
        assert not trimmer.due()
        for t in churn:
            other.release(t)
        churn = _open(other, 100)
        for t in churn:
            other.release(t)
        assert not trimmer.due()             # ended >= wave, but never half of the peak
        adm.reset_peak(), other.reset_peak()
    trimmer = HeapTrimmer(lambda: [adm, other], wave=256)
    wave = _open(other, 1000)
    for t in wave[:600]:
        other.release(t)
    assert not trimmer.due()                 # 700 of 1,300 still held: not drained
    for t in wave[600:]:
        other.release(t)
    assert not trimmer.due()                 # 300 of 1,300, but 400 ended since: draining
    assert trimmer.due()                     # calm at the next check: drained
    assert not trimmer.due()                 # and measured afresh: not twice
    for t in steady[:200]:
        adm.release(t)
    assert not trimmer.due()                 # 200 ended: under a wave


def test_a_wave_whose_ends_are_still_queued_is_not_trimmed_until_they_ran():
    """A flood that leaves at once frees its slots in one check, and the application tears
    its connections down a few per turn of the loop (runtime/teardown.py) over the next
    seconds: the trim's collection waits for that, the real queue's length included."""
    from runtime.teardown import Teardown
    adm, queue = _admission(), Teardown(per_turn=4)
    trimmer = HeapTrimmer(lambda: [adm], wave=256, ends_queued=queue.__len__)
    ran: list[int] = []

    async def main():
        for t in _open(adm, 1000):
            adm.release(t)
            queue.later(ran.append, 1)
        assert not trimmer.due()             # 1,000 ended since the last check: draining
        assert not trimmer.due()             # calm, but their 1,000 ends still queued
        while len(queue):
            await asyncio.sleep(0)
        assert len(ran) == 1000 and trimmer.due()
    asyncio.run(main())


def test_the_trimmer_runs_until_stopped_and_trims_after_a_wave():
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, check_every=0.01, again_after=0.2)

    async def main():
        async with running(trimmer):
            wave = _open(adm, 300)
            await asyncio.sleep(0.05)
            assert trimmer.trims == 0
            for t in wave:
                adm.release(t)
            await until_trims(trimmer, 1, tries=200)
            assert trimmer.trims == 1
            await until_trims(trimmer, 2)        # once more after the wave, then no more
            assert trimmer.trims == 2
            await asyncio.sleep(0.6)
            assert trimmer.trims == 2

    asyncio.run(main())


def test_the_trims_after_a_wave_go_on_while_its_tail_keeps_ending():
    """A flood's tail (handshake and hello timeouts, evictions) ends seconds after the wave
    drained: another trim gives back what it held, not the scheduled full collection a minute
    later; past `tail_seconds`, connections that end are left to the other rules."""
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, check_every=0.01, again_after=0.2,
                          tail_seconds=1.5)

    async def main():
        async with running(trimmer):
            wave = _open(adm, 500)
            await asyncio.sleep(0.05)
            for t in wave[:300]:
                adm.release(t)
            await until_trims(trimmer, 1)
            assert trimmer.trims == 1
            await until_trims(trimmer, 2)
            assert trimmer.trims == 2            # once more after the wave, regardless
            await asyncio.sleep(0.5)
            assert trimmer.trims == 2            # nothing ending: none
            for t in wave[300:400]:              # the tail: 100 end a second after the wave
                adm.release(t)
            await until_trims(trimmer, 3)
            assert trimmer.trims == 3
            await asyncio.sleep(1.5)             # the tail's time is over
            for t in wave[400:]:
                adm.release(t)
            await asyncio.sleep(0.6)
            assert trimmer.trims == 3            # 100 more ended, too late and under a wave

    asyncio.run(main())


def test_a_new_wave_building_in_the_tail_is_not_trimmed_until_it_drains():
    """The next flood may begin within the last one's tail: while it builds, connections end
    by the hundred (refused, evicted), and a trim each time would stop the loop for a full
    collection in the middle of it. It gets its own trim once it drains."""
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, check_every=0.01, again_after=0.2,
                          tail_seconds=5.0)

    async def main():
        async with running(trimmer):
            wave = _open(adm, 300)
            await asyncio.sleep(0.05)
            for t in wave:
                adm.release(t)
            await until_trims(trimmer, 2)
            assert trimmer.trims == 2            # the wave's, and once more
            flood = _open(adm, 600)              # the next wave, within the tail
            for _ in range(5):                   # churning: 100 end every 0.2 s
                for t in flood[:100]:
                    adm.release(t)
                flood = flood[100:] + _open(adm, 100)
                await asyncio.sleep(0.2)
            assert trimmer.trims == 2
            for t in flood:                      # it drains: its own trim
                adm.release(t)
            await until_trims(trimmer, 3)
            assert trimmer.trims == 3

    asyncio.run(main())


def test_full_collections_are_left_to_the_schedule_and_given_back():
    before = gc.get_threshold()
    undo = take_over_collector()
    try:
        young, middle, full = gc.get_threshold()
        assert (young, middle) == before[:2]     # young and middle collections as CPython's
        assert full >= 1 << 30                   # CPython's own full ones: never in practice
        gc.collect()
        seen = []

        def callback(phase, info):
            if phase == "stop":
                seen.append(info["generation"])
        gc.callbacks.append(callback)
        try:
            junk = []
            for _ in range(200_000):             # ~300 middle collections' worth of survivors
                junk.append([junk and junk[-1]])
        finally:
            gc.callbacks.remove(callback)
        assert seen and 2 not in seen            # CPython alone: several full ones here
    finally:
        undo()
    assert gc.get_threshold() == before


def test_a_full_collection_is_due_after_enough_connections_ended_or_time():
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, full_after_ended=500, full_every=60.0)
    now = time.monotonic()
    assert not trimmer.full_due(now)
    for t in _open(adm, 499):
        adm.release(t)
    assert not trimmer.full_due(now)
    adm.release(_open(adm, 1)[0])
    assert trimmer.full_due(now)                 # 500 ended since the last one
    trimmer.collect()
    assert trimmer.full_collections == 1
    assert not trimmer.full_due(time.monotonic())
    assert trimmer.full_due(time.monotonic() + 60.0)   # and at least every minute
    for t in _open(adm, 600):                    # a flood's drain: hundreds end a second
        adm.release(t)
    assert not trimmer.due() and trimmer.draining
    assert not trimmer.full_due(time.monotonic())      # due, but not now
    assert not trimmer.full_due(time.monotonic() + 60.0)
    assert trimmer.full_due(time.monotonic() + 300.0)  # overdue: whatever the load
    for t in _open(adm, 2000):
        adm.release(t)
    trimmer.due()
    assert trimmer.full_due(time.monotonic())           # 5 x 500 ended: overdue too
    trimmer.due()                                # a calm check
    assert not trimmer.draining and trimmer.full_due(time.monotonic())


def test_memory_is_given_back_between_trims_once_a_wave_has_ended_and_calmed():
    """A flood ended piecemeal (evicted, timed out) whose peak never halves still gets its
    freed memory given back (malloc_trim alone), once it stops ending by the hundred, and
    not more often than `again_after`."""
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, again_after=0.05)
    held = _open(adm, 2000)
    for t in held[:300]:                 # 300 of 2,000 ended: the peak is far from halved
        adm.release(t)
    now = time.monotonic() + 1
    assert not trimmer.due()             # still ending by the hundred: draining
    assert not trimmer.return_due(now)
    assert not trimmer.due()             # calm now, but 1,700 of 2,000 still held
    assert trimmer.return_due(now)
    asyncio.run(trimmer.give_back())
    assert trimmer.returns == 1 and trimmer.trims == 0
    assert not trimmer.return_due(now + 1)     # nothing more ended since
    for t in held[300:400]:
        adm.release(t)
    trimmer.due()
    assert not trimmer.return_due(now + 1)     # 100 ended: under a wave


def test_giving_memory_back_lets_go_of_attribute_names_built_at_run_time():
    """CPython's attribute cache holds each name it was asked for by address: a name built
    at run time (aioquic's transport parameters, six a connection) would stay alive in the
    middle of a wave's memory and keep its page from being given back."""
    import sys

    class Params:
        initial_max_data = 1

    name = "".join(["initial_", "max_data"])   # built at run time: not the interned literal
    before = sys.getrefcount(name)
    assert getattr(Params(), name) == 1
    if sys.getrefcount(name) == before:
        pytest.skip("this CPython's attribute cache does not hold the names it caches")
    trimmer = HeapTrimmer(lambda: [_admission()])
    asyncio.run(trimmer.give_back())
    assert sys.getrefcount(name) == before
    assert trimmer.returns == 1
