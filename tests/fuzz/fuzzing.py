"""How a fuzz target runs: Hypothesis for a wall-clock budget, with a hang watchdog.

Hypothesis stops after a number of examples and has no time limit of its own, so a target
runs it in rounds of `FUZZ_ROUND` examples, each round from a fresh seed, until
`FUZZ_SECONDS` have passed (30 s by default: the CI budget per target). A round that finds a
failure shrinks it and fails the test with the smallest input, the seed and a reproduction
blob (`@reproduce_failure`). `@example` regressions on the target run first, once.

An input must be handled within `FUZZ_HANG_SECONDS` (default 5 s, orders of magnitude over
what any codec needs for the bounded sizes drawn here): past it the watchdog (SIGALRM)
raises `Hang` inside the codec, so a loop that never ends fails the test with its input
instead of hanging CI. `FUZZ_SEED` fixes the first round's seed (default: random, printed).

Environment: FUZZ_SECONDS (per target), FUZZ_ROUND (examples per round), FUZZ_SEED,
FUZZ_HANG_SECONDS.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

FUZZ_SECONDS = float(os.environ.get("FUZZ_SECONDS", "30"))
FUZZ_ROUND = int(os.environ.get("FUZZ_ROUND", "300"))
FUZZ_HANG_SECONDS = float(os.environ.get("FUZZ_HANG_SECONDS", "5"))


class Hang(Exception):
    """One input ran past FUZZ_HANG_SECONDS."""


def _alarm(signum, frame):
    raise Hang(f"an input took over {FUZZ_HANG_SECONDS} s")


def fuzz_target(**strategies):
    """Decorator: `check(**values)` becomes a pytest test fuzzing it for FUZZ_SECONDS.

    `check` asserts the contract for one input; `@example(...)` decorators placed under this
    one are regressions, run before any generated input."""

    def decorate(check):
        @functools.wraps(check)   # Hypothesis reads the signature and examples through it
        def guarded(**values):
            previous = signal.signal(signal.SIGALRM, _alarm)
            signal.setitimer(signal.ITIMER_REAL, FUZZ_HANG_SECONDS)
            try:
                check(**values)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

        def test():
            first = int(os.environ.get("FUZZ_SEED", random.randrange(2**32)))
            deadline = time.monotonic() + FUZZ_SECONDS
            rounds = 0
            while True:
                phases = [Phase.generate, Phase.shrink]
                if rounds == 0:
                    phases.insert(0, Phase.explicit)
                run = settings(
                    max_examples=FUZZ_ROUND, deadline=None, database=None, phases=phases,
                    print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much],
                )(seed(first + rounds)(given(**strategies)(guarded)))
                try:
                    run()
                except BaseException:
                    print(f"fuzz {check.__name__}: failed in round {rounds} "
                          f"(FUZZ_SEED={first} reproduces it)", file=sys.stderr)
                    raise
                rounds += 1
                if time.monotonic() >= deadline:
                    break
            print(f"fuzz {check.__name__}: {rounds} rounds of {FUZZ_ROUND} examples "
                  f"in {FUZZ_SECONDS:.0f} s (FUZZ_SEED={first})")

        test.__name__ = test.__qualname__ = check.__name__
        test.__module__ = check.__module__
        test.__doc__ = check.__doc__
        return test

    return decorate
