"""A small cursor-sync client for the tests, written from cursor-sync-interop.md §1 (and the
README's extension layouts), not from the relay's code: every frame is built here byte by byte
(`u32_be(len) ‖ msgpack array [tag, fields...]`, byte arrays as arrays of uints, blob ids as
bin16), responses are read with the msgpack library into plain lists.

Transport: aioquic, ALPN `/0k-sync/1`, one bidirectional stream per request (frame + FIN, the
answer is one frame + FIN or an empty FIN), NOTIFY and other relay pushes on unidirectional
streams, collected in `uni`. The relay certificate is pinned by its SHA-256.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
import struct

import msgpack
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, StreamDataReceived
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from cryptography.hazmat.primitives.serialization import Encoding
from nacl.signing import SigningKey

ALPN = "/0k-sync/1"
TIMEOUT = 30.0


# --- msgpack, by hand ------------------------------------------------------------------------

def uint(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    if n <= 0xFF:
        return b"\xcc" + bytes([n])
    if n <= 0xFFFF:
        return b"\xcd" + struct.pack(">H", n)
    if n <= 0xFFFFFFFF:
        return b"\xce" + struct.pack(">I", n)
    return b"\xcf" + struct.pack(">Q", n)


def s(text: str) -> bytes:
    raw = text.encode()
    n = len(raw)
    if n < 32:
        return bytes([0xA0 | n]) + raw
    if n < 256:
        return b"\xd9" + bytes([n]) + raw
    if n < 65536:
        return b"\xda" + struct.pack(">H", n) + raw
    return b"\xdb" + struct.pack(">I", n) + raw


def arr(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 65536:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def byte_arr(data: bytes) -> bytes:
    """`[u8; N]` / `Vec<u8>`: an array of uints (not bin)."""
    return arr(len(data)) + b"".join(uint(b) for b in data)


def bin16(data: bytes) -> bytes:
    assert len(data) == 16
    return b"\xc4\x10" + data


def boolean(v: bool) -> bytes:
    return b"\xc3" if v else b"\xc2"


NIL = b"\xc0"


def msg(tag: str, *fields: bytes) -> bytes:
    return arr(1 + len(fields)) + s(tag) + b"".join(fields)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# --- the messages (interop §1.3 layouts; extensions from the README) --------------------------

def hello(version: int, name: str, group: bytes, last_cursor: int = 0) -> bytes:
    return msg("Hello", uint(version), s(name), byte_arr(group), uint(last_cursor))


def push(blob_id: bytes, payload: bytes, ttl: int = 0) -> bytes:
    return msg("Push", bin16(blob_id), byte_arr(payload), uint(ttl))


def pull(after: int, limit: int) -> bytes:
    return msg("Pull", uint(after), uint(limit))


def bye(reason: str | None = None) -> bytes:
    return msg("Bye", NIL if reason is None else s(reason))


def auth(version: int = 1) -> bytes:
    return msg("Auth", uint(version))


def auth_proof(device_id: bytes, signature: bytes) -> bytes:
    return msg("AuthProof", byte_arr(device_id), byte_arr(signature))


def join(group: bytes, admitter: bytes, expires_at: int, signature: bytes) -> bytes:
    return msg("Join", byte_arr(group), byte_arr(admitter), uint(expires_at),
               byte_arr(signature))


def presence(online: bool) -> bytes:
    return msg("Presence", boolean(online))


def ack(cursor: int) -> bytes:
    return msg("Ack", uint(cursor))


def delete(blob_id: bytes) -> bytes:
    return msg("Delete", bin16(blob_id))


def revoke(device_id: bytes) -> bytes:
    return msg("RevokeDevice", byte_arr(device_id))


def register_push(platform: str, token: str) -> bytes:
    return msg("RegisterPush", s(platform), s(token))


def unregister_push(platform: str, token: str) -> bytes:
    return msg("UnregisterPush", s(platform), s(token))


def content_ref(content_hash: bytes, nonce: bytes, size: int, encrypted: int) -> bytes:
    return msg("ContentRef", byte_arr(content_hash), byte_arr(nonce), uint(size),
               uint(encrypted))


def parse(body: bytes) -> list:
    return msgpack.unpackb(body, raw=False)


def group_id(secret: bytes) -> bytes:
    """0k-sync `GroupId::from_secret`: SHA-256("0k-sync-group-id-v1" ‖ secret)."""
    return hashlib.sha256(b"0k-sync-group-id-v1" + secret).digest()


# --- identity --------------------------------------------------------------------------------

class Device:
    def __init__(self, seed: bytes | None = None):
        self.key = SigningKey(seed) if seed else SigningKey.generate()
        self.id = bytes(self.key.verify_key)

    def auth_signature(self, nonce: bytes, cert_der: bytes) -> bytes:
        return self.key.sign(b"0k-sync-auth-v1" + nonce + hashlib.sha256(cert_der).digest()
                             ).signature

    def admit(self, group: bytes, joiner: bytes, expires_at: int) -> bytes:
        return self.key.sign(b"0k-sync-admit-v1" + group + joiner
                             + struct.pack(">Q", expires_at)).signature


# --- transport -------------------------------------------------------------------------------

class _Proto(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bufs: dict[int, bytearray] = {}
        self.fins: dict[int, asyncio.Future] = {}
        self.chunks: dict[int, asyncio.Queue] = {}
        self.uni: asyncio.Queue = asyncio.Queue()
        self.terminated: asyncio.Future = self._loop.create_future()

    def quic_event_received(self, event) -> None:
        if isinstance(event, StreamDataReceived):
            sid = event.stream_id
            buf = self.bufs.setdefault(sid, bytearray())
            buf += event.data
            if sid in self.chunks:
                self.chunks[sid].put_nowait(event.data)
            if sid % 4 == 3:          # relay-opened unidirectional
                if event.end_stream:
                    self.uni.put_nowait(bytes(self.bufs.pop(sid)))
            elif event.end_stream:
                fut = self.fins.get(sid)
                if fut is not None and not fut.done():
                    fut.set_result(bytes(buf))
        elif isinstance(event, ConnectionTerminated):
            if not self.terminated.done():
                self.terminated.set_result((event.error_code, event.reason_phrase))
            for fut in self.fins.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))


class SyncClient:
    def __init__(self, proto: _Proto, ctx):
        self.proto = proto
        self._ctx = ctx
        self.cert_der = proto._quic.tls._peer_certificate.public_bytes(Encoding.DER)

    @classmethod
    async def connect(cls, port: int, pin_sha256: str | None = None, *,
                      local_host: str | None = None) -> "SyncClient":
        """`local_host`: bind the client's UDP socket to this address of 127.0.0.0/8 (one
        more client address for the relay's per-address budgets)."""
        conf = QuicConfiguration(is_client=True, alpn_protocols=[ALPN],
                                 verify_mode=ssl.CERT_NONE, max_data=8 << 20,
                                 max_stream_data=4 << 20)
        if local_host is None:
            ctx = connect("127.0.0.1", port, configuration=conf, create_protocol=_Proto)
        else:
            ctx = connect_from(local_host, port, configuration=conf, create_protocol=_Proto)
        proto = await asyncio.wait_for(ctx.__aenter__(), TIMEOUT)
        client = cls(proto, ctx)
        if pin_sha256 is not None and hashlib.sha256(client.cert_der).hexdigest() != pin_sha256:
            await client.close()
            raise ssl.SSLError("relay certificate does not match the pin")
        return client

    async def close(self) -> None:
        try:
            await self._ctx.__aexit__(None, None, None)
        except Exception:
            pass

    def _open(self) -> int:
        sid = self.proto._quic.get_next_available_stream_id()
        self.proto.fins[sid] = self.proto._loop.create_future()
        return sid

    async def send_raw(self, data: bytes, *, fin: bool = True) -> bytes:
        """Write `data` on a new bidirectional stream; return what the relay wrote before
        its FIN (b"": the empty-FIN refusal)."""
        sid = self._open()
        self.proto._quic.send_stream_data(sid, data, end_stream=fin)
        self.proto.transmit()
        return await asyncio.wait_for(self.proto.fins[sid], TIMEOUT)

    async def request(self, body: bytes) -> list | None:
        """One framed request; the parsed answer, or None for an empty FIN."""
        out = await self.send_raw(frame(body))
        if not out:
            return None
        (n,) = struct.unpack(">I", out[:4])
        assert len(out) == 4 + n, "one frame, then FIN"
        return parse(out[4:])

    async def authenticate(self, device: Device, *, sign_with: Device | None = None) -> list:
        sid = self._open()
        self.proto.chunks[sid] = asyncio.Queue()
        self.proto._quic.send_stream_data(sid, frame(auth(1)), end_stream=False)
        self.proto.transmit()
        got = b""
        while len(got) < 4 or len(got) < 4 + struct.unpack(">I", got[:4])[0]:
            got += await asyncio.wait_for(self.proto.chunks[sid].get(), TIMEOUT)
        challenge = parse(got[4:])
        assert challenge[0] == "AuthChallenge"
        nonce = bytes(challenge[1])
        sig = (sign_with or device).auth_signature(nonce, self.cert_der)
        self.proto._quic.send_stream_data(sid, frame(auth_proof(device.id, sig)),
                                          end_stream=True)
        self.proto.transmit()
        out = await asyncio.wait_for(self.proto.fins[sid], TIMEOUT)
        rest = out[len(got):]
        return parse(rest[4:]) if rest else None

    async def next_uni(self, timeout: float = TIMEOUT) -> list:
        data = await asyncio.wait_for(self.proto.uni.get(), timeout)
        (n,) = struct.unpack(">I", data[:4])
        assert len(data) == 4 + n
        return parse(data[4:])

    async def closed(self, timeout: float = TIMEOUT) -> tuple[int, str]:
        """(error code, reason) of the relay's CONNECTION_CLOSE."""
        return await asyncio.wait_for(asyncio.shield(self.proto.terminated), timeout)


async def device_session(port: int, device: Device, group: bytes, *, name: str = "dev",
                         version: int = 2, admission: list | None = None,
                         last_cursor: int = 0,
                         local_host: str | None = None) -> tuple[SyncClient, list | None]:
    """Connect, authenticate, (join), HELLO; returns the client and the WELCOME (or None)."""
    c = await SyncClient.connect(port, local_host=local_host)
    assert await c.authenticate(device) == ["Done", "AuthProof"]
    if admission is not None:
        assert await c.request(join(group, *admission)) == ["Done", "Join"]
    return c, await c.request(hello(version, name, group, last_cursor))


# --- many client addresses, and clients that never finish ------------------------------------

@contextlib.asynccontextmanager
async def connect_from(local_host: str, port: int, *, configuration: QuicConfiguration,
                       create_protocol=QuicConnectionProtocol):
    """aioquic's `connect` to 127.0.0.1:`port`, from a UDP socket bound to `local_host`
    (aioquic's binds "::" and takes no local address)."""
    loop = asyncio.get_running_loop()
    configuration.server_name = configuration.server_name or "localhost"
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((local_host, 0))
    transport, protocol = await loop.create_datagram_endpoint(
        lambda: create_protocol(QuicConnection(configuration=configuration)), sock=sock)
    try:
        protocol.connect(("127.0.0.1", port))
        await protocol.wait_connected()
        yield protocol
    finally:
        protocol.close()
        await protocol.wait_closed()
        transport.close()


class SilentInitial:
    """A client that sends its first Initial (a real ClientHello, padded to 1,200 bytes) from
    `local_host` and nothing after: a handshake that never finishes, or, if the relay answers
    with a Retry, a spoofed source that never echoes it. `received()` drains what came back."""

    def __init__(self, port: int, local_host: str = "127.0.0.1", *, send: bool = True):
        conf = QuicConfiguration(is_client=True, alpn_protocols=[ALPN],
                                 verify_mode=ssl.CERT_NONE, server_name="localhost")
        quic = QuicConnection(configuration=conf)
        quic.connect(("127.0.0.1", port), now=0.0)
        self.port = port
        self.datagrams = [data for data, _ in quic.datagrams_to_send(now=0.0)]
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((local_host, 0))
        self.sock.setblocking(False)
        if send:
            self.send()

    def send(self) -> None:
        for data in self.datagrams:
            self.sock.sendto(data, ("127.0.0.1", self.port))

    def received(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.sock.recv(65536))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


def packet_type(datagram: bytes) -> QuicPacketType:
    return pull_quic_header(Buffer(data=datagram), host_cid_length=8).packet_type
