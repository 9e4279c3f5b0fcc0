"""asyncio shell of the Heya listener (:8337, TLS 1.3, a client certificate from everyone).

The protocol is `engine.heya.session.HeyaSession`; this module owns the socket, the clocks,
the stores and the views, and carries out each command the core reports:

* TLS 1.3 through pyOpenSSL (`runtime/tls_stream.py`); any client certificate is accepted and
  its DER's SHA-256 is the identity (`runtime/tls.py`, interop §1).
* SEND is checked against the send token (known, not revoked, `start <= now <= end`: interop
  §5.1) and stored as a landing row (protocol "heya", mailbox = send token, envelope = body)
  through the ingress `GroupCommitAppender`; RECV goes out only after `append` returned, i.e.
  after the landing commit (DESIGN.md "Ack = durable"). SENDs of one connection are stored
  concurrently (`max_in_flight`); the core keeps the replies in command order.
* Sequence numbers are the inbox cursors the stream assigns (`egress/heya_inbox.py`); HAVE
  follows the inbox commit and reaches every connected session of the owner.
* Control commands go through `delta_tables/heya_control.py` (durable before the reply).
* A command that cannot be carried out (unknown inbox token, a send token that is not
  yours / revoked / outside its times, a push token you never registered, ...) is refused:
  the connection closes after the replies owed before it (there is no error line in Heya).

Limits (interop §5.9, §5.10: the public server has one global command goroutine, blocking
writes with no deadline, a 1 s body deadline and no handshake deadline):

* `handshake_timeout_seconds` for TLS; `idle_timeout_seconds` between commands;
  `command_timeout_seconds` + length / `min_body_bytes_per_second` from a command's first byte
  to its last; `write_timeout_seconds` for any write to drain. Each connection has its own
  tasks and deadlines, so a slow or stalled client only ever closes itself.
* Reading stops while `max_in_flight` replies are owed or unwritten output passes
  `OUTPUT_HIGH_WATER`; `max_in_flight_bytes` bounds the SEND bodies being stored by all
  connections together.
* Admission (README "Hostile clients"; `engine/admission.py` through `runtime/listener.py`),
  counted from TCP accept, TLS handshakes included: HANDSHAKE until TLS is done; then AUTH
  if the certificate is a mailbox, else UNAUTH. An UNAUTH session is promoted to AUTH when
  its INCO succeeds (or another session of its certificate makes it a mailbox) and at its
  first SEND with a valid send token (before the store); it is never demoted (DALL leaves
  it AUTH: it proved a mailbox once). UNAUTH sessions are closed `unauth_timeout_seconds`
  after TLS. Full HANDSHAKE / UNAUTH stages evict the oldest of the address holding the
  most; AUTH yields only by fair share (a promotion into a full AUTH takes the oldest of an
  address holding at least two more than this one's), and when it (or the address's share)
  is full otherwise a promotion is not made: the session stays UNAUTH, served, but evictable
  and under the UNAUTH deadline.
  An address at its UNAUTH or AUTH cap, or a certificate at `max_sessions_per_certificate`,
  loses its session idle longest in application terms (a command other than PING, a HAVE
  sent) and not mid-delivery (`_delivering`) to the newcomer; with every one mid-delivery,
  the newcomer is closed right after TLS, before the greeting.
* A closed connection is closed for real: close_notify, then the transport is aborted if the
  peer does not let it finish within the write timeout (no CLOSE-WAIT leak, interop §0).

Never logged: tokens, certificate digests, push tokens, bodies, client addresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from delta_tables.heya_control import HeyaControl
from delta_tables.layout import Layout
from delta_tables.schema import C
from egress.heya_inbox import HeyaInbox
from egress.inbox_tail import InboxTail
from engine.admission import Cap, Limits, Stage, Ticket
from engine.heya import frames
from engine.heya.events import CommandReceived, ConnectionClosed
from engine.heya.frames import (MAX_UINT, Auth, Dall, Deau, Extd, Inco, Iosa, Iosd, Iosl,
                                ListTokens, Send, Trim, Want)
from engine.heya.ids import PROTOCOL, event_id
from engine.heya.session import HeyaSession, Phase
from runtime import tls, tls_stream
from runtime.config import Settings
from runtime.listener import Listener
from runtime.push_desk import PushDesk, desk_dir

from .push_backends import HeyaDesk

log = logging.getLogger("relay.ingress.heya")

READ_SIZE = 65536
OUTPUT_HIGH_WATER = 1 << 20   # unwritten reply bytes past which a connection stops reading


def heya_limits(conf) -> Limits:
    """[heya] budgets: TLS handshakes, strangers (UNAUTH), mailboxes and senders (AUTH)."""
    return Limits(conf.max_connections,
                  handshake=Cap(conf.max_handshakes, conf.max_handshakes_per_address),
                  unauth=Cap(conf.max_unauth_sessions, conf.max_unauth_sessions_per_address),
                  auth=Cap(conf.max_auth_sessions, conf.max_auth_sessions_per_address),
                  per_identity=conf.max_sessions_per_certificate)


def landing_row(token: bytes, digest: bytes, body: bytes, received_at: datetime,
                ttl_seconds: int) -> dict[str, Any]:
    """One LANDING row: the mailbox of a Heya message is its send token."""
    return {
        C.EVENT_ID: event_id(token, digest),
        C.PROTOCOL: PROTOCOL,
        C.MAILBOX: token,
        C.ENVELOPE: body,
        C.META: None,
        C.RECEIVED_AT: received_at,
        C.EXPIRES_AT: received_at + timedelta(seconds=ttl_seconds),
    }


class _ByteBudget:
    """Bytes of SEND bodies being stored, all connections together."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.limit)
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class HeyaServer(Listener):
    name = "heya"
    protocol = PROTOCOL

    def __init__(self, settings: Settings, appender, *, fsync: bool = True,
                 host: str | None = None, port: int | None = None,
                 clock: Callable[[], float] = time.time):
        """`appender`: the node's landing `GroupCommitAppender`. `clock`: unix seconds (send
        token times; tests move it)."""
        self.conf = settings.heya
        super().__init__(settings.bind if host is None else host,
                         self.conf.port if port is None else port, self.conf.max_connections,
                         limits=heya_limits(self.conf), backlog=self.conf.listen_backlog,
                         open_files_reserve=settings.process.open_files_reserve)
        self.settings = settings
        self.appender = appender
        self.clock = clock
        self.layout = Layout.of(settings)
        self.control = HeyaControl(self.layout, fsync=fsync)
        self.push_desk: PushDesk | None = None
        self.inbox = HeyaInbox(self.layout.inbox, self.control, cache_bytes=self.conf.cache_bytes)
        self.tail = InboxTail(self.layout.inbox, self.layout.acks, self.inbox,
                              protocols={PROTOCOL})
        self.cert_file, self.key_file = tls.load_or_create_server_cert(
            settings.data_dir, self.conf.cert_file, self.conf.key_file)
        self.ssl_context = tls.server_context(self.cert_file, self.key_file)
        self.budget = _ByteBudget(self.conf.max_in_flight_bytes)
        self._stores: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        self._tail_task: asyncio.Task | None = None

    async def _start_server(self) -> tls_stream.TLSServer:
        # Our own accept loop (runtime/listener.py) with TLS streams on it: a connection is
        # admitted (and counted in HANDSHAKE) at TCP accept, before it costs a TLS engine.
        self._tls = tls_stream.Acceptor(
            self.ssl_context, lambda reader, writer: self._on_connect(reader, writer,
                                                                      writer.tag),
            handshake_timeout=self.conf.handshake_timeout_seconds,
            on_handshake_failed=self._handshake_failed,
            on_lost=lambda stream: self.release(stream.tag), gate=self.gate)
        return tls_stream.TLSServer(self._accept_server(), self._tls)

    def _protocol_for(self, ticket: Ticket) -> tls_stream.TLSStream:
        stream = self._tls(ticket)
        ticket.closer = stream.abort
        return stream

    def _handshake_failed(self, kind: str, detail: str) -> None:
        """A TLS handshake that failed or timed out; a client that left during it is no news."""
        if kind == "timeout":
            self.rejected["handshake_timeout"] += 1
            if (dropped := self.quiet.allow(("timeout", "handshake"))) is not None:
                log.info("heya TLS handshake timed out", extra={
                    "event": "handshake_timeout", "listener": self.name,
                    "suppressed": dropped})
        elif kind == "busy":
            self.rejected["handshake_queue_full"] += 1
        elif kind == "tls":
            log.debug("heya TLS handshake failed", extra={"event": "heya_closed",
                                                          "reason": "tls", "detail": detail})
            self.rejected["tls_handshake"] += 1

    async def start(self) -> None:
        await asyncio.to_thread(self.layout.ensure_shared_tables)
        await self.control.load()
        self.control.start_following(
            self.settings.ingress.control_follow_seconds)   # the other Heya hosts' changes
        self.tail.version = await self.inbox.bootstrap()
        self._stop = asyncio.Event()
        self._tail_task = asyncio.create_task(
            self.tail.follow(self.settings, self._stop, "heya"),
            name="heya-inbox-tail")
        self.push_desk = await PushDesk.open(desk_dir(self.settings.data_dir), "heya",
                                             HeyaDesk(self.inbox, self.control))
        await super().start()

    async def close(self) -> None:
        if self.push_desk is not None:
            self.push_desk.close()
            self.push_desk = None
        await self.control.stop_following()
        await super().close()
        self._stop.set()
        if self._tail_task is not None:
            await self._tail_task
            self._tail_task = None

    async def _after_connections_closed(self) -> None:
        # Stores under way are queued for commit; the node closes the appender after this.
        await asyncio.gather(*self._stores, return_exceptions=True)

    async def serve(self, reader: tls_stream.TLSStream, writer: tls_stream.TLSStream,
                    ticket: Ticket | None) -> None:
        await _HeyaConnection(self, reader, writer, ticket).run()

    def set_mailbox(self, owner: bytes, mailbox: bool, origin: "_HeyaConnection") -> None:
        """INCO / DALL on one connection: the certificate's other connections follow."""
        for session in self.inbox.sessions_of(owner):
            if session is not origin:
                session.core.set_mailbox(mailbox)
                if mailbox:
                    session.promote()


# Each command's method of `_HeyaConnection`, by name: a table of bound methods built per
# connection would refer back to it, a reference cycle that only the full collector frees
# (thousands at once when a flood leaves, with the event loop stopped meanwhile).
HANDLERS = {
    Inco: "_inco", Auth: "_auth", Deau: "_deau", Extd: "_extd", ListTokens: "_list",
    Send: "_send", Want: "_want", Trim: "_trim", Iosa: "_iosa", Iosd: "_iosd", Iosl: "_iosl",
    Dall: "_dall",
}


class _HeyaConnection:
    def __init__(self, server: HeyaServer, reader: tls_stream.TLSStream,
                 writer: tls_stream.TLSStream, ticket: Ticket | None):
        self.server = server
        self.ticket = ticket
        self.conf = server.conf
        self.control = server.control
        self.inbox = server.inbox
        self.reader = reader
        self.writer = writer
        self.core = HeyaSession(max_body=self.conf.max_body)
        self.owner = b""
        self.loop = asyncio.get_running_loop()
        self.stores: set[asyncio.Task] = set()
        self._wake = asyncio.Event()       # output to write
        self._drained = asyncio.Event()    # the writer caught up
        self._progress = asyncio.Event()   # a store finished
        self._aborted = False
        self.unauth_until: float | None = None   # UNAUTH: closed at this loop time

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        der = self.writer.peer_certificate()
        if not der:   # unreachable (VERIFY_FAIL_IF_NO_PEER_CERT); never serve without identity
            self.writer.transport.abort()
            return
        self.owner = tls.cert_digest(der)
        mailbox = await self.control.find_mailbox(self.owner)   # INCO'd here or elsewhere
        if not self._admit(mailbox):
            self.writer.transport.abort()   # this address holds its share of strangers
            return
        last = ([(t.token, self.inbox.next_seq(t.token))
                 for t in self.control.tokens_of(self.owner)] if mailbox else [])
        # Registered and greeted with no await in between: no HAVE can fall in the gap.
        self.inbox.register(self.owner, self)
        self.core.greet(last, mailbox)
        writer_task = asyncio.create_task(self._write_loop(), name="heya-write")
        self._wake.set()
        try:
            await self._read_loop()
        finally:
            try:
                if self.stores and not self.core.closed:
                    # RECVs owed for SENDs being stored still go out (QUIT/EOF drain).
                    await asyncio.gather(*self.stores, return_exceptions=True)
                if not self.core.closed:
                    self.core.close()
                self._wake.set()
                await writer_task
            finally:
                self.inbox.unregister(self.owner, self)
                if not writer_task.done():
                    writer_task.cancel()
                await self._close_transport()

    def _admit(self, mailbox: bool) -> bool:
        """After TLS: AUTH for a mailbox if there is room, else UNAUTH (with its deadline).
        The certificate digest is the identity (`max_sessions_per_certificate`): any
        self-signed certificate passes (interop §1), so it buys no protection from eviction."""
        identity = self.owner.hex()
        if self.ticket is not None:
            self.ticket.delivering = self._delivering
        if mailbox and self.server.advance(self.ticket, Stage.AUTH, identity):
            return True
        if not self.server.advance(self.ticket, Stage.UNAUTH, identity):
            return False
        self.unauth_until = self.loop.time() + self.conf.unauth_timeout_seconds
        return True

    def _delivering(self) -> bool:
        """Mid-delivery, not to be evicted: a SEND being stored (its RECV owed), a reply owed
        (a WANT's GIVE) or output not yet written (PONGs are owed for an instant only)."""
        return bool(self.stores) or self.core.outstanding > 0 or self.core.buffered_output > 0

    def promote(self) -> None:
        """The certificate became a mailbox, or sent with a valid send token: AUTH if there
        is room; if not, the session stays UNAUTH (served, evictable, deadline kept)."""
        if self.unauth_until is not None and self.server.advance(self.ticket, Stage.AUTH):
            self.unauth_until = None

    def notify_have(self, token: bytes, next_seq: int) -> None:
        if self.core.have(token, next_seq):
            self.server.touch(self.ticket)
            self._wake.set()

    async def _close_transport(self) -> None:
        if self._aborted:
            return
        if not self.writer.transport.is_closing():
            self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), self.conf.write_timeout_seconds)
        except (asyncio.TimeoutError, TimeoutError, ConnectionError, OSError):
            self._abort()

    def _abort(self) -> None:
        self._aborted = True
        self.core.close()
        self.writer.transport.abort()
        self._drained.set()
        self._progress.set()

    # --- reading -------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        conf = self.conf
        idle_since = self.loop.time()
        started = idle_since
        while self.core.phase is Phase.READY:
            await self._room()
            if self.core.phase is not Phase.READY:
                return
            if self.core.partial:
                deadline = (started + conf.command_timeout_seconds
                            + self.core.body_length / conf.min_body_bytes_per_second)
                what = "command"
            else:
                deadline = idle_since + conf.idle_timeout_seconds
                what = "idle"
            if self.unauth_until is not None and self.unauth_until < deadline:
                deadline, what = self.unauth_until, "auth"
            try:
                data = await asyncio.wait_for(self.reader.read(READ_SIZE),
                                              max(0.0, deadline - self.loop.time()))
            except (asyncio.TimeoutError, TimeoutError):
                if what == "auth" and self.unauth_until is None:
                    continue   # promoted while the read waited
                self.server.rejected[f"{what}_timeout"] += 1
                if (dropped := self.server.quiet.allow(("timeout", what))) is not None:
                    log.info("heya connection timed out", extra={
                        "event": "heya_timeout", "waiting_for": what, "suppressed": dropped})
                self.core.close()
                return
            except (ConnectionError, OSError):
                self.core.close()
                return
            arrived = self.loop.time()
            was_partial, before = self.core.partial, self.core.commands_completed
            if data:
                self.core.receive_data(data)
            else:
                self.core.receive_eof()
            if self.core.partial and (not was_partial or self.core.commands_completed != before):
                started = arrived   # a new command began in this read
            await self._handle_events()
            self._wake.set()
            if not self.core.partial:
                idle_since = self.loop.time()

    async def _room(self) -> None:
        """Wait while this connection owes `max_in_flight` replies or has more than
        `OUTPUT_HIGH_WATER` bytes unwritten: a client that pipelines faster than it reads
        (WANT after WANT) is held at its own socket, in bounded memory."""
        while not (self._aborted or self.core.closed):
            if self.core.outstanding >= self.conf.max_in_flight and self.stores:
                self._progress.clear()
                await self._progress.wait()
            elif (self.core.buffered_output + self.writer.transport.get_write_buffer_size()
                  > OUTPUT_HIGH_WATER):
                self._drained.clear()
                self._wake.set()
                await self._drained.wait()
            else:
                return

    async def _handle_events(self) -> None:
        for ev in self.core.events_received():
            if isinstance(ev, CommandReceived):   # PING never comes here (the core PONGs)
                self.server.touch(self.ticket)
                await self._room()
                if self.core.is_live(ev.request_id):
                    await getattr(self, HANDLERS[type(ev.command)])(ev.request_id, ev.command)
                    self._wake.set()
            elif isinstance(ev, ConnectionClosed):
                if ev.reason.value not in ("eof", "quit", "local", "refused"):
                    self.server.rejected[ev.reason.value] += 1
                log.debug("heya connection closing", extra={"event": "heya_closed",
                                                            "reason": ev.reason.value})

    def _refuse(self, request_id: int, reason: str) -> None:
        if (dropped := self.server.quiet.allow(("refused", reason))) is not None:
            log.info("heya command refused", extra={"event": "heya_refused", "reason": reason,
                                                    "suppressed": dropped})
        self.server.rejected[reason] += 1
        self.core.refuse(request_id)

    # --- writing -------------------------------------------------------------------------------
    async def _write_loop(self) -> None:
        """The only writer of this connection: whole replies and HAVEs in core order."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            data = self.core.data_to_send()
            if data and not self._aborted:
                self.writer.write(data)
            if not self._aborted and (data or self.writer.transport.get_write_buffer_size()):
                try:
                    await asyncio.wait_for(self.writer.drain(), self.conf.write_timeout_seconds)
                except (asyncio.TimeoutError, TimeoutError):
                    if (dropped := self.server.quiet.allow("write_timeout")) is not None:
                        log.info("heya client not reading; closing", extra={
                            "event": "heya_write_timeout", "suppressed": dropped})
                    self.server.rejected["write_timeout"] += 1
                    self._abort()
                    return
                except (ConnectionError, OSError):
                    self._abort()
                    return
            self._drained.set()
            if self.core.closed or self._aborted:
                if not self._aborted and not self.writer.transport.is_closing():
                    self.writer.close()   # close_notify; wakes a read still waiting
                return

    # --- commands ------------------------------------------------------------------------------
    async def _mailbox(self) -> bool:
        """The control plane is authoritative (another connection, here or on another host,
        may have run INCO or DALL)."""
        return await self.control.find_mailbox(self.owner)

    async def _inco(self, rid: int, cmd: Inco) -> None:
        if not await self.control.inco(self.owner, cmd.token):
            self._refuse(rid, "inbox_token")   # README "INCO": unknown -> close
            return
        self.server.set_mailbox(self.owner, True, self)
        self.promote()
        self.core.reply(rid, frames.inco(cmd.token))

    async def _auth(self, rid: int, cmd: Auth) -> None:
        # interop §5.1: the public server accepts end < start and ends in the past.
        if not await self._mailbox() or cmd.start > cmd.end or cmd.end < int(self.server.clock()):
            self._refuse(rid, "auth")
            return
        tok = await self.control.auth(self.owner, cmd.start, cmd.end)
        if tok is None:                # its DALL under way, on this host or another
            self._refuse(rid, "auth")
            return
        self.core.reply(rid, frames.auth(tok.token, cmd.start, cmd.end))

    async def _deau(self, rid: int, cmd: Deau) -> None:
        if not await self.control.deau(self.owner, cmd.token):
            self._refuse(rid, "send_token")   # interop §5.12: not yours / already revoked
            return
        self.inbox.forget(cmd.token)
        self.core.reply(rid, frames.deau(cmd.token))

    async def _extd(self, rid: int, cmd: Extd) -> None:
        end = await self.control.extd(self.owner, cmd.token, cmd.seconds, MAX_UINT)
        if end is None:
            self._refuse(rid, "send_token")
            return
        self.core.reply(rid, frames.extd(cmd.token, end))

    async def _list(self, rid: int, cmd: ListTokens) -> None:
        entries = [(t.token, self.inbox.next_seq(t.token), t.start, t.end)
                   for t in self.control.tokens_of(self.owner)]
        self.core.reply(rid, frames.list_tokens(entries))

    async def _send(self, rid: int, cmd: Send) -> None:
        tok = await self.control.find_send_token(cmd.token)   # AUTH'd here or elsewhere
        if tok is None or not tok.valid_at(self.server.clock()):
            self._refuse(rid, "send_token")   # README "SEND": error -> close
            return
        self.promote()   # a send-token holder
        while len(self.stores) >= self.conf.max_in_flight:
            await asyncio.wait(self.stores, return_when=asyncio.FIRST_COMPLETED)
        held = await self.server.budget.acquire(len(cmd.body))
        task = asyncio.create_task(self._store(rid, cmd, held))
        for tasks in (self.stores, self.server._stores):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _store(self, rid: int, cmd: Send, held: int) -> None:
        row = landing_row(cmd.token, cmd.digest, cmd.body, datetime.now(timezone.utc),
                          self.conf.ttl_seconds)
        try:
            await self.server.appender.append(row)
        except Exception as exc:
            # No RECV: the client's retry is the only way the message can still arrive.
            if (dropped := self.server.quiet.allow("store_failed")) is not None:
                log.error("heya store failed; closing", extra={
                    "event": "heya_store_failed", "size": len(cmd.body),
                    "error": type(exc).__name__, "suppressed": dropped})
            self._refuse(rid, "store_failed")
        else:
            self.server.accepted += 1
            self.core.reply(rid, frames.recv(cmd.digest))
        finally:
            await self.server.budget.release(held)
            self._progress.set()
            self._wake.set()

    async def _want(self, rid: int, cmd: Want) -> None:
        # Only the token's owner reads its messages; anyone else hears GONE (interop §3 WANT).
        body = None
        if await self.control.owns(self.owner, cmd.token):
            body = await self.inbox.body(cmd.token, cmd.seq)
        self.core.reply(rid, frames.gone(cmd.token, cmd.seq) if body is None
                        else frames.give(cmd.token, cmd.seq, body))

    async def _trim(self, rid: int, cmd: Trim) -> None:
        # interop §5.2: scoped to its token (the public server trims every token). Only
        # messages that exist are trimmed, so a TRIM ahead of the stream never eats later ones.
        if not await self.control.owns(self.owner, cmd.token):
            self._refuse(rid, "send_token")
            return
        before = self.control.trimmed(cmd.token)
        up_to = min(cmd.seq, self.inbox.next_seq(cmd.token) - 1)
        count = max(0, up_to - before)
        if count and not await self.control.trim(self.owner, cmd.token, up_to):
            self._refuse(rid, "send_token")
            return
        self.inbox.trim(cmd.token, up_to)
        self.core.reply(rid, frames.trim(cmd.token, cmd.seq, count))

    async def _iosa(self, rid: int, cmd: Iosa) -> None:
        if not await self._mailbox():
            self._refuse(rid, "not_a_mailbox")   # README "IOSA ... non-mailbox will close"
            return
        if not await self.control.iosa(self.owner, cmd.device_token):
            self._refuse(rid, "not_a_mailbox")   # its DALL under way, here or on another host
            return
        self.core.reply(rid, frames.iosa(cmd.device_token))

    async def _iosd(self, rid: int, cmd: Iosd) -> None:
        if not await self.control.iosd(self.owner, cmd.device_token):
            self._refuse(rid, "push_token")   # interop §5.12: unknown push token
            return
        self.core.reply(rid, frames.iosd(cmd.device_token))

    async def _iosl(self, rid: int, cmd: Iosl) -> None:
        self.core.reply(rid, frames.iosl(self.control.push_tokens(self.owner)))

    async def _dall(self, rid: int, cmd: Dall) -> None:
        tokens = await self.control.dall(self.owner)
        if tokens is None:
            self._refuse(rid, "not_a_mailbox")   # interop §3 DALL: requires a mailbox
            return
        for token in tokens:
            self.inbox.forget(token)
        self.server.set_mailbox(self.owner, False, self)
        self.core.reply(rid, frames.dall())
