"""runtime/teardown.py: ends of connections run a few per turn of the event loop, so the
clients still connected are served between them."""

from __future__ import annotations

import asyncio

from runtime.teardown import PER_TURN, TEARDOWN, Teardown


def test_teardowns_run_a_few_per_turn_and_other_callbacks_run_between_them():
    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx["message"]))
        t = Teardown(per_turn=10)
        log: list[str] = []
        for i in range(35):
            t.later(log.append, f"end{i}")
        t.later(lambda: 1 / 0)                    # one failing end does not stop the rest
        t.later(log.append, "last")
        loop.call_soon(log.append, "client")      # a client's callback, ready meanwhile
        for _ in range(10):
            await asyncio.sleep(0)
        ends = [x for x in log if x != "client"]
        assert ends == [f"end{i}" for i in range(35)] + ["last"]
        assert 0 < log.index("client") <= 10      # served after the first turn, not the last
        assert errors == ["connection teardown failed"]
        assert len(t) == 0 and t.peak == 37
        t.later(log.append, "again")              # re-armed after it ran dry
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert log[-1] == "again"

    asyncio.run(main())


def test_ends_left_queued_by_a_loop_that_closed_run_on_the_next_one():
    t = Teardown(per_turn=0)
    ran: list[str] = []

    async def first():
        t.later(ran.append, "old")        # armed, never run: per_turn 0, then the loop closes

    asyncio.run(first())
    t.per_turn = 8

    async def second():
        t.later(ran.append, "new")
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(second())
    assert ran == ["old", "new"] and len(t) == 0


def test_a_ppp_node_stops_while_the_ends_of_lost_websockets_wait_their_turn(settings):
    """`relay bench` found it: uvicorn's shutdown closes every connection it still lists, and
    a WebSocket its client had closed (the closing handshake done) but whose end was still
    queued was sent a second close (websockets raised InvalidState and the stop failed). Real
    PPP sessions are reset or closed, the queue is held, the node stops: the stop finishes,
    nothing is raised, and every end queued still runs once the queue moves."""
    from nacl.signing import SigningKey

    from ingress.service import IngressNode
    from test_ppp_hostile import login
    from test_ppp_shell import until

    async def go():
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        loop.set_exception_handler(
            lambda _loop, ctx: errors.append(f"{ctx['message']}: {ctx.get('exception')!r}"))
        queue = TEARDOWN
        settings.heya.enabled = False
        n = IngressNode(settings, fsync=False)
        await n.start()
        stop = None
        try:
            sessions = []
            for i in range(12):
                ws, reply = await login(n.ppp.bound_port, f"127.0.0.{2 + i % 3}",
                                        SigningKey.generate())
                assert reply == {"cmd": "AUTH_OK"}, reply
                sessions.append(ws)
            await until(lambda: n.ppp.connections == 12)
            queue.per_turn = 0                 # the ends wait, as behind a flood's
            try:
                for ws in sessions[:6]:      # as a flood leaves: reset
                    ws.transport.abort()
                for ws in sessions[6:]:      # as a client leaves: the closing handshake
                    await ws.close()
                # the slots are free at once; a reset session counts until its end runs
                await until(lambda: n.ppp.admission.total == 0 and len(queue) == 12
                            and n.ppp.connections == 6, 10)
                stop = asyncio.create_task(n.close())
                await asyncio.sleep(0.3)       # uvicorn's shutdown has gone over them
            finally:
                queue.per_turn = PER_TURN
            await asyncio.wait_for(stop, 30)
            await until(lambda: len(queue) == 0 and n.ppp.connections == 0, 10)
        finally:
            if stop is None:
                await n.close()
        assert errors == [], errors

    asyncio.run(go())
