"""A UDP endpoint that drains its socket every time it is readable.

asyncio's datagram transport reads one datagram per event-loop turn. A QUIC listener spends
~1 ms of CPU on a new connection's Initial, so under a flood of them it read ~1,000
datagrams a second, and every established session's packets waited in the kernel's receive
buffer behind the flood: seconds with a deep buffer, and dropped (then resent after a loss
timeout of seconds) with a shallow one. Here each readable event reads up to `batch`
datagrams, all cheap to take off the socket, and hands them to the protocol; the protocol
decides what to do now and what to defer (`ingress/sync_quic.AdmittingServer`: packets of
known connections now, new connections' Initials from a bounded queue after the batch), and
`batch_done()` tells it when a batch is over.

The surface is the part of `asyncio.DatagramTransport` that aioquic uses: `sendto`,
`get_extra_info("socket" | "sockname")`, `close`. A send the kernel cannot take now is dropped
(UDP: QUIC's loss recovery resends it), never queued.
"""

from __future__ import annotations

import asyncio
import socket

BATCH = 256      # datagrams read per readable event: bounds one turn's work


async def open_endpoint(protocol_factory, host: str, port: int, *,
                        receive_buffer: int | None = None,
                        batch: int = BATCH) -> tuple["DrainingEndpoint", asyncio.BaseProtocol]:
    """Bind `host:port` (UDP) and connect a protocol to it, as
    `loop.create_datagram_endpoint(..., local_addr=(host, port))` does."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_DGRAM)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setblocking(False)
        if receive_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    protocol = protocol_factory()
    return DrainingEndpoint(loop, sock, protocol, batch), protocol


class DrainingEndpoint(asyncio.DatagramTransport):
    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol,
                 batch: int = BATCH):
        super().__init__()
        self._loop = loop
        self._sock = sock
        self._protocol = protocol
        self._batch = batch
        self._closing = False
        self.send_dropped = 0      # datagrams the kernel could not take (full send buffer)
        self._extra = {"socket": sock, "sockname": sock.getsockname()}
        protocol.connection_made(self)
        loop.add_reader(sock.fileno(), self._readable)

    def _readable(self) -> None:
        recv, deliver = self._sock.recvfrom, self._protocol.datagram_received
        try:
            for _ in range(self._batch):
                try:
                    data, addr = recv(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:       # an ICMP error of an earlier send: nothing to read
                    continue
                deliver(data, addr)
                if self._closing:
                    return
        finally:
            if not self._closing:
                self._protocol.batch_done()

    def sendto(self, data, addr=None) -> None:
        if self._closing:
            return
        try:
            self._sock.sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            self.send_dropped += 1
        except OSError:               # e.g. an unreachable address: the peer's loss
            pass

    def get_extra_info(self, name, default=None):
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._sock.fileno())
        self._loop.call_soon(self._finish)

    abort = close

    def _finish(self) -> None:
        try:
            self._protocol.connection_lost(None)
        finally:
            self._sock.close()
