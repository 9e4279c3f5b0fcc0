"""The handshake gate (runtime/handshake_gate.py) on a real event loop: lanes, turns that leave
room for the loop's other work, a full queue that drops the flood's own steps, and the known
addresses' memory."""

from __future__ import annotations

import asyncio

from runtime.handshake_gate import HandshakeGate, Known


def test_steps_run_known_first_then_light_then_the_rest_in_turn():
    lanes = {"known": 0, "light": 1}
    ran: list[str] = []

    async def go():
        gate = HandshakeGate(lambda key: lanes.get(key, 2), steps_per_turn=100)
        for i in range(3):
            for k in ("f1", "f2"):
                gate.submit(k, lambda k=k, i=i: ran.append(f"{k}.{i}"), lambda: None)
        gate.submit("light", lambda: ran.append("light"), lambda: None)
        gate.submit("known", lambda: ran.append("known"), lambda: None)
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(go())
    assert ran == ["known", "light", "f1.0", "f2.0", "f1.1", "f2.1", "f1.2", "f2.2"]


def test_a_turn_runs_a_few_steps_then_lets_the_loop_do_other_work():
    order: list[str] = []

    async def go():
        gate = HandshakeGate(lambda key: 2, steps_per_turn=2)
        for i in range(6):
            gate.submit(f"a{i}", lambda i=i: order.append(f"step{i}"), lambda: None)
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: order.append("other"))
        while gate:
            await asyncio.sleep(0)

    asyncio.run(go())
    # two steps, then the callback that was already waiting, then the rest two by two
    assert order[:3] == ["step0", "step1", "other"]
    assert [x for x in order if x != "other"] == [f"step{i}" for i in range(6)]


def test_a_step_whose_connection_is_gone_does_not_use_up_a_turn():
    order: list[str] = []

    async def go():
        gate = HandshakeGate(lambda key: 2, steps_per_turn=1)
        gate.submit("gone", lambda: False, lambda: None)
        gate.submit("live", lambda: order.append("live"), lambda: None)
        asyncio.get_running_loop().call_soon(lambda: order.append("other"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    asyncio.run(go())
    assert order == ["live", "other"]


def test_full_the_flooding_address_loses_its_own_oldest_step():
    dropped: list[str] = []

    async def go():
        gate = HandshakeGate(lambda key: 2, capacity=4, per_key=10)
        for i in range(3):
            gate.submit("flood", lambda: None, lambda i=i: dropped.append(f"flood{i}"))
        gate.submit("client", lambda: None, lambda: dropped.append("client"))
        gate.submit("other", lambda: None, lambda: dropped.append("other"))
        assert gate.dropped == 1 and len(gate) == 4
        gate.close()
        assert gate.closed and len(gate) == 0
        gate.submit("late", lambda: None, lambda: dropped.append("late"))

    asyncio.run(go())
    assert dropped[0] == "flood0"                       # pushed out by "other"
    assert sorted(dropped[1:]) == ["client", "flood1", "flood2", "late", "other"]


def test_turn_answers_false_when_its_step_is_pushed_out():
    async def go():
        gate = HandshakeGate(lambda key: 2, per_key=1)
        first = asyncio.ensure_future(gate.turn("a"))
        second = asyncio.ensure_future(gate.turn("a"))    # "a" at per_key: its first goes
        return await asyncio.gather(first, second)

    assert asyncio.run(go()) == [False, True]


def test_a_wait_cancelled_before_its_turn_gives_the_turn_to_the_next():
    async def go():
        gate = HandshakeGate(lambda key: 2, steps_per_turn=1)
        cancelled = asyncio.ensure_future(gate.turn("x"))
        waiting = asyncio.ensure_future(gate.turn("y"))
        await asyncio.sleep(0)        # both queued; the gate's first turn comes next
        cancelled.cancel()
        assert await waiting is True
        return gate.run_steps

    assert asyncio.run(go()) == 1


def test_known_addresses_expire_and_the_oldest_are_forgotten():
    known = Known(ttl=10.0, capacity=2)
    known.add("a", 0.0)
    known.add("b", 1.0)
    assert known.knows("a", 9.0) and not known.knows("a", 10.5)   # expired: forgotten
    assert len(known) == 1
    known.add("c", 2.0)
    known.add("d", 3.0)                                           # over capacity: "b" goes
    assert not known.knows("b", 3.0) and known.knows("c", 3.0) and known.knows("d", 3.0)


def test_known_addresses_are_held_as_keyed_hashes_not_as_addresses():
    known, other = Known(), Known()
    known.add("203.0.113.7", 0.0)
    other.add("203.0.113.7", 0.0)
    assert known.knows("203.0.113.7", 1.0) and not known.knows("203.0.113.8", 1.0)
    assert "203.0.113.7" not in repr(known._seen)
    assert list(known._seen) != list(other._seen)     # a key of its own per process
