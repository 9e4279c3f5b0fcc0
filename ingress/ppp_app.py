"""The PPP listener: FastAPI + uvicorn inside the ingress process's event loop (spec 004 §5, §6).

* `GET /v1/ws` (WebSocket, §5.1): MessagePack binary frames with `cmd`. The protocol is the
  sans-I/O `engine.ppp.session.PppSession`; this shell owns the socket, the handshake timeout
  (no AUTH_OK within `handshake_timeout_seconds`: closed), one writer task per connection,
  and runs each command through the shared `PppService` (several at once per connection, up
  to `max_in_flight`; replies still go out in command order).
* `POST /v1/note/submit` (§6 sealed sender): body limit before parsing, per-IP then per-token
  sliding budgets (C.2), unknown token 401. Logged only as coarse outcomes: no request id,
  no IP, no token.
* `POST /v1/room/submit` (§7.3 sealed room message): the same body limit, per-IP budget and
  trusted-proxy rule; then the room (unknown 404, expired 410), the member token with its
  grace period (401), the per-token budget (429, keyed by room and token), and ROOM_STORED
  once the stream has numbered the message (`ppp_rooms.py`).
* Room commands over the WebSocket (§7): `ppp_rooms.RoomService`, with the room view
  (`egress/ppp_rooms.py`) fed by the same inbox tail as the PPP inbox view.
* Contact discovery over the WebSocket (§9): `ppp_discovery.DiscoveryService`.
* HTTP polling (§5.2): `POST /v1/events` (STORE), `GET /v1/events?since=` (FETCH),
  `POST /v1/events/ack` (ACK), `GET /v1/events/carry?group=&since=` (FETCH_CARRY) and
  `POST /v1/events/carry/ack` (ACK_CARRY, this relay's), authenticated by
  `Authorization: PPP-Ed25519 <pk>:<sig>` over body || timestamp (`X-PPP-Timestamp`, see
  `engine.ppp.protocol.http_auth`), with a replay window; same rate budgets and the same
  `PppService` as the WebSocket.

uvicorn runs as a task of the caller's loop (`PppServer.start` / `close`, from IngressNode);
its signal handlers are not installed (the relay process owns signals). It serves no socket of
its own: `runtime/listener.py` accepts (admission at TCP accept, its own accept loop that pauses
near the descriptor limit) and hands each admitted socket to uvicorn's protocol classes with
this port's deadlines (`ppp_conn.py`). Budgets (issue 19, `engine/admission.py`):

* HANDSHAKE: TCP accepted, no complete request head yet.
* UNAUTH: a request head is in: an HTTP request (sealed submit and polling are anonymous or
  signed per request, so an HTTP connection never authenticates; between requests it stays
  here, under the keep-alive timeout), or a WebSocket before AUTH_OK.
* AUTH: a WebSocket after AUTH_OK. Its address at its cap, or its pubkey at
  `max_sessions_per_pubkey`: the session of theirs idle longest (no command, NOTIFY or
  unsolicited frame; WebSocket pings do not count) and not mid-delivery is closed for the
  newcomer. Full otherwise (or every such session mid-delivery): AUTH_FAIL, close 1013.
* Behind a trusted proxy (`trusted_proxies`), the TCP peer is the proxy: until the head is in
  the connection counts for the proxy's address (a proxy sends the head with the connection,
  so it holds few there); from the head on it counts for the client X-Forwarded-For names by
  the rule of the sealed endpoints, so one proxy does not share one address's caps.

Client noise is not an error: a client leaving inside a body is counted and answered into
the void; uvicorn's warnings about a client's bytes ("Invalid HTTP request received.") become
one rate-limited line of ours (`ppp_bad_request`), without an address.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Query, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.requests import ClientDisconnect
from starlette.websockets import WebSocketDisconnect

from delta_tables.group_commit import DeltaAppendTarget, GroupCommitAppender
from delta_tables.layout import Layout
from delta_tables.ppp_control import PppControl
from delta_tables.schema import ACKS
from egress.inbox_tail import InboxTail
from egress.ppp_inbox import PppInbox
from egress.ppp_rooms import RoomInbox
from engine.admission import Cap, Limits, Stage, Ticket, address_key
from engine.ppp import protocol as P
from engine.ppp.ids import PROTOCOL
from engine.ppp.rooms import ROOM_PROTOCOL
from engine.ppp.limits import (REQUEST_ID_LEN, SEALED_BODY_LIMIT_BYTES, SEALED_IP_RATE_LIMIT,
                               SEALED_TOKEN_RATE_LIMIT, command_budget)
from engine.ppp.session import Authenticated, Closing, CommandReceived, PppSession, Refused
from engine.ratelimit import KeyedBudgets, SlidingWindowLimiter
from runtime import logs
from runtime.config import PppConf, Settings
from runtime.keys import load_or_create
from runtime.listener import Listener
from runtime.push_desk import PushDesk, desk_dir

from .ppp_conn import PppConn, PppHttpProtocol, PppWsProtocol
from .ppp_discovery import PEPPER_SEED_FILE, DiscoveryService
from .ppp_rooms import SealedRoomOutcome
from .ppp_service import PppService, SealedOutcome
from .push_backends import PppDesk

log = logging.getLogger("relay.ingress.ppp")

MSGPACK = "application/msgpack"
SWEEP_SECONDS = 30.0
ROOM_FORGET_SECONDS = 3600.0
# uvicorn's warnings that a client's bytes cause (logger "uvicorn.error"): ours instead.
CLIENT_NOISE = {"Invalid HTTP request received.": "invalid_http",
                "Unsupported upgrade request.": "unsupported_upgrade",
                "Invalid UTF-8 sequence received from client.": "invalid_utf8",
                "Exceeded concurrency limit.": "concurrency_limit"}


def ppp_limits(conf: PppConf) -> Limits:
    return Limits(conf.max_sockets,
                  Cap(conf.max_handshakes, conf.max_handshakes_per_address),
                  Cap(conf.max_unauth_connections, conf.max_unauth_connections_per_address),
                  Cap(conf.max_auth_sessions, conf.max_auth_sessions_per_address),
                  per_identity=conf.max_sessions_per_pubkey)


def tls_context(cert_file: str, key_file: str) -> "ssl.SSLContext | None":
    """The listener's own TLS (ppp.tls_cert_file / tls_key_file): both or neither. uvicorn's
    protocols see the TLS transport, so scopes say wss / https."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("ppp.tls_cert_file and ppp.tls_key_file go together: set both")
    import ssl
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"ppp.tls_cert_file / tls_key_file: cannot load ({e})") from e
    return ctx


def parse_trusted(spec: str) -> list[ipaddress._BaseNetwork]:
    """`PPP_TRUSTED_PROXIES`: comma-separated addresses or CIDR networks."""
    return [ipaddress.ip_network(p.strip(), strict=False) for p in spec.split(",") if p.strip()]


def _trusted(addr: str, trusted: list) -> bool:
    try:
        ip = ipaddress.ip_address(addr.strip())
    except ValueError:
        return False
    return any(ip in net for net in trusted)


def client_ip(peer: str, forwarded_for: list[str], trusted: list) -> str:
    """§5.x trusted-proxy rule: an untrusted peer is the client; behind a trusted peer, walk
    X-Forwarded-For right to left skipping trusted entries; the first untrusted one is the
    client (all trusted: the leftmost)."""
    if not _trusted(peer, trusted):
        return peer
    entries = [e.strip() for h in forwarded_for for e in h.split(",") if e.strip()]
    for e in reversed(entries):
        if not _trusted(e, trusted):
            return e
    return entries[0] if entries else peer


class _Views:
    """The inbox tail's hub for the two views of this listener (each takes its protocol)."""

    def __init__(self, *views):
        self.views = views

    def add(self, protocol: str, mailbox: bytes, envelopes) -> None:
        envelopes = list(envelopes)
        for v in self.views:
            v.add(protocol, mailbox, envelopes)


class _Body(Exception):
    pass


class _Gone(Exception):
    """The client left (or was closed by a deadline) before its body was in."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (`_Body`) as soon as it passes `limit`: before any parsing, and
    without buffering more than `limit` bytes. `_Gone`: the client left inside it."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise _Body()
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise _Body()
    except ClientDisconnect:
        raise _Gone() from None
    return bytes(buf)


# A body refused for its size is not read: the connection closes after the reply.
_CLOSE = {"Connection": "close"}


def _msgpack(reply: P.Reply | dict, status: int = 200, headers: dict | None = None) -> Response:
    body = reply.encode() if isinstance(reply, P.Reply) else P.msgpack.packb(reply)
    return Response(body, status_code=status, media_type=MSGPACK, headers=headers)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):   # the relay process owns SIGINT / SIGTERM
        yield


class _ClientNoise(logging.Filter):
    """On uvicorn's logger: its warnings about a client's bytes are counted and become one
    line of ours per 10 s, without the address (`CLIENT_NOISE`)."""

    def __init__(self, server: "PppServer"):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        what = CLIENT_NOISE.get(record.msg) if isinstance(record.msg, str) else None
        if what is None:
            return True
        self.server.bad_request(what)
        return False


class PppServer(Listener):
    name = "ppp"
    protocol = PROTOCOL

    def __init__(self, settings: Settings, appender, *, fsync: bool = True,
                 host: str | None = None, port: int | None = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        """`appender`: the node's landing GroupCommitAppender. `clock`: unix seconds (expiry,
        HTTP timestamps); `monotonic`: rate-limit windows."""
        self.conf = settings.ppp
        super().__init__(settings.bind if host is None else host,
                         self.conf.port if port is None else port, self.conf.max_connections,
                         limits=ppp_limits(self.conf), backlog=self.conf.listen_backlog,
                         open_files_reserve=settings.process.open_files_reserve)
        self.settings = settings
        self.clock = clock
        self.monotonic = monotonic
        self.layout = Layout.of(settings)
        self.control = PppControl(self.layout, fsync=fsync)
        # a pubkey's departure is kept (for the push job) only if it registered for push
        self.inbox = PppInbox(self.layout.inbox, self.layout.acks,
                              notify_window=self.conf.notify_window_ms / 1000,
                              cache_bytes=self.conf.cache_bytes,
                              remember=self.control.has_push)
        self.rooms = RoomInbox(self.layout.inbox, self.layout.acks,
                               notify_window=self.conf.notify_window_ms / 1000,
                               cache_bytes=self.conf.room_cache_bytes)
        self.tail = InboxTail(self.layout.inbox, self.layout.acks, _Views(self.inbox, self.rooms),
                              protocols={PROTOCOL, ROOM_PROTOCOL})
        self.ack_appender = GroupCommitAppender(DeltaAppendTarget(self.layout.acks, ACKS,
                                                                  fsync=fsync))
        self.service = PppService(appender, self.ack_appender, self.inbox, self.control,
                                  clock=clock, counters=self, room_view=self.rooms,
                                  room_sequence_timeout=self.conf.room_sequence_timeout_seconds,
                                  moderation=self.conf.moderation)
        self.service.discovery = DiscoveryService(
            self.control, load_or_create(settings.data_dir, PEPPER_SEED_FILE).private_bytes,
            max(1, round(self.conf.discovery_pepper_rotation_hours * 3600)), self.service._fail,
            clock=clock, monotonic=monotonic)
        self.budgets = KeyedBudgets(command_budget)   # per pubkey, both transports (C.3)
        self.sealed_ip = SlidingWindowLimiter(SEALED_IP_RATE_LIMIT.max_count,
                                              SEALED_IP_RATE_LIMIT.window_secs)
        self.sealed_token = SlidingWindowLimiter(SEALED_TOKEN_RATE_LIMIT.max_count,
                                                 SEALED_TOKEN_RATE_LIMIT.window_secs)
        # POST /v1/room/submit: the same per-token budget, keyed by room id + member token.
        self.sealed_room_token = SlidingWindowLimiter(SEALED_TOKEN_RATE_LIMIT.max_count,
                                                      SEALED_TOKEN_RATE_LIMIT.window_secs)
        self.trusted = parse_trusted(self.conf.trusted_proxies)
        self.accept_tls = tls_context(self.conf.tls_cert_file, self.conf.tls_key_file)
        self._seen_sigs: dict[bytes, float] = {}   # HTTP replay cache: sig -> forget after
        self.app = build_app(self)
        self._noise = _ClientNoise(self)
        self._uvicorn: _Server | None = None
        self._serve_task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.push_desk: PushDesk | None = None

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.layout.ensure_shared_tables)
        await self.control.load()
        self.control.start_following(
            self.settings.ingress.control_follow_seconds)   # the other PPP hosts' changes
        await self.ack_appender.start()
        # Each view read its own snapshot; the tail goes on from the older one (a view skips
        # the rows it has, by cursor).
        self.tail.version = min(await self.inbox.bootstrap(), await self.rooms.bootstrap())
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self.tail.follow(self.settings, self._stop, "ppp"),
                                name="ppp-inbox-tail"),
            asyncio.create_task(self._sweep_loop(), name="ppp-sweep")]
        desk = PppDesk(self.inbox, self.control)
        if self.service.rooms is not None:
            self.service.rooms.on_admin_offline = desk.knock
        self.push_desk = await PushDesk.open(desk_dir(self.settings.data_dir), "ppp", desk)
        # Logging: uvicorn configures none (log_config=None: our root handler, runtime/logs.py)
        # and its loggers stay at WARNING: its INFO records are per connection and carry the
        # client's address ("127.0.0.1:48284 - "WebSocket /v1/ws" [accepted]").
        # proxy_headers off: X-Forwarded-For is read by our rule only (`trusted_proxies`).
        # limit_concurrency unset: admission refuses at accept, before a byte is read, where
        # uvicorn's would answer 503 after reading the head. No socket of its own (`sockets=[]`):
        # `runtime/listener.py` accepts and `_protocol_for` builds uvicorn's protocols.
        # No permessage-deflate: PPP frames carry ciphertext, which does not compress, and
        # each connection's deflate contexts were most of the memory of an idle session.
        conf = self.conf
        config = uvicorn.Config(
            self.app, http=PppHttpProtocol, ws=PppWsProtocol, ws_per_message_deflate=False,
            lifespan="off",
            log_config=None, access_log=logs.libraries_loud(),
            log_level=logging.getLogger().level if logs.libraries_loud() else logging.WARNING,
            proxy_headers=False,
            server_header=False, ws_max_size=conf.max_message_bytes,
            ws_ping_interval=conf.ws_ping_interval_seconds,
            ws_ping_timeout=conf.ws_ping_timeout_seconds,
            timeout_keep_alive=conf.keep_alive_timeout_seconds,
            h11_max_incomplete_event_size=conf.max_request_head_bytes,
            timeout_graceful_shutdown=5)
        logging.getLogger("uvicorn.error").addFilter(self._noise)
        self._uvicorn = _Server(config)
        self._serve_task = asyncio.create_task(self._uvicorn.serve(sockets=[]),
                                               name="ppp-uvicorn")
        while not self._uvicorn.started:
            if self._serve_task.done():
                self._serve_task.result()   # raises why it could not start
                raise RuntimeError("ppp listener did not start")
            await asyncio.sleep(0.01)
        self._server = self._accept_server()
        log.info("listener started", extra={"event": "listener_started",
                                            "listener": self.name, "port": self.bound_port})

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()              # stop accepting
        if self.push_desk is not None:
            self.push_desk.close()
            self.push_desk = None
        for task in list(self._opening):
            task.cancel()
        await asyncio.gather(*self._opening, return_exceptions=True)
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            await self._serve_task
            self._uvicorn = None
        logging.getLogger("uvicorn.error").removeFilter(self._noise)
        await self.control.stop_following()
        self._stop.set()
        for t in self._tasks:
            if t.get_name() == "ppp-sweep":
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inbox.cancel_timers()
        self.rooms.cancel_timers()
        await self.service.drain()
        await self.ack_appender.close()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = self.clock()
            self.inbox.sweep(now)
            # Rooms expired an hour ago are forgotten (until then they answer "room
            # expired"); compaction purges their rows.
            gone = self.control.rooms.sweep(now - ROOM_FORGET_SECONDS)
            self.rooms.sweep(now, gone)
            mono = self.monotonic()
            self.budgets.sweep(mono)
            self.sealed_ip.sweep(mono)
            self.sealed_token.sweep(mono)
            self.sealed_room_token.sweep(mono)
            self.service.rooms.knocks.sweep(now)
            self.service.discovery.sweep()
            self._seen_sigs = {s: t for s, t in self._seen_sigs.items() if t > now}

    # --- below the app: connections, budgets, deadlines ------------------------------------------
    def _protocol_for(self, ticket: Ticket) -> asyncio.BaseProtocol:
        """An admitted socket: uvicorn's h11 protocol with our deadlines (`ppp_conn.py`); the
        `PppConn` reaches the app as `scope["state"]["ppp_conn"]`."""
        server = self._uvicorn
        state = dict(server.lifespan.state)
        state["ppp_conn"] = PppConn(self, ticket)
        return PppHttpProtocol(server.config, server.server_state, state)

    def admit_client(self, ticket: Ticket, peer: str,
                     headers: list[tuple[bytes, bytes]]) -> Ticket | None:
        """A request head from `peer`: the ticket to count it by. From a trusted proxy, the
        client X-Forwarded-For names (the sealed endpoints' rule) gets a ticket of its own
        (None: refused one)."""
        if not self.trusted or not _trusted(peer, self.trusted):
            return ticket
        forwarded = [v.decode("latin-1") for k, v in headers if k == b"x-forwarded-for"]
        client = client_ip(peer, forwarded, self.trusted) if forwarded else peer
        try:
            key = address_key(str(ipaddress.ip_address(client.strip())))
        except ValueError:   # not an address: the proxy's own count
            return ticket
        if key == ticket.address:
            return ticket
        self.admission.release(ticket)
        decision = self.admission.admit(key, asyncio.get_running_loop().time())
        self._evict(decision.evicted)
        if decision.ticket is None:
            self._refused(Stage.HANDSHAKE, decision.refused)
        return decision.ticket

    def client_closed(self, reason: str) -> None:
        """A client was closed below the app (a deadline, a first message too large)."""
        self.rejected[reason] += 1
        if (dropped := self.quiet.allow(("closed", reason))) is not None:
            log.info("ppp client closed", extra={"event": "ppp_client_closed",
                                                 "reason": reason, "suppressed": dropped})

    def bad_request(self, what: str) -> None:
        self.rejected[what] += 1
        if (dropped := self.quiet.allow(("bad_request", what))) is not None:
            log.info("ppp client sent what uvicorn refused", extra={
                "event": "ppp_bad_request", "what": what, "suppressed": dropped})

    def client_gone(self, where: str) -> None:
        """A client left inside its request body: a normal event, counted."""
        self.rejected["client_gone"] += 1
        if (dropped := self.quiet.allow(("gone", where))) is not None:
            log.info("ppp client left inside a request body", extra={
                "event": "ppp_client_gone", "where": where, "suppressed": dropped})

    def refusal_logged(self, cmd: str | None, reason: str) -> int | None:
        return self.service.refusal_logged(cmd, reason)

    # --- WebSocket ------------------------------------------------------------------------------
    async def serve_ws(self, ws: WebSocket) -> None:
        if self.connections >= self.max_connections:
            # `ppp.max_connections`, as every listener: past it the upgrade is refused (403).
            self.rejected["max_connections"] += 1
            if (dropped := self.quiet.allow("max_connections")) is not None:
                log.warning("connection cap reached", extra={
                    "event": "connection_refused", "listener": self.name,
                    "suppressed": dropped})
            await ws.close(code=1013)
            return
        await ws.accept()
        self.connections += 1
        try:
            await _PppConnection(self, ws, ws.scope.get("state", {}).get("ppp_conn")).run()
        finally:
            self.connections -= 1

    # --- HTTP polling auth (§5.2) --------------------------------------------------------------
    def http_auth(self, request: Request, body: bytes, *, once: bool = True) -> bytes | None:
        """The authenticated pubkey, or None (bad header, signature, timestamp or a replay).
        `once`: a signature is accepted once (POSTs). A GET signs an empty body, i.e. only
        the timestamp (§5.2), so two polls in one second carry the same signature: reads are
        checked against the window but not the replay cache."""
        now = self.clock()
        pubkey = P.http_auth(request.headers.get("authorization"),
                             request.headers.get(P.TIMESTAMP_HEADER), body, now,
                             self.conf.http_auth_window_seconds)
        if pubkey is None or not once:
            return pubkey
        sig = request.headers["authorization"].rsplit(":", 1)[1]
        key = bytes.fromhex(sig)
        if key in self._seen_sigs:
            return None
        self._seen_sigs[key] = now + 2 * self.conf.http_auth_window_seconds
        return pubkey


class _PppConnection:
    """One WebSocket: reader (this task), one writer task, command tasks."""

    def __init__(self, server: PppServer, ws: WebSocket, conn: PppConn | None):
        self.server = server
        self.ws = ws
        self.conn = conn
        self.core = PppSession(server.budgets, max_in_flight=server.conf.max_in_flight,
                               admit=self._admit)
        self.pubkey: bytes | None = None
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._closing: Closing | None = None
        self._tasks: set[asyncio.Task] = set()
        self._unwritten = False         # a frame is being written (never evicted then)

    def notify(self, count: int) -> None:
        if self.core.notify(count):
            self._active()
            self._wake.set()

    def push(self, reply: P.Reply) -> bool:
        """An unsolicited frame (room notifications, KNOCK_NOTIFY, ADMITTED, KICKED)."""
        if self.core.push(reply):
            self._active()
            self._wake.set()
            return True
        return False

    def _active(self) -> None:
        if self.conn is not None:
            self.conn.active()

    def _delivering(self) -> bool:
        """Mid-delivery, not to be evicted: a command being run (a STORE's STORED owed, a
        FETCH page) or a frame (a NOTIFY) not yet written."""
        return bool(self._tasks) or self.core.outstanding > 0 or self._unwritten

    def room_notify(self, room_id: bytes, count: int) -> None:
        self.push(P.room_notify(room_id, count))

    def key_rotation(self, room_id: bytes, grace_until: int) -> None:
        self.push(P.key_rotation_notify(room_id, grace_until))

    def _admit(self, pubkey: bytes) -> str | None:
        """AUTH_OK needs an AUTH slot (taken from another session only by fair share; full
        or the address at its cap: refused, the client retries later)."""
        if self.conn is None or self.conn.authenticated(pubkey, self._delivering):
            return None
        return "relay full"

    async def run(self) -> None:
        writer = asyncio.create_task(self._write_loop(), name="ppp-ws-write")
        self.core._out.append(self.core.greeting())   # CHALLENGE first
        self._wake.set()
        deadline = asyncio.get_running_loop().time() + self.server.conf.handshake_timeout_seconds
        try:
            while self._closing is None and not self.core.closed:
                while self.core.outstanding >= self.core.max_in_flight:
                    self._progress.clear()
                    await self._progress.wait()
                timeout = None
                if self.pubkey is None:
                    timeout = max(0.0, deadline - asyncio.get_running_loop().time())
                try:
                    msg = await asyncio.wait_for(self.ws.receive(), timeout)
                except (asyncio.TimeoutError, TimeoutError):
                    self.server.rejected["handshake_timeout"] += 1
                    if (dropped := self.server.quiet.allow("handshake_timeout")) is not None:
                        log.info("ppp handshake timed out", extra={
                            "event": "ppp_handshake_timeout", "suppressed": dropped})
                    self._closing = Closing(1008, "handshake timeout")
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("bytes")
                if data is None:      # a text frame is not MessagePack (§5.1: binary frames)
                    data = b"\xc1"    # a byte MessagePack never uses: answered as malformed
                self.core.receive_frame(data, self.server.monotonic())
                self._handle_events()
                self._wake.set()
        except WebSocketDisconnect:
            pass
        finally:
            if self._tasks and self._closing is None:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._closing is None:
                self._closing = Closing(1000, "")
            self._wake.set()
            try:
                await writer
            finally:
                for t in self._tasks:
                    t.cancel()
                if self.pubkey is not None:
                    self.server.inbox.unregister(self.pubkey, self)
                self.server.rooms.unsubscribe(self)
                self.core.close()

    def _handle_events(self) -> None:
        for ev in self.core.events_received():
            if isinstance(ev, CommandReceived):
                self._active()
                task = asyncio.create_task(self._run(ev))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(ev, Authenticated):
                self.pubkey = ev.pubkey
                self.server.inbox.register(ev.pubkey, self)
                self.server.service.rooms.on_login(ev.pubkey)
            elif isinstance(ev, Refused):
                self.server.service.count_refused(ev.reason)
                if (dropped := self.server.refusal_logged(ev.cmd, ev.reason)) is not None:
                    log.info("ppp command refused", extra={
                        "event": "ppp_command_refused", "cmd": ev.cmd, "reason": ev.reason,
                        "request_id": ev.request_id, "suppressed": dropped})
            elif isinstance(ev, Closing):
                self._closing = ev

    async def _run(self, ev: CommandReceived) -> None:
        try:
            reply = await self.server.service.run(self.pubkey, ev.command, ev.request_id,
                                                  session=self)
        except Exception as exc:
            if (dropped := self.server.quiet.allow(("failed", ev.command.name))) is not None:
                log.exception("ppp command failed", extra={"event": "ppp_command_failed",
                                                           "cmd": ev.command.name,
                                                           "request_id": ev.request_id,
                                                           "error": type(exc).__name__,
                                                           "suppressed": dropped})
            reply = P.failure(ev.command.name, f"internal error (request {ev.request_id})")
        self.core.reply(ev.slot, reply)
        self._progress.set()
        self._wake.set()

    async def _write_loop(self) -> None:
        """The only writer of this socket."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                for frame in self.core.frames_to_send():
                    self._unwritten = True
                    await self.ws.send_bytes(frame)
                self._unwritten = False
                if self._closing is not None and not self._tasks:
                    for frame in self.core.frames_to_send():
                        await self.ws.send_bytes(frame)
                    with contextlib.suppress(Exception):
                        await self.ws.close(self._closing.code, self._closing.reason)
                    return
        except Exception:
            # The peer went away; the reader sees the disconnect.
            self._closing = self._closing or Closing(1000, "")
            self._progress.set()


def _request_id() -> str:
    import secrets
    return secrets.token_bytes(REQUEST_ID_LEN).hex()


_STORE_BODY = {"type": "object", "required": ["event"], "properties": {
    "cmd": {"type": "string", "enum": ["STORE"], "description": "optional"},
    "event": {"type": "string", "format": "binary", "description": "encoded GiftWrap"}}}
_ACK_BODY = {"type": "object", "required": ["event_ids"], "properties": {
    "cmd": {"type": "string", "enum": ["ACK"], "description": "optional"},
    "event_ids": {"type": "array", "items": {"type": "string", "format": "binary"}}}}
_ROOM_BODY = {"type": "object", "required": ["room_id", "member_token", "nonce", "ciphertext"],
              "properties": {
                  "room_id": {"type": "string", "format": "binary", "description": "16 bytes"},
                  "member_token": {"type": "string", "format": "binary",
                                   "description": "12 bytes"},
                  "nonce": {"type": "string", "format": "binary", "description": "24 bytes"},
                  "ciphertext": {"type": "string", "format": "binary"}}}
_NOTE_BODY = {"type": "object", "required": ["delivery_token", "ephemeral_pk", "nonce",
                                             "ciphertext", "created_at", "expires_at"],
              "properties": {
                  "delivery_token": {"type": "string", "format": "binary", "description": "12 bytes"},
                  "ephemeral_pk": {"type": "string", "format": "binary", "description": "32 bytes"},
                  "nonce": {"type": "string", "format": "binary", "description": "24 bytes"},
                  "ciphertext": {"type": "string", "format": "binary"},
                  "created_at": {"type": "integer", "format": "uint64"},
                  "expires_at": {"type": "integer", "format": "uint64"}}}


def _body_doc(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {MSGPACK: {"schema": schema}}}}


def _replies(ok: str, **codes: str) -> dict:
    out: dict[int | str, Any] = {200: {"description": ok, "content": {MSGPACK: {}}}}
    for code, text in codes.items():
        out[int(code.lstrip("_"))] = {"description": text, "content": {MSGPACK: {}}}
    return out


_AUTH_DOC = ("Authenticated by `Authorization: PPP-Ed25519 <pubkey_hex>:<sig_hex>` with "
             "`sig = Ed25519(body || timestamp)`, `timestamp` the decimal unix seconds sent in "
             "`X-PPP-Timestamp`, within the replay window (`ppp.http_auth_window_seconds`); a "
             "POST's signature is accepted once.")


def build_app(server: PppServer) -> FastAPI:
    app = FastAPI(
        title="PPP relay", version="1",
        description="PPP (spec 004) over HTTP: sealed-sender Note submission (§6) and the "
                    "polling transport (§5.2). The primary transport is the WebSocket at "
                    "`/v1/ws` (§5.1: MessagePack frames with `cmd`, CHALLENGE -> AUTH -> "
                    "AUTH_OK), which OpenAPI does not describe. All bodies are MessagePack.",
        docs_url=None, redoc_url=None)
    svc = server.service

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        # A query parameter of the wrong type (FETCH `since=-1`): the protocol's refusal,
        # 400 STORE_FAIL, rather than FastAPI's 422 JSON.
        return _msgpack(P.store_fail("malformed request"), 400)

    @app.websocket("/v1/ws")
    async def ws_endpoint(ws: WebSocket) -> None:
        await server.serve_ws(ws)

    async def sealed_body(request: Request, outcome, rate_limited: str):
        """(body, None) for a sealed submission within the body limit (refused before
        parsing) and its client's per-IP budget (the trusted-proxy rule), else (None, the
        refusing Response): the same first steps for notes (§6) and room messages (§7.3)."""
        try:
            body = await read_body(request, SEALED_BODY_LIMIT_BYTES)
        except _Body:
            return None, outcome("too_large", 413, _CLOSE)
        except _Gone:
            server.client_gone("sealed")
            return None, Response(status_code=400)   # nobody reads it
        peer = request.client.host if request.client else ""
        ip = client_ip(peer, request.headers.getlist("x-forwarded-for"), server.trusted)
        if not server.sealed_ip.allow(ip, server.monotonic()):
            return None, outcome(rate_limited, 429,
                                 {"Retry-After": str(SEALED_IP_RATE_LIMIT.window_secs)})
        return body, None

    @app.post("/v1/note/submit", summary="Sealed Note submission (§6)",
              description="Anonymous: identified only by a registered delivery token. The body "
                          f"is refused past {SEALED_BODY_LIMIT_BYTES} bytes before parsing; "
                          "per-IP (120/60 s) and per-token (2/1 s) sliding budgets. Lands a "
                          "GiftWrap addressed to the token's recipient, fetched like any event.",
              openapi_extra=_body_doc(_NOTE_BODY),
              responses=_replies("stored: `{cmd: STORED, event_id}`", _400="malformed or "
                                 "expired", _401="unknown delivery token", _409="duplicate "
                                 "event", _413="body too large", _429="rate limited",
                                 _503="storage unavailable"))
    async def note_submit(request: Request) -> Response:
        def sealed_line(o: str) -> None:
            if (dropped := server.refusal_logged("note/submit", o)) is not None:
                log.info("ppp sealed submission", extra={"event": "ppp_sealed", "outcome": o,
                                                         "suppressed": dropped})

        def outcome(o: str, status: int, headers=None) -> Response:
            sealed_line(o)
            if o != SealedOutcome.OK:
                svc.count_refused(f"sealed_{o}")
            return Response(status_code=status, headers=headers)
        body, refused = await sealed_body(request, outcome, SealedOutcome.RATE_LIMITED)
        if refused is not None:
            return refused
        now = server.monotonic()
        try:
            note = P.decode_sealed_note(body)
        except P.ProtocolError:
            return outcome(SealedOutcome.INVALID, 400)
        if await server.control.find_recipient(note.delivery_token) is None:
            return outcome(SealedOutcome.UNKNOWN_TOKEN, 401)
        if not server.sealed_token.allow(note.delivery_token, now):
            return outcome(SealedOutcome.RATE_LIMITED, 429,
                           {"Retry-After": str(SEALED_TOKEN_RATE_LIMIT.window_secs)})
        o, eid = await svc.sealed_note(note)
        status = {SealedOutcome.OK: 200, SealedOutcome.UNKNOWN_TOKEN: 401,
                  SealedOutcome.INVALID: 400, SealedOutcome.DUPLICATE: 409}.get(o, 503)
        if status != 200:
            return outcome(o, status)
        sealed_line(o)
        return _msgpack(P.stored(eid))

    @app.post("/v1/room/submit", summary="Sealed room message (§7.3)",
              description="Anonymous: proven by a member token the room's admin registered "
                          "(valid through a key rotation's grace period). The body is refused "
                          f"past {SEALED_BODY_LIMIT_BYTES} bytes before parsing; per-IP "
                          "(120/60 s) and per-token (2/1 s) sliding budgets. Answered once the "
                          "stream has numbered the message.",
              openapi_extra=_body_doc(_ROOM_BODY),
              responses=_replies("`{cmd: ROOM_STORED, room_id, sequence_number}`",
                                 _202="durable but not numbered yet: send the same bytes "
                                 "again for the number", _400="malformed", _401="member token "
                                 "not valid for the room", _404="unknown room",
                                 _410="room expired", _413="body too large",
                                 _429="rate limited", _503="storage unavailable"))
    async def room_submit(request: Request) -> Response:
        def outcome(o: str, status: int, headers=None) -> Response:
            if (dropped := server.refusal_logged("room/submit", o)) is not None:
                log.info("ppp sealed room submission", extra={
                    "event": "ppp_sealed_room", "outcome": o, "suppressed": dropped})
            if o != SealedRoomOutcome.OK:
                svc.count_refused(f"sealed_room_{o}")
            return Response(status_code=status, headers=headers)
        body, refused = await sealed_body(request, outcome, SealedRoomOutcome.RATE_LIMITED)
        if refused is not None:
            return refused
        try:
            sub = P.decode_sealed_room(body)
        except P.ProtocolError:
            return outcome(SealedRoomOutcome.INVALID, 400)
        now = server.monotonic()
        o, reply = await svc.rooms.sealed(
            sub, lambda key: server.sealed_room_token.allow(key, now))
        if reply is None:
            if o == SealedRoomOutcome.RATE_LIMITED:
                return outcome(o, 429, {"Retry-After": str(SEALED_TOKEN_RATE_LIMIT.window_secs)})
            return outcome(o, {SealedRoomOutcome.INVALID: 400, SealedRoomOutcome.TOKEN: 401,
                               SealedRoomOutcome.UNKNOWN_ROOM: 404,
                               SealedRoomOutcome.EXPIRED: 410,
                               SealedRoomOutcome.PENDING: 202}.get(o, 503))
        outcome(o, 200)
        return _msgpack(reply)

    async def _authed(request: Request, body: bytes, cmd: str):
        """(pubkey, request_id) or the error Response."""
        pubkey = server.http_auth(request, body, once=request.method != "GET")
        rid = _request_id()
        if pubkey is None:
            svc.count_refused("http_auth")
            if (dropped := server.refusal_logged("http_auth", "refused")) is not None:
                log.info("ppp http auth refused", extra={"event": "ppp_http_auth_refused",
                                                          "request_id": rid,
                                                          "suppressed": dropped})
            return None, _msgpack(P.auth_fail(f"bad authorization (request {rid})"), 401)
        if not server.budgets.allow(cmd, pubkey, server.monotonic()):
            svc.count_refused("rate_limited")
            if (dropped := server.refusal_logged(cmd, "rate_limited")) is not None:
                log.info("ppp command refused", extra={
                    "event": "ppp_command_refused", "cmd": cmd, "reason": "rate_limited",
                    "request_id": rid, "suppressed": dropped})
            return None, _msgpack(P.failure(cmd, f"rate limited (request {rid})"), 429,
                                  {"Retry-After": str(command_budget(cmd).window_secs)})
        return (pubkey, rid), None

    def _status(reply: P.Reply) -> int:
        if reply.ok:
            return 200
        return 409 if "duplicate" in reply.fields.get("reason", "") else 400

    async def _signed_post(request: Request, name: str) -> Response:
        """A polling POST: body limit, signature, then the command map (`cmd` implied)."""
        try:
            body = await read_body(request, server.conf.max_message_bytes)
        except _Body:
            return Response(status_code=413, headers=_CLOSE)
        except _Gone:
            server.client_gone("polling")
            return Response(status_code=400)   # nobody reads it
        ok, err = await _authed(request, body, name)
        if err is not None:
            return err
        pubkey, rid = ok
        try:
            cmd = P.decode_map(P.unpack_map(body), implied=name)
        except P.ProtocolError as e:   # counted and logged with the request id (§5.x)
            return _msgpack(svc._fail(name, e.reason, rid), 400)
        reply = await svc.run(pubkey, cmd, rid)
        return _msgpack(reply, _status(reply))

    async def _signed_get(request: Request, cmd: P.Command) -> Response:
        """A polling GET: `since` / `cursor` in decimal digits only (FastAPI's int would also
        take "1.0", " 1", "1_000"), the signature over the empty body, then the command."""
        if not all(v.isascii() and v.isdigit() for k, v in request.query_params.multi_items()
                   if k in ("since", "cursor")):
            return _msgpack(P.store_fail("malformed request"), 400)
        signed = b""
        if server.conf.http_get_signature_covers_path:
            qs = request.scope.get("query_string", b"")
            signed = P.http_get_signed_body(request.scope.get("raw_path", b"")
                                            + (b"?" + qs if qs else b""))
        ok, err = await _authed(request, signed, cmd.name)
        if err is not None:
            return err
        pubkey, rid = ok
        reply = await svc.run(pubkey, cmd, rid)
        return _msgpack(reply, _status(reply))

    @app.post("/v1/events", summary="Store an event (STORE, §5.2)", description=_AUTH_DOC
              + " Body: the STORE command map (`cmd` optional). Reply: STORED or STORE_FAIL.",
              openapi_extra=_body_doc(_STORE_BODY),
              responses=_replies("`{cmd: STORED, event_id}`", _400="STORE_FAIL (malformed, "
                                 "oversize, expired)", _401="AUTH_FAIL", _409="STORE_FAIL "
                                 "duplicate event", _413="body too large",
                                 _429="STORE_FAIL rate limited"))
    async def http_store(request: Request) -> Response:
        return await _signed_post(request, "STORE")

    @app.get("/v1/events", summary="Fetch events (FETCH, §5.2)", description=_AUTH_DOC
             + " The signed body is empty (the signature covers the timestamp). Reply: "
             "EVENTS; pass its `cursor` back for the next page.",
             responses=_replies("`{cmd: EVENTS, events: [GiftWrap bytes], cursor?}`",
                                _401="AUTH_FAIL", _429="STORE_FAIL rate limited"))
    async def http_fetch(request: Request, since: int = Query(0, ge=0, lt=1 << 64),
                         cursor: int | None = Query(None, ge=0, lt=1 << 64)) -> Response:
        return await _signed_get(request, P.Fetch(since, cursor))

    @app.get("/v1/events/carry", summary="Fetch a carry group's events (FETCH_CARRY, §5.2, §8)",
             description=_AUTH_DOC + " The signed body is empty. `group`: the 16-byte group id "
             "in hex. For a courier of the group: its consenting members' undelivered events. "
             "Reply: CARRY_EVENTS; pass its `cursor` back for the next page.",
             responses=_replies("`{cmd: CARRY_EVENTS, events: [GiftWrap bytes], cursor?}`",
                                _400="STORE_FAIL malformed, unknown carry group",
                                _401="AUTH_FAIL", _429="STORE_FAIL rate limited"))
    async def http_fetch_carry(request: Request, group: str = Query(..., max_length=32),
                               since: int = Query(0, ge=0, lt=1 << 64),
                               cursor: int | None = Query(None, ge=0, lt=1 << 64)) -> Response:
        try:
            group_id = bytes.fromhex(group)
        except ValueError:
            group_id = b""
        if len(group_id) != 16:
            return _msgpack(P.store_fail("malformed request"), 400)
        return await _signed_get(request, P.FetchCarry(group_id, since, None, cursor))

    @app.post("/v1/events/carry/ack", summary="Report carried events handed over (ACK_CARRY)",
              description=_AUTH_DOC + " Body: `{group_id, event_ids}`. A courier's report: "
              "the relay stops offering those events to the group's couriers (the "
              "recipient's own FETCH still serves them until it ACKs).",
              responses=_replies("`{cmd: ACKED, count}`", _400="STORE_FAIL malformed, "
                                 "unknown carry group", _401="AUTH_FAIL",
                                 _413="body too large", _429="STORE_FAIL rate limited"))
    async def http_ack_carry(request: Request) -> Response:
        return await _signed_post(request, "ACK_CARRY")

    @app.post("/v1/events/ack", summary="Acknowledge events (ACK, §5.2)", description=_AUTH_DOC
              + " Body: the ACK command map (`cmd` optional). Only the caller's own unacked "
              "events count.", openapi_extra=_body_doc(_ACK_BODY),
              responses=_replies("`{cmd: ACKED, count}`", _400="STORE_FAIL malformed",
                                 _401="AUTH_FAIL", _413="body too large",
                                 _429="STORE_FAIL rate limited"))
    async def http_ack(request: Request) -> Response:
        return await _signed_post(request, "ACK")

    return app
