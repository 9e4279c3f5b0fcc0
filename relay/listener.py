"""A TCP listener for one protocol: start, bound port, connection cap, tracked handlers, close.

Shared by every asyncio shell (ingress and egress). A subclass names itself and serves one
connection in `serve(reader, writer)`; this class owns the socket bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

log = logging.getLogger("relay.listener")


class Listener:
    name = "listener"   # for logs and metrics: "trueseal_push", ...
    protocol = ""       # metrics label: the protocol this listener speaks

    def __init__(self, host: str, port: int, max_connections: int):
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.connections = 0    # open connections: the `relay_sessions_open` gauge
        # Plain counters bumped on the event loop and read by the metrics endpoint
        # (relay/metrics.py): requests this listener stored and acknowledged, and those it
        # refused, by reason. A shell counts; it never talks to Prometheus itself.
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    def _server_options(self) -> dict:
        """Hook: extra `asyncio.start_server` arguments (a TLS listener returns `ssl=...`)."""
        return {}

    async def _start_server(self):
        """Hook: the server whose connections reach `_on_connect(reader, writer)` (the Heya
        listener brings its own TLS streams, `relay/tls_stream.py`)."""
        return await asyncio.start_server(self._on_connect, self.host, self.port,
                                          **self._server_options())

    async def start(self) -> None:
        self._server = await self._start_server()
        log.info("listener started", extra={"event": "listener_started",
                                            "listener": self.name, "port": self.bound_port})

    @property
    def bound_port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop accepting, let the connections finish what they owe (`_drain`), then end them."""
        if self._server is not None:
            self._server.close()
        await self._drain()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _drain(self) -> None:
        """Hook: wait for work the open connections started (e.g. stores owed an Ack), while
        they can still write their replies."""

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


async def serve_role(settings, role: str, node, registry, stop: asyncio.Event,
                     ready=None) -> None:
    """`serve_until` with the role's /metrics exporter around it (relay/metrics.py)."""
    from relay import metrics
    exporter = metrics.serve_role(settings, role, registry)
    try:
        await serve_until(node, stop, metrics.announce(ready, exporter, settings.metrics.bind))
    finally:
        metrics.stop(exporter)
