"""runtime/teardown.py: ends of connections run a few per turn of the event loop, so the
clients still connected are served between them."""

from __future__ import annotations

import asyncio

from runtime.teardown import Teardown


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
