"""A test-only trueseal client built straight on the `noise` package and hand-written bytes.

It shares no code with the relay (no frames.py, no noise_session.py), so a test that uses it
checks the relay against the spec, not against itself.
"""

from __future__ import annotations

import asyncio
import os

from nacl.bindings import crypto_scalarmult_base
from noise.connection import Keypair, NoiseConnection

NK = b"Noise_NK_25519_ChaChaPoly_BLAKE2s"
XX = b"Noise_XX_25519_ChaChaPoly_BLAKE2s"


def u16(message: bytes) -> bytes:
    """interop §2: every Noise message is sent as [len u16 BE][message]."""
    assert len(message) <= 0xFFFF
    return len(message).to_bytes(2, "big") + bytes(message)


def split_u16(data: bytes) -> tuple[list[bytes], bytes]:
    out, pos = [], 0
    while len(data) - pos >= 2:
        n = int.from_bytes(data[pos:pos + 2], "big")
        if len(data) - pos - 2 < n:
            break
        out.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    return out, data[pos:]


def frame(tag: int, body: bytes = b"") -> bytes:
    """000 "Wire Format": [type u8][len u32 BE][body]."""
    return bytes([tag]) + len(body).to_bytes(4, "big") + body


def push_frame(recipient: bytes, envelope: bytes) -> bytes:
    return bytes([0x01]) + (32 + len(envelope)).to_bytes(4, "big") + recipient + envelope


def deliver_ack_frame(blob_id: int) -> bytes:
    return bytes([0x06]) + (8).to_bytes(4, "big") + blob_id.to_bytes(8, "big")


HEARTBEAT = bytes([0x03, 0, 0, 0, 0])
ACK = bytes([0x04, 0, 0, 0, 0])
ERROR = bytes([0x05, 0, 0, 0, 0])


def keypair() -> tuple[bytes, bytes]:
    priv = os.urandom(32)
    return priv, crypto_scalarmult_base(priv)


class Client:
    """Initiator side: NK (anonymous, pins the relay key) or XX (device static key)."""

    def __init__(self, pattern: bytes, relay_pub: bytes, static_priv: bytes | None = None):
        self.conn = NoiseConnection.from_name(pattern)
        self.conn.set_as_initiator()
        if pattern == NK:
            self.conn.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, relay_pub)
        else:
            self.static_priv = static_priv or os.urandom(32)
            self.static_pub = crypto_scalarmult_base(self.static_priv)
            self.conn.set_keypair_from_private_bytes(Keypair.STATIC, self.static_priv)
        self.pattern = pattern
        self.relay_pub = relay_pub
        self.conn.start_handshake()
        self._hs = self.conn.noise_protocol.handshake_state
        self.buf = b""
        self.sizes: list[int] = []   # raw handshake message sizes, both directions, in order

    def hello(self) -> bytes:
        m = bytes(self.conn.write_message(b""))
        self.sizes.append(len(m))
        return u16(m)

    def answer(self, data: bytes) -> bytes:
        """Feed the relay's handshake reply; returns the next message to send (XX msg 3)."""
        msgs, self.buf = split_u16(self.buf + data)
        assert len(msgs) == 1, msgs
        self.sizes.append(len(msgs[0]))
        rs = None
        self.conn.read_message(msgs[0])
        if self.pattern == XX:
            rs = self._hs.rs.public_bytes
            assert rs == self.relay_pub  # the real client checks it (interop §3)
            m = bytes(self.conn.write_message(b""))
            self.sizes.append(len(m))
            assert self.conn.handshake_finished
            return u16(m)
        assert self.conn.handshake_finished
        return b""

    def send(self, plaintext: bytes) -> bytes:
        return u16(self.conn.encrypt(bytes(plaintext)))

    def receive(self, data: bytes) -> list[bytes]:
        msgs, self.buf = split_u16(self.buf + data)
        return [self.conn.decrypt(bytes(m)) for m in msgs]


class AsyncClient:
    """The same client over asyncio streams, for the shell tests."""

    def __init__(self, reader, writer, client: Client):
        self.reader, self.writer, self.client = reader, writer, client
        self.pending: list[bytes] = []

    @classmethod
    async def connect(cls, port: int, pattern: bytes, relay_pub: bytes,
                      static_priv: bytes | None = None, handshake: bool = True,
                      host: str = "127.0.0.1"):
        reader, writer = await asyncio.open_connection(host, port)
        self = cls(reader, writer, Client(pattern, relay_pub, static_priv))
        if handshake:
            await self.handshake()
        return self

    async def handshake(self) -> None:
        self.writer.write(self.client.hello())
        data = b""
        while not split_u16(data)[0]:
            chunk = await asyncio.wait_for(self.reader.read(65536), 5)
            assert chunk, "relay closed during the handshake"
            data += chunk
        out = self.client.answer(data)
        if out:
            self.writer.write(out)

    def send(self, plaintext: bytes) -> None:
        self.writer.write(self.client.send(plaintext))

    async def recv_frame(self, timeout: float = 5.0) -> bytes | None:
        """Next decrypted frame, or None at EOF."""
        while not self.pending:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
            if not data:
                return None
            self.pending.extend(self.client.receive(data))
        return self.pending.pop(0)

    async def read_to_eof(self, timeout: float = 5.0) -> bytes:
        """Raw bytes until the relay closes (fails if it does not within `timeout`)."""
        return await asyncio.wait_for(self.reader.read(), timeout)

    def close(self) -> None:
        self.writer.close()
