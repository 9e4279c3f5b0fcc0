"""The cursor-sync listener: QUIC (aioquic) with ALPN `/0k-sync/1`, hosted by the ingress node.

Wire (cursor-sync-interop §1): the client opens one bidirectional stream per request and
writes one frame `u32_be(len) ‖ MessagePack`; the relay answers one frame and FIN, or an empty
FIN on any refusal (ERROR instead for clients that ask, `engine/sync/session.py`). NOTIFY,
DEVICE_REVOKED and relayed CONTENT_REF / CONTENT_ACK go out on relay-opened unidirectional
streams, one frame each. Connection closes: code 1 "rate limited", 2 "too many sessions"
(0k-sync), 3 "auth failed" / "hello timeout", 4 "device revoked" (ours).

Requests of one connection are taken in order (0k-sync handles streams sequentially); a PUSH
is checked in that order and then completes on its own task, because its PUSH_ACK waits for
the inbox commit that assigns its cursor (landing commit, then a stream micro-batch): a
client pipelining pushes on several streams is not held to one push per micro-batch.

The protocol decisions (state table, limits, identity checks) are `engine/sync`'s; this shell
owns sockets, timers, the landing appender, the control plane and the inbox view. It never
logs an id, a key, a group id, a payload, an address or a connection id.

Hostile clients (issue 19). Every connection holds a slot of the listener's `Admission`
(engine/admission.py) from its first Initial: HANDSHAKE until the QUIC handshake is done,
UNAUTH until its HELLO is accepted (the identity challenge included), AUTH after (the device
id its identity: `max_sessions_per_device`; past the handshake an address or device at its
cap loses its session idle longest, no request or NOTIFY, and not mid-delivery, to the
newcomer). Before any
state is kept for a new connection, `AdmittingServer` decides: while the relay is under load
(`retry_above_handshakes` connections in handshake, or `retry_above_handshakes_per_address`
of its address) the client must first echo a stateless Retry token, so a spoofed-source flood
creates nothing; then the connection must be admitted, or its Initial is dropped unanswered.
A handshake not done within `handshake_timeout_seconds` is dropped silently and its state
freed (aioquic alone keeps it for the idle timeout, renewed by every packet). Per connection,
at most `max_streams_before_hello` request streams are open at once before HELLO and
`max_streams_per_connection` after (aioquic's 128 before), and the client may open no
unidirectional stream; each request stream may carry `stream_window_before_hello` bytes
before HELLO and one largest frame after
(`BoundedStreams`: aioquic doubled a stream's window whenever half of it was used, gaps
included, so out-of-order bytes could grow without end), which bounds what one connection can
make the relay hold.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import secrets
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Callable

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, _encode_invalid_token_close
from aioquic.buffer import Buffer
from aioquic.quic.configuration import SMALLEST_MAX_DATAGRAM_SIZE, QuicConfiguration
from aioquic.quic.connection import (MAX_STREAM_DATA_FRAME_CAPACITY, Limit, NetworkAddress,
                                     QuicConnection)
from aioquic.quic.events import (ConnectionTerminated, HandshakeCompleted, QuicEvent,
                                 StreamDataReceived, StreamReset)
from aioquic.quic.packet import (QuicFrameType, QuicPacketType, encode_quic_retry,
                                 pull_quic_header)

from delta_tables.group_commit import DeltaAppendTarget, GroupCommitAppender
from delta_tables.layout import Layout
from delta_tables.schema import ACKS
from delta_tables.sync_control import SyncControl
from egress.inbox_tail import InboxTail
from egress.sync_inbox import SyncInbox, decode_meta
from engine.admission import Cap, Limits, Stage, Ticket, address_key
from engine.fair_queue import FairQueue
from engine.work_budget import WorkBudget
from engine.sync import ALPN, PROTOCOL, identity
from engine.sync import messages as m
from engine.sync.framing import FrameError, FrameReader, frame
from engine.sync.session import (CLOSE_AUTH_FAILED, CLOSE_RATE_LIMITED, CLOSE_TOO_MANY_SESSIONS,
                                 Session, State)
from engine.sync.token_bucket import KeyedBuckets, TokenBucket
from runtime.config import Settings
from runtime import logs, tls, udp_endpoint
from runtime.handshake_gate import LANES
from runtime.listener import Listener
from runtime.log_rate import LogRate
from runtime.push_desk import PushDesk, desk_dir
from runtime.teardown import TEARDOWN

from .push_backends import SyncDesk
from .sync_requests import ContentWaiting, SyncRequests, drain, unix_now

log = logging.getLogger("relay.ingress.sync")
if not logs.libraries_loud():   # aioquic logs connection ids per event
    logging.getLogger("quic").setLevel(logging.WARNING)

# --- certificate ----------------------------------------------------------------------------

def load_or_create_cert(settings: Settings) -> tuple[Path, Path]:
    """`sync.cert_file` / `sync.key_file`, or `<data>/keys/sync_server.{crt,key}` created on
    first start (ECDSA P-256, self-signed, 10 years; clients pin its SHA-256, `relay keys`)."""
    return tls.load_or_create_server_cert(settings.data_dir, settings.sync.cert_file,
                                          settings.sync.key_file, listener="sync")


cert_der = tls.server_cert_der


# --- what aioquic logs ----------------------------------------------------------------------

class _QuicLines(logging.Filter):
    """aioquic's one WARNING left on a server (`[<connection id>] Error: <code>, reason: ...`
    each time a peer breaks the protocol: no common ALPN, a flow-control violation, ...) names
    the connection and comes once per connection a client chooses to break: it is dropped and
    told as one rate-limited `sync_quic_error` line per error code instead."""

    _CODE = re.compile(r"Error: (\d+)")

    def __init__(self) -> None:
        super().__init__()
        self.quiet = LogRate()

    def filter(self, record: logging.LogRecord) -> bool:
        found = self._CODE.search(str(record.msg))
        code = int(found.group(1)) if found else None
        if record.levelno < logging.WARNING:   # only with RELAY_LOG_LIBRARIES=all
            return True                          # (then redacted as every line)
        if (dropped := self.quiet.allow(code)) is not None:
            log.info("QUIC connection closed for a protocol error", extra={
                "event": "sync_quic_error", "error_code": code, "suppressed": dropped})
        return False


logging.getLogger("quic").addFilter(_QuicLines())


# --- QUIC transport: admission before state, Retry under load, bounded streams --------------

# The most a closed connection lingers in its closing or draining state (BoundedStreams): three
# PTOs of a 300 ms mobile round trip fit.
CLOSE_PERIOD_MAX_SECONDS = 1.5

# A request stream's window once HELLO is accepted: one largest frame with its length prefix,
# and a little room to spare (bytes past the request are read no further).
STREAM_WINDOW_SLACK = 1024


def sync_limits(conf) -> Limits:
    """The sync listener's budgets. AUTH (HELLO accepted) is capped by
    `max_concurrent_sessions` too; the shell also refuses, at the end of a handshake, a
    connection that would make UNAUTH + AUTH exceed it (F-007, code 2). The overall total is
    the sum of the stages', so it never binds before them (admission rule 4 keeps a handshake
    slot free)."""
    return Limits(
        total=conf.max_handshakes + conf.max_unauth_sessions + conf.max_concurrent_sessions,
        handshake=Cap(conf.max_handshakes, conf.max_handshakes_per_address),
        unauth=Cap(conf.max_unauth_sessions, conf.max_unauth_sessions_per_address),
        auth=Cap(conf.max_concurrent_sessions, conf.max_sessions_per_address),
        per_identity=conf.max_sessions_per_device)


# Every finished handshake's staging buffers (BoundedStreams.handshake_done): always empty.
SPENT_CRYPTO_BUFFER = Buffer(capacity=0)


class _FrameHandlers:
    """aioquic's table of frame handlers, shared. aioquic builds it for every connection: 34
    bound methods, each with a new frozenset of the epochs it may come in (~14 KiB, 100+
    objects a connection, all the same). Here one table of (method name, epochs) is taken
    from the first connection and a handler is bound when a frame asks for it. The weak
    reference keeps the connection out of a reference cycle."""

    __slots__ = ("_conn",)
    _table: dict[int, tuple[str, frozenset]] | None = None

    def __init__(self, conn: QuicConnection, own: dict):
        cls = type(self)
        if cls._table is None:
            cls._table = {ft: (handler.__func__.__name__, epochs)
                          for ft, (handler, epochs) in own.items()}
        self._conn = weakref.ref(conn)

    def __getitem__(self, frame_type: int) -> tuple[Callable, frozenset]:
        name, epochs = self._table[frame_type]     # KeyError: aioquic's "Unknown frame type"
        return getattr(self._conn(), name), epochs


class BoundedStreams(QuicConnection):
    """A server connection whose client streams have fixed receive windows.

    aioquic doubles a stream's window (MAX_STREAM_DATA) whenever the peer has sent past half
    of it, and counts a gap as sent: a peer writing ever further ahead made it allocate ever
    larger out-of-order buffers. Here every request stream's window is `stream_window`
    (before HELLO `stream_window_before_hello`, room for the identity exchange, a Join and a
    HELLO; after, one largest frame: all the relay reads from one stream), and a client may
    have `max_streams` request streams open at once and no unidirectional stream (the relay
    reads none). One connection can make the relay hold at most `max_streams` windows;
    `accepted_hello` widens both."""

    def __init__(self, *, max_streams: int, stream_window: int, **kwargs):
        super().__init__(**kwargs)
        self._QuicConnection__frame_handlers = _FrameHandlers(
            self, self._QuicConnection__frame_handlers)
        self.stream_window = stream_window
        self.max_streams = max_streams        # open at once
        self._local_max_streams_bidi = Limit(QuicFrameType.MAX_STREAMS_BIDI, "max_streams_bidi",
                                             max_streams)
        self._local_max_streams_uni = Limit(QuicFrameType.MAX_STREAMS_UNI, "max_streams_uni", 0)

    def _close_begin(self, is_initiator: bool, now: float) -> None:
        """The closing or draining period (RFC 9000 §10.2: 3 PTO) is capped at
        `CLOSE_PERIOD_MAX_SECONDS`. The PTO follows the RTT this connection measured, and a
        handshake measured while the relay was busy can make it seconds: after a flood, the
        hostile-load suite saw 2,000 closed connections keep their whole state (~60 KiB each)
        for up to 11 s. A packet that comes later for a forgotten connection id is dropped."""
        super()._close_begin(is_initiator, now)
        self._close_at = min(self._close_at, now + CLOSE_PERIOD_MAX_SECONDS)

    def handshake_done(self) -> None:
        """The TLS handshake is over: aioquic's staging buffers for outgoing CRYPTO data (16 KiB
        for each of three epochs, allocated at the first packet and kept for the connection's
        life) give way to one shared empty buffer. With the shared frame table, an idle
        session's resident memory fell from ~88 to ~60 KiB (hostile-load suite). What
        they staged went to the crypto streams at once (`_push_crypto_data`), and a server's
        TLS writes nothing after its Finished (any later handshake message is refused with an
        alert before a byte is written; QUIC has no TLS KeyUpdate)."""
        self._crypto_buffers = dict.fromkeys(self._crypto_buffers, SPENT_CRYPTO_BUFFER)

    def accepted_hello(self, stream_window: int, max_streams: int) -> None:
        """HELLO was accepted: one largest frame per stream, and `max_streams` of them open
        at once (aioquic announces the new limit in its next MAX_STREAMS frame)."""
        self.stream_window = stream_window
        if max_streams > self.max_streams:
            # the limit counts streams ever allowed; aioquic adds one per finished stream
            self._local_max_streams_bidi.value += max_streams - self.max_streams
            self.max_streams = max_streams

    def _write_stream_limits(self, builder, space, stream) -> None:
        if not stream.max_stream_data_local or stream.receiver.is_finished:
            return          # a stream the relay opened, or one whose request is all in
        if stream.max_stream_data_local < self.stream_window:
            stream.max_stream_data_local = self.stream_window      # HELLO was accepted
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            buf = builder.start_frame(QuicFrameType.MAX_STREAM_DATA,
                                      capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                                      handler=self._on_max_stream_data_delivery,
                                      handler_args=(stream,))
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local


SWEEP_SECONDS = 5.0        # SyncServer._loop_sweep

# New connections started per event-loop turn (~1 ms of CPU each); the sessions' packets read
# in the same turn go first.
INITIALS_PER_TURN = 8
# New connections' CPU the listener may spend at once past `new_connection_cpu_share`
# (~30 whole handshakes here): a burst of real newcomers on a quiet relay does not wait.
BUDGET_BURST_SECONDS = 0.25


class AdmittingServer(QuicServer):
    """aioquic's server, deciding before a new connection costs anything.

    An Initial that would open a connection (unknown destination id, full size, a version we
    speak) gets a Retry while the relay is under load (`SyncServer.needs_retry`): stateless,
    its token (aioquic's: the client's address and port, 30 s) must come back before anything
    is kept, so a spoofed-source flood creates no state. Then the listener's `Admission` must
    grant it a HANDSHAKE slot, or the Initial is dropped unanswered (the client resends until
    its connect timeout, 30 s for 0k-sync); before that, its address must be within
    `handshakes_per_address_per_second`, so one address cannot spend the relay's CPU on
    handshakes the others then wait behind. Everything else is aioquic's."""

    def __init__(self, listener: "SyncServer", configuration: QuicConfiguration):
        super().__init__(configuration=configuration, create_protocol=listener._protocol,
                         retry=True)
        self.listener = listener
        # round-robin by source address (engine/fair_queue.py): a flood's Initials do not
        # queue ahead of another address's; in the lanes of the TCP listeners' handshake
        # gate (Listener.handshake_lane): known addresses, then light ones, then the rest
        self._initials: FairQueue = FairQueue(listener.conf.initial_queue,
                                              listener.conf.initial_queue_per_address,
                                              lanes=LANES)
        self._initials_scheduled = False
        self._initials_timer: asyncio.TimerHandle | None = None
        self.budget = listener.new_connections

    def datagram_received(self, data: bytes, addr: NetworkAddress) -> None:
        try:
            header = pull_quic_header(Buffer(data=data),
                                      host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            return
        if (header.packet_type != QuicPacketType.INITIAL or len(data) < SMALLEST_MAX_DATAGRAM_SIZE
                or header.version not in self._configuration.supported_versions
                or header.destination_cid in self._protocols):
            super().datagram_received(data, addr)   # a known connection, version negotiation
            return
        # A new connection waits its turn: sessions' packets first (runtime/udp_endpoint.py),
        # then by lane (known addresses, light ones, the rest), one address at a time.
        key = address_key(str(addr[0]))
        lane = self.listener.handshake_lane(key)
        if self._initials.push(key, (data, addr, header), lane=lane) is not None:
            self.listener.rejected["initial_queue_full"] += 1   # an oldest: likely resent

    def batch_done(self) -> None:
        """The endpoint read what it had: start up to `INITIALS_PER_TURN` new connections,
        and the rest on later turns, between the sessions' packets. Waiting for the budget,
        a known address's Initial still starts at once."""
        if not self._initials:
            return
        if not self._initials_scheduled or (self._initials_timer is not None
                                            and self._initials.next_lane() == 0):
            self._start_initials()

    def _start_initials(self) -> None:
        self._initials_scheduled = False
        if self._initials_timer is not None:
            self._initials_timer.cancel()
            self._initials_timer = None
        if self._transport is None or self._transport.is_closing():
            self._initials.clear()     # closed while they waited: nothing new is admitted
            return
        for _ in range(min(INITIALS_PER_TURN, len(self._initials))):
            if self._initials.next_lane() != 0:
                wait = self.budget.wait(self._loop.time())
                if wait > 0:
                    self._initials_scheduled = True
                    self._initials_timer = self._loop.call_later(wait, self._start_initials)
                    return
            data, addr, header = self._initials.pop()
            if header.destination_cid in self._protocols:   # a resent Initial, now known
                super().datagram_received(data, addr)
            else:
                self._new_connection(data, addr, header)
        if self._initials:
            self._initials_scheduled = True
            self._loop.call_soon(self._start_initials)

    def _new_connection(self, data: bytes, addr: NetworkAddress, header) -> None:
        started = time.thread_time()
        lst, now = self.listener, self._loop.time()
        key = address_key(str(addr[0]))
        if header.token:
            try:
                original = self._retry.validate_token(
                    address=addr, destination_cid=header.destination_cid, token=header.token,
                    now=now)
            except ValueError:     # not ours, expired or another address's (RFC 9000 §8.1.3)
                lst.rejected["retry_token_invalid"] += 1
                self._transport.sendto(_encode_invalid_token_close(
                    version=header.version, source_cid=header.destination_cid,
                    destination_cid=header.source_cid), addr)
                return
            retry_source = header.destination_cid
        elif lst.needs_retry(key):
            source = os.urandom(self._configuration.connection_id_length)
            lst.retries += 1
            self._transport.sendto(encode_quic_retry(
                version=header.version, source_cid=source, destination_cid=header.source_cid,
                original_destination_cid=header.destination_cid,
                retry_token=self._retry.create_token(
                    address=addr, original_destination_connection_id=header.destination_cid,
                    retry_source_connection_id=source, now=now)), addr)
            return
        else:
            original, retry_source = header.destination_cid, None
        if not lst.handshake_rate.take(key, now):
            lst._refused(Stage.HANDSHAKE, "rate")   # dropped: the client resends
            return
        ticket = lst._admit(addr)
        if ticket is None:
            return
        connection = BoundedStreams(
            configuration=self._configuration,
            original_destination_connection_id=original,
            retry_source_connection_id=retry_source,
            session_ticket_fetcher=self._session_ticket_fetcher,
            session_ticket_handler=self._session_ticket_handler,
            max_streams=lst.conf.max_streams_before_hello,
            stream_window=lst.conf.stream_window_before_hello)
        protocol = self._create_protocol(connection, stream_handler=self._stream_handler)
        protocol.connection_made(self._transport)
        protocol._connection_id_issued_handler = partial(self._connection_id_issued,
                                                         protocol=protocol)
        protocol._connection_id_retired_handler = partial(self._connection_id_retired,
                                                          protocol=protocol)
        protocol._connection_terminated_handler = partial(self._connection_terminated,
                                                          protocol=protocol)
        for cid in (header.destination_cid, connection.host_cid):
            self._connection_id_issued(cid, protocol)
        protocol.admitted(ticket)
        self.budget.spend(time.thread_time() - started, now)   # its first packet spends itself
        protocol.datagram_received(data, addr)

    # aioquic scans every connection id of the server to forget one connection; each
    # connection keeps its own here, so a wave of dropped handshakes costs no scans.
    def _connection_id_issued(self, cid: bytes, protocol: "SyncConnection") -> None:
        self._protocols[cid] = protocol
        protocol.cids.add(cid)

    def _connection_id_retired(self, cid: bytes, protocol: "SyncConnection") -> None:
        if self._protocols.get(cid) is protocol:
            del self._protocols[cid]
        protocol.cids.discard(cid)

    def _connection_terminated(self, protocol: "SyncConnection") -> None:
        for cid in protocol.cids:
            if self._protocols.get(cid) is protocol:
                del self._protocols[cid]
        protocol.cids.clear()


def _nothing(*_args, **_kwargs) -> None:
    pass


class _Terminated:
    """What a disposed connection's protocol holds in place of its `QuicConnection`: nothing
    to send, no timer, no events; anything else is a no-op (see `SyncConnection._dispose`)."""

    def datagrams_to_send(self, now: float) -> list:
        return []

    def get_timer(self) -> None:
        return None

    def next_event(self) -> None:
        return None

    def __getattr__(self, name: str):
        return _nothing


_TERMINATED = _Terminated()


# --- the listener ---------------------------------------------------------------------------

class SyncServer(Listener):
    name = "sync"
    protocol = PROTOCOL
    light_holds = 1     # a device opens one connection at a time; a flooding address many

    def __init__(self, settings: Settings, appender, *, fsync: bool = True):
        conf = settings.sync
        super().__init__(settings.bind, conf.port, conf.max_concurrent_sessions,
                         limits=sync_limits(conf))
        self.settings = settings
        self.conf = conf
        self.appender = appender
        self.layout = Layout.of(settings)
        self.fsync = fsync
        self.control = SyncControl(self.layout, fsync=fsync)
        self.push_desk: PushDesk | None = None
        self.inbox = SyncInbox(self.layout.inbox, self.layout.acks, cache_bytes=conf.cache_bytes)
        self.tail = InboxTail(self.layout.inbox, self.layout.acks, self.inbox,
                              protocols={PROTOCOL})
        self.acks: GroupCommitAppender | None = None
        self.cert_path, self.key_path = load_or_create_cert(settings)
        self.cert_der = cert_der(self.cert_path)
        now = time.monotonic()
        self.global_limit = TokenBucket(conf.global_requests_per_second, 1.0, now)
        self.device_limit = KeyedBuckets(conf.messages_per_minute, 60.0)
        self.control_limit = KeyedBuckets(conf.control_requests_per_minute, 60.0)
        self.connect_limit = KeyedBuckets(conf.connections_per_minute, 60.0)
        self.handshake_rate = KeyedBuckets(conf.handshakes_per_address_per_second, 1.0)
        # The CPU of connections before their HELLO (starting them, their packets and
        # timers), measured: an address not known lately starts a new connection only within
        # `new_connection_cpu_share` of a core of it (engine/work_budget.py)
        self.new_connections = WorkBudget(conf.new_connection_cpu_share, BUDGET_BURST_SECONDS)
        self.conns: set[SyncConnection] = set()
        self.inflight: dict[bytes, int] = {}      # group -> payload bytes being stored
        self.last_seen: dict[tuple[bytes, bytes], int] = {}
        self.retries = 0           # Retry packets sent (address validation under load)
        self.validating = False    # every new connection must pass a Retry now
        self._server: AdmittingServer | None = None
        self.iroh = None           # the iroh endpoint for stock 0k-sync clients (sync_iroh.py)
        self.content_waiting = ContentWaiting(conf.default_ttl_seconds)
        self._stop = asyncio.Event()
        self._tail_task: asyncio.Task | None = None
        self._sweep: asyncio.TimerHandle | None = None

    @property
    def cert_sha256(self) -> str:
        return hashlib.sha256(self.cert_der).hexdigest()

    async def start(self) -> None:
        await asyncio.to_thread(self.layout.ensure_shared_tables)
        await self.control.load()
        self.control.start_following(
            self.settings.ingress.control_follow_seconds)   # the other sync hosts' changes
        self.acks = GroupCommitAppender(DeltaAppendTarget(self.layout.acks, ACKS,
                                                          fsync=self.fsync))
        await self.acks.start()
        self.tail.version = await self.inbox.bootstrap()
        self._tail_task = asyncio.create_task(
            self.tail.follow(self.settings, self._stop, "sync"),
            name="sync-inbox-tail")
        self._loop_sweep()
        self.push_desk = await PushDesk.open(desk_dir(self.settings.data_dir), "sync",
                                             SyncDesk(self, decode_meta))
        conf = self.conf
        # max_stream_data: a client stream's window before HELLO (BoundedStreams); max_data
        # lets every stream fill its window after HELLO (aioquic raises it from there).
        qconf = QuicConfiguration(is_client=False, alpn_protocols=[ALPN],
                                  idle_timeout=conf.idle_timeout_seconds,
                                  max_data=conf.max_streams_per_connection * self.stream_window,
                                  max_stream_data=conf.stream_window_before_hello)
        qconf.load_cert_chain(str(self.cert_path), str(self.key_path))
        # A connect burst waits in the socket's buffer, as TCP connects in a listen backlog;
        # the endpoint drains it every turn so sessions' packets never wait behind it.
        _, self._server = await udp_endpoint.open_endpoint(
            lambda: AdmittingServer(self, qconf), self.host, self.port,
            receive_buffer=conf.receive_buffer_bytes)
        log.info("listener started", extra={"event": "listener_started",
                                            "listener": self.name, "port": self.bound_port})
        if conf.iroh_enabled:
            from .sync_iroh import IrohEndpoint
            self.iroh = IrohEndpoint(self, self.settings)
            await self.iroh.start()

    def _protocol(self, *args, **kwargs) -> "SyncConnection":
        return SyncConnection(self, *args, **kwargs)

    @property
    def bound_port(self) -> int:
        assert self._server is not None, "not started"
        return self._server._transport.get_extra_info("sockname")[1]

    @property
    def stream_window(self) -> int:
        """A request stream's window once HELLO is accepted (BoundedStreams)."""
        return self.conf.max_message_size + 4 + STREAM_WINDOW_SLACK

    def needs_retry(self, address: str) -> bool:
        """The Retry rule: a new connection must prove its address first while the relay holds
        `retry_above_handshakes` connections in handshake (0: always), or its address holds
        `retry_above_handshakes_per_address`. A real client pays one round trip, only then;
        a spoofed source can hold at most that many unvalidated handshakes, in all and of any
        one address (so it cannot fill a real address's per-address cap either)."""
        conf, adm = self.conf, self.admission
        busy = adm.count(Stage.HANDSHAKE) >= conf.retry_above_handshakes
        if busy != self.validating:
            self.validating = busy
            if (dropped := self.quiet.allow(("validating", busy))) is not None:
                log.info("address validation (QUIC Retry) for every new connection", extra={
                    "event": "sync_address_validation", "on": busy,
                    "handshakes": adm.count(Stage.HANDSHAKE), "suppressed": dropped})
        return busy or adm.count_of(address, Stage.HANDSHAKE) \
            >= conf.retry_above_handshakes_per_address

    async def close(self) -> None:
        """Stop accepting; pushes being stored finish (and are answered) first."""
        if self.push_desk is not None:
            self.push_desk.close()
            self.push_desk = None
        if self.iroh is not None:
            await self.iroh.close()
        await drain(self.conns, self.conf.push_ack_timeout_seconds)
        if self._server is not None:
            self._server.close()
        self._stop.set()
        if self._sweep is not None:
            self._sweep.cancel()
        if self._tail_task is not None:
            await self._tail_task
        await self.control.close()
        if self.acks is not None:
            await self.acks.close()

    def _loop_sweep(self) -> None:
        """Every `SWEEP_SECONDS`, forget the rate limits' keys whose bucket is full again: a
        flood of new device ids or addresses leaves nothing behind once it has refilled."""
        now = time.monotonic()
        for keyed in (self.device_limit, self.control_limit, self.connect_limit,
                      self.handshake_rate):
            keyed.sweep(now)
        self._sweep = asyncio.get_running_loop().call_later(SWEEP_SECONDS, self._loop_sweep)

    def admissions(self) -> list:
        return [self.admission] + ([self.iroh.wave] if self.iroh is not None else [])

    # --- shared state the connections use ------------------------------------------------------
    def count_sessions(self) -> None:
        """The `relay_sessions_open` gauge: established sessions of both transports (the
        iroh endpoint's count against `max_concurrent_sessions` too)."""
        self.connections = len(self.conns) + (len(self.iroh.conns) if self.iroh else 0)

    def group_sessions(self, group: bytes) -> list["SyncConnection"]:
        return [s for s in self.inbox.sessions_of(group) if isinstance(s, SyncRequests)]

    @property
    def relay_id(self) -> str:
        """WELCOME.relay_id of the spec form: the iroh endpoint id, else the node id."""
        return self.iroh.id if self.iroh is not None else self.settings.ingress.node_id

    def online(self, group: bytes, device: bytes) -> bool:
        return any(c.device_id == device for c in self.group_sessions(group))


class _Stream:
    """A client bidirectional stream: its frame reader, read deadline, and the frames after
    the first (only the identity exchange reads a second one)."""
    __slots__ = ("reader", "timer", "got", "later", "waiter")

    def __init__(self, reader: FrameReader, timer: asyncio.TimerHandle):
        self.reader, self.timer = reader, timer
        self.got = 0
        self.later: list[bytes | None] = []
        self.waiter: asyncio.Future | None = None

    def give(self, body: bytes | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(body)
            self.waiter = None
        else:
            self.later.append(body)


class SyncConnection(SyncRequests, QuicConnectionProtocol):
    def __init__(self, server: SyncServer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server = server
        self.conf = server.conf
        self.session = Session()
        self.streams: dict[int, _Stream] = {}
        self.requests: asyncio.Queue = asyncio.Queue()
        self.answered: set[int] = set()
        self.tasks: set[asyncio.Task] = set()
        self.worker: asyncio.Task | None = None
        self.handling = False           # a request is being answered (_delivering)
        self.hello_timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.draining = False
        self.registered = False
        # Admission (AdmittingServer): the slot, the handshake's deadlines (from its start
        # and from the client's last packet), the connection ids the server routes to this
        # connection, and whether it was dropped without a word.
        self.ticket: Ticket | None = None
        self.handshake_timer: asyncio.TimerHandle | None = None
        self.started = self.heard = 0.0
        self.cids: set[bytes] = set()
        self.aborted = False

    def __repr__(self) -> str:
        return f"SyncConnection({self.session!r})"

    # --- aioquic events ----------------------------------------------------------------------
    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self._on_handshake()
        elif isinstance(event, StreamDataReceived):
            self._on_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, StreamReset):
            self._forget_stream(event.stream_id)
        elif isinstance(event, ConnectionTerminated):
            self._on_closed()
            # once aioquic's own call has returned; a few per turn (runtime/teardown.py)
            TEARDOWN.later(self._dispose)

    # --- admission -----------------------------------------------------------------------------
    def admitted(self, ticket: Ticket) -> None:
        """Its HANDSHAKE slot: evicted for a newcomer, or still in its handshake after
        `handshake_timeout_seconds` (or `handshake_idle_timeout_seconds` after the client's
        last packet), the connection is dropped without a word (`abort`)."""
        self.ticket = ticket
        ticket.closer = self.abort
        self.started = self.heard = self._loop.time()
        self.handshake_timer = self._loop.call_at(self._handshake_deadline(),
                                                  self._handshake_expired)

    def _handshake_deadline(self) -> float:
        return min(self.started + self.conf.handshake_timeout_seconds,
                   self.heard + self.conf.handshake_idle_timeout_seconds)

    def _handshake_expired(self) -> None:
        """A handshake's deadline: dropped, unless its client was heard since (then the timer
        is set again, for the sooner of the two deadlines). A flood's clients that left in
        their handshake no longer hold their slots and ~150 KiB each for the whole
        `handshake_timeout_seconds` (the hostile suite: 100 for 10 s after every flood)."""
        self.handshake_timer = None
        if self.closed:
            return
        deadline = self._handshake_deadline()
        if self._loop.time() < deadline:
            self.handshake_timer = self._loop.call_at(deadline, self._handshake_expired)
            return
        srv = self.server
        srv.rejected["handshake_timeout"] += 1
        if (dropped := srv.quiet.allow("handshake_timeout")) is not None:
            log.info("QUIC handshake not finished in time; dropped", extra={
                "event": "sync_handshake_timeout", "suppressed": dropped})
        self.abort()

    def abort(self) -> None:
        """Forget a connection still in its handshake. Nothing is sent (its address may be a
        spoofed one, and a close would be a packet per dropped handshake); its timers stop and
        the server drops its connection ids, so nothing refers to its state any more."""
        if self.closed:
            return
        self.aborted = True
        for handle in (self._timer, self._transmit_task):
            if handle is not None:
                handle.cancel()
        self._timer = self._transmit_task = None
        terminated = self._connection_terminated_handler
        self._connection_id_issued_handler = self._connection_id_retired_handler = _nothing
        self._connection_terminated_handler = _nothing
        terminated()
        self._closed.set()
        self._on_closed()
        TEARDOWN.later(self._dispose)

    def _dispose(self) -> None:
        """Break the reference cycles of a connection that is over, so that reference counting
        frees it at once. aioquic's `QuicConnection` refers to itself from ~280 objects
        (its frame handler table, its TLS context's and crypto contexts' callbacks, its loss
        recovery's probe), and this protocol to itself through the server's handlers (its
        ticket's closer is dropped by `Listener.release`, in `_on_closed`): left to the cyclic
        collector, a flood of 1,500 QUIC connections that ended was ~630,000 objects for one
        full collection, which stopped the event loop for ~1.7 s while legitimate devices
        waited. Queued after ConnectionTerminated (or `abort`), when aioquic has nothing left
        to do for it, and run a few per turn of the loop (`TEARDOWN`: ~1,500 that drain at
        once are ~1,500 x ~280 objects freed, which must not be one turn): its timers are
        cancelled, and a late call (a request handler finishing after the close: `closed`
        guards our side) reaches `_TERMINATED`, never a half-cleared object."""
        if self._quic is _TERMINATED:
            return
        for handle in (self._timer, self._transmit_task):
            if handle is not None:
                handle.cancel()
        self._timer = self._transmit_task = None
        self._connection_id_issued_handler = self._connection_id_retired_handler = _nothing
        self._connection_terminated_handler = _nothing
        quic, self._quic = self._quic, _TERMINATED
        # a packet not yet acknowledged refers to its packet space (an ACK frame's delivery
        # handler gets the space), which keeps the packet: a cycle the clear below leaves, of
        # every connection dropped mid-handshake with its flight unacknowledged
        for space in (quic.__dict__.get("_spaces") or {}).values():
            space.sent_packets.clear()
        quic.__dict__.clear()

    def transmit(self) -> None:
        if not self.aborted:
            super().transmit()

    # A connection before its HELLO spends the listener's new-connection budget: its share of
    # the handshake's CPU is mostly here (the client's flights, resends, the first 1-RTT
    # frames), not in starting it (~40% in a profile of a flood).
    def datagram_received(self, data: bytes | str, addr: NetworkAddress) -> None:
        if self.handshake_timer is not None:
            self.heard = self._loop.time()
        if self.session.state is State.ACTIVE:
            # aioquic sends after every datagram; an established session sends once per loop
            # turn instead (`_transmit_soon`), so its ACKs and the replies of one turn share
            # packets: the endpoint hands over up to a whole socket's worth of datagrams at
            # once (runtime/udp_endpoint.py)
            self._quic.receive_datagram(data, addr, now=self._loop.time())
            self._process_events()
            self._transmit_soon()
            return
        self._before_hello(super().datagram_received, data, addr)

    def _handle_timer(self) -> None:
        self._before_hello(super()._handle_timer)

    def _before_hello(self, step: Callable, *args) -> None:
        """Run aioquic's `step`; before HELLO, its CPU is spent from the budget."""
        if self.session.state is State.ACTIVE:
            step(*args)
            return
        started = time.thread_time()
        step(*args)
        self.server.new_connections.spend(time.thread_time() - started, self._loop.time())

    def _on_handshake(self) -> None:
        srv = self.server
        self._quic.handshake_done()
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
            self.handshake_timer = None
        # F-007: established connections (UNAUTH + AUTH) past max_concurrent_sessions are
        # closed with code 2, as 0k-sync does at accept. UNAUTH alone is capped well below it
        # (max_unauth_sessions, evicting), so unauthenticated connections cannot fill it.
        if len(srv.conns) >= self.conf.max_concurrent_sessions:
            srv._refused(Stage.UNAUTH, "session_cap")
            self.close(CLOSE_TOO_MANY_SESSIONS, "too many sessions")
            return
        if not srv.advance(self.ticket, Stage.UNAUTH):
            self.close(CLOSE_TOO_MANY_SESSIONS, "too many sessions")
            return
        if self.ticket is not None:     # evicted for a newcomer: as past the session cap
            self.ticket.closer = partial(self.close, CLOSE_TOO_MANY_SESSIONS,
                                         "too many sessions")
        srv.conns.add(self)
        srv.count_sessions()
        self.hello_timer = self._loop.call_later(self.conf.hello_timeout_seconds,
                                                 self._hello_timeout)
        self.worker = asyncio.ensure_future(self._work())

    def _on_data(self, sid: int, data: bytes, fin: bool) -> None:
        if self.closed or sid % 4 != 0 or sid in self.answered:
            return          # only client-initiated bidirectional streams carry requests
        st = self.streams.get(sid)
        if st is None:
            st = self.streams[sid] = _Stream(
                FrameReader(self.conf.max_message_size),
                self._loop.call_later(self.conf.stream_read_timeout_seconds,
                                      self._stream_timeout, sid))
        elif st.got >= 2:
            return          # the request and one more frame (identity exchange) are all we read
        try:
            bodies = st.reader.feed(data)
            if fin and not bodies:
                st.reader.end()
                if st.got == 0:
                    raise FrameError("no frame")
        except FrameError:
            # ST-001: an oversize prefix is refused before a body byte is buffered.
            self.server.rejected["malformed"] += 1
            self._deliver(sid, st, None)
            return
        for body in bodies:
            self._deliver(sid, st, body)
        if fin and st.waiter is not None:
            st.give(None)    # the exchange wanted another frame and got FIN

    def _deliver(self, sid: int, st: _Stream, body: bytes | None) -> None:
        if st.got >= 2:
            return          # never buffer more: a client could write frames without end
        st.got += 1
        if st.got == 1:
            st.timer.cancel()
            self.requests.put_nowait((sid, body))
        else:
            st.give(body)

    async def next_frame(self, sid: int) -> bytes | None:
        """The next frame on a stream that already delivered its request (identity exchange),
        None on FIN, reset or timeout."""
        st = self.streams.get(sid)
        if st is None:
            return None
        if st.later:
            return st.later.pop(0)
        st.waiter = self._loop.create_future()
        st.timer = self._loop.call_later(self.conf.stream_read_timeout_seconds, st.give, None)
        try:
            return await st.waiter
        finally:
            st.timer.cancel()

    def _stream_timeout(self, sid: int) -> None:
        st = self.streams.get(sid)
        if st is not None and st.got == 0:
            self._deliver(sid, st, None)       # nothing complete in time: empty FIN

    def _forget_stream(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            st.timer.cancel()
            st.give(None)

    def _on_closed(self) -> None:
        if self.closed:
            return
        self.closed = True
        srv = self.server
        srv.conns.discard(self)
        srv.count_sessions()
        srv.release(self.ticket)
        for timer in (self.hello_timer, self.handshake_timer):
            if timer is not None:
                timer.cancel()
        for st in self.streams.values():
            st.timer.cancel()
            st.give(None)
        if self.registered and self.session.group_id is not None:
            srv.inbox.unregister(self.session.group_id, self)
            srv.last_seen[(self.session.group_id, self.device_id)] = unix_now()
        if self.worker is not None:
            # let go of it: a task cancelled while it waits keeps its CancelledError, whose
            # traceback holds the worker's frame and so this connection, a cycle only a full
            # collection frees (the hostile suite's floods kept ~25 MiB for up to a minute)
            worker, self.worker = self.worker, None
            worker.cancel()

    # --- writing -----------------------------------------------------------------------------
    def close(self, code: int = 0, reason: str = "") -> None:
        if not self.closed:
            super().close(error_code=code, reason_phrase=reason)
            self._on_closed()

    def _respond(self, sid: int, msg: m.Message | bytes | None, *,
                 fin: bool = True) -> None:
        """One frame (and FIN), or None: the empty FIN every 0k-sync refusal is."""
        if self.closed or sid in self.answered:
            return
        if fin:
            self.answered.add(sid)
            if len(self.answered) > 2 * self.conf.max_streams_per_connection + 8:
                # aioquic delivers nothing more for a stream it discarded: forget those
                live = self._quic._streams
                self.answered = {s for s in self.answered if s in live}
            st = self.streams.pop(sid, None)
            if st is not None:
                st.timer.cancel()
        data = frame(msg if isinstance(msg, bytes) else m.encode(msg),
                     self.conf.max_message_size) if msg is not None else b""
        try:
            self._quic.send_stream_data(sid, data, end_stream=fin)
        except Exception:   # the stream is gone (peer reset it)
            return
        self._transmit_soon()   # with the other replies of this turn (one inbox commit's)

    def send_uni(self, msg: m.Message | bytes) -> None:
        if self.closed:
            return
        sid = self._quic.get_next_available_stream_id(is_unidirectional=True)
        if sid // 4 >= self._quic._remote_max_streams_uni:
            # The peer grants no more streams (a 0k-sync client never accepts NOTIFY, so its
            # credit runs out): drop the message rather than queue a blocked stream for the
            # connection's life. NOTIFY is a hint; PULL still returns everything.
            self.server.rejected["uni_blocked"] += 1
            return
        self._quic.send_stream_data(sid, frame(msg if isinstance(msg, bytes) else m.encode(msg)), end_stream=True)
        self._transmit_soon()

    def _hello_accepted(self) -> None:
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        self._quic.accepted_hello(self.server.stream_window, self.conf.max_streams_per_connection)

    # --- handlers ----------------------------------------------------------------------------
    async def _on_auth(self, sid: int, msg: m.Auth) -> None:
        nonce = secrets.token_bytes(identity.NONCE_LEN)
        self._respond(sid, m.AuthChallenge(nonce), fin=False)
        body = await self.next_frame(sid)
        try:
            proof = m.decode(body) if body is not None else None
        except m.DecodeError:
            proof = None
        if not (isinstance(proof, m.AuthProof) and identity.auth_ok(
                proof.device_id, proof.signature, nonce, self.server.cert_der)):
            srv = self.server
            srv.rejected["auth_failed"] += 1
            if (dropped := srv.quiet.allow("auth_failed")) is not None:
                log.info("sync auth failed", extra={"event": "sync_auth_failed",
                                                    "suppressed": dropped})
            self.close(CLOSE_AUTH_FAILED, "auth failed")
            return
        if not self.server.connect_limit.take(proof.device_id, time.monotonic()):
            self.server.rejected["rate_limited"] += 1
            self.close(CLOSE_RATE_LIMITED, "rate limited")
            return
        self.session.authenticated(proof.device_id)
        self._respond(sid, m.Done(m.AuthProof.TAG))

def server_cert_sha256(settings: Settings) -> str:
    """For `relay keys`: what a direct client pins."""
    cert, _ = load_or_create_cert(settings)
    return hashlib.sha256(cert_der(cert)).hexdigest()

