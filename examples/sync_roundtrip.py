"""A cursor-sync round trip against a running relay: device A creates a group (its first HELLO),
admits device B (a signed Join), and PUSHes a blob; B hears NOTIFY and PULLs it at the cursor
the stream assigned. QUIC with ALPN /0k-sync/1, the relay's certificate pinned; the frames are
tests/sync_client.py's, written byte by byte from the cursor-sync interop notes.

    .venv/bin/python examples/sync_roundtrip.py --pin <sync-cert-sha256 from `relay keys`>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from runtime import config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from sync_client import Device, SyncClient, group_id, hello, join, pull, push  # noqa: E402


async def session(args, device: Device, group: bytes, admission: list | None = None):
    client = await SyncClient.connect(args.port, args.pin)
    assert await client.authenticate(device) == ["Done", "AuthProof"]
    if admission:
        assert await client.request(join(group, *admission)) == ["Done", "Join"]
    welcome = await client.request(hello(2, "example", group))
    return client, welcome


async def main(args) -> None:
    group = group_id(os.urandom(32))
    a, b = Device(), Device()
    ca, welcome = await session(args, a, group)
    print("A:", welcome[0], "(created the group)")
    expires = int(time.time()) + 3600
    cb, welcome = await session(args, b, group, [a.id, expires, a.admit(group, b.id, expires)])
    print("B:", welcome[0], "(admitted by A)")
    t0 = time.perf_counter()
    ack = await ca.request(push(os.urandom(16), b"hello over cursor-sync", 0))
    print(f"A: {ack[0]} at cursor {ack[2]} ({(time.perf_counter() - t0) * 1000:.0f} ms)")
    notify = await cb.next_uni(30)
    print(f"B: {notify[0]} latest cursor {notify[1]}")
    page = await cb.request(pull(0, 10))
    print("B: PULL", [(blob[1], bytes(blob[2]).decode()) for blob in page[1]])
    await ca.close()
    await cb.close()


if __name__ == "__main__":
    settings = config.load()   # the port `relay up` uses here: conf/relay.toml, RELAY_SYNC_PORT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pin", help="the `sync-cert-sha256` line of `relay keys`")
    p.add_argument("--port", type=int, default=settings.sync.port,
                   help="the relay's UDP port on 127.0.0.1")
    asyncio.run(main(p.parse_args()))
