"""A PPP client written from the spec for the tests: frames are MessagePack maps built here
with `msgpack` directly (spec 004 §5.1, C.1/C.4, the §3.x GiftWrap key table), sockets are
the real `websockets` client and `http.client`. No relay code on this side."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import os
import struct
import time

import msgpack
from nacl.signing import SigningKey
from websockets.asyncio.client import connect


def pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def unpack(b: bytes) -> dict:
    return msgpack.unpackb(b, raw=False, strict_map_key=False)


def giftwrap(recipient: bytes, *, ciphertext: bytes | None = None, created_at: int | None = None,
             expires_at: int | None = None, ephemeral_pk: bytes | None = None,
             nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """(encoded GiftWrap, its authenticated-path event id): keys 1-6 of the §3.x table."""
    now = int(time.time())
    epk = ephemeral_pk or os.urandom(32)
    n = nonce or os.urandom(24)
    ct = ciphertext if ciphertext is not None else os.urandom(1040)
    m = {1: recipient, 2: epk, 3: n, 4: ct, 5: now if created_at is None else created_at,
         6: now + 3600 if expires_at is None else expires_at}
    return pack(m), hashlib.blake2b(epk + n + ct, digest_size=32).digest()


def sealed_id(epk: bytes, nonce: bytes, ct: bytes, token: bytes, created_at: int) -> bytes:
    return hashlib.blake2b(b"ppp-note-event-id-v1" + epk + nonce + ct + token
                           + struct.pack(">Q", created_at), digest_size=32).digest()


class Ws:
    def __init__(self, conn):
        self.conn = conn

    @classmethod
    async def open(cls, port: int, host: str = "127.0.0.1") -> tuple["Ws", bytes]:
        """Connect and read the CHALLENGE; returns (client, nonce)."""
        conn = await connect(f"ws://{host}:{port}/v1/ws", max_size=8 << 20)
        c = cls(conn)
        ch = await c.recv()
        assert ch["cmd"] == "CHALLENGE" and len(ch["nonce"]) == 32
        return c, ch["nonce"]

    @classmethod
    async def login(cls, port: int, sk: SigningKey, host: str = "127.0.0.1") -> "Ws":
        c, nonce = await cls.open(port, host)
        await c.send({"cmd": "AUTH", "pubkey": bytes(sk.verify_key),
                      "sig": sk.sign(nonce).signature})
        assert (await c.recv()) == {"cmd": "AUTH_OK"}
        return c

    async def send(self, m: dict) -> None:
        await self.conn.send(pack(m))

    async def send_raw(self, b) -> None:
        await self.conn.send(b)

    async def recv(self, timeout: float = 30.0) -> dict:
        return unpack(await asyncio.wait_for(self.conn.recv(), timeout))

    async def call(self, m: dict) -> dict:
        await self.send(m)
        return await self.recv()

    async def closed(self, timeout: float = 30.0) -> bool:
        """True once the server closed the socket (anything still sent is drained)."""
        try:
            while True:
                await asyncio.wait_for(self.conn.recv(), timeout)
        except Exception as e:
            from websockets.exceptions import ConnectionClosed
            return isinstance(e, ConnectionClosed)

    async def close(self) -> None:
        await self.conn.close()


def http_call(port: int, method: str, path: str, body: bytes = b"",
         headers: dict | None = None) -> tuple[int, bytes, dict]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request(method, path, body=body or None, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        c.close()


async def ahttp(port: int, method: str, path: str, body: bytes = b"", headers=None):
    return await asyncio.to_thread(http_call, port, method, path, body, headers)


def signed_get(sk: SigningKey, target: str, ts: int | None = None) -> dict:
    """A polling GET: the signature covers `GET <path?query>` (engine/ppp/protocol.py)."""
    return signed(sk, b"GET " + target.encode(), ts)


def signed(sk: SigningKey, body: bytes, ts: int | None = None) -> dict:
    """§5.2: Authorization: PPP-Ed25519 <pubkey_hex>:<sig_hex>, sig over body || timestamp."""
    t = str(int(time.time()) if ts is None else ts)
    sig = sk.sign(body + t.encode()).signature
    return {"Authorization": f"PPP-Ed25519 {bytes(sk.verify_key).hex()}:{sig.hex()}",
            "X-PPP-Timestamp": t, "Content-Type": "application/msgpack"}
