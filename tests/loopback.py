"""Raw TCP clients on loopback for the listener tests: a connection from a chosen source
address of 127.0.0.0/8 (one of many clients), whether the server closed it, and waiting for
the server's state to reach a condition."""

from __future__ import annotations

import asyncio
import time


async def raw(port: int, src: str):
    """A TCP connection from `src` that says nothing (yet)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(src, 0))


async def closed_by_server(reader, timeout: float) -> bool:
    """The server closed the connection within `timeout` (EOF or reset)."""
    try:
        while True:
            if not await asyncio.wait_for(reader.read(65536), timeout):
                return True
    except (asyncio.TimeoutError, TimeoutError):
        return False
    except (ConnectionError, OSError):
        return True


async def wait_until(cond, timeout: float = 5.0) -> None:
    """Poll `cond()` every 10 ms until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
