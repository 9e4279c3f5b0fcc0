"""asyncio shell of the trueseal push listener (:7701): sockets, timeouts and stores.

The protocol is `engine.trueseal.push.PushSession`; this module only moves bytes and turns
each PushReceived into a landing row. Each Push is stored concurrently with the ones before
it (`appender.append` group-commits them), and the core is told `accept` once the commit has
returned, so an Ack always means durable (DESIGN.md "Ack = durable"); the core keeps the Acks
in Push order. A failed store closes the connection after the replies before it: Error
would tell the real client to drop the blob for good (000), a close makes it retry.

Limits (README "Hostile clients"; settings in [trueseal]):
* Admission (`engine/admission.py` through `runtime/listener.py`): HANDSHAKE until NK is done,
  then UNAUTH (the anonymous session) until the connection ends; `max_handshakes`,
  `max_push_sessions` and their per-address caps, `max_connections` in all. A full stage
  evicts the idlest connection of the address holding the most there; an address at its
  session cap loses its session idle longest (no Push since NK or its last one) and not
  mid-delivery (a Push being stored, an Ack owed) to the newcomer; past
  `max_connections` with no handshake to evict, a connection is closed at once with no bytes
  (interop §1).
* Deadlines, one timer per connection (the client's turn only: none while we owe it a
  reply): `handshake_timeout_seconds` from accept for NK; then `push_idle_timeout_seconds`
  for the next Push to start, from the handshake or the last reply (the real client sends
  its one Push at once and closes after the Ack, interop §6; the public relay has no read
  deadline, and 1,000 idle sessions locked every push out); a Noise message must be whole
  `frame_timeout_seconds` + length / `min_frame_bytes_per_second` after its first byte;
  replies not taken within `write_timeout_seconds` (a client that pipelines and never
  reads) close the connection.
* At most `max_in_flight` replies of one connection are owed at a time (Pushes being stored
  and what is queued behind them); past that the shell stops reading, which pushes back on a
  client that pipelines faster than we commit. The bound is checked between reads, so one
  read (`READ_SIZE`) more may be taken in.
* Every line a client can repeat is rate-limited (`runtime/log_rate.py`).

Never logged: envelope bytes, keys, client addresses.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Protocol

from delta_tables.schema import C
from engine.admission import Cap, Limits, Stage, Ticket
from engine.noise_session import StaticKey
from engine.trueseal.events import (ConnectionClosed, HandshakeComplete, PushReceived,
                                    PushRejected)
from engine.trueseal.ids import PROTOCOL, event_id
from engine.trueseal.push import PushSession
from engine.trueseal.session import State
from runtime.config import Settings
from runtime.handoff import Handoff, HandoffSender, handoff_dir
from runtime.keys import RelayKey
from runtime.listener import Deadline, Listener, RecordClock

log = logging.getLogger("relay.ingress.trueseal_push")

READ_SIZE = 65536
VOUCH_EVERY_SECONDS = 60.0   # a connection storing pushes refreshes its address's standing
# Metrics reason for a push whose landing commit failed (the connection is closed, no Error).
REASON_STORE_FAILED = "store_failed"


class Appender(Protocol):
    async def append(self, row: dict[str, Any]) -> Any: ...


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def push_limits(conf) -> Limits:
    """[trueseal] budgets of the push listener: no AUTH stage (pushes are anonymous)."""
    return Limits(conf.max_connections,
                  handshake=Cap(conf.max_handshakes, conf.max_handshakes_per_address),
                  unauth=Cap(conf.max_push_sessions, conf.max_push_sessions_per_address),
                  auth=Cap(0, 0))


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
                         self.conf.max_connections, limits=push_limits(self.conf),
                         backlog=self.conf.listen_backlog,
                         open_files_reserve=settings.process.open_files_reserve)
        self.appender = appender
        self._static = StaticKey(key.private_bytes)
        self.max_in_flight = max_in_flight
        self.clock = clock
        self._stores: set[asyncio.Task] = set()   # every connection's, for a clean shutdown
        # Each landed push also goes to egress at once (runtime/handoff.py), for a receiver
        # that is online; the stream's inbox row still follows.
        self.handoff = (HandoffSender(handoff_dir(settings.data_dir))
                        if self.conf.early_delivery else None)
        # ... and to egress on other hosts that have its receiver online (runtime/peer_link.py,
        # set by the ingress node when [cluster] peer_listen is on)
        self.peers = None

    async def close(self) -> None:
        await super().close()
        if self.handoff is not None:
            self.handoff.close()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    ticket: Ticket | None) -> None:
        await _PushConnection(self, reader, writer, ticket).run()

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
                 writer: asyncio.StreamWriter, ticket: Ticket | None):
        self.server = server
        self.reader = reader
        self.writer = writer
        self.ticket = ticket
        self.core = PushSession(server._static, max_envelope=server.conf.max_envelope)
        self.stores: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()
        self.records = RecordClock()
        self.deadline = Deadline(self._expired)
        self.turn = self.loop.time()   # since when the client, not the relay, is to act
        self.vouched_at = -VOUCH_EVERY_SECONDS

    async def run(self) -> None:
        core, conf = self.core, self.server.conf
        handshake_deadline = self.loop.time() + conf.handshake_timeout_seconds
        self.deadline.at(handshake_deadline, "handshake")
        try:
            while core.state in (State.HANDSHAKE, State.OPEN):
                if core.outstanding >= self.server.max_in_flight and self.stores:
                    await asyncio.wait(self.stores, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    data = await self.reader.read(READ_SIZE)
                except (ConnectionError, OSError):
                    core.close()
                    break
                if data and core.state is State.HANDSHAKE \
                        and not await self._turn(handshake_deadline):
                    core.close()
                    break
                if data:
                    done = self.records.completed
                    self.records.feed(data, self.loop.time())
                    if self.records.completed != done:
                        self.turn = self.loop.time()
                    core.receive_data(data)
                else:
                    core.receive_eof()
                self._handle_events()
                await self._flush()
                self._arm()
            # DRAINING: the stores under way still owe their replies.
            if self.stores and not core.closed:
                await asyncio.gather(*self.stores, return_exceptions=True)
                await self._flush()
        finally:
            self.deadline.close()   # its callback is this connection's: a cycle
            # A store already queued still commits; only its Ack is lost, and the client's
            # retry then lands as a duplicate the stream drops (same event_id).
            core.close()
            self._handle_events()
            data = core.data_to_send()   # e.g. Acks queued before a protocol error
            if data and not self.writer.is_closing():
                self.writer.write(data)
            self.writer.close()

    def _turn(self, deadline: float):
        """Wait for this address's turn at the handshake gate (runtime/handshake_gate.py),
        within the handshake deadline (whose timer counts the timeout)."""
        return self.server.handshake_turn(self.ticket, deadline, self._handshake_late)

    def _handshake_late(self) -> None:
        if not self.core.closed:
            self._expired("handshake")

    def _arm(self) -> None:
        """The client's deadline for what it is doing now; none while replies are owed."""
        core, conf = self.core, self.server.conf
        if core.state is State.HANDSHAKE:
            return   # the handshake deadline, from accept, stands
        if core.state is not State.OPEN or core.outstanding:
            self.deadline.clear()
            return
        if self.records.partial:
            start = max(self.records.started, self.turn)
            self.deadline.at(start + conf.frame_timeout_seconds
                             + self.records.length / conf.min_frame_bytes_per_second, "frame")
        else:
            self.deadline.at(self.turn + conf.push_idle_timeout_seconds, "idle")

    def _expired(self, what: str) -> None:
        server = self.server
        server.rejected[f"{what}_timeout"] += 1
        if (dropped := server.quiet.allow(("timeout", what))) is not None:
            if what == "handshake":
                log.info("push handshake timed out", extra={
                    "event": "handshake_timeout", "listener": server.name,
                    "suppressed": dropped})
            else:
                log.info("push session timed out", extra={
                    "event": "session_timeout", "listener": server.name,
                    "waiting_for": what, "suppressed": dropped})
        self.core.close()
        self.writer.close()   # the read returns EOF and run() ends

    def _handle_events(self) -> None:
        for ev in self.core.events_received():
            if isinstance(ev, PushReceived):
                self.server.touch(self.ticket)
                task = asyncio.create_task(self._store(ev))
                self.stores.add(task)
                self.server._stores.add(task)
                task.add_done_callback(self._stored)   # one callback: each is a loop turn
            elif isinstance(ev, PushRejected):
                self.server.rejected[ev.reason] += 1
                if (dropped := self.server.quiet.allow(("rejected", ev.reason))) is not None:
                    log.info("push rejected", extra={"event": "push_rejected",
                                                     "reason": ev.reason, "size": ev.size,
                                                     "suppressed": dropped})
            elif isinstance(ev, HandshakeComplete):
                self.turn = self.loop.time()
                if not self.server.advance(self.ticket, Stage.UNAUTH):
                    self.core.close()   # every session of its address is mid-delivery
                    continue
                if self.ticket is not None:
                    # a Push being stored or its Ack owed: never evicted meanwhile
                    self.ticket.delivering = self._delivering
                log.debug("push session open", extra={"event": "push_session_open"})
            elif isinstance(ev, ConnectionClosed):
                log.debug("push session closed", extra={"event": "push_session_closed",
                                                        "reason": ev.reason.value})

    def _delivering(self) -> bool:
        return bool(self.stores) or self.core.outstanding > 0

    def _stored(self, task: asyncio.Task) -> None:
        self.stores.discard(task)
        self.server._stores.discard(task)

    async def _store(self, ev: PushReceived) -> None:
        conf = self.server.conf
        row = landing_row(ev.recipient, ev.envelope, self.server.clock(), conf.ttl_seconds)
        try:
            await self.server.appender.append(row)
        except Exception as exc:
            if (dropped := self.server.quiet.allow("store_failed")) is not None:
                log.error("push store failed; closing so the client retries",
                          extra={"event": "push_store_failed", "size": len(ev.envelope),
                                 "error": type(exc).__name__, "suppressed": dropped})
            self.server.rejected[REASON_STORE_FAILED] += 1
            self.core.fail(ev.push_id)
        else:
            if self.server.handoff is not None:   # egress may deliver it before its row
                h = Handoff(PROTOCOL, ev.recipient, row[C.EVENT_ID], row[C.EXPIRES_AT],
                            ev.envelope)
                self.server.handoff.send(h)
                if self.server.peers is not None:
                    self.server.peers.send(h)
            self.server.accepted += 1
            now = self.loop.time()
            if now - self.vouched_at > VOUCH_EVERY_SECONDS:
                # a real client: its address's handshakes go first a while (a keyed hash
                # per call: once a minute per connection is enough to stay known)
                self.server.vouch(self.ticket)
                self.vouched_at = now
            self.core.accept(ev.push_id)
        self._handle_events()
        # One turn of the loop first: the other pushes of the same group commit resume in
        # it and queue their Acks too, so the first of them to flush writes them all (one
        # send instead of one per push; the rest find nothing left to send).
        await asyncio.sleep(0)
        await self._flush()
        if not self.core.outstanding:
            self.turn = self.loop.time()   # the last reply is out: the client's turn
        self._arm()
        if self.core.closed and not self.writer.is_closing():
            self.writer.close()   # wakes the read loop, which then ends the connection

    async def _flush(self) -> None:
        await self.server.send(self.writer, self.core.data_to_send(), self.core.close,
                               self.server.conf.write_timeout_seconds)


async def start_push_server(settings: Settings, appender: Appender, key: RelayKey, *,
                            host: str | None = None, port: int | None = None) -> PushServer:
    server = PushServer(settings, appender, key, host=host, port=port)
    await server.start()
    return server
