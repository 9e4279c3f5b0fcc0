"""A 0k-sync-style client over iroh for the tests: what 0k-sync's `IrohTransport` does
(cursor-sync-interop §1.1), on the same `iroh` bindings the relay uses, with every frame built
byte by byte by `sync_client` (the interop notes' layouts), never by the relay's codec.

Per request: open a bidirectional stream, write one frame, FIN; read to the end: one frame, or
nothing (the empty-FIN refusal). NOTIFYs arrive on relay-opened unidirectional streams
(`next_uni`; 0k-sync's own client never reads them). The device key is the iroh secret key, so
the relay's device id is this endpoint's id. Relays and discovery are off: loopback only.
"""

from __future__ import annotations

import asyncio
import struct

import iroh

from sync_client import frame, parse

ALPN = b"/0k-sync/1"
TIMEOUT = 30.0


async def bind(secret: bytes | None = None) -> iroh.Endpoint:
    return await iroh.Endpoint.bind(iroh.EndpointOptions(
        preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0",
        secret_key=secret if secret is not None else iroh.SecretKey.generate().to_bytes(),
        relay_mode=iroh.RelayMode.disabled()))


class IrohSyncClient:
    def __init__(self, endpoint: iroh.Endpoint, conn: iroh.Connection, own: bool):
        self.endpoint = endpoint
        self.conn = conn
        self._own = own
        self.id = endpoint.id().to_bytes()

    @classmethod
    async def connect(cls, relay_id: str, addresses: list[str],
                      endpoint: iroh.Endpoint | None = None) -> "IrohSyncClient":
        """Dial the relay by endpoint id and direct address (what `sync-cli` is given)."""
        own = endpoint is None
        ep = endpoint or await bind()
        addr = iroh.EndpointAddr(iroh.EndpointId.from_string(relay_id), None, addresses)
        conn = await asyncio.wait_for(ep.connect(addr, ALPN), TIMEOUT)
        return cls(ep, conn, own)

    async def close(self) -> None:
        try:
            self.conn.close(0, b"closing")      # 0k-sync `iroh.rs:232-238`
        except Exception:
            pass
        if self._own:
            await self.endpoint.close()

    async def send_raw(self, data: bytes) -> bytes:
        """`data` on a new bidirectional stream + FIN; what the relay wrote before its FIN."""
        bi = await asyncio.wait_for(self.conn.open_bi(), TIMEOUT)
        send = bi.send()
        await send.write_all(data)
        await send.finish()
        return await asyncio.wait_for(bi.recv().read_to_end(4 << 20), TIMEOUT)

    async def request(self, body: bytes) -> list | None:
        return self.answer(await self.send_raw(frame(body)))

    @staticmethod
    def answer(out: bytes) -> list | None:
        if not out:
            return None
        (n,) = struct.unpack(">I", out[:4])
        assert len(out) == 4 + n, "one frame, then FIN"
        return parse(out[4:])

    async def next_uni_raw(self, timeout: float = TIMEOUT) -> bytes:
        recv = await asyncio.wait_for(self.conn.accept_uni(), timeout)
        return await asyncio.wait_for(recv.read_to_end(1 << 20), timeout)

    async def closed(self, timeout: float = TIMEOUT) -> str:
        """The relay's close (iroh's text, e.g. `closed by peer: 1`) once it came."""
        return await asyncio.wait_for(self.conn.closed(), timeout)
