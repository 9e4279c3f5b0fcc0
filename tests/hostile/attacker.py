"""The hostile clients: one process opening up to N connections to one listener, all at one
stage of its protocol, from one source address or spread over many of 127.0.0.0/8, holding them
for a while, then closing them all and exiting by itself.

Run by the suite as `python tests/hostile/attacker.py '<json spec>'` (a process of its own, so
its descriptors, memory and event loop are not the test's). It prints JSON lines on stdout:
`{"event": "ramped", ...}` once every connection has been tried (or the ramp time ran out) and
the hold starts, then `{"event": "done", ...}` with the counts. Every wait is bounded: connects
and handshakes by `step_timeout`, the ramp by `ramp_seconds`, the hold by `hold_seconds`; the
process cannot outlive ramp + hold + a few seconds.

Stages (what each connection does, then holds; see STAGES for which listener has which):
  silent               TCP connect, send nothing
  drip                 send the start of a valid first message one byte every `drip_seconds`
  abandoned_handshake  send part of the transport handshake, never finish it (trueseal push:
                       half a Noise NK message 1; receive: XX message 1, never message 3;
                       Heya: a TLS ClientHello, nothing after; PPP: a request head without its
                       last CRLF; cursor-sync, aioquic or iroh: a QUIC Initial, nothing after)
  idle_handshake       finish the transport handshake, then nothing (NK done; TLS + the Heya
                       greeting; WebSocket upgraded + CHALLENGE; QUIC handshake done)
  idle_auth            authenticate, then stay (receive: XX with a device key; Heya: any
                       self-signed certificate, PING every `ping_seconds` (25); PPP: AUTH_OK,
                       pings answered; cursor-sync: Auth proof + HELLO; over iroh: HELLO)

Identities (`identity` in the spec; what a connection authenticates as: Heya certificate,
trueseal device key, PPP signing key, cursor-sync device): "per_address" (the default: one
per source address; cursor-sync: one device per ten connections, the relay's per-minute
budget), "one" (every connection the same), "per_connection" (a fresh one each).
  half_frame           after the handshake (and auth), start a frame or body and never finish
                       it (trueseal: a Noise record cut short; Heya: a SEND body; PPP: a POST
                       body shorter than its Content-Length; cursor-sync: a request frame)
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import resource
import socket
import ssl
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))   # tests/: the protocol clients

STAGES = {
    "trueseal_push": ("silent", "drip", "abandoned_handshake", "idle_handshake", "half_frame"),
    "trueseal_receive": ("silent", "drip", "abandoned_handshake", "idle_auth", "half_frame"),
    "heya": ("silent", "drip", "abandoned_handshake", "idle_handshake", "idle_auth",
             "half_frame"),
    "ppp": ("silent", "drip", "abandoned_handshake", "idle_handshake", "idle_auth",
            "half_frame"),
    "sync": ("abandoned_handshake", "idle_handshake", "idle_auth", "half_frame"),
    "sync_iroh": ("abandoned_handshake", "idle_handshake", "idle_auth"),
}


class Closed(Exception):
    """The relay closed (or refused) the connection."""


class Stats:
    def __init__(self) -> None:
        self.attempted = 0
        self.connect_failed: dict[str, int] = {}
        self.setup_failed: dict[str, int] = {}
        self.established = 0       # reached the stage
        self.open = 0              # established and not closed by the relay yet
        self.peak_open = 0
        self.closed_in_ramp = 0    # closed by the relay after reaching the stage, during ramp
        self.closed_in_hold = 0
        self.holding = False

    def fail(self, kind: dict, exc: BaseException) -> None:
        name = type(exc).__name__
        if isinstance(exc, OSError) and exc.errno:
            name = f"{name}:{exc.errno}"
        kind[name] = kind.get(name, 0) + 1

    def opened(self) -> None:
        self.established += 1
        self.open += 1
        self.peak_open = max(self.peak_open, self.open)

    def lost(self) -> None:
        self.open -= 1
        if self.holding:
            self.closed_in_hold += 1
        else:
            self.closed_in_ramp += 1

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "holding"}


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# --- byte material, made once ------------------------------------------------------------------

def nk_message1(relay_pub: bytes) -> bytes:
    """A Noise NK message 1 for the relay key, u16-framed (interop §2). The relay cannot tell
    a replayed message 1 from a new one, so one is sent on every connection."""
    from trueseal_client import NK, Client
    return Client(NK, relay_pub).hello()


def xx_message1() -> bytes:
    from trueseal_client import XX, Client
    return Client(XX, b"\0" * 32).hello()


def tls_client_hello(ctx: ssl.SSLContext) -> bytes:
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=False)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def ws_upgrade(port: int) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            f"Sec-WebSocket-Version: 13\r\n\r\n").encode()


def ws_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """A masked client frame (RFC 6455 §5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
    elif n < 65536:
        head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def ws_read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    b0, b1 = await reader.readexactly(2)
    n = b1 & 0x7F
    if n == 126:
        (n,) = struct.unpack("!H", await reader.readexactly(2))
    elif n == 127:
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    return b0 & 0x0F, await reader.readexactly(n)


class Tls:
    """TLS over a plain asyncio stream through memory BIOs: a few KiB per connection, where
    asyncio's own SSL transport keeps a 256 KiB read buffer for each (10,000 = 2.5 GiB)."""

    def __init__(self, ctx: ssl.SSLContext, reader, writer, timeout: float):
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.obj = ctx.wrap_bio(self.inc, self.out, server_side=False)
        self.reader, self.writer, self.timeout = reader, writer, timeout
        self.buf = b""

    async def _feed(self) -> None:
        self.writer.write(self.out.read())
        data = await asyncio.wait_for(self.reader.read(65536), self.timeout)
        if not data:
            raise Closed("eof")
        self.inc.write(data)

    async def handshake(self) -> None:
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._feed()
        self.writer.write(self.out.read())

    def write(self, data: bytes) -> None:
        self.obj.write(data)
        self.writer.write(self.out.read())

    async def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            try:
                self.buf += self.obj.read(65536)
            except ssl.SSLWantReadError:
                await self._feed()
            except ssl.SSLZeroReturnError:
                raise Closed("close_notify") from None
        end = self.buf.index(marker) + len(marker)
        line, self.buf = self.buf[:end], self.buf[end:]
        return line


# --- one TCP connection at one stage -----------------------------------------------------------

class TcpAttack:
    def __init__(self, spec: dict, stats: Stats):
        self.spec = spec
        self.stats = stats
        self.listener = spec["listener"]
        self.stage = spec["stage"]
        self.port = spec["port"]
        self.step = spec.get("step_timeout", 10.0)
        self.work = Path(tempfile.mkdtemp(prefix="hostile-"))
        relay_pub = bytes.fromhex(spec.get("relay_pub", "00" * 32))
        self.certs: dict[str, ssl.SSLContext] = {}
        self.tls: dict[object, Tls] = {}
        self.keys: dict[str, object] = {}
        self.identity = spec.get("identity", "per_address")
        self.fresh: dict[int, ssl.SSLContext] = {}
        if self.listener == "trueseal_push":
            self.first = nk_message1(relay_pub)
        elif self.listener == "trueseal_receive":
            self.first = xx_message1()
            self.relay_pub = relay_pub
        elif self.listener == "heya":
            self.first = tls_client_hello(self.tls_context("127.0.0.1"))
        elif self.listener == "ppp":
            self.first = ws_upgrade(self.port)

    def who(self, addr: str, index: int):
        """The identity a connection authenticates as (module docstring)."""
        return {"one": "one", "per_connection": index}.get(self.identity, addr)

    def prepare(self, addr: str, index: int) -> None:
        """Make a fresh identity's certificate before connecting: made after, under load,
        it ate into the relay's handshake deadline (a Heya attacker starved of CPU sent no
        ClientHello within 10 s)."""
        if self.listener == "heya" and self.stage == "idle_auth" \
                and self.identity == "per_connection":
            self.fresh[index] = self.tls_context(index)

    def tls_context(self, who) -> ssl.SSLContext:
        """One self-signed client certificate per identity (any certificate is accepted,
        interop §1). A fresh one per connection is not kept after its handshake."""
        ctx = self.certs.get(who)
        if ctx is None:
            from heya_client import Cert, client_context
            name = f"a{str(who).replace('.', '_')}"
            ctx = client_context(Cert(self.work, name))
            if self.identity == "per_connection":
                for suffix in (".crt", ".key"):
                    (self.work / f"{name}{suffix}").unlink()
                return ctx
            self.certs[who] = ctx
        return ctx

    def signing_key(self, who):
        from nacl.signing import SigningKey
        if self.identity == "per_connection":
            return SigningKey.generate()
        key = self.keys.get(who)
        if key is None:
            key = self.keys[who] = SigningKey.generate()
        return key

    async def open(self, addr: str):
        return await asyncio.open_connection(self.spec["host"], self.port, local_addr=(addr, 0))

    async def setup(self, addr: str, reader, writer, index: int = 0) -> None:
        """Bring the connection to its stage; raises Closed if the relay closes it."""
        who = self.who(addr, index)
        L, S = self.listener, self.stage
        w = writer.write
        if S == "silent":
            return
        if S == "drip":
            w(self.first[:1])
            return
        if L == "trueseal_push":
            if S == "abandoned_handshake":
                w(self.first[:len(self.first) // 2])
                return
            w(self.first)
            await self.read_at_least(reader, 2 + 48)      # NK message 2: e, empty payload
            if S == "half_frame":
                w(b"\x00\x80" + os.urandom(16))          # a 128-byte record, 16 sent
            return
        if L == "trueseal_receive":
            if S == "abandoned_handshake":
                w(self.first)                            # XX message 1; never message 3
                return
            from trueseal_client import XX, Client
            client = Client(XX, self.relay_pub, self.device_key(who))
            w(client.hello())
            data = await self.read_at_least(reader, 2 + 96)   # XX message 2: e, s, payload
            w(client.answer(data))
            if S == "half_frame":
                w(b"\x00\x80" + os.urandom(16))
            return
        if L == "heya":
            if S == "abandoned_handshake":
                w(self.first)
                await self.read_some(reader)             # the server's flight; never answered
                return
            ctx = self.fresh.pop(index, None) or self.tls_context(who)
            tls = self.tls[writer] = Tls(ctx, reader, writer, self.step)
            await tls.handshake()
            await tls.read_until(b"DONE\n")
            if S == "idle_auth":
                tls.write(b"PING\n")
                await tls.read_until(b"PONG\n")
            elif S == "half_frame":
                body = os.urandom(1000)
                tls.write(b"SEND %s %s 1000\n" % (os.urandom(32).hex().encode(),
                                                  hashlib.sha256(body).hexdigest().encode())
                          + body[:10])
            return
        if L == "ppp":
            if S == "abandoned_handshake":
                w(self.first[:-2])                       # the head without its last CRLF
                return
            if S == "half_frame":
                w(b"POST /v1/note/submit HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/msgpack\r\nContent-Length: 1000\r\n\r\n"
                  + os.urandom(10))
                return
            w(ws_upgrade(self.port))
            head = await self.read_until(reader, b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 101"):
                raise Closed(head.split(b"\r\n", 1)[0].decode(errors="replace"))
            challenge = await self.ws_message(reader, writer)
            if S == "idle_auth":
                import msgpack
                nonce = msgpack.unpackb(challenge)["nonce"]
                key = self.signing_key(who)
                w(ws_frame(msgpack.packb({"cmd": "AUTH", "pubkey": bytes(key.verify_key),
                                          "sig": key.sign(nonce).signature},
                                         use_bin_type=True)))
                reply = msgpack.unpackb(await self.ws_message(reader, writer))
                if reply.get("cmd") != "AUTH_OK":
                    raise Closed(str(reply.get("cmd")))
            return
        raise ValueError(f"no stage {S} on {L}")

    def device_key(self, who) -> bytes:
        """One trueseal device key per identity (one mailbox each)."""
        if self.identity == "per_connection":
            return os.urandom(32)
        key = self.keys.get(("x25519", who))
        if key is None:
            key = self.keys[("x25519", who)] = os.urandom(32)
        return key

    async def read_at_least(self, reader, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await asyncio.wait_for(reader.read(65536), self.step)
            if not chunk:
                raise Closed("eof")
            data += chunk
        return data

    async def read_some(self, reader) -> bytes:
        chunk = await asyncio.wait_for(reader.read(65536), self.step)
        if not chunk:
            raise Closed("eof")
        return chunk

    async def read_until(self, reader, marker: bytes) -> bytes:
        try:
            return await asyncio.wait_for(reader.readuntil(marker), self.step)
        except asyncio.IncompleteReadError:
            raise Closed("eof") from None

    async def ws_message(self, reader, writer) -> bytes:
        while True:
            try:
                op, payload = await asyncio.wait_for(ws_read_frame(reader), self.step)
            except asyncio.IncompleteReadError:
                raise Closed("eof") from None
            if op == 0x9:
                writer.write(ws_frame(payload, 0xA))
            elif op == 0x8:
                raise Closed("websocket close")
            elif op in (0x1, 0x2):
                return payload

    async def hold(self, addr: str, reader, writer, until: float) -> None:
        """Keep the stage until `until`; returns early when the relay closes."""
        L, S = self.listener, self.stage
        loop = asyncio.get_running_loop()
        if S == "drip":
            sent = 1
            while loop.time() < until and sent < len(self.first):
                if await self.eof_within(reader, min(self.spec["drip_seconds"],
                                                     until - loop.time())):
                    raise Closed("eof")
                writer.write(self.first[sent:sent + 1])
                sent += 1
        if L == "ppp" and S in ("idle_handshake", "idle_auth"):
            while loop.time() < until:
                try:
                    op, payload = await asyncio.wait_for(ws_read_frame(reader),
                                                         max(0.01, until - loop.time()))
                except asyncio.TimeoutError:
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    raise Closed("eof") from None
                if op == 0x9:
                    writer.write(ws_frame(payload, 0xA))
                elif op == 0x8:
                    raise Closed("websocket close")
            return
        if L == "heya" and S == "idle_auth":
            every = self.spec.get("ping_seconds", 25.0)   # 25 s: under the 30 s idle timeout
            while loop.time() < until:
                if await self.eof_within(reader, min(every, until - loop.time())):
                    raise Closed("eof")
                if loop.time() < until:
                    self.tls[writer].write(b"PING\n")
            return
        if await self.eof_within(reader, until - loop.time()):
            raise Closed("eof")

    async def eof_within(self, reader, seconds: float) -> bool:
        """Read (and drop) whatever comes for `seconds`; True if the relay closed."""
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, seconds)
        while True:
            left = end - loop.time()
            if left <= 0:
                return False
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except asyncio.TimeoutError:
                return False
            except (ConnectionError, ssl.SSLError, OSError):
                return True
            if not data:
                return True


# --- cursor-sync over QUIC ---------------------------------------------------------------------

class QuicAttack:
    """QUIC stages. `abandoned_handshake` sends the client's first flight (the Initial with its
    ClientHello) from a new connection id and never answers; the others complete the aioquic
    handshake from a UDP socket bound to the source address."""

    def __init__(self, spec: dict, stats: Stats):
        self.spec = spec
        self.stats = stats
        self.stage = spec["stage"]
        self.port = spec["port"]
        self.step = spec.get("step_timeout", 10.0)
        self.sockets: dict[str, socket.socket] = {}
        self.protocols: list = []
        self.devices: dict[int, tuple] = {}

    def configuration(self):
        from aioquic.quic.configuration import QuicConfiguration
        return QuicConfiguration(is_client=True, alpn_protocols=["/0k-sync/1"],
                                 verify_mode=ssl.CERT_NONE, server_name="relay",
                                 idle_timeout=120.0)

    async def open_abandoned(self, addr: str) -> None:
        from aioquic.quic.connection import QuicConnection
        sock = self.sockets.get(addr)
        if sock is None:
            sock = self.sockets[addr] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind((addr, 0))
            sock.setblocking(False)
        conn = QuicConnection(configuration=self.configuration())
        now = time.monotonic()
        target = (self.spec["host"], self.port)
        conn.connect(target, now=now)
        for data, _ in conn.datagrams_to_send(now=now):
            sock.sendto(data, target)

    async def open_full(self, addr: str):
        from aioquic.asyncio.protocol import QuicConnectionProtocol
        from aioquic.quic.connection import QuicConnection
        from aioquic.quic.events import ConnectionTerminated, StreamDataReceived
        loop = asyncio.get_running_loop()

        class Proto(QuicConnectionProtocol):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.data: dict[int, bytearray] = {}
                self.ended: dict[int, asyncio.Future] = {}
                self.terminated = loop.create_future()

            def quic_event_received(self, event):
                if isinstance(event, StreamDataReceived):
                    self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                    fut = self.ended.get(event.stream_id)
                    if fut is not None and not fut.done() and (
                            event.end_stream or self._has_frame(event.stream_id)):
                        fut.set_result(bytes(self.data[event.stream_id]))
                elif isinstance(event, ConnectionTerminated):
                    if not self.terminated.done():
                        self.terminated.set_result(event.error_code)
                    for fut in self.ended.values():
                        if not fut.done():
                            fut.set_exception(Closed("quic closed"))

            def _has_frame(self, sid):
                buf = self.data[sid]
                return len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]

            async def exchange(self, body: bytes, *, fin: bool = True, sid=None) -> bytes:
                if sid is None:
                    sid = self._quic.get_next_available_stream_id()
                self.ended[sid] = loop.create_future()
                self._quic.send_stream_data(sid, struct.pack(">I", len(body)) + body,
                                            end_stream=fin)
                self.transmit()
                got = await asyncio.wait_for(self.ended[sid], TIMEOUT)
                self.data[sid] = bytearray()
                return got, sid

        TIMEOUT = self.step
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((addr, 0))
        transport, proto = await loop.create_datagram_endpoint(
            lambda: Proto(QuicConnection(configuration=self.configuration())), sock=sock)
        proto.transport_ = transport
        proto.connect((self.spec["host"], self.port))
        try:
            await asyncio.wait_for(proto.wait_connected(), self.step)
        except BaseException:
            transport.close()
            raise
        return proto

    def device(self, index: int):
        """Ten connections per device (the relay lets a device open 10 per minute; spec
        `identity`: "one", one device; "per_connection", a device each), each device in a
        group of its own (its first HELLO creates it; one control-table row)."""
        from sync_client import Device
        key = {"one": 0, "per_connection": index}.get(self.spec.get("identity"), index // 10)
        if key not in self.devices:
            self.devices[key] = (Device(), os.urandom(32))
        return self.devices[key]

    async def setup_full(self, addr: str, proto, index: int) -> None:
        if self.stage == "idle_handshake":
            return
        import msgpack
        from sync_client import auth, auth_proof, hello, pull
        device, group = self.device(index)
        got, sid = await proto.exchange(auth(1), fin=False)
        challenge = msgpack.unpackb(got[4:])
        nonce = bytes(challenge[1])
        from cryptography.hazmat.primitives.serialization import Encoding
        der = proto._quic.tls._peer_certificate.public_bytes(Encoding.DER)
        got, _ = await proto.exchange(auth_proof(device.id, device.auth_signature(nonce, der)),
                                      sid=sid)
        if b"Done" not in got:
            raise Closed("auth refused")
        got, _ = await proto.exchange(hello(1, f"h{index}", group, 0))
        if b"Welcome" not in got:
            raise Closed("hello refused")
        if self.stage == "half_frame":
            sid = proto._quic.get_next_available_stream_id()
            body = pull(0, 10)
            proto._quic.send_stream_data(sid, struct.pack(">I", len(body) + 50) + body,
                                         end_stream=False)
            proto.transmit()


# --- cursor-sync over iroh --------------------------------------------------------------------

class IrohAttack:
    """The iroh endpoint's stages, as stock 0k-sync clients would hold them: `idle_handshake`
    dials (iroh's QUIC + raw-key TLS) and sends nothing, `idle_auth` sends HELLO (a group per
    device, created by it) and stays. The device id is the iroh key, so a device is an iroh
    endpoint bound to one source address (one key on two addresses would be one peer moving
    between paths): per_address, a device per ten connections of an address (the relay's
    per-minute budget); per_connection, one each; one, one device (its connections past ten
    a minute are closed with code 1). `abandoned_handshake` is QuicAttack's: an Initial from
    aioquic, never answered."""

    def __init__(self, spec: dict, stats: Stats):
        self.spec = spec
        self.stage = spec["stage"]
        self.step = spec.get("step_timeout", 10.0)
        self.relay = None
        self.endpoints: dict[tuple, object] = {}
        self.groups: dict[object, bytes] = {}       # endpoint -> its device's group
        self.per_address: dict[str, int] = {}
        self.conns: list = []

    async def endpoint(self, addr: str, index: int):
        import iroh
        n = self.per_address.get(addr, 0)
        self.per_address[addr] = n + 1
        key = {"one": ("one",), "per_connection": (index,)}.get(
            self.spec.get("identity"), (addr, n // 10))
        ep = self.endpoints.get(key)
        if ep is None:
            bind_addr = "127.0.0.2:0" if key == ("one",) else f"{addr}:0"
            ep = self.endpoints[key] = await iroh.Endpoint.bind(iroh.EndpointOptions(
                preset=iroh.preset_minimal(), bind_addr=bind_addr,
                secret_key=iroh.SecretKey.generate().to_bytes(),
                relay_mode=iroh.RelayMode.disabled()))
            self.groups[ep] = os.urandom(32)
        return ep

    async def open_full(self, addr: str, index: int):
        import iroh
        from sync_iroh_client import ALPN
        ep = await self.endpoint(addr, index)
        target = iroh.EndpointAddr(iroh.EndpointId.from_string(self.spec["relay_id"]), None,
                                   [f"{self.spec['host']}:{self.spec['port']}"])
        conn = await asyncio.wait_for(ep.connect(target, ALPN), self.step)
        self.conns.append(conn)
        return conn, self.groups[ep]

    async def setup_full(self, conn, group: bytes) -> None:
        if self.stage != "idle_auth":
            return
        from sync_client import frame, hello
        bi = await asyncio.wait_for(conn.open_bi(), self.step)
        send = bi.send()
        await send.write_all(frame(hello(1, "h", group, 0)))
        await send.finish()
        got = await asyncio.wait_for(bi.recv().read_to_end(1 << 16), self.step)
        if b"Welcome" not in got:
            raise Closed("hello refused")

    async def leave(self) -> None:
        for n, conn in enumerate(self.conns):
            try:
                conn.close(0, b"bye")
            except Exception:
                pass
            if n % 100 == 99:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        for ep in self.endpoints.values():
            try:
                await asyncio.wait_for(ep.close(), 2)
            except Exception:
                pass


# --- the run -----------------------------------------------------------------------------------

async def run(spec: dict) -> dict:
    raise_nofile()
    stats = Stats()
    loop = asyncio.get_running_loop()
    addresses = spec["addresses"]
    count = spec["count"]
    sem = asyncio.Semaphore(spec.get("parallel", 256))
    ramp_end = loop.time() + spec["ramp_seconds"]
    hold_seconds = spec["hold_seconds"]
    quic = spec["listener"] in ("sync", "sync_iroh")
    iroh_ = spec["listener"] == "sync_iroh"
    attack = QuicAttack(spec, stats) if quic else TcpAttack(spec, stats)
    full = IrohAttack(spec, stats) if iroh_ else attack
    writers: list = []
    tasks: list[asyncio.Task] = []

    async def one(i: int) -> None:
        addr = addresses[i % len(addresses)]
        async with sem:
            if loop.time() >= ramp_end:
                return
            stats.attempted += 1
            if quic and spec["stage"] == "abandoned_handshake":
                try:
                    await attack.open_abandoned(addr)
                except OSError as e:
                    stats.fail(stats.connect_failed, e)
                    return
                stats.opened()
                return
            if not quic:
                attack.prepare(addr, i)
            try:
                if iroh_:
                    conn, group = await full.open_full(addr, i)
                elif quic:
                    proto = await attack.open_full(addr)
                else:
                    reader, writer = await asyncio.wait_for(attack.open(addr),
                                                            attack.step + 1)
            except Exception as e:   # refused, reset, timed out, out of ports, ...
                stats.fail(stats.connect_failed, e)
                return
            try:
                if iroh_:
                    await full.setup_full(conn, group)
                elif quic:
                    attack.protocols.append(proto)
                    await attack.setup_full(addr, proto, i)
                else:
                    writers.append(writer)
                    await attack.setup(addr, reader, writer, i)
            except Exception as e:   # closed, refused, garbled, timed out: all count
                stats.fail(stats.setup_failed, e)
                return
            stats.opened()
        # hold from now on (the run cancels every task when the hold is over), so a
        # connection the relay closes during the ramp is counted then
        until = ramp_end + hold_seconds + 1
        try:
            if iroh_:
                await conn.closed()
                stats.lost()
                return
            if quic:
                await proto.terminated
                stats.lost()
                return
            await attack.hold(addr, reader, writer, until)
        except (Closed, OSError, asyncio.IncompleteReadError, ssl.SSLError):
            stats.lost()

    for i in range(count):
        tasks.append(asyncio.create_task(one(i)))
    # the ramp ends when every connection is at its stage (or failed) or time is up
    done_waiting = asyncio.gather(*tasks, return_exceptions=True)
    ramp_start = loop.time()
    while loop.time() < ramp_end:
        pending = sum(1 for t in tasks if not t.done())
        if stats.attempted >= count and pending <= stats.open:
            break
        await asyncio.sleep(0.1)
    ramp_seconds = loop.time() - ramp_start
    stats.holding = True
    report = {"event": "ramped", "t": time.time(), "ramp_seconds": round(ramp_seconds, 2),
              "cpu_s": round(time.process_time(), 2), **stats.as_dict()}
    print(json.dumps(report), flush=True)
    await asyncio.sleep(hold_seconds)
    await asyncio.sleep(0.2)
    open_at_end = stats.open
    # leave: first stop every connection where it is, so none reaches its stage (and the
    # list of those to close) while the others are closed; a QUIC session set up during the
    # closes below was never closed, and the relay rightly held it for its idle timeout (60 s)
    for t in tasks:
        t.cancel()
    try:
        await asyncio.wait_for(done_waiting, 5)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        pass
    # then abort every socket (no lingering close handshakes to wait for)
    for w in writers:
        try:
            w.transport.abort()
        except Exception:
            pass
    # QUIC: CONNECTION_CLOSE in batches, so the relay's UDP receive buffer does not drop them
    # (a lost one leaves the relay holding the connection until its idle timeout)
    for n, p in enumerate(attack.protocols if quic else ()):
        try:
            p.close()
        except Exception:
            pass
        if n % 100 == 99:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2 if quic else 0)
    for p in attack.protocols if quic else ():
        try:
            p.transport_.close()
        except Exception:
            pass
    for s in getattr(attack, "sockets", {}).values():
        s.close()
    if iroh_:
        await full.leave()
    return {"event": "done", "t": time.time(), "open_at_hold_end": open_at_end,
            "cpu_s": round(time.process_time(), 2), **stats.as_dict()}


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = asyncio.run(run(spec))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
