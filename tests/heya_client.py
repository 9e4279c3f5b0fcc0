"""A minimal Heya test client: its own self-signed certificate, TLS 1.3 over loopback, and
byte-exact reads (`expect` compares whole lines written out in the test, like the upstream
server_test.go's `recv`)."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


class Cert:
    """A client certificate and key on disk; `digest` is the mailbox identity it gives."""

    def __init__(self, directory: Path, name: str, *, key=None,
                 valid: tuple[timedelta, timedelta] = (timedelta(days=-1), timedelta(days=1)),
                 issuer: "Cert | None" = None):
        """Self-signed unless `issuer` signs it; valid from now + valid[0] to now + valid[1]."""
        directory.mkdir(parents=True, exist_ok=True)
        self.key_obj = key or ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.subject = subject
        now = datetime.now(timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(subject)
                .issuer_name(issuer.subject if issuer else subject)
                .public_key(self.key_obj.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now + valid[0]).not_valid_after(now + valid[1])
                .sign(issuer.key_obj if issuer else self.key_obj, hashes.SHA256()))
        self.der = cert.public_bytes(serialization.Encoding.DER)
        self.digest = hashlib.sha256(self.der).digest()
        self.cert_file = directory / f"{name}.crt"
        self.key_file = directory / f"{name}.key"
        self.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key_file.write_bytes(self.key_obj.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

    def renewed(self, directory: Path, name: str) -> "Cert":
        """A new certificate for the same key (what a renewal is)."""
        return Cert(directory, name, key=self.key_obj)


def client_context(cert: Cert | None, *, max_version=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE   # the reference client's SKIP_VERIFY=1
    if max_version is not None:
        ctx.maximum_version = max_version
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert_file), str(cert.key_file))
    return ctx


class HeyaClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    @classmethod
    async def connect(cls, port: int, cert: Cert | None, *, greeting: bytes | None = b"",
                      **ctx) -> "HeyaClient":
        """Connect; with `greeting` (default: `HEYA 0\\nDONE\\n`), expect it at once."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                       ssl=client_context(cert, **ctx))
        c = cls(reader, writer)
        if greeting is not None:
            await c.expect(greeting or b"HEYA 0\nDONE\n")
        return c

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read_exact(self, n: int, timeout: float = 10.0) -> bytes:
        return await asyncio.wait_for(self.reader.readexactly(n), timeout)

    async def read_line(self, timeout: float = 10.0) -> bytes:
        return await asyncio.wait_for(self.reader.readline(), timeout)

    async def expect(self, data: bytes, timeout: float = 10.0) -> None:
        got = await self.read_exact(len(data), timeout)
        assert got == data, f"expected {data!r}, got {got!r}"

    async def closed_by_server(self, timeout: float = 5.0) -> bool:
        """True if the server closed the connection (EOF or reset) within `timeout`, with
        nothing sent first."""
        try:
            data = await asyncio.wait_for(self.reader.read(1), timeout)
        except asyncio.TimeoutError:   # before OSError: TimeoutError is one
            return False
        except (ConnectionError, ssl.SSLError, OSError):
            return True
        assert data == b"", f"unexpected bytes before close: {data!r}"
        return True

    def close(self) -> None:
        if not self.writer.is_closing():
            self.writer.close()


async def register_and_mint(port: int, cert: Cert, inbox_hex: bytes,
                            end: int) -> tuple["HeyaClient", bytes]:
    """A receiver's session: INCO (register the mailbox with an inbox token), then AUTH (mint
    a send token valid from 0 to `end`), as interop §3 writes them; returns the session and
    the token's hex."""
    a = await HeyaClient.connect(port, cert)
    a.send(b"INCO " + inbox_hex + b"\n")
    await a.expect(b"INCO " + inbox_hex + b"\n")
    a.send(b"AUTH 0 %d\n" % end)
    await a.expect(b"AUTH ")
    t_hex = await a.read_exact(64)
    await a.expect(b" 0 %d\n" % end)
    return a, t_hex


def send_line(token_hex: bytes, body: bytes) -> bytes:
    """`SEND <token> <sha256> <len>\\n<body>\\n`, written out as interop §3 SEND says."""
    return (b"SEND " + token_hex + b" " + hashlib.sha256(body).hexdigest().encode() + b" "
            + str(len(body)).encode() + b"\n" + body + b"\n")


def recv_line(body: bytes) -> bytes:
    return b"RECV " + hashlib.sha256(body).hexdigest().encode() + b"\n"
