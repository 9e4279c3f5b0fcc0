"""The PPP port below the ASGI app: a budget slot and a client deadline for every connection,
in uvicorn's own protocol classes (issue 19 items 2 and 5).

uvicorn has no deadline before a request head, inside a body or inside a WebSocket frame,
and counts nothing below the WebSocket upgrade. So the PPP listener accepts on its own
(`runtime/listener.py`: admission at TCP accept, its accept loop that stops near the descriptor
limit) and gives each admitted socket these protocols:

* `PppHttpProtocol` (uvicorn's h11 protocol): the request head must be complete
  `request_head_timeout_seconds` after accept or after the previous response (a header drip
  is closed; the idle keep-alive is uvicorn's `timeout_keep_alive`); a body must keep
  `min_bytes_per_second` after `request_body_timeout_seconds` (a body shorter than its
  Content-Length no longer waits for the client to leave). A complete head moves the
  connection from HANDSHAKE to UNAUTH, counted for the client a trusted proxy names.
* `PppWsProtocol` (uvicorn's websockets-sansio protocol, after the upgrade): a frame, or a
  fragmented message, must keep the same byte rate after `frame_timeout_seconds`; the first
  message (the AUTH) may not announce more than `max_unauth_message_bytes`. AUTH_OK moves it
  to AUTH (`PppConn.authenticated`); idle authenticated sessions answer uvicorn's pings.
* `PppConn`, shared by both across the upgrade: the admission ticket, the one timer, and
  the transport the protocols write to. Output a client does not take (a reply, a ping, a
  close) must drain at `min_bytes_per_second` after `write_timeout_seconds`, so `close()` on
  a peer that never reads cannot hold the descriptor for ever. While the server itself has
  paused reading (the app is busy with what the client already sent), no read deadline runs.

A passed deadline aborts the connection (its slot and descriptor are free at once) and is
counted (`rejected["<what>_timeout"]`) and logged at most once per 10 s (`ppp_client_closed`).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from engine.admission import Stage, Ticket
from runtime.config import PppConf
from runtime.listener import Deadline
from runtime.teardown import TEARDOWN


class Port(Protocol):
    """What a connection asks of the PPP listener (`ppp_app.PppServer`, which builds these
    protocols: they know it by this interface, not by import)."""
    conf: PppConf

    def admit_client(self, ticket: Ticket, peer: str,
                     headers: list[tuple[bytes, bytes]]) -> Ticket | None: ...
    def advance(self, ticket: Ticket | None, stage: Stage,
                identity: str | None = None) -> bool: ...
    def touch(self, ticket: Ticket | None) -> None: ...
    def release(self, ticket: Ticket | None) -> None: ...
    def client_closed(self, reason: str) -> None: ...


class PppConn:
    """One TCP connection of the PPP port, from accept to close. The uvicorn protocols see it
    as their transport: it forwards everything to the real one and watches the output."""

    def __init__(self, server: Port, ticket: Ticket):
        self.server = server
        self.conf = server.conf
        self.ticket = ticket
        self.transport: asyncio.Transport | None = None
        self.ws: PppWsProtocol | None = None     # once upgraded
        self.received = 0                        # bytes read from the client
        self.written = 0                         # bytes given to the transport
        self._loop = asyncio.get_running_loop()
        self._deadline = Deadline(self._expired)
        self._read: tuple[str, float, int, float, float | None] | None = None
        self._write: tuple[float, int] | None = None   # (since, drained bytes then)
        self._paused_at: float | None = None
        self.gone = False

    # --- the transport, as the protocols see it -------------------------------------------------
    def attach(self, transport: asyncio.Transport) -> "PppConn":
        self.transport = transport
        if self.ticket.live:
            self.ticket.closer = transport.abort
        else:                       # evicted between accept and now
            transport.abort()
        return self

    def __getattr__(self, name: str) -> Any:   # everything not overridden below
        if name == "transport":
            raise AttributeError(name)
        return getattr(self.transport, name)

    def write(self, data) -> None:
        if self.gone:    # asyncio would count it and warn past 5 writes to a lost socket
            return
        self.transport.write(data)
        self.written += len(data)
        if self._write is None and self.transport.get_write_buffer_size():
            self._write = (self._loop.time(), self._drained())
            self._arm()

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def pause_reading(self) -> None:
        self.transport.pause_reading()
        if self._paused_at is None:
            self._paused_at = self._loop.time()
            self._arm()

    def resume_reading(self) -> None:
        self.transport.resume_reading()
        if self._paused_at is not None:
            if self._read is not None:   # the paused time is not the client's
                what, since, base, grace, rate = self._read
                self._read = (what, since + self._loop.time() - self._paused_at, base, grace,
                              rate)
            self._paused_at = None
            self._arm()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _drained(self) -> int:
        return self.written - self.transport.get_write_buffer_size()

    # --- stages ---------------------------------------------------------------------------------
    def head(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A request head is complete. False: refused a slot (the connection is aborted)."""
        peer = self.transport.get_extra_info("peername") if self.transport else None
        host = peer[0] if isinstance(peer, tuple) and peer else ""
        ticket = self.server.admit_client(self.ticket, host, headers)
        if ticket is None:
            self.abort()
            return False
        if ticket is not self.ticket:
            self.ticket = ticket
            ticket.closer = self.transport.abort
        if ticket.stage is Stage.HANDSHAKE and not self.server.advance(ticket, Stage.UNAUTH):
            self.abort()
            return False
        return True

    def authenticated(self, pubkey: bytes, delivering: Callable[[], bool]) -> bool:
        """AUTH_OK is about to be sent for `pubkey` (the identity: max_sessions_per_pubkey).
        False: no AUTH slot for it (refuse the AUTH). `delivering`: whether the session is
        mid-delivery (never evicted then)."""
        if self.ticket is not None:
            self.ticket.delivering = delivering
        return self.server.advance(self.ticket, Stage.AUTH, pubkey.hex())

    def active(self) -> None:
        """An application message went either way (pings do not count)."""
        self.server.touch(self.ticket)

    def lost(self) -> None:
        if not self.gone:
            self.gone = True
            self._deadline.close()
            self.server.release(self.ticket)
        # this object and its protocols refer to each other (ws, the deadline's callback,
        # the protocols' app state): cycles a flood would leave to the full collector
        self.ws = None

    # --- deadlines ------------------------------------------------------------------------------
    def reading(self, what: str, grace: float, rate: float | None = None) -> None:
        """The client owes `what` from now (kept if it already owed it): complete within
        `grace` seconds, or, with a `rate`, at least `rate` bytes a second after `grace`."""
        if self._read is None or self._read[0] != what:
            self._read = (what, self._loop.time(), self.received, grace, rate)
            self._arm()

    def read_done(self) -> None:
        if self._read is not None:
            self._read = None
            self._arm()

    def _due(self) -> tuple[float, str] | None:
        due: list[tuple[float, str]] = []
        if self._read is not None and self._paused_at is None:
            what, since, base, grace, rate = self._read
            extra = (self.received - base) / rate if rate else 0.0
            due.append((since + grace + extra, what))
        if self._write is not None:
            if not self.transport.get_write_buffer_size():
                self._write = None
            else:
                since, base = self._write
                due.append((since + self.conf.write_timeout_seconds
                            + (self._drained() - base) / self.conf.min_bytes_per_second,
                            "write"))
        return min(due) if due else None

    def _arm(self) -> None:
        if self.gone:
            return
        due = self._due()
        if due is None:
            self._deadline.clear()
        else:
            self._deadline.at(*due)

    def _expired(self, _what: str) -> None:
        due = self._due()   # bytes may have come (or gone) since the timer was set
        if due is None or self.gone:
            return
        when, what = due
        if when > self._loop.time():
            self._deadline.at(when, what)
            return
        self.server.client_closed(f"{what}_timeout")
        self.abort()


class _H11Connection(h11.Connection):
    """h11's connection, telling the protocol when a request head is complete, before uvicorn
    runs anything for it: refused, the request is dropped (the connection is aborted)."""

    def __init__(self, on_head: Callable[[list[tuple[bytes, bytes]]], bool],
                 max_incomplete_event_size: int):
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self._on_head = on_head

    def next_event(self):
        event = super().next_event()
        if type(event) is h11.Request and not self._on_head(event.headers):
            return h11.NEED_DATA
        return event


class PppHttpProtocol(H11Protocol):
    """uvicorn's h11 protocol with the head and body deadlines and the head's stage move."""

    def __init__(self, config, server_state, app_state: dict, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.ppp: PppConn = app_state["ppp_conn"]
        # `PppConn.head`, not a method of this protocol: that would be a reference cycle
        # (protocol -> h11 connection -> protocol) left to the full collector at every close.
        self.conn = _H11Connection(self.ppp.head, config.h11_max_incomplete_event_size)

    def connection_made(self, transport) -> None:
        super().connection_made(self.ppp.attach(transport))
        self._watch()

    def data_received(self, data: bytes) -> None:
        self.ppp.received += len(data)
        super().data_received(data)
        if self.ppp.ws is None:
            self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.ppp.ws is None:
            self._watch()

    def connection_lost(self, exc) -> None:
        # As a WebSocket's (`PppWsProtocol`): the slot now, uvicorn's end of the request (an
        # ASGI task waiting for a body wakes up and unwinds) in its turn (runtime/teardown.py).
        self.ppp.lost()
        TEARDOWN.later(H11Protocol.connection_lost, self, exc)

    def shutdown(self) -> None:
        if not self.ppp.gone:   # lost: its end is queued (TEARDOWN), there is no client to tell
            super().shutdown()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self.ppp.read_done()
        super().handle_websocket_upgrade(event)

    def _watch(self) -> None:
        conf, state = self.ppp.conf, self.conn.their_state
        if state is h11.IDLE:          # before a request head: at accept, and after a response
            self.ppp.reading("head", conf.request_head_timeout_seconds)
        elif state is h11.SEND_BODY:
            self.ppp.reading("body", conf.request_body_timeout_seconds,
                             conf.min_bytes_per_second)
        else:                          # the request is in: the server's turn
            self.ppp.read_done()


class FrameClock:
    """Where a client is in its WebSocket frames (RFC 6455 §5.2), without a copy of them:
    `partial` (a frame, or a message in fragments, is under way), `messages` (data messages
    completed) and `first_length` (the payload bytes the first data message announced so
    far). Control frames between fragments do not end a message."""

    __slots__ = ("_head", "_need", "_left", "_fin", "_control", "in_frame", "in_message",
                 "messages", "first_length")

    def __init__(self) -> None:
        self._head = bytearray()
        self._need = 2          # header bytes needed: 2, then with extended length and mask
        self._left = 0          # payload bytes of the current frame still to come
        self._fin = self._control = False
        self.in_frame = self.in_message = False
        self.messages = 0
        self.first_length = 0

    @property
    def partial(self) -> bool:
        return self.in_frame or self.in_message

    def feed(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if self._left:
                take = min(self._left, n - pos)
                self._left -= take
                pos += take
                if not self._left:
                    self._frame_done()
                continue
            self.in_frame = True
            take = min(self._need - len(self._head), n - pos)
            self._head += data[pos:pos + take]
            pos += take
            if len(self._head) < self._need:
                return
            if self._need == 2:
                size = self._head[1] & 0x7F
                self._need += (2 if size == 126 else 8 if size == 127 else 0) + (
                    4 if self._head[1] & 0x80 else 0)
                if self._need > 2:
                    continue
            self._header_done()

    def _header_done(self) -> None:
        head, size = self._head, self._head[1] & 0x7F
        length = (int.from_bytes(head[2:4], "big") if size == 126 else
                  int.from_bytes(head[2:10], "big") if size == 127 else size)
        self._fin, self._control = bool(head[0] & 0x80), bool(head[0] & 0x08)
        if not self._control and self.messages == 0:
            self.first_length += length
        self._head.clear()
        self._need = 2
        self._left = length
        if not length:
            self._frame_done()

    def _frame_done(self) -> None:
        self.in_frame = False
        if self._control:
            return
        self.in_message = not self._fin
        if self._fin:
            self.messages += 1


class PppWsProtocol(WebSocketsSansIOProtocol):
    """uvicorn's websockets-sansio protocol with the frame deadline, the first message's size
    bound and the slot released when the connection is gone."""

    def __init__(self, config, server_state, app_state: dict, _loop=None):
        super().__init__(config, server_state, app_state, _loop)
        self.ppp: PppConn = app_state["ppp_conn"]
        self.ppp.ws = self
        self.clock = FrameClock()
        self._request_seen = False

    def data_received(self, data: bytes) -> None:
        if not self._request_seen:
            # uvicorn's h11 protocol hands over the upgrade request it already read first
            self._request_seen = True
        else:
            ppp, conf = self.ppp, self.ppp.conf
            ppp.received += len(data)
            self.clock.feed(data)
            if self.clock.messages == 0 and self.clock.first_length > \
                    conf.max_unauth_message_bytes:
                # The first message is the AUTH (~120 bytes): a client announcing more wants
                # memory before it has authenticated.
                ppp.server.client_closed("auth_too_large")
                ppp.abort()
                return
            if self.clock.partial:
                ppp.reading("frame", conf.frame_timeout_seconds, conf.min_bytes_per_second)
            else:
                ppp.read_done()
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        # The slot is free at once; the application's end of the session (uvicorn's
        # disconnect, the ASGI task, the session's cleanup) waits its turn (runtime/teardown.py).
        self.ppp.lost()
        TEARDOWN.later(WebSocketsSansIOProtocol.connection_lost, self, exc)

    def shutdown(self) -> None:
        # uvicorn's shutdown closes every connection it still lists; one that is lost but
        # whose end still waits its turn must not be sent a close (websockets raises)
        if not self.ppp.gone:
            super().shutdown()
