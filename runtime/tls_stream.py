"""Server-side TLS streams on asyncio, through pyOpenSSL memory BIOs.

Why: the Heya listener needs Go's `RequireAnyClientCert` (a client certificate is mandatory and
never verified; OpenSSL still checks its CertificateVerify signature), which Python's `ssl`
cannot express and pyOpenSSL can (`runtime/tls.py`). pyOpenSSL has no asyncio integration, so
this module is the shell: a protocol on the plain TCP transport hands the bytes it receives to
the TLS engine (`bio_write`) and sends what the engine produces (`bio_read`).

* `Acceptor` is the protocol factory, for a listener with its own accept loop
  (`runtime/listener.py`): `acceptor(tag)` is one connection's protocol for
  `loop.connect_accepted_socket` (or `loop.create_server`); the callback gets
  `(stream, stream)` once the handshake is done. With a `gate` (runtime/handshake_gate.py)
  every handshake step waits its turn there, keyed by `tag.address`: the bytes wait in the
  TLS engine's BIO meanwhile. A handshake that fails, ends, outlasts its deadline or is
  dropped by a full gate is closed and reported to `on_handshake_failed(kind, detail)` (kind
  "timeout", "tls" with OpenSSL's reason, "eof", or "busy"); nothing is logged here (no tracebacks,
  no addresses); `tag` stays on the stream (`stream.tag`, the listener's
  admission ticket), and `on_lost(stream)` hears of every connection that ends, in its
  handshake or after it.
* `TLSStream` is reader and writer in one, with the `StreamReader` / `StreamWriter` names the
  listener uses (`read`, `write`, `drain`, `close`, `wait_closed`, `transport`).
* Memory: a connection in its handshake holds its TLS engine state (made at its first byte)
  and no task; sockets are read into one `READ_CHUNK` buffer per server (asyncio's SSL keeps
  256 KiB per connection). How many handshakes there are is the listener's HANDSHAKE cap
  (runtime/listener.py, engine/admission.py); each one's memory is returned when it ends.
  Decrypted bytes wait for the application up to `read_limit`, then the socket is not read;
  writes are encrypted `WRITE_CHUNK` at a time, so the outgoing BIO stays one record.
  Losing the transport frees the TLS engine.
* `close()` sends close_notify, then closes once the written bytes are out; `abort()` drops
  at once. The peer's EOF (close_notify or a bare FIN) reads as b"". A connection ends with
  its handler: one that returns without closing it is aborted.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from cryptography.hazmat.primitives.serialization import Encoding
from OpenSSL import SSL

READ_CHUNK = 16384     # bytes read from the socket per call: one TLS record
READ_LIMIT = 65536     # decrypted bytes the application has not read, past which reading stops
WRITE_CHUNK = 16384    # plaintext encrypted per step
_BIO_READ = 32768      # > one record of ciphertext


class TLSError(ConnectionError):
    """The TLS layer failed (an alert, a corrupt record); the connection is gone."""


def _reason(exc: SSL.Error) -> str:
    """OpenSSL's reason text, e.g. 'peer did not return a certificate' (nothing of the peer's)."""
    try:
        return str(exc.args[0][-1][-1])
    except (IndexError, TypeError):
        return type(exc).__name__


class TLSServer:
    """A server over an `Acceptor`; closing it also drops the connections still in their
    handshake (they have no handler yet that would end them)."""

    def __init__(self, server, acceptor: "Acceptor"):
        self._server = server
        self._acceptor = acceptor

    @property
    def sockets(self):
        return self._server.sockets

    def is_serving(self) -> bool:
        return self._server.is_serving()

    def close(self) -> None:
        self._server.close()
        self._acceptor.close()

    async def wait_closed(self) -> None:
        await self._server.wait_closed()


class Acceptor:
    """What the connections of one server share; called, it makes a connection's protocol.
    `buffer` is the socket read buffer of them all: selector loops (and uvloop) call
    `get_buffer`, `recv_into` and `buffer_updated` in one callback, and `buffer_updated` hands
    the bytes to OpenSSL before returning."""

    def __init__(self, context: SSL.Context,
                 client_connected_cb: Callable[["TLSStream", "TLSStream"], Awaitable], *,
                 handshake_timeout: float,
                 on_handshake_failed: Callable[[str, str], None] | None = None,
                 on_lost: Callable[["TLSStream"], None] | None = None,
                 read_limit: int = READ_LIMIT, gate=None):
        self.context = context
        self.client_connected_cb = client_connected_cb
        self.handshake_timeout = handshake_timeout
        self.on_handshake_failed = on_handshake_failed
        self.on_lost = on_lost
        self.read_limit = read_limit
        self.gate = gate               # runtime/handshake_gate.HandshakeGate, or None
        self.buffer = memoryview(bytearray(READ_CHUNK))
        self.handshaking: set[TLSStream] = set()
        self.closed = False

    def __call__(self, tag=None) -> "TLSStream":
        stream = TLSStream(self)
        stream.tag = tag
        return stream

    def close(self) -> None:
        self.closed = True
        for stream in list(self.handshaking):
            stream.abort()


class TLSStream(asyncio.BufferedProtocol):
    """One server-side TLS connection: protocol of the TCP transport below, stream (reader,
    writer and `transport`) for the application above. One reader task, one writer task."""

    __slots__ = ("_acceptor", "_loop", "_tcp", "_conn", "_timer", "_handshaken", "_reported",
                 "_peer_cert", "_buffer", "_eof", "_exc", "_reader", "_paused_reading",
                 "_paused_writing", "_drainers", "_closing", "_lost", "_closed", "_task", "_queued",
                 "tag")

    def __init__(self, acceptor: Acceptor):
        self.tag = None                   # the listener's, e.g. its admission ticket
        self._acceptor = acceptor
        self._loop = asyncio.get_running_loop()
        self._tcp: asyncio.Transport | None = None
        self._conn: SSL.Connection | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._handshaken = False
        self._reported = False            # the handshake's failure went to on_handshake_failed
        self._peer_cert: bytes | None = None
        self._buffer = bytearray()        # decrypted, not yet read by the application
        self._eof = False
        self._exc: BaseException | None = None
        self._reader: asyncio.Future | None = None
        self._paused_reading = False
        self._paused_writing = False
        self._drainers: list[asyncio.Future] = []
        self._closing = False
        self._lost = False
        self._closed: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._queued = False              # a handshake step waits in the acceptor's gate

    # --- the application's side: StreamReader / StreamWriter names -------------------------------
    async def read(self, n: int = -1) -> bytes:
        """Up to `n` decrypted bytes (all buffered if n < 0); b"" at EOF. Raises `TLSError` or
        the transport's `ConnectionError` if the connection failed."""
        while not (self._buffer or self._eof or self._exc is not None or self._lost):
            self._reader = self._loop.create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        if self._buffer:
            if 0 <= n < len(self._buffer):
                data = bytes(self._buffer[:n])
                del self._buffer[:n]
            else:
                data = bytes(self._buffer)
                self._buffer.clear()
            if self._paused_reading and len(self._buffer) <= self._acceptor.read_limit // 2:
                self._paused_reading = False
                self._tcp.resume_reading()
            return data
        if self._exc is not None:
            raise self._exc
        return b""

    def write(self, data: bytes) -> None:
        """Encrypt and send `data`; ignored once the stream is closing."""
        if self._closing or self._lost or not self._handshaken:
            return
        view = memoryview(data)
        try:
            for i in range(0, len(view), WRITE_CHUNK):
                self._conn.sendall(view[i:i + WRITE_CHUNK])
                self._flush()
        except SSL.Error as exc:
            self._exc = TLSError(_reason(exc))
            self.abort()

    async def drain(self) -> None:
        """Wait while the TCP transport's write buffer is above its high-water mark."""
        if self._lost:
            raise self._exc or ConnectionResetError("Connection lost")
        if not self._paused_writing:
            return
        waiter = self._loop.create_future()
        self._drainers.append(waiter)
        try:
            await waiter
        finally:
            self._drainers.remove(waiter)

    def close(self) -> None:
        """close_notify, then close the socket once everything written is out."""
        if self._closing or self._tcp is None:
            return
        self._closing = True
        if self._handshaken and not self._lost:
            try:
                self._conn.shutdown()
                self._flush()
            except SSL.Error:
                pass
        self._tcp.close()

    def abort(self) -> None:
        """Drop the connection now: nothing more is sent or read."""
        self._closing = True
        self._buffer = bytearray()
        if self._tcp is not None:
            self._tcp.abort()

    def is_closing(self) -> bool:
        return self._closing or self._tcp is None or self._tcp.is_closing()

    async def wait_closed(self) -> None:
        if self._lost:
            return
        if self._closed is None:
            self._closed = self._loop.create_future()
        await asyncio.shield(self._closed)

    def get_write_buffer_size(self) -> int:
        """Ciphertext not yet written to the socket (the TLS engine keeps none: see `write`)."""
        return self._tcp.get_write_buffer_size() if self._tcp is not None else 0

    @property
    def transport(self) -> "TLSStream":
        """The stream is its own transport (`abort`, `is_closing`, `get_write_buffer_size`),
        as `StreamWriter.transport` is for a plain stream."""
        return self

    def peer_certificate(self) -> bytes | None:
        """The client certificate (leaf) as DER, as `getpeercert(binary_form=True)`."""
        return self._peer_cert

    # --- the TCP transport's side --------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._tcp = transport
        acceptor = self._acceptor
        if acceptor.closed:
            self.abort()
            return
        acceptor.handshaking.add(self)
        self._timer = self._loop.call_later(acceptor.handshake_timeout, self._handshake_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._acceptor.buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing or self._lost:
            return
        if self._conn is None:
            # Made at the first byte, not at accept: an OpenSSL 4 SSL object is ~17 KiB, and
            # a client that connects and says nothing should not cost that.
            self._conn = SSL.Connection(self._acceptor.context, None)
            self._conn.set_accept_state()
        try:
            self._conn.bio_write(self._acceptor.buffer[:nbytes])
        except SSL.Error as exc:
            self._fail(exc)
            return
        if self._handshaken:
            self._decrypt()
        elif self._acceptor.gate is None:
            self._handshake()
        elif not self._queued:      # else the step queued already takes these bytes too
            self._queued = True
            self._acceptor.gate.submit(getattr(self.tag, "address", None),
                                       self._gated_handshake, self._gate_dropped)

    def eof_received(self) -> bool:
        if not self._handshaken:
            self._handshake_failed("eof", "")
            return False
        self._eof = True
        self._wake_reader()
        return True   # half-closed: the replies owed can still go out; close() ends it

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        for waiter in self._drainers:
            if not waiter.done():
                waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if not self._handshaken:
            self._handshake_failed("eof", "")
        if exc is not None and self._exc is None and not self._eof:
            self._exc = exc
        self._conn = None   # frees the TLS engine and its BIOs
        self._wake_reader()
        for waiter in self._drainers:
            if not waiter.done():
                waiter.set_exception(self._exc or ConnectionResetError("Connection lost"))
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        if self._acceptor.on_lost is not None:
            self._acceptor.on_lost(self)

    # --- TLS -----------------------------------------------------------------------------------
    def _handshake(self) -> None:
        try:
            self._conn.do_handshake()
        except SSL.WantReadError:
            self._flush()
            return
        except SSL.Error as exc:
            self._handshake_failed("tls", _reason(exc))
            return
        self._handshaken = True
        self._timer.cancel()
        self._timer = None
        self._acceptor.handshaking.discard(self)
        cert = self._conn.get_peer_certificate()
        self._peer_cert = cert.to_cryptography().public_bytes(Encoding.DER) if cert else None
        self._flush()       # the server's session tickets
        self._decrypt()     # application data that came with the client's Finished
        if self._lost or self._closing:
            return
        self._task = self._loop.create_task(self._acceptor.client_connected_cb(self, self))
        self._task.add_done_callback(self._served)

    def _gated_handshake(self) -> bool:
        """The gate's turn: the handshake step on every byte received so far. False: the
        connection is gone, the turn was free."""
        self._queued = False
        if self._lost or self._closing or self._handshaken or self._conn is None:
            return False
        self._handshake()
        return True

    def _gate_dropped(self) -> None:
        self._queued = False
        if not (self._lost or self._closing or self._handshaken):
            self._handshake_failed("busy", "")

    def _handshake_timeout(self) -> None:
        self._timer = None
        self._handshake_failed("timeout", "")

    def _handshake_failed(self, kind: str, detail: str) -> None:
        """Send OpenSSL's alert if it wrote one, close, report once."""
        self._acceptor.handshaking.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if kind in ("timeout", "busy"):
            self.abort()
        elif not self._closing and self._tcp is not None:
            self._closing = True
            if not self._lost:
                self._flush()
            self._tcp.close()
        if not self._reported:
            self._reported = True
            if self._acceptor.on_handshake_failed is not None:
                self._acceptor.on_handshake_failed(kind, detail)

    def _decrypt(self) -> None:
        conn = self._conn
        try:
            while True:
                self._buffer += conn.recv(READ_CHUNK)
        except SSL.WantReadError:
            pass
        except SSL.ZeroReturnError:   # close_notify
            self._eof = True
        except SSL.Error as exc:
            self._fail(exc)
            return
        self._flush()   # what reading made OpenSSL send (a KeyUpdate answer)
        if len(self._buffer) > self._acceptor.read_limit and not self._paused_reading:
            self._paused_reading = True
            self._tcp.pause_reading()
        self._wake_reader()

    def _fail(self, exc: SSL.Error) -> None:
        """A corrupt record or an alert: the connection is over."""
        if not self._handshaken:
            self._handshake_failed("tls", _reason(exc))
            return
        self._exc = TLSError(_reason(exc))
        if not self._closing:
            self._closing = True
            self._flush()    # our alert, if OpenSSL wrote one
            self._tcp.close()
        self._wake_reader()

    def _flush(self) -> None:
        """Send what the TLS engine wrote to its outgoing BIO."""
        conn, tcp = self._conn, self._tcp
        if conn is None or tcp is None:
            return
        while True:
            try:
                data = conn.bio_read(_BIO_READ)
            except SSL.WantReadError:
                return
            tcp.write(data)

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _served(self, task: asyncio.Task) -> None:
        """The connection ends with its handler: a handler that returned without closing, or
        raised, has nothing more to send."""
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            self._loop.call_exception_handler({
                "message": "TLS stream handler failed", "exception": task.exception()})
        if not self.is_closing():
            self.abort()
