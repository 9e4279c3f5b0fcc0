"""cursor-sync for stock 0k-sync clients: an iroh endpoint with ALPN `/0k-sync/1`.

0k-sync's clients reach their relay over iroh: QUIC with TLS 1.3 raw Ed25519 public keys
(RFC 7250), and the device id is the connection's remote endpoint id (cursor-sync-interop §1.1,
§4). aioquic can do neither, so this endpoint uses iroh itself (the `iroh` Python bindings: the
QUIC and TLS are iroh's Rust code). What it speaks is the seed relay's wire (interop §1-3):

* one client-opened bidirectional stream per request: `u32_be(len) ‖ MessagePack`, one frame,
  the length checked against `sync.max_message_size` as soon as its four bytes are in
  (ST-001); the answer is one frame and FIN, or the empty FIN of every refusal (ERROR to
  version-2 sessions);
* NOTIFY on a relay-opened unidirectional stream, one frame and FIN;
* the device id is `connection.remote_id()`, so the session starts at AWAIT_HELLO
  (`Session.identified`): no Auth exchange, which only the aioquic listener needs;
* connection closes: 1 "rate limited" (connections per device id per minute), 2 "too many
  sessions" (F-007), 3 "hello timeout" (F-006), 4 "device revoked".

Requests are the same handlers as the aioquic listener's (`ingress/sync_requests.py`) over the
same `SyncServer` state, so a group's devices share cursors, PULLs and NOTIFYs whichever
transport each uses. The endpoint's secret key is `<data>/keys/sync_iroh.key` (hex, 0600,
created once), so its endpoint id survives restarts (0k-sync's relay makes a new one at every
start, interop §1.1). iroh's relay servers and discovery are off unless `sync.iroh_discovery`:
then the n0 preset (public relays and DNS discovery) is used and clients may dial by id alone.

Hostile clients: new connections past `max_handshakes` in handshake are refused; past
`retry_above_handshakes` an unvalidated address must first echo a QUIC Retry; a handshake not
done within `handshake_timeout_seconds` is dropped. Before HELLO a connection may have
`max_streams_before_hello` request streams open, after it `max_streams_per_connection`; each
request must arrive whole within `stream_read_timeout_seconds` (empty FIN otherwise). Not
bounded here: the bindings (iroh 1.2.0) expose no transport config, so each stream's receive
window is quinn's default (1.25 MB, granted at the handshake and never taken back): before
HELLO one connection can make the relay buffer up to `max_streams_before_hello` x 1.25 MB for
`stream_read_timeout_seconds` (the aioquic listener: 16 KiB a stream).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from pathlib import Path

import iroh

from engine.sync import ALPN
from engine.sync import messages as m
from engine.sync.framing import frame
from engine.sync.session import CLOSE_RATE_LIMITED, CLOSE_TOO_MANY_SESSIONS, Session
from runtime import keys
from runtime.config import Settings

from .sync_requests import SyncRequests, drain, unix_now

log = logging.getLogger("relay.ingress.sync")

IROH_KEY_FILE = "sync_iroh.key"
ALPN_BYTES = ALPN.encode()
# Relay-opened unidirectional streams one connection may have in flight. A 0k-sync client never
# accepts them (interop §2.4), so once its stream credit is spent an open waits for ever: past
# this many, a NOTIFY is dropped (a hint; PULL returns everything) instead of queued.
UNI_IN_FLIGHT = 4


def secret_key(settings: Settings) -> bytes:
    """The endpoint's Ed25519 secret (32 bytes): `sync.iroh_key_file`, or
    `<data>/keys/sync_iroh.key`, created on first use."""
    conf = settings.sync
    if conf.iroh_key_file:
        return keys._load(Path(conf.iroh_key_file)).private_bytes
    return keys.load_or_create(settings.data_dir, IROH_KEY_FILE).private_bytes


def endpoint_id(settings: Settings) -> str:
    """What a 0k-sync client dials (64 hex, `relay keys` prints it)."""
    return str(iroh.SecretKey.from_bytes(secret_key(settings)).public())


class Wave:
    """The iroh endpoint's connections as the heap trimmer counts a listener's admission
    (runtime/memory_trim.py: `total`, `peak`, `released`, `reset_peak`): iroh's connections
    pass no `Admission`, and a wave of them that timed out left the ingress holding their
    memory (the hostile suite: +52% after 1,537 idle connections from one address)."""

    def __init__(self) -> None:
        self.total = self.peak = self.released = 0

    def opened(self) -> None:
        self.total += 1
        self.peak = max(self.peak, self.total)

    def ended(self) -> None:
        self.total -= 1
        self.released += 1

    def reset_peak(self) -> None:
        self.peak = self.total


class IrohEndpoint:
    """The iroh side of the cursor-sync listener, sharing `server`'s state."""

    def __init__(self, server, settings: Settings):
        self.server = server
        self.settings = settings
        self.conf = settings.sync
        self.endpoint: iroh.Endpoint | None = None
        self.conns: set[IrohConnection] = set()
        self.handshaking = 0
        self.wave = Wave()
        self._accept_task: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()

    @property
    def id(self) -> str:
        assert self.endpoint is not None, "not started"
        return str(self.endpoint.id())

    @property
    def addresses(self) -> list[str]:
        assert self.endpoint is not None, "not started"
        return [a for a in self.endpoint.bound_sockets() if not a.startswith("[::]")]

    @property
    def bound_port(self) -> int:
        return int(self.addresses[0].rsplit(":", 1)[1])

    async def start(self) -> None:
        conf = self.conf
        options = iroh.EndpointOptions(
            preset=iroh.preset_n0() if conf.iroh_discovery else iroh.preset_minimal(),
            bind_addr=f"{self.settings.bind}:{conf.iroh_port}",
            secret_key=secret_key(self.settings),
            alpns=[ALPN_BYTES],
            relay_mode=iroh.RelayMode.default_mode() if conf.iroh_discovery
            else iroh.RelayMode.disabled())
        self.endpoint = await iroh.Endpoint.bind(options)
        self._accept_task = asyncio.create_task(self._accept_loop(), name="sync-iroh-accept")
        log.info("iroh endpoint started", extra={
            "event": "listener_started", "listener": "sync-iroh", "port": self.bound_port,
            "endpoint_id": self.id, "discovery": conf.iroh_discovery})

    async def close(self) -> None:
        await drain(self.conns, self.conf.push_ack_timeout_seconds)
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._pending):
            task.cancel()
        if self.endpoint is not None:
            await self.endpoint.close()

    # --- accepting ---------------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        assert self.endpoint is not None
        while True:
            incoming = await self.endpoint.accept_next()
            if incoming is None:
                return
            task = asyncio.ensure_future(self._accept(incoming))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _accept(self, incoming: iroh.Incoming) -> None:
        srv, conf = self.server, self.conf
        if self.handshaking >= conf.max_handshakes:
            srv.rejected["handshake_full"] += 1
            await incoming.refuse()
            return
        if self.handshaking >= conf.retry_above_handshakes \
                and not await incoming.remote_addr_validated():
            srv.retries += 1
            await incoming.retry()         # stateless: a spoofed source never comes back
            return
        self.handshaking += 1
        self.wave.opened()
        try:
            try:
                async with asyncio.timeout(conf.handshake_timeout_seconds):
                    conn = await (await incoming.accept()).connect()
            except Exception:
                srv.rejected["handshake_timeout"] += 1
                return
            finally:
                self.handshaking -= 1
            await IrohConnection(self, conn).run()
        finally:
            self.wave.ended()


class IrohConnection(SyncRequests):
    """One iroh connection: requests read stream by stream, handled in order of arrival."""

    def __init__(self, endpoint: IrohEndpoint, conn: iroh.Connection):
        self.endpoint = endpoint
        self.server = endpoint.server
        self.conf = endpoint.conf
        self.conn = conn
        self.session = Session.identified(conn.remote_id().to_bytes())
        self.requests: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()     # PUSHes being stored (SyncRequests)
        self.io: set[asyncio.Task] = set()        # stream reads and writes
        self.closed = False
        self.draining = False
        self.registered = False
        self.uni_in_flight = 0
        self.hello_timer: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return f"IrohConnection({self.session!r})"

    async def run(self) -> None:
        srv, conf = self.server, self.conf
        # 0k-sync `protocol.rs:38-58`: the device's connection rate, then the session cap.
        if not srv.connect_limit.take(self.device_id, time.monotonic()):
            srv.rejected["rate_limited"] += 1
            self.conn.close(CLOSE_RATE_LIMITED, b"rate limited")
            return
        if len(srv.conns) + len(self.endpoint.conns) >= conf.max_concurrent_sessions:
            srv.rejected["session_cap"] += 1
            self.conn.close(CLOSE_TOO_MANY_SESSIONS, b"too many sessions")
            return
        self.endpoint.conns.add(self)
        srv.count_sessions()
        self.conn.set_max_concurrent_bi_streams(conf.max_streams_before_hello)
        self.conn.set_max_concurrent_uni_streams(0)      # the relay reads none
        loop = asyncio.get_running_loop()
        self.hello_timer = loop.call_later(conf.hello_timeout_seconds, self._hello_timeout)
        worker = asyncio.ensure_future(self._work())
        try:
            while not self.closed:
                try:
                    bi = await self.conn.accept_bi()
                except Exception:
                    break                                 # closed by the peer or by us
                self._spawn(self._read(bi))
        finally:
            worker.cancel()
            self._on_closed()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.io.add(task)
        task.add_done_callback(self.io.discard)

    async def _read(self, bi: iroh.BiStream) -> None:
        """One request frame, whole within `stream_read_timeout_seconds`, or None (the
        handler answers it with an empty FIN, as 0k-sync does for every bad frame).

        Read in chunks of at most the rest of a largest frame: a frame that arrived whole (a
        PUSH of a few KiB is one or two packets) costs one async call across the bindings,
        where a prefix read then a body read cost two (each call is a Rust future completed
        through a cross-thread wake-up of this loop, ~0.05 ms: `relay bench`'s sync section).
        The length is checked as soon as its four bytes are in (ST-001): nothing past the
        first chunk is read for a frame over the cap, and no chunk reaches past a largest
        frame. The answer does not wait for the client's FIN (0k-sync reads one frame)."""
        recv, body, cap = bi.recv(), None, self.conf.max_message_size
        try:
            async with asyncio.timeout(self.conf.stream_read_timeout_seconds):
                buf, need = b"", 4
                while len(buf) < need:
                    chunk = await recv.read(4 + cap - len(buf))
                    if not chunk:
                        break                             # FIN inside the frame
                    buf += chunk
                    if need == 4 and len(buf) >= 4:
                        (n,) = struct.unpack(">I", buf[:4])
                        if n > cap:                       # ST-001
                            break
                        need = 4 + n
                if need > 4 and len(buf) >= need:
                    body = buf[4:need]
        except Exception:
            pass
        if body is None:
            self.server.rejected["malformed"] += 1
        self.requests.put_nowait((bi, body))

    def _on_closed(self) -> None:
        if self.closed and self not in self.endpoint.conns:
            return
        self.closed = True
        self.endpoint.conns.discard(self)
        self.server.count_sessions()
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.registered and self.session.group_id is not None:
            self.server.inbox.unregister(self.session.group_id, self)
            self.server.last_seen[(self.session.group_id, self.device_id)] = unix_now()
            self.registered = False

    # --- the transport's part of SyncRequests --------------------------------------------------
    def _hello_accepted(self) -> None:
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self.conn.set_max_concurrent_bi_streams(self.conf.max_streams_per_connection)

    def _respond(self, bi: iroh.BiStream, msg: m.Message | bytes | None, *,
                 fin: bool = True) -> None:
        if self.closed:
            return
        data = frame(msg if isinstance(msg, bytes) else m.encode(msg),
                     self.conf.max_message_size) if msg is not None else b""
        self._spawn(self._write(bi.send(), data, fin))

    @staticmethod
    async def _write(send: iroh.SendStream, data: bytes, fin: bool) -> None:
        try:
            if data:
                await send.write_all(data)
            if fin:
                await send.finish()
        except Exception:
            pass                       # the stream or connection is gone

    def send_uni(self, msg: m.Message | bytes) -> None:
        if self.closed:
            return
        if self.uni_in_flight >= UNI_IN_FLIGHT:
            self.server.rejected["uni_blocked"] += 1
            return
        self.uni_in_flight += 1
        self._spawn(self._send_uni(frame(msg if isinstance(msg, bytes) else m.encode(msg))))

    async def _send_uni(self, data: bytes) -> None:
        try:
            send = await self.conn.open_uni()
            await send.write_all(data)
            await send.finish()
        except Exception:
            pass
        finally:
            self.uni_in_flight -= 1

    def close(self, code: int = 0, reason: str = "") -> None:
        if self.closed:
            return
        try:
            self.conn.close(code, reason.encode())
        except Exception:
            pass
        self._on_closed()
