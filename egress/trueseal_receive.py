"""asyncio shell of the trueseal receive listener (:7700): sockets, timers and the hub.

The protocol is `engine.trueseal.receive.ReceiveSession`. After the XX handshake the device's
static key is its mailbox (interop §3); the shell opens a `DeliverySession` on the hub and runs
three tasks per connection until one of them ends:

* reader: bytes into the core; each DeliverAck becomes `session.ack(blob_id)`, which the hub
  scopes to this mailbox (the public relay deletes any id from anyone, interop §7);
* deliverer: `session.next()` in cursor order, one Deliver per envelope, blob_id = seq;
  the hub hands each seq to a session once, so a blob is not re-sent within one session;
* heartbeat: after `heartbeat_idle_seconds` with nothing received, send a Heartbeat; if
  nothing at all arrives within `heartbeat_timeout_seconds`, close (the real client echoes,
  interop §7).

Writes are serialised without a lock: the core encrypts into its own buffer in nonce order,
and `data_to_send()` + `writer.write()` run with no await in between, so frames from the
deliverer and the heartbeat echo can never interleave or swap nonces (the public relay's
race, interop §7).

On close: acks already under way finish, then `session.close()` releases what was delivered
and not acked, for the next session.

Limits (README "Hostile clients"; settings in [trueseal]):
* Admission (`engine/admission.py` through `runtime/listener.py`): HANDSHAKE until XX is done,
  then AUTH (the device key is proven; there is no anonymous stage): `max_handshakes`,
  `max_receive_sessions` and their per-address caps, `max_connections` in all. A full
  handshake stage evicts the oldest handshake of the address holding the most. Any key
  passes XX, so receive sessions yield by fair share: a full stage gives a new session the
  idlest of an address holding at least two more than the newcomer's. An address at its cap,
  or a device key at `max_receive_sessions_per_key`, loses its session idle longest (no
  Deliver, no DeliverAck: heartbeats do not count) holding no unacked Deliver; with none
  such, a new one is closed right after XX.
* Deadlines: `handshake_timeout_seconds` for XX; after it the heartbeat bounds silence
  (only whole frames count as an answer), and a Noise message must be whole
  `frame_timeout_seconds` + length / `min_frame_bytes_per_second` after its first byte, so
  a half-sent frame, or one dripped a byte at a time, does not hold a session; a Deliver or
  Heartbeat not taken within `write_timeout_seconds` (a client that stopped reading) closes
  the session, whose blobs then go to the next one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from engine.admission import Cap, Limits, Stage, Ticket
from engine.noise_session import StaticKey
from engine.trueseal.events import (ConnectionClosed, DeliverAckReceived, HandshakeComplete,
                                    HeartbeatReceived)
from engine.trueseal.ids import PROTOCOL
from engine.trueseal.receive import ReceiveSession
from engine.trueseal.session import State
from runtime.config import Settings
from runtime.keys import RelayKey
from runtime.listener import Deadline, Listener, RecordClock

log = logging.getLogger("relay.egress.trueseal_receive")

READ_SIZE = 65536


class Hub(Protocol):   # egress.pending.MailboxHub
    def open_session(self, protocol: str, mailbox: bytes): ...


def receive_limits(conf) -> Limits:
    """[trueseal] budgets of the receive listener: after XX a session is AUTH at once."""
    return Limits(conf.max_connections,
                  handshake=Cap(conf.max_handshakes, conf.max_handshakes_per_address),
                  unauth=Cap(0, 0),
                  auth=Cap(conf.max_receive_sessions, conf.max_receive_sessions_per_address),
                  per_identity=conf.max_receive_sessions_per_key)


class ReceiveServer(Listener):
    name = "trueseal_receive"
    protocol = PROTOCOL

    def __init__(self, settings: Settings, hub: Hub, key: RelayKey, *,
                 host: str | None = None, port: int | None = None):
        self.conf = settings.trueseal
        super().__init__(settings.bind if host is None else host,
                         self.conf.receive_port if port is None else port,
                         self.conf.max_connections, limits=receive_limits(self.conf),
                         backlog=self.conf.listen_backlog,
                         open_files_reserve=settings.process.open_files_reserve)
        self.hub = hub
        self._static = StaticKey(key.private_bytes)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    ticket: Ticket | None) -> None:
        await _ReceiveConnection(self, reader, writer, ticket).run()


class _ReceiveConnection:
    def __init__(self, server: ReceiveServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, ticket: Ticket | None):
        self.server = server
        self.conf = server.conf
        self.reader = reader
        self.writer = writer
        self.ticket = ticket
        self.core = ReceiveSession(server._static)
        self.session = None
        self.acks: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()
        self.last_rx = self.loop.time()   # the last whole frame (a drip is no answer)
        self.records = RecordClock()
        self.deadline = Deadline(self._expired)

    async def run(self) -> None:
        tasks: list[asyncio.Task] = []
        try:
            if not await self._handshake():
                return
            tasks = [asyncio.create_task(self._read_loop(), name="trueseal-read"),
                     asyncio.create_task(self._deliver_loop(), name="trueseal-deliver"),
                     asyncio.create_task(self._heartbeat_loop(), name="trueseal-heartbeat")]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("receive session task failed",
                              extra={"event": "receive_task_failed", "task": task.get_name()},
                              exc_info=task.exception())
        finally:
            try:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                # Let durable acks finish before the unacked claims are released.
                await asyncio.gather(*self.acks, return_exceptions=True)
            finally:
                self.deadline.close()   # its callback is this connection's: a cycle
                if self.session is not None:
                    self.session.close()
                self.core.close()
                self._handle_events()
                data = self.core.data_to_send()   # e.g. a Deliver queued just before the close
                if data and not self.writer.is_closing():
                    self.writer.write(data)
                self.writer.close()

    async def _handshake(self) -> bool:
        deadline = self.loop.time() + self.conf.handshake_timeout_seconds
        while self.core.state is State.HANDSHAKE:
            try:
                data = await asyncio.wait_for(self.reader.read(READ_SIZE),
                                              deadline - self.loop.time())
            except (TimeoutError, asyncio.TimeoutError):
                self.server.rejected["handshake_timeout"] += 1
                if (dropped := self.server.quiet.allow(("timeout", "handshake"))) is not None:
                    log.info("receive handshake timed out", extra={
                        "event": "handshake_timeout", "listener": "trueseal_receive",
                        "suppressed": dropped})
                return False
            except (ConnectionError, OSError):
                return False
            if data and not await self._turn(deadline):
                return False
            self._feed(data)
            await self._flush()
        return self.core.state is State.OPEN

    def _turn(self, deadline: float):
        """Wait for this address's turn at the handshake gate (runtime/handshake_gate.py),
        within the handshake deadline."""
        return self.server.handshake_turn(self.ticket, deadline, self._handshake_late)

    def _handshake_late(self) -> None:
        self.server.rejected["handshake_timeout"] += 1

    def _feed(self, data: bytes) -> None:
        now = self.loop.time()
        if data:
            done = self.records.completed
            self.records.feed(data, now)
            if self.records.completed != done:
                self.last_rx = now
            self.core.receive_data(data)
        else:
            self.core.receive_eof()
        self._handle_events()
        if self.records.partial and self.core.state is State.OPEN:
            self.deadline.at(self.records.started + self.conf.frame_timeout_seconds
                             + self.records.length / self.conf.min_frame_bytes_per_second,
                             "frame")
        else:
            self.deadline.clear()

    def _expired(self, what: str) -> None:
        self.server.rejected[f"{what}_timeout"] += 1
        if (dropped := self.server.quiet.allow(("timeout", what))) is not None:
            log.info("receive session timed out", extra={
                "event": "session_timeout", "listener": self.server.name,
                "waiting_for": what, "suppressed": dropped})
        self.writer.close()   # the read loop sees EOF inside a frame: truncated, closed

    def _handle_events(self) -> None:
        for ev in self.core.events_received():
            if isinstance(ev, DeliverAckReceived):
                self.server.touch(self.ticket)
                task = asyncio.create_task(self._ack(ev.blob_id))
                self.acks.add(task)
                task.add_done_callback(self.acks.discard)
            elif isinstance(ev, HandshakeComplete):
                # The device key is the identity (max_receive_sessions_per_key): any key
                # passes XX, so it buys no protection from eviction, only a budget.
                if not self.server.advance(self.ticket, Stage.AUTH, ev.remote_static.hex()):
                    self.core.close()   # every session of its address or key mid-delivery
                    continue
                # Opened here, before any frame that followed msg 3 in the same read is handled.
                self.session = self.server.hub.open_session(PROTOCOL, ev.remote_static)
                if self.ticket is not None:
                    # a Deliver not yet acked: never evicted meanwhile
                    session = self.session
                    self.ticket.delivering = lambda: session.holds_claims
                log.debug("receive session open", extra={"event": "receive_session_open"})
            elif isinstance(ev, HeartbeatReceived):
                pass   # the core already echoed it, or it answered ours
            elif isinstance(ev, ConnectionClosed):
                log.debug("receive session closed", extra={"event": "receive_session_closed",
                                                           "reason": ev.reason.value})

    async def _ack(self, blob_id: int) -> None:
        try:
            if not await self.session.ack(blob_id):
                log.debug("DeliverAck for a blob not pending here", extra={"event": "ack_ignored"})
        except Exception as exc:
            # Not acked means redelivered later; the client dedups (000 "Deliver").
            if (dropped := self.server.quiet.allow("ack_failed")) is not None:
                log.error("ack failed", extra={"event": "ack_failed",
                                               "error": type(exc).__name__,
                                               "suppressed": dropped})

    async def _flush(self) -> None:
        # nonce order: the bytes are written before any other task runs
        await self.server.send(self.writer, self.core.data_to_send(), self.core.close,
                               self.server.conf.write_timeout_seconds)

    async def _read_loop(self) -> None:
        while self.core.state is State.OPEN:
            try:
                data = await self.reader.read(READ_SIZE)
            except (ConnectionError, OSError):
                return
            self._feed(data)
            await self._flush()

    async def _deliver_loop(self) -> None:
        while self.core.state is State.OPEN:
            for env in await self.session.next():
                try:
                    if not self.core.deliver(env.seq, env.envelope):
                        return
                except ValueError:
                    log.error("envelope cannot be delivered as one frame",
                              extra={"event": "deliver_skipped", "size": len(env.envelope)})
                    continue
                self.server.touch(self.ticket)
                await self._flush()

    async def _heartbeat_loop(self) -> None:
        idle, timeout = self.conf.heartbeat_idle_seconds, self.conf.heartbeat_timeout_seconds
        while self.core.state is State.OPEN:
            probe = self._superseded_with_claims()
            wait = 0 if probe else self.last_rx + idle - self.loop.time()
            if wait > 0:
                await self._sleep_unless_superseded(wait)
                continue
            self.core.send_heartbeat()
            await self._flush()
            sent = self.loop.time()
            # A superseded session holding blobs delays the device's new session: ask sooner.
            await asyncio.sleep(min(timeout, self.conf.superseded_probe_seconds)
                                if probe else timeout)
            if self.last_rx < sent:
                self.server.rejected["heartbeat_timeout"] += 1
                if (dropped := self.server.quiet.allow(("heartbeat", probe))) is not None:
                    log.info("heartbeat not answered; closing",
                             extra={"event": "heartbeat_timeout", "superseded": probe,
                                    "suppressed": dropped})
                return
            if probe:
                self.session.superseded.clear()

    def _superseded_with_claims(self) -> bool:
        return (self.session is not None and self.session.superseded.is_set()
                and self.session.holds_claims)

    async def _sleep_unless_superseded(self, seconds: float) -> None:
        if self.session is None:
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(self.session.superseded.wait(), seconds)
        except (TimeoutError, asyncio.TimeoutError):
            pass
        if self.session.superseded.is_set() and not self.session.holds_claims:
            self.session.superseded.clear()   # nothing held back: nothing to probe for


async def start_receive_server(settings: Settings, hub: Hub, key: RelayKey, *,
                               host: str | None = None, port: int | None = None) -> ReceiveServer:
    server = ReceiveServer(settings, hub, key, host=host, port=port)
    await server.start()
    return server
