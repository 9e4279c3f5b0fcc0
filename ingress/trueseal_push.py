"""asyncio shell of the trueseal push listener (:7701): sockets, timeouts and stores.

The protocol is `engine.trueseal.push.PushSession`; this module only moves bytes and turns
each PushReceived into a landing row. Each Push is stored concurrently with the ones before
it (`appender.append` group-commits them), and the core is told `accept` once the commit has
returned, so an Ack always means durable (DESIGN.md "Ack = durable"); the core keeps the Acks
in Push order. A failed store closes the connection after the replies before it: Error
would tell the real client to drop the blob for good (000), a close makes it retry.

Limits:
* `handshake_timeout_seconds` bounds the NK handshake; after it, like the public relay, a
  push session has no read deadline (interop §1), and `max_connections` bounds what idle
  sessions can hold.
* Past `max_connections` a new connection is accepted and closed at once, with no bytes
  (interop §1).
* At most `max_in_flight` replies of one connection are owed at a time (Pushes being stored
  and what is queued behind them); past that the shell stops reading, which pushes back on a
  client that pipelines faster than we commit. The bound is checked between reads, so one
  read (`READ_SIZE`) more may be taken in.

Never logged: envelope bytes, keys, client addresses.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Protocol

from delta_tables.schema import C
from engine.noise_session import StaticKey
from engine.trueseal.events import (ConnectionClosed, HandshakeComplete, PushReceived,
                                    PushRejected)
from engine.trueseal.ids import PROTOCOL, event_id
from engine.trueseal.push import PushSession
from engine.trueseal.session import State
from relay.config import Settings
from relay.keys import RelayKey
from relay.listener import Listener

log = logging.getLogger("relay.ingress.trueseal_push")

READ_SIZE = 65536
# Metrics reason for a push whose landing commit failed (the connection is closed, no Error).
REASON_STORE_FAILED = "store_failed"


class Appender(Protocol):
    async def append(self, row: dict[str, Any]) -> Any: ...


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def landing_row(recipient: bytes, envelope: bytes, received_at: datetime,
                ttl_seconds: int) -> dict[str, Any]:
    """One LANDING row; the mailbox of a trueseal blob is its recipient key (interop §6)."""
    return {
        C.EVENT_ID: event_id(recipient, envelope),
        C.PROTOCOL: PROTOCOL,
        C.MAILBOX: recipient,
        C.ENVELOPE: envelope,
        C.META: None,
        C.RECEIVED_AT: received_at,
        C.EXPIRES_AT: received_at + timedelta(seconds=ttl_seconds),
    }


class PushServer(Listener):
    name = "trueseal_push"
    protocol = PROTOCOL

    def __init__(self, settings: Settings, appender: Appender, key: RelayKey, *,
                 host: str | None = None, port: int | None = None, max_in_flight: int = 256,
                 clock: Callable[[], datetime] = utc_now):
        self.conf = settings.trueseal
        super().__init__(settings.bind if host is None else host,
                         self.conf.push_port if port is None else port,
                         self.conf.max_connections)
        self.appender = appender
        self._static = StaticKey(key.private_bytes)
        self.max_in_flight = max_in_flight
        self.clock = clock
        self._stores: set[asyncio.Task] = set()   # every connection's, for a clean shutdown

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _PushConnection(self, reader, writer).run()

    async def _drain(self, limit_seconds: float = 10.0) -> None:
        # Pushes being stored get their commit and then their Ack before the connections are
        # ended, so a restart does not turn them into client retries. Pushes still arriving
        # meanwhile are stored too; the bound keeps a flood from holding shutdown forever.
        deadline = asyncio.get_running_loop().time() + limit_seconds
        while self._stores:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            await asyncio.wait(list(self._stores), timeout=left)


class _PushConnection:
    def __init__(self, server: PushServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter):
        self.server = server
        self.reader = reader
        self.writer = writer
        self.core = PushSession(server._static, max_envelope=server.conf.max_envelope)
        self.stores: set[asyncio.Task] = set()

    async def run(self) -> None:
        core, conf = self.core, self.server.conf
        loop = asyncio.get_running_loop()
        deadline = loop.time() + conf.handshake_timeout_seconds
        try:
            while core.state in (State.HANDSHAKE, State.OPEN):
                if core.outstanding >= self.server.max_in_flight and self.stores:
                    await asyncio.wait(self.stores, return_when=asyncio.FIRST_COMPLETED)
                    continue
                timeout = (deadline - loop.time()) if core.state is State.HANDSHAKE else None
                try:
                    data = await asyncio.wait_for(self.reader.read(READ_SIZE), timeout)
                except (TimeoutError, asyncio.TimeoutError):
                    log.info("push handshake timed out", extra={"event": "handshake_timeout",
                                                                "listener": "trueseal_push"})
                    core.close()
                    break
                except (ConnectionError, OSError):
                    core.close()
                    break
                if data:
                    core.receive_data(data)
                else:
                    core.receive_eof()
                self._handle_events()
                await self._flush()
            # DRAINING: the stores under way still owe their replies.
            if self.stores and not core.closed:
                await asyncio.gather(*self.stores, return_exceptions=True)
                await self._flush()
        finally:
            # A store already queued still commits; only its Ack is lost, and the client's
            # retry then lands as a duplicate the stream drops (same event_id).
            core.close()
            self._handle_events()
            data = core.data_to_send()   # e.g. Acks queued before a protocol error
            if data and not self.writer.is_closing():
                self.writer.write(data)
            self.writer.close()

    def _handle_events(self) -> None:
        for ev in self.core.events_received():
            if isinstance(ev, PushReceived):
                task = asyncio.create_task(self._store(ev))
                for tasks in (self.stores, self.server._stores):
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            elif isinstance(ev, PushRejected):
                self.server.rejected[ev.reason] += 1
                log.info("push rejected", extra={"event": "push_rejected",
                                                 "reason": ev.reason, "size": ev.size})
            elif isinstance(ev, HandshakeComplete):
                log.debug("push session open", extra={"event": "push_session_open"})
            elif isinstance(ev, ConnectionClosed):
                log.debug("push session closed", extra={"event": "push_session_closed",
                                                        "reason": ev.reason.value})

    async def _store(self, ev: PushReceived) -> None:
        conf = self.server.conf
        row = landing_row(ev.recipient, ev.envelope, self.server.clock(), conf.ttl_seconds)
        try:
            await self.server.appender.append(row)
        except Exception as exc:
            log.error("push store failed; closing so the client retries",
                      extra={"event": "push_store_failed", "size": len(ev.envelope),
                             "error": type(exc).__name__})
            self.server.rejected[REASON_STORE_FAILED] += 1
            self.core.fail(ev.push_id)
        else:
            self.server.accepted += 1
            self.core.accept(ev.push_id)
        self._handle_events()
        await self._flush()
        if self.core.closed and not self.writer.is_closing():
            self.writer.close()   # wakes the read loop, which then ends the connection

    async def _flush(self) -> None:
        data = self.core.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)
            try:
                await self.writer.drain()
            except (ConnectionError, OSError):
                self.core.close()


async def start_push_server(settings: Settings, appender: Appender, key: RelayKey, *,
                            host: str | None = None, port: int | None = None) -> PushServer:
    server = PushServer(settings, appender, key, host=host, port=port)
    await server.start()
    return server
