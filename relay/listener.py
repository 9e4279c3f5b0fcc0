"""A TCP listener for one protocol: start, bound port, connection cap, tracked handlers, close.

Shared by every asyncio shell (ingress and egress). A subclass names itself and serves one
connection in `serve(reader, writer)`; this class owns the socket bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("relay.listener")


class Listener:
    name = "listener"   # for logs: "trueseal_push", ...

    def __init__(self, host: str, port: int, max_connections: int):
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._on_connect, self.host, self.port)
        log.info("listener started", extra={"event": "listener_started",
                                            "listener": self.name, "port": self.bound_port})

    @property
    def bound_port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop accepting, then end the open connections."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._after_connections_closed()
        if self._server is not None:
            await self._server.wait_closed()

    async def _after_connections_closed(self) -> None:
        """Hook: work the connections started that must finish before close returns."""

    async def _on_connect(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            # trueseal interop §1: past the cap, accept and close at once, sending nothing.
            log.warning("connection cap reached", extra={"event": "connection_refused",
                                                         "listener": self.name})
            writer.close()
            return
        self.connections += 1
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self.serve(reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            self._handlers.discard(task)
            self.connections -= 1


async def serve_until(node, stop: asyncio.Event, ready=None) -> None:
    """Run a node (anything with start / listening / close) until `stop` is set."""
    await node.start()
    if ready:
        ready(node.listening())
    try:
        await stop.wait()
    finally:
        await node.close()
