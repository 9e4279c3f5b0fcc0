"""A TCP listener for one protocol: its socket and accept loop, fair admission, tracked
handlers, close.

Shared by the asyncio shells (trueseal push and receive, Heya). A subclass names itself and
serves one connection in `serve(reader, writer, ticket)`; this class owns the socket
bookkeeping:

* **Accept loop of its own.** asyncio's retries EMFILE in a hot loop (Python 3.11:
  `_accept_connection` keeps calling accept() after "socket.accept() out of system resource",
  one ERROR line and one retry timer per try, up to the backlog each time the socket is
  ready: issue 19 saw a million lines). Here, near the descriptor limit (the accepted
  descriptor's number at `open_files.ceiling(reserve)`, or accept() failing with EMFILE /
  ENFILE / ENOBUFS / ENOMEM) the listener stops accepting, says so in one rate-limited line
  (`listener_paused`), and probes every `RESUME_PROBE_SECONDS` until descriptors are free
  again (`listener_resumed`). Meanwhile new clients wait in the listen backlog (`backlog`,
  default 1024; asyncio's default is 100: a burst of 2,000 connects left hundreds
  established and never accepted).
* **Admission** (`engine/admission.py`): every accepted connection asks `admission.admit`
  before any byte is read: refused, it is closed at once sending nothing (trueseal interop
  §1); the connections it evicts are closed. The shell calls `advance(ticket, stage)` as a
  connection reaches UNAUTH / AUTH and closes it if that returns False; the slot is released
  when the handler ends (a TLS listener also when a handshake fails: `release`).
* **Opening and handshakes in turns** (`runtime/handshake_gate.py`): an admitted socket
  waits in `self.gate` for its transport and protocol, and the shells run each handshake
  step through it too: known addresses first (`vouch`: one of its connections
  authenticated), then light ones, then the rest round-robin, a few steps per loop turn.
* **Deadlines**: `Deadline` (one timer per connection, moved as it changes stage) and
  `RecordClock` (where a client is inside a length-prefixed record, for a minimum byte rate)
  are the shells' tools.

* **Same address, many people** (a carrier NAT): past the handshake, an address (and an
  identity: `advance(..., identity)`) at its cap loses its session idle longest in
  application terms, never one mid-delivery (engine/admission.py rules 1 and 1a). The shells
  `touch(ticket)` on every application message either way (not on keep-alives) and mark
  deliveries under way (`ticket.owe()` / `paid()`, or `ticket.delivering`).

Counters for runtime/metrics.py: `connections` (connections whose handler runs: the
`relay_sessions_open` gauge; a TLS handshake is not a session yet), `accepted`, `rejected`
(by reason: refusals and evictions by stage, timeouts), `admission.counts()` per stage,
`admission.decisions` (every admission decision by stage and reason).
Every line a client can make repeat goes through `self.quiet` (runtime/log_rate.py).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import Counter
from functools import partial
from typing import Callable

from engine.admission import Admission, Cap, Limits, Stage, Ticket, address_key
from runtime import open_files, transport_cycle
from runtime.handshake_gate import LIGHT_HOLDS, HandshakeGate, Known
from runtime.log_rate import LogRate

log = logging.getLogger("relay.listener")

BACKLOG = 1024                 # listen backlog (somaxconn caps it; 4096 on current Linux)
ACCEPT_BATCH = 256             # accepts per wake-up (each only admitted and queued: cheap)
RESUME_PROBE_SECONDS = 0.25    # paused: how often free descriptors are looked for
# accept() errors that mean "no resources now", not "this client": pause, then retry.
_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}

# every listener's connections, and the clients of this process, freed as they end
transport_cycle.install()


def open_limits(max_connections: int) -> Limits:
    """Every stage allowed up to the total: admission as a plain connection cap."""
    cap = Cap(max_connections, max_connections)
    return Limits(max_connections, cap, cap, cap)


class Listener:
    name = "listener"   # for logs and metrics: "trueseal_push", ...
    protocol = ""       # metrics label: the protocol this listener speaks
    light_holds = LIGHT_HOLDS   # connections an address may hold and still be light
    # TLS by asyncio on accepted sockets, after admission: None = plain TCP (or a listener
    # that runs TLS in its own protocol, as Heya does). The PPP listener sets it when it has
    # a certificate.
    accept_tls = None
    accept_tls_handshake_timeout = 10.0

    def __init__(self, host: str, port: int, max_connections: int, *,
                 limits: Limits | None = None, backlog: int = BACKLOG,
                 open_files_reserve: int = open_files.DEFAULT_RESERVE):
        """`limits`: the admission budgets (default: `max_connections` for everything).
        `open_files_reserve`: descriptors this listener leaves to the rest of the process."""
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.backlog = backlog
        self.open_files_reserve = open_files_reserve
        self.admission = Admission(limits or open_limits(max_connections))
        self.connections = 0    # handlers running: the `relay_sessions_open` gauge
        # Plain counters bumped on the event loop and read by the metrics endpoint
        # (runtime/metrics.py): requests this listener stored and acknowledged, and those it
        # refused, by reason. A shell counts; it never talks to Prometheus itself.
        self.accepted = 0
        self.rejected: Counter[str] = Counter()
        self.pauses = 0         # times accepting stopped near the descriptor limit
        self.quiet = LogRate()
        self.known = Known()
        self.gate = HandshakeGate(self.handshake_lane)
        self._server = None
        self._handlers: set[asyncio.Task] = set()
        self._opening: set[asyncio.Task] = set()

    def admissions(self) -> list:
        """What the heap trimmer watches for waves of ended connections
        (runtime/memory_trim.py): this listener's admission, and any other connection counts
        it keeps (cursor-sync's iroh endpoint)."""
        return [self.admission]

    async def serve(self, reader, writer, ticket: Ticket | None) -> None:
        raise NotImplementedError

    # --- lifecycle --------------------------------------------------------------------------
    async def _start_server(self):
        """Hook: the server whose connections reach `_on_connect(reader, writer, ticket)`
        (the Heya listener wraps `_accept_server()` with its TLS streams,
        `runtime/tls_stream.py`). Anything with `sockets`, `close()` and `wait_closed()`."""
        return self._accept_server()

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
        self.gate.close()
        for task in list(self._opening):
            task.cancel()
        await self._drain()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, *self._opening, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _drain(self) -> None:
        """Hook: wait for work the open connections started (e.g. stores owed an Ack), while
        they can still write their replies."""

    # --- accepting --------------------------------------------------------------------------
    def _accept_server(self) -> "AcceptServer":
        return AcceptServer(self, bind(self.host, self.port, self.backlog))

    def _protocol_for(self, ticket: Ticket) -> asyncio.BaseProtocol:
        """Hook: the protocol of one accepted connection (default: asyncio streams whose
        callback is `_on_connect`)."""
        return asyncio.StreamReaderProtocol(
            asyncio.StreamReader(),
            lambda reader, writer: self._on_connect(reader, writer, ticket))

    def _accepted(self, conn: socket.socket, peer) -> None:
        """A socket accept() returned (non-blocking already): admit it, then let it wait its
        turn in the handshake gate for its transport and protocol. Accepting stays cheap, so
        the listen queue drains faster than a flood fills it, and a known client's connection
        is opened ahead of the flood's (a flood of 1,100 connects a second kept a device's
        connect 1-2 s in the kernel's queue while each accepted connection was opened at
        once)."""
        ticket = self._admit(peer)
        if ticket is None:
            conn.close()   # trueseal interop §1: closed at once, nothing sent
            return
        ticket.closer = conn.close        # evicted while it waits: its socket is closed
        self.gate.submit(ticket.address, partial(self._start, conn, ticket),
                         partial(self._not_started, conn, ticket))

    def _start(self, conn: socket.socket, ticket: Ticket) -> bool:
        if not ticket.live:               # evicted while it waited: closed already
            return False
        ticket.closer = None              # the protocol sets its own once it has one
        task = asyncio.get_running_loop().create_task(self._open(conn, ticket))
        self._opening.add(task)
        task.add_done_callback(self._opening.discard)
        return True

    def _not_started(self, conn: socket.socket, ticket: Ticket) -> None:
        """Dropped from a full gate (or the listener closing): closed, nothing sent."""
        if ticket.live and not self.gate.closed:
            self.rejected["handshake_queue_full"] += 1
        conn.close()
        self.admission.release(ticket)

    async def _open(self, conn: socket.socket, ticket: Ticket) -> None:
        try:
            tls = {} if self.accept_tls is None else {
                "ssl": self.accept_tls,
                "ssl_handshake_timeout": self.accept_tls_handshake_timeout}
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: self._protocol_for(ticket), sock=conn, **tls)
        except asyncio.CancelledError:
            conn.close()
            self.admission.release(ticket)
            raise
        except Exception:   # e.g. the client reset it before it got its transport
            conn.close()
            self.admission.release(ticket)

    def _admit(self, peer) -> Ticket | None:
        host = peer[0] if isinstance(peer, tuple) and peer else ""
        decision = self.admission.admit(address_key(str(host)),
                                        asyncio.get_running_loop().time())
        self._evict(decision.evicted)
        if decision.ticket is None:
            self._refused(Stage.HANDSHAKE, decision.refused)
        return decision.ticket

    def advance(self, ticket: Ticket | None, stage: Stage, identity: str | None = None) -> bool:
        """The connection reached `stage` (AUTH also vouches for its address), as `identity`
        if it authenticated as one (a key, a certificate digest: its budget, engine/admission
        rule 1a). False: refused (every session of its address or identity there is
        mid-delivery, or the stage full and not to be evicted from); the shell closes the
        connection."""
        if ticket is None:
            return True
        decision = self.admission.advance(ticket, stage, asyncio.get_running_loop().time(),
                                          identity=identity)
        self._evict(decision.evicted)
        if decision.ticket is None:
            self._refused(stage, decision.refused)
            return False
        if stage is Stage.AUTH:
            self.vouch(ticket)
        return True

    def vouch(self, ticket: Ticket | None) -> None:
        """The connection proved its client (authenticated, or a push was stored): its
        address's handshakes go first for a while (`handshake_lane`)."""
        if ticket is not None:
            self.known.add(ticket.address, asyncio.get_running_loop().time())

    def handshake_lane(self, key: str) -> int:
        """The gate's lane for an address's handshake steps (runtime/handshake_gate.py)."""
        if (self.known.knows(key, asyncio.get_running_loop().time())
                and self.admission.count_of(key, Stage.HANDSHAKE) <= self.light_holds):
            return 0
        return 1 if self.admission.held_by(key) <= self.light_holds else 2

    async def handshake_turn(self, ticket: Ticket | None, deadline: float,
                             on_timeout: Callable[[], object]) -> bool:
        """A coroutine shell's wait for its connection's turn at the gate, within the
        handshake `deadline` (loop time): True to run the step; False when the deadline
        passed first (`on_timeout()`) or the gate dropped the step (`handshake_queue_full`),
        and the shell closes the connection."""
        key = ticket.address if ticket is not None else None
        try:
            async with asyncio.timeout_at(deadline):
                if await self.gate.turn(key):
                    return True
        except TimeoutError:
            on_timeout()
            return False
        self.rejected["handshake_queue_full"] += 1
        return False

    def touch(self, ticket: Ticket | None) -> None:
        """An application message went either way on the connection (keep-alives do not
        count): it is not the idle one its address or identity loses at its cap."""
        if ticket is not None:
            self.admission.touch(ticket, asyncio.get_running_loop().time())

    def release(self, ticket: Ticket | None) -> None:
        """The connection is gone: its slot is free, and its closer and `delivering` (usually
        methods of the connection, which holds the ticket: a reference cycle) are dropped."""
        if ticket is not None:
            self.admission.release(ticket)
            ticket.closer = None
            ticket.delivering = None

    def _evict(self, tickets) -> None:
        for ticket in tickets:
            stage = ticket.stage.name.lower()
            self.rejected[f"evicted_{stage}"] += 1
            if (dropped := self.quiet.allow(("evicted", stage))) is not None:
                log.info("connection evicted for a newcomer", extra={
                    "event": "connection_evicted", "listener": self.name, "stage": stage,
                    "suppressed": dropped})
            ticket.close()

    def _refused(self, stage: Stage, reason: str | None) -> None:
        name = stage.name.lower()
        self.rejected[f"{name}_{reason}"] += 1
        if (dropped := self.quiet.allow(("refused", name, reason))) is not None:
            log.warning("connection refused", extra={
                "event": "admission_refused", "listener": self.name, "stage": name,
                "reason": reason, "suppressed": dropped})

    async def send(self, writer, data: bytes, close_core: Callable[[], object],
                   timeout: float) -> None:
        """Write `data` and wait, at most `timeout`, until the client has taken it: one that
        stops reading is closed (`write_stalled`), one whose connection broke `close_core`d."""
        if not data or writer.is_closing():
            return
        writer.write(data)
        try:
            async with asyncio.timeout(timeout):
                await writer.drain()
        except TimeoutError:   # before OSError: it is one
            self.write_stalled(close_core, writer.transport)
        except (ConnectionError, OSError):
            close_core()

    def write_stalled(self, close_core: Callable[[], object], transport) -> None:
        """A client stopped reading what we owe it: it only ever closes itself."""
        self.rejected["write_timeout"] += 1
        if (dropped := self.quiet.allow(("timeout", "write"))) is not None:
            log.info("client not reading; closed", extra={
                "event": "session_timeout", "listener": self.name,
                "waiting_for": "write", "suppressed": dropped})
        close_core()
        transport.abort()

    async def _on_connect(self, reader, writer, ticket: Ticket | None = None) -> None:
        if ticket is not None:
            if not ticket.live:          # evicted before its handler started
                writer.transport.abort()
                return
            ticket.closer = writer.transport.abort
        self.connections += 1
        task = asyncio.current_task()
        self._handlers.add(task)
        try:
            await self.serve(reader, writer, ticket)
        except asyncio.CancelledError:
            pass
        finally:
            self._handlers.discard(task)
            self.connections -= 1
            self.release(ticket)


def bind(host: str | None, port: int, backlog: int) -> socket.socket:
    """A listening, non-blocking TCP socket on `host:port` (the first address it resolves to;
    "" or None: all IPv4 interfaces)."""
    infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM,
                               flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException as e:
        sock.close()
        if isinstance(e, OSError):
            e.port = port   # for the operator's line (runtime/operator_errors.py)
        raise
    return sock


class AcceptServer:
    """One listening socket and its accept loop (see the module docstring); the
    `asyncio.Server` names a listener uses (`sockets`, `close`, `wait_closed`)."""

    def __init__(self, listener: Listener, sock: socket.socket):
        self._listener = listener
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._ceiling = open_files.ceiling(listener.open_files_reserve)
        self._retry: asyncio.TimerHandle | None = None
        self._paused_at: float | None = None
        self._closed = False
        self._loop.add_reader(sock.fileno(), self._ready)

    @property
    def sockets(self) -> list[socket.socket]:
        return [] if self._closed else [self._sock]

    def is_serving(self) -> bool:
        return not self._closed and self._paused_at is None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
        if self._paused_at is None:
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()

    async def wait_closed(self) -> None:
        return None

    def _ready(self) -> None:
        lst = self._listener
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRNOS:
                    self._pause(errno.errorcode.get(exc.errno, "resource"))
                else:
                    if (dropped := lst.quiet.allow("accept_failed")) is not None:
                        log.error("accept failed", extra={
                            "event": "accept_failed", "listener": lst.name,
                            "error": type(exc).__name__, "suppressed": dropped})
                return
            if conn.fileno() >= self._ceiling:
                # The lowest free descriptor is in the reserve: keep it for the process.
                conn.close()
                lst.rejected["open_files"] += 1
                self._pause("reserve")
                return
            conn.setblocking(False)
            lst._accepted(conn, peer)

    def _pause(self, why: str) -> None:
        lst = self._listener
        self._loop.remove_reader(self._sock.fileno())
        self._paused_at = self._loop.time()
        lst.pauses += 1
        if (dropped := lst.quiet.allow("paused")) is not None:
            log.warning("descriptors near the process limit: not accepting", extra={
                "event": "listener_paused", "listener": lst.name, "reason": why,
                "suppressed": dropped})
        self._retry = self._loop.call_later(RESUME_PROBE_SECONDS, self._probe)

    def _probe(self) -> None:
        self._retry = None
        if self._closed:
            return
        free = open_files.lowest_free()
        if free is None or free >= self._ceiling:
            self._retry = self._loop.call_later(RESUME_PROBE_SECONDS, self._probe)
            return
        lst = self._listener
        paused = self._loop.time() - self._paused_at
        self._paused_at = None
        self._loop.add_reader(self._sock.fileno(), self._ready)
        if (dropped := lst.quiet.allow("resumed")) is not None:
            log.info("accepting again", extra={
                "event": "listener_resumed", "listener": lst.name,
                "paused_seconds": round(paused, 3), "suppressed": dropped})


class Deadline:
    """One connection's client deadline: `at(when, what)` arms (or moves) it, `clear()`
    disarms it; when it passes, `on_expiry(what)` runs once. `when` is loop time."""

    __slots__ = ("_loop", "_on_expiry", "_handle", "when", "what")

    def __init__(self, on_expiry: Callable[[str], None]):
        self._loop = asyncio.get_running_loop()
        self._on_expiry = on_expiry
        self._handle: asyncio.TimerHandle | None = None
        self.when: float | None = None
        self.what = ""

    def at(self, when: float, what: str) -> None:
        if self._handle is not None:
            if when == self.when and what == self.what:
                return
            self._handle.cancel()
        self.when, self.what = when, what
        self._handle = self._loop.call_at(when, self._fire)

    def clear(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self.when = None

    def close(self) -> None:
        """Disarm for good and drop the callback: it is usually a method of the connection
        that owns this deadline, a reference cycle that only a full collection would free
        (thousands at once when a flood leaves)."""
        self.clear()
        self._on_expiry = _never

    def _fire(self) -> None:
        self._handle = None
        self.when = None
        self._on_expiry(self.what)


def _never(_what: str) -> None:
    pass


class RecordClock:
    """Where a client is in a stream of `[length][record]` records (big-endian length of
    `prefix` bytes), without a copy of the bytes: for a deadline inside a record (a minimum
    byte rate), so a client cannot hold a connection by dripping one record forever.

    `feed(data, now)` after each read; then `partial` (a record is under way), `length` (its
    announced length, once the prefix is in), `started` (when its first byte came) and
    `completed` (records finished so far)."""

    __slots__ = ("prefix", "_head", "_left", "partial", "length", "started", "completed")

    def __init__(self, prefix: int = 2):
        self.prefix = prefix
        self._head = b""
        self._left = 0
        self.partial = False
        self.length = 0
        self.started = 0.0
        self.completed = 0

    def feed(self, data: bytes, now: float) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if not self.partial:
                self.partial, self.started, self.length = True, now, 0
            if self._left:
                take = min(self._left, n - pos)
                self._left -= take
                pos += take
            else:
                need = self.prefix - len(self._head)
                self._head += data[pos:pos + need]
                pos += min(need, n - pos)
                if len(self._head) < self.prefix:
                    break
                self.length = self._left = int.from_bytes(self._head, "big")
                self._head = b""
            if not self._left and not self._head:
                self.partial = False
                self.completed += 1
