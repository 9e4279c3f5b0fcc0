"""TLS for the Heya listener: the server certificate, and a context that demands a client
certificate from everyone but accepts any (self-signed, expired, unknown issuer).

* Server certificate: `heya.cert_file` / `heya.key_file` if configured; otherwise
  `<data>/keys/heya_server.crt` and `.key`, created on first start (ECDSA P-256, self-signed,
  10 years), the key with mode 0600. Created once, exclusively, never rewritten: clients that
  pin it keep working across restarts. `relay keys` prints its SHA-256.
* Client certificates: the public server uses Go's `RequireAnyClientCert` (interop §1): a
  certificate is mandatory, it is not verified, TLS only proves the client holds its key.
  Python's `ssl` has no switch for that (CERT_REQUIRED verifies against a CA store and aborts
  on a self-signed certificate), so `server_context` is a pyOpenSSL context:
  `VERIFY_PEER | VERIFY_FAIL_IF_NO_PEER_CERT` (a client without a certificate fails the
  handshake) with a verify callback that accepts every chain. The callback only decides
  chain trust: OpenSSL still checks the client's CertificateVerify signature, so the key is
  proven. `runtime/tls_stream.py` runs the context over asyncio.
* TLS 1.3 only, as the public server (interop §1: a TLS 1.2 client gets `protocol_version`).

The mailbox identity is SHA-256 of the client certificate's DER (interop §1), see
`cert_digest`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import ssl
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

from OpenSSL import SSL

log = logging.getLogger("relay.tls")

CERT_YEARS = 10

def cert_digest(der: bytes) -> bytes:
    """The Heya mailbox identity: SHA-256 of the whole DER certificate, so a renewed
    certificate (even for the same key) is a different mailbox (interop §1, §5.13)."""
    return hashlib.sha256(der).digest()


def server_cert_paths(data_dir: str | os.PathLike, cert_file: str = "",
                      key_file: str = "", listener: str = "heya") -> tuple[Path, Path]:
    keys = Path(data_dir).resolve() / "keys"
    return (Path(cert_file) if cert_file else keys / f"{listener}_server.crt",
            Path(key_file) if key_file else keys / f"{listener}_server.key")


def load_or_create_server_cert(data_dir: str | os.PathLike, cert_file: str = "",
                               key_file: str = "", listener: str = "heya") -> tuple[Path, Path]:
    """Paths of a listener's server certificate and key (Heya's TLS, cursor-sync's QUIC);
    created as `<data>/keys/<listener>_server.{crt,key}` on first start when none is
    configured. A configured pair that does not exist is an error, not created."""
    cert, key = server_cert_paths(data_dir, cert_file, key_file, listener)
    if cert_file or key_file:
        if not (cert.exists() and key.exists()):
            raise FileNotFoundError(f"{listener}.cert_file / {listener}.key_file: "
                                    "both must exist")
        return cert, key
    if not cert.exists():
        _create(cert, key, listener)
        # Lost a creation race: the winner links its certificate right after its key. A key
        # whose certificate never follows is what a crash between the two links leaves.
        deadline = time.monotonic() + 5
        while not cert.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not cert.exists():
            log.warning("server key without certificate; creating a new pair",
                        extra={"event": "server_cert_recreated", "listener": listener})
            key.unlink(missing_ok=True)
            _create(cert, key, listener)
    return cert, key


def server_cert_der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


def _create(cert: Path, key: Path, listener: str) -> None:
    """Key first (exclusive, 0600), then the certificate linked into place: a process that
    loses the race loads the winner's pair, and nobody reads a half-written file."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    cert.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"spark-relay {listener}")])
    now = datetime.now(timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(private.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(hours=1))
                   .not_valid_after(now + timedelta(days=365 * CERT_YEARS))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
                   .sign(private, hashes.SHA256()))
    key_pem = private.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    cert_pem = certificate.public_bytes(serialization.Encoding.PEM)
    suffix = f".{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp_key, tmp_cert = key.with_name(key.name + suffix), cert.with_name(cert.name + suffix)
    try:
        for path, data, mode in ((tmp_key, key_pem, 0o600), (tmp_cert, cert_pem, 0o644)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        try:
            os.link(tmp_key, key)
        except FileExistsError:
            return   # another process is creating the pair; its certificate follows
        os.link(tmp_cert, cert)
        dir_fd = os.open(cert.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        log.info("created server certificate", extra={"event": "server_cert_created",
                                                      "listener": listener, "path": str(cert)})
    finally:
        tmp_key.unlink(missing_ok=True)
        tmp_cert.unlink(missing_ok=True)


def server_context(cert: Path, key: Path) -> SSL.Context:
    """The Heya listener's TLS 1.3 context: `RequireAnyClientCert` (see the module docstring)."""
    ctx = SSL.Context(SSL.TLS_SERVER_METHOD)
    ctx.set_min_proto_version(SSL.TLS1_3_VERSION)
    ctx.use_certificate_chain_file(str(cert))
    ctx.use_privatekey_file(str(key))
    ctx.check_privatekey()
    ctx.set_verify(SSL.VERIFY_PEER | SSL.VERIFY_FAIL_IF_NO_PEER_CERT, _accept_any_chain)
    # A server that asks for client certificates must name its sessions, or OpenSSL refuses
    # every resumption attempt with a fatal error (Python's ssl names them "Python").
    ctx.set_session_id(b"heya")
    ctx.set_mode(SSL.MODE_RELEASE_BUFFERS)   # no record buffers held by idle connections
    return ctx


def _accept_any_chain(conn, cert, errno: int, depth: int, ok: int) -> bool:   # noqa: ARG001
    """Every client chain is trusted (RequireAnyClientCert): self-signed, expired, any issuer."""
    return True
