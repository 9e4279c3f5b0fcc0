"""A trueseal round trip against a running relay, as the real client does it: a device opens its
receive session (Noise XX with its own static key), a sender pushes one envelope to that key
(a fresh Noise NK connection, one Push, wait for the Ack), and the device gets the Deliver and
acks it. The Noise handshakes are relay/bench/trueseal_client.py's, written from the interop
notes, not the relay's code.

    .venv/bin/python examples/trueseal_roundtrip.py --relay-key <hex from `relay keys`>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import time

from relay.bench.trueseal_client import (TAG_DELIVER, TAG_HEARTBEAT, connect_xx,
                                         deliver_ack_frame, frame, push_once, static_public)
from runtime import config


async def main(args) -> None:
    relay_pub = bytes.fromhex(args.relay_key)
    device_key = os.urandom(32)                      # the device's X25519 private key
    mailbox = static_public(device_key)              # what senders address
    receiver = await connect_xx(args.host, args.receive_port, relay_pub, device_key)
    envelope = b"hello over trueseal " + os.urandom(16)   # ciphertext, to the relay
    t0 = time.perf_counter()
    acked = await push_once(args.host, args.push_port, relay_pub, mailbox, envelope)
    print(f"push acked: {acked} ({(time.perf_counter() - t0) * 1000:.1f} ms)")
    while True:
        for f in await asyncio.wait_for(receiver.frames(), timeout=30):
            if f[0] == TAG_HEARTBEAT:
                receiver.send_frame(frame(TAG_HEARTBEAT))
            elif f[0] == TAG_DELIVER:
                blob_id = struct.unpack_from(">Q", f, 5)[0]
                body = f[13:]
                receiver.send_frame(deliver_ack_frame(blob_id))
                await receiver.writer.drain()
                print(f"delivered: blob {blob_id}, {len(body)} bytes, same bytes: "
                      f"{body == envelope} ({(time.perf_counter() - t0) * 1000:.1f} ms)")
                receiver.close()
                return


if __name__ == "__main__":
    settings = config.load()   # the ports `relay up` uses here: conf/relay.toml, RELAY_* variables
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--relay-key", required=True, help="the `trueseal` line of `relay keys`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--push-port", type=int, default=settings.trueseal.push_port)
    p.add_argument("--receive-port", type=int, default=settings.trueseal.receive_port)
    asyncio.run(main(p.parse_args()))
