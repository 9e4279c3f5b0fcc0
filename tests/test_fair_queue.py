"""engine/fair_queue.py: round-robin by key, bounded in all and per key."""

import pytest

from engine.fair_queue import FairQueue


def test_a_new_key_waits_for_one_item_of_each_other_key_not_for_a_flood():
    q = FairQueue(capacity=100, per_key=50)
    for i in range(40):
        q.push("flood", f"f{i}")
    q.push("client", "c0")
    assert [q.pop(), q.pop()] == ["f0", "c0"]     # the flood's turn, then the client's
    assert [q.pop() for _ in range(len(q))] == [f"f{i}" for i in range(1, 40)]


def test_keys_are_served_in_turn_in_arrival_order():
    q = FairQueue(capacity=10, per_key=10)
    for item in ("a1", "a2", "b1", "c1", "b2"):
        q.push(item[0], item)
    assert [q.pop() for _ in range(len(q))] == ["a1", "b1", "c1", "a2", "b2"]


def test_a_key_at_its_cap_drops_its_own_oldest():
    q = FairQueue(capacity=10, per_key=2)
    q.push("x", 1)
    q.push("y", 9)
    assert q.push("x", 2) is None
    assert q.push("x", 3) == 1
    assert len(q) == 3 and q.dropped == 1
    assert [q.pop() for _ in range(3)] == [2, 9, 3]


def test_full_drops_the_oldest_of_the_longest_queue_not_the_newcomer():
    q = FairQueue(capacity=4, per_key=4)
    for i in range(3):
        q.push("flood", i)
    q.push("a", "a")
    assert q.push("b", "b") == 0          # the flood loses its oldest
    assert q.push("c", "c") == 1
    assert q.push("d", "d") == 2          # the flood's last: its queue is gone
    assert len(q) == 4
    assert sorted(q.pop() for _ in range(4)) == ["a", "b", "c", "d"]


def test_full_of_single_items_drops_one_and_keeps_serving():
    q = FairQueue(capacity=2, per_key=1)
    q.push("a", "a")
    q.push("b", "b")
    assert q.push("c", "c") == "a"
    assert [q.pop(), q.pop()] == ["b", "c"]
    with pytest.raises(IndexError):
        q.pop()


def test_clear_and_bounds():
    q = FairQueue(capacity=3, per_key=1)
    q.push("a", 1)
    q.clear()
    assert len(q) == 0
    with pytest.raises(ValueError):
        FairQueue(capacity=0, per_key=1)


def test_a_light_key_is_served_before_every_queued_heavy_one():
    """A key holding next to nothing (light) goes ahead of 200 flooding keys, each with
    items queued; the heavy keys keep their round-robin after it."""
    q = FairQueue(capacity=1000, per_key=4)
    for k in range(200):
        q.push(f"h{k}", f"h{k}-0")
    q.push("client", "c0", lane=0)
    assert q.pop() == "c0"
    assert [q.pop() for _ in range(3)] == ["h0-0", "h1-0", "h2-0"]


def test_three_lanes_are_served_in_order():
    q = FairQueue(capacity=10, per_key=4, lanes=3)
    q.push("flood", "f1")
    q.push("light", "l1", lane=1)
    q.push("known", "k1", lane=0)
    q.push("flood", "f2", lane=0)      # already queued in the last lane: stays there
    assert [q.pop() for _ in range(4)] == ["k1", "l1", "f1", "f2"]
    with pytest.raises(IndexError):
        q.pop()


def test_a_key_stays_in_its_lane_until_its_queue_empties():
    q = FairQueue(capacity=10, per_key=10)
    q.push("a", "a1", lane=0)
    q.push("a", "a2")                  # still light: it is queued there
    q.push("b", "b1")
    q.push("b", "b2", lane=0)      # still heavy
    assert [q.pop() for _ in range(4)] == ["a1", "a2", "b1", "b2"]


def test_a_full_queue_drops_from_either_lane_the_longest():
    q = FairQueue(capacity=3, per_key=3)
    q.push("x", "x1", lane=0)
    q.push("x", "x2")
    q.push("y", "y1")
    assert q.push("z", "z1") == "x1"
    assert [q.pop() for _ in range(3)] == ["x2", "y1", "z1"]


def test_the_only_key_at_capacity_keeps_its_newest():
    q = FairQueue(capacity=1, per_key=5)
    q.push("a", 1)
    assert q.push("a", 2) == 1
    assert len(q) == 1 and q.pop() == 2


def test_next_lane_is_the_lane_pop_serves():
    q: FairQueue[str] = FairQueue(16, 4, lanes=3)
    assert q.next_lane() is None
    q.push("flood", "f1", lane=2)
    assert q.next_lane() == 2
    q.push("known", "k1", lane=0)
    assert q.next_lane() == 0
    assert q.pop() == "k1"
    assert q.next_lane() == 2
    q.pop()
    assert q.next_lane() is None
