"""The relay's static X25519 key: loaded from, or created in, `<data>/keys/trueseal_static.key`.

The file holds the hex of the 32-byte private key, whitespace trimmed, as the public relay's
key file does (interop §1), so a key can move between the two. Clients pin the public key
(NK `rs`; XX check after the handshake), so losing or regenerating it locks every client out:
it is created once, exclusively, with mode 0600, and never rewritten.

A file readable by group or others is not refused (that would take the relay down over a
fixable mode); it is logged as a warning and tightened to 0600.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from nacl.bindings import crypto_scalarmult_base

from runtime import logs

log = logging.getLogger("relay.keys")

TRUESEAL_KEY_FILE = "trueseal_static.key"


class RelayKey:
    """A static X25519 key pair. Its repr shows the public key only."""

    __slots__ = ("_private", "public")

    def __init__(self, private: bytes):
        if len(private) != 32:
            raise ValueError("an X25519 private key is 32 bytes")
        self._private = bytes(private)
        logs.plant(self._private)   # never in a log line, in any spelling
        # X25519(priv, basepoint), clamping included: what the public relay and the Noise
        # library both compute from the same bytes (interop §1).
        self.public: bytes = crypto_scalarmult_base(self._private)

    @classmethod
    def generate(cls) -> "RelayKey":
        return cls(secrets.token_bytes(32))

    @property
    def private_bytes(self) -> bytes:
        return self._private

    @property
    def public_hex(self) -> str:
        return self.public.hex()

    def __repr__(self) -> str:
        return f"RelayKey(public={self.public_hex})"

    __str__ = __repr__

    def __reduce__(self):   # no pickling a private key into a worker or a log by accident
        raise TypeError("RelayKey is not picklable")


def key_path(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir).resolve() / "keys" / TRUESEAL_KEY_FILE


def load_or_create(data_dir: str | os.PathLike, name: str = TRUESEAL_KEY_FILE) -> RelayKey:
    """The trueseal relay key under `data_dir` (or another 32-byte secret of the relay's,
    `<data>/keys/<name>`), created on first start."""
    path = Path(data_dir).resolve() / "keys" / name
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        _create(path)
    return _load(path)


def _load(path: Path) -> RelayKey:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("relay key file was readable by others; mode set to 0600",
                    extra={"event": "key_mode_fixed", "path": str(path), "mode": oct(mode)})
        os.chmod(path, 0o600)
    text = path.read_text(encoding="ascii", errors="replace").strip()
    try:
        private = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: not a hex-encoded key") from None
    if len(private) != 32:
        raise ValueError(f"{path}: expected 32 bytes of key, found {len(private)}")
    return RelayKey(private)


def _create(path: Path) -> None:
    if write_secret_file(path, (RelayKey.generate().private_bytes.hex() + "\n").encode()):
        log.info("created relay key", extra={"event": "key_created", "path": str(path)})


def write_secret_file(path: Path, data: bytes) -> bool:
    """Write a fresh secret to a private temp file (0600, fsync'ed), then link it into place:
    the link fails if another process got there first (False: load theirs), and nobody ever
    reads a half-written secret. The directory is fsync'ed after the link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return True
    finally:
        tmp.unlink(missing_ok=True)
