"""engine/work_budget.py: a share of a core, spent after the fact (the cursor-sync listener's
new connections: ingress/sync_quic.py)."""

import pytest

from engine.work_budget import WorkBudget


def test_work_may_start_until_the_burst_is_spent_then_waits_for_the_share():
    b = WorkBudget(share=0.25, burst=0.05)
    now = 100.0
    spent = 0.0
    while b.wait(now) == 0:
        b.spend(0.004, now)          # a connection's Initial: 4 ms
        spent += 0.004
    # the burst and one item past it (work is measured after it is done)
    assert 0.05 <= spent <= 0.05 + 0.004 + 1e-9
    # then what went past the burst is paid for at a quarter of a core: 4 x its time
    wait = b.wait(now)
    assert wait == pytest.approx((spent - 0.05) / 0.25, abs=1e-9) and wait > 0
    assert b.wait(now + wait) == 0
    b.spend(0.004, now + wait)
    assert b.wait(now + wait) == pytest.approx(0.004 / 0.25, abs=1e-9)


def test_over_a_long_run_the_work_done_is_the_share_of_the_time():
    b = WorkBudget(share=0.25, burst=0.05)
    now, done = 0.0, 0.0
    while now < 60.0:
        wait = b.wait(now)
        if wait:
            now += wait
            continue
        b.spend(0.004, now)
        done += 0.004
        now += 0.004                 # the work itself takes its time
    assert done / now == pytest.approx(0.25, rel=0.02)
    assert b.spent == pytest.approx(done)


def test_idle_time_is_not_saved_beyond_the_burst():
    b = WorkBudget(share=0.5, burst=0.01)
    b.spend(0.001, 0.0)
    later = 1000.0                   # idle for long: only the burst is available
    n = 0
    while b.wait(later) == 0:
        b.spend(0.001, later)
        n += 1
    assert n == 11                   # 10 ms of burst, and the one that crossed it


@pytest.mark.parametrize("share,burst", [(0, 0.1), (1.5, 0.1), (0.5, -1)])
def test_nonsense_is_refused(share, burst):
    with pytest.raises(ValueError):
        WorkBudget(share, burst)
