"""A Heya round trip against a running relay: a mailbox owner redeems an inbox token (INCO) from
its client certificate and mints a send token (AUTH); a sender with a certificate of its own
SENDs a message with that token; the owner hears HAVE and fetches it with WANT -> GIVE. Plain
TLS 1.3 and the line protocol, written from the Heya interop notes.

    .venv/bin/relay heya inbox-token          # the operator mints one
    .venv/bin/python examples/heya_roundtrip.py --inbox-token <hex> --pin <heya-cert-sha256>
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import ssl
import tempfile
import time
from pathlib import Path

from relay.bench.heya import client_cert   # a self-signed P-256 certificate and key, as PEM files
from runtime import config


def certificate(directory: Path, name: str) -> ssl.SSLContext:
    """A new client certificate (its SHA-256 is the mailbox) in a TLS 1.3 context."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE          # self-signed relay certificate: pinned below
    ctx.load_cert_chain(*client_cert(str(directory), name))
    return ctx


async def connect(args, ctx: ssl.SSLContext):
    reader, writer = await asyncio.open_connection(args.host, args.port, ssl=ctx)
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    if args.pin and hashlib.sha256(der).hexdigest() != args.pin.lower():
        raise SystemExit("the relay's certificate is not the pinned one")
    greeting = [await reader.readline()]
    while greeting[-1] != b"DONE\n":
        greeting.append(await reader.readline())
    return reader, writer


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as d:
        owner_ctx, sender_ctx = certificate(Path(d), "owner"), certificate(Path(d), "sender")
        owner_r, owner_w = await connect(args, owner_ctx)
        owner_w.write(f"INCO {args.inbox_token}\n".encode())
        print("owner:", (await owner_r.readline()).split()[0].decode(), "(this certificate is a mailbox now)")
        now = int(time.time())
        owner_w.write(f"AUTH {now - 60} {now + 3600}\n".encode())
        token = (await owner_r.readline()).split()[1]
        print("owner: send token", token[:12].decode(), "...")

        sender_r, sender_w = await connect(args, sender_ctx)
        body = b"hello over Heya"
        t0 = time.perf_counter()
        sender_w.write(b"SEND %s %s %d\n%s\n" % (token, hashlib.sha256(body).hexdigest().encode(),
                                                  len(body), body))
        print("sender:", (await sender_r.readline()).split()[0].decode(), "(stored)")
        have = await asyncio.wait_for(owner_r.readline(), 30)      # HAVE <token> <next seq>
        print(f"owner: {have.split()[0].decode()} after {(time.perf_counter() - t0) * 1000:.0f} ms")
        owner_w.write(b"WANT %s 0\n" % token)
        give = (await owner_r.readline()).split()                  # GIVE <token> <seq> <len>
        got = await owner_r.readexactly(int(give[3]) + 1)
        print(f"owner: GIVE seq {give[2].decode()}: {got[:-1].decode()!r}")
        for w in (owner_w, sender_w):
            w.write(b"QUIT\n")
            w.close()


if __name__ == "__main__":
    settings = config.load()   # the port `relay up` uses here: conf/relay.toml, RELAY_HEYA_PORT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inbox-token", required=True, help="a line of `relay heya inbox-token`")
    p.add_argument("--pin", help="the `heya-cert-sha256` line of `relay keys`")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=settings.heya.port)
    asyncio.run(main(p.parse_args()))
