"""runtime/memory_trim.py: the heap is trimmed after a drained wave of connections, never under
steady load."""

from __future__ import annotations

import asyncio

from engine.admission import Admission, Cap, Limits
from runtime.memory_trim import HeapTrimmer


def _admission() -> Admission:
    cap = Cap(20_000, 20_000)
    return Admission(Limits(20_000, cap, cap, cap))


def _open(adm: Admission, n: int, address: str = "10.0.0.2") -> list:
    return [adm.admit(address, 0).ticket for _ in range(n)]


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
    assert trimmer.due()                     # 300 of 1,300: drained
    assert not trimmer.due()                 # and measured afresh: not twice
    for t in steady[:200]:
        adm.release(t)
    assert not trimmer.due()                 # 200 ended: under a wave


def test_the_trimmer_runs_until_stopped_and_trims_after_a_wave():
    adm = _admission()
    trimmer = HeapTrimmer(lambda: [adm], wave=256, check_every=0.01, again_after=0.2)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(trimmer.run(stop))
        wave = _open(adm, 300)
        await asyncio.sleep(0.05)
        assert trimmer.trims == 0
        for t in wave:
            adm.release(t)
        for _ in range(200):
            if trimmer.trims:
                break
            await asyncio.sleep(0.01)
        assert trimmer.trims == 1
        await asyncio.sleep(0.4)
        assert trimmer.trims == 2                # once more after the wave, then no more
        await asyncio.sleep(0.3)
        assert trimmer.trims == 2
        stop.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(main())
