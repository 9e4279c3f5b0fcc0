"""runtime/log_rate.py: one line per key per interval, the next one counting what was dropped."""

from runtime.log_rate import LogRate


def test_one_line_per_key_per_interval_with_the_dropped_count():
    now = [100.0]
    rate = LogRate(interval=10.0, clock=lambda: now[0])
    assert rate.allow("timeout") == 0
    assert [rate.allow("timeout") for _ in range(1000)] == [None] * 1000
    assert rate.allow("refused") == 0           # keys are independent
    now[0] += 9.9
    assert rate.allow("timeout") is None
    now[0] += 0.1
    assert rate.allow("timeout") == 1001
    assert rate.allow("timeout") is None
    now[0] += 60
    assert rate.allow("timeout") == 1
    assert rate.allow("timeout") is None
