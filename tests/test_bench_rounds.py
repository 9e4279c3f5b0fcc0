"""The bench's medians over rounds (relay/bench/rounds.py)."""

from relay.bench.rounds import median_of


def test_numbers_take_the_median_and_keep_ints_whole():
    assert median_of([3, 1, 2]) == 2
    assert median_of([1.0, 5.5, 2.25]) == 2.25
    assert median_of([1, 2]) == 1.5            # an even count: the mean of the middle two
    assert median_of([10, None, 30]) == 20     # a failed round is left out
    assert median_of([None, None]) is None


def test_nested_dicts_take_each_figures_median_over_the_rounds_that_have_it():
    rounds = [{"p": {"p50": 10, "p99": 90}, "mode": "quick", "ok": True, "x": [1, 8]},
              {"p": {"p50": 30, "p99": 70}, "mode": "quick", "ok": False, "x": [3, 4]},
              {"p": {"p50": 20}, "mode": "quick", "ok": True, "x": [2, 6], "late": 5}]
    assert median_of(rounds) == {"p": {"p50": 20, "p99": 80}, "mode": "quick", "ok": True,
                                 "x": [2, 6], "late": 5}

