"""Medians over repeated rounds of `relay bench` (issue 13: every figure the median of 3).

This machine is noisy (2 cores shared with whatever else runs), so one round's figure can be
half or twice another's. `relay bench` runs every section `rounds` times, each round in the
same order (the delta-rs ceiling and Spark's floor are measured in every round, so ratios
compare like with like), and reports each figure as the median over the rounds. Pure code:
the rounds' result dicts in, one dict of medians out.
"""

from __future__ import annotations

import statistics
from typing import Any


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def median_of(values: list[Any]) -> Any:
    """The median of one figure over the rounds that have it, in the rounds' shape: numbers
    give their median (an int stays an int when the median is whole), dicts their keys'
    medians, lists of equal length their items' medians; anything else (strings, flags)
    is the first round's. A round without the figure (its section failed) is left out."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if _number(first):
        nums = [v for v in present if _number(v)]
        m = statistics.median(nums)
        if all(isinstance(v, int) for v in nums) and float(m).is_integer():
            return int(m)
        return round(float(m), 3)
    if isinstance(first, dict):
        keys: list = []
        for v in present:
            if isinstance(v, dict):
                keys += [k for k in v if k not in keys]
        return {k: median_of([v.get(k) for v in present if isinstance(v, dict)]) for k in keys}
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first)
                                       for v in present):
        return [median_of([v[i] for v in present]) for i in range(len(first))]
    return first

