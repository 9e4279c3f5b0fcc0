"""Connections that are gone, handed to the application a few at a time.

When a flood of connections leaves at once (an attacker's process exits: thousands of resets
in one read of the event loop), each one's end runs a chain of callbacks through the whole
application: for a PPP WebSocket, uvicorn's `connection_lost`, the ASGI task that wakes on
the disconnect, its writer task, the session's cleanup and a dozen middleware frames
unwinding, ~0.15-0.2 ms of Python each. asyncio runs every callback that is ready at the
start of a turn of its loop before it looks at the sockets again, so 6,500 of these made
turns of a quarter of a second, and a real client's login, a handful of turns, took ~1 s.

`Teardown.later(fn, *args)` queues such an end; the queue runs `per_turn` of them per turn
of the loop (one callback that re-arms itself with `call_soon`), so a turn carries at most
that many application teardowns and the clients still connected are served between them.
What must happen at once is not queued: the transport is already closed by asyncio, and the
shell frees the connection's admission slot itself before queuing (`PppWsProtocol`).

`TEARDOWN` is the process's queue (every listener of a process shares its event loop, so the
bound per turn holds for all of them): PPP's WebSockets and HTTP requests, and cursor-sync's
QUIC connections, whose disposal (`SyncConnection._dispose`) frees ~280 objects each.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

PER_TURN = 32       # ~5 ms of teardown per turn of the loop at ~0.15 ms each


class Teardown:
    def __init__(self, per_turn: int = PER_TURN):
        self.per_turn = per_turn
        self._due: deque[tuple[Callable[..., object], tuple]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._armed = False
        self.peak = 0       # most queued at once (for tests)

    def __len__(self) -> int:
        return len(self._due)

    def later(self, fn: Callable[..., object], *args) -> None:
        self._due.append((fn, args))
        self.peak = max(self.peak, len(self._due))
        loop = asyncio.get_running_loop()
        # armed on a loop that has since closed (a test's asyncio.run ended with ends queued):
        # arm again here, or nothing would ever run them
        if not self._armed or self._loop is not loop:
            self._armed = True
            self._loop = loop
            loop.call_soon(self._turn)

    def _turn(self) -> None:
        due = self._due
        for _ in range(min(self.per_turn, len(due))):
            fn, args = due.popleft()
            try:
                fn(*args)
            except Exception as exc:     # one connection's end must not stall the others
                self._loop.call_exception_handler({
                    "message": "connection teardown failed", "exception": exc})
        if due:
            self._loop.call_soon(self._turn)
        else:
            self._armed = False


TEARDOWN = Teardown()
