"""The stream tells the listeners of an inbox commit at once, over loopback UDP.

Every process that follows the inbox (egress, and the ingress of Heya, PPP and cursor-sync)
used to find the stream's commits by polling the Delta log every 50 ms: on average 25 ms
added to every delivery, and a log read 20 times a second per process when nothing happens.
Now each of them binds a UDP socket on 127.0.0.1 and registers it as a small file
`<data_dir>/run/inbox-signal/<pid>-<name>` holding the port; after each inbox commit the
stream sends every registered socket one datagram. The datagram carries only the micro-batch
id, and it is a wake-up, not data: the listener then reads the Delta log as before, which
stays the only source of truth, and still polls now and then (`egress.poll_interval_ms`) in
case a datagram was lost or the stream runs on another host.

The sender never blocks or raises into the stream: a registration whose process is gone is
removed, a send that fails is counted. The directory is re-listed only when it changed.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("relay.inbox_signal")

_PAYLOAD = struct.Struct(">Q")   # the micro-batch id that committed
HOST = "127.0.0.1"


def signal_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir).resolve() / "run" / "inbox-signal"


def landing_signal_dir(data_dir: str | os.PathLike) -> Path:
    """The other direction: ingress nodes tell the stream's source of each landing commit,
    so the stream waits for data instead of polling (`BlockingSignal`)."""
    return Path(data_dir).resolve() / "run" / "landing-signal"


def register(directory: Path, name: str, address: int | str) -> Path:
    """Publish a receiver's address (a port, or a socket path for `runtime/handoff.py`) as
    `<directory>/<pid>-<name>` (written whole: a sender never reads a half-written one);
    returns the file, which the receiver's `close` removes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}-{name}"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(address))
    os.replace(tmp, path)
    return path


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def registered(directory: Path) -> Iterator[tuple[Path, bool]]:
    """Each registration file in `directory` (not one still being written), and whether the
    process that wrote it is alive."""
    for entry in directory.iterdir():
        pid, _, _ = entry.name.partition("-")
        if pid.isdigit() and not entry.name.endswith(".tmp"):
            yield entry, process_alive(int(pid))


class Registrations:
    """The receivers registered in a directory, as (file, address text); the directory is
    re-listed only when it changed, and a registration whose process is gone is removed."""

    def __init__(self, directory: Path, recheck_seconds: float = 0.0):
        """`recheck_seconds`: how long a listing is used before the directory is looked at
        again (for a caller on a per-message path, where a stat each time shows in
        profiles)."""
        self.directory = Path(directory)
        self.recheck_seconds = recheck_seconds
        self._checked = -recheck_seconds
        self._listed_mtime: int | None = None
        self._targets: list[tuple[Path, str]] = []

    def current(self) -> list[tuple[Path, str]]:
        if self.recheck_seconds:
            now = time.monotonic()
            if now - self._checked < self.recheck_seconds:
                return self._targets
            self._checked = now
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            self._targets, self._listed_mtime = [], None
            return self._targets
        if mtime == self._listed_mtime:
            return self._targets
        self._listed_mtime = mtime
        targets = []
        for entry, alive in registered(self.directory):
            try:
                if not alive:
                    entry.unlink(missing_ok=True)   # a process that died without closing
                    continue
                targets.append((entry, entry.read_text()))
            except OSError:
                continue
        self._targets = targets
        return targets


class InboxSignalSender:
    """The stream's side: `notify(batch_id)` after each inbox commit."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._registrations = Registrations(self.directory)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        self.sent = 0
        self.failed = 0

    def notify(self, batch_id: int) -> None:
        try:
            targets = [int(port) for _, port in self._registrations.current()
                       if port.isdigit()]
        except Exception:   # never into the stream: the listeners' polls still find it
            self.failed += 1
            return
        payload = _PAYLOAD.pack(batch_id & (2 ** 64 - 1))
        for port in targets:
            try:
                self._sock.sendto(payload, (HOST, port))
                self.sent += 1
            except OSError:
                self.failed += 1

    def close(self) -> None:
        self._sock.close()


class _Datagrams:
    """An asyncio datagram protocol (duck-typed: asyncio is imported where it runs, so the
    stream's landing source, which needs only BlockingSignal, does not load it)."""

    def __init__(self, event):
        self.event = event
        self.received = 0

    def connection_made(self, transport) -> None:
        pass

    def datagram_received(self, data: bytes, addr) -> None:
        self.received += 1
        self.event.set()

    def error_received(self, exc: Exception) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class InboxSignal:
    """A listener's side: `await wait(timeout)` is True when the stream committed since the
    last wait (many commits during one poll make one wake-up), False on timeout."""

    def __init__(self, directory: Path, name: str):
        import asyncio

        self.directory = Path(directory)
        self.path = self.directory / f"{os.getpid()}-{name}"
        self._event = asyncio.Event()
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Datagrams | None = None

    @classmethod
    async def open(cls, directory: Path, name: str) -> "InboxSignal":
        import asyncio

        sig = cls(directory, name)
        loop = asyncio.get_running_loop()
        sig._transport, sig._protocol = await loop.create_datagram_endpoint(
            lambda: _Datagrams(sig._event), local_addr=(HOST, 0))
        sig.path = register(sig.directory, name, sig._transport.get_extra_info("sockname")[1])
        return sig

    @property
    def received(self) -> int:
        return self._protocol.received if self._protocol else 0

    def poke(self) -> None:
        """End the current `wait` now (the follower is told to stop)."""
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        import asyncio

        try:
            await asyncio.wait_for(self._event.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._event.clear()

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self._transport is not None:
            self._transport.close()
            self._transport = None


class BlockingSignal:
    """`InboxSignal` for a thread that may block: the stream's landing source, which runs in
    a Python worker Spark calls synchronously. `wait(timeout)` is True when a datagram came
    (all that came meanwhile are drained: one wake-up for many commits)."""

    def __init__(self, directory: Path, name: str):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((HOST, 0))
        self.received = 0
        self.path = register(Path(directory), name, self._sock.getsockname()[1])

    def wait(self, timeout: float) -> bool:
        self._sock.settimeout(max(timeout, 0.0))
        try:
            self._sock.recv(64)
        except (socket.timeout, BlockingIOError):
            return False
        self.received += 1
        self._sock.setblocking(False)
        try:
            while True:
                self._sock.recv(64)
                self.received += 1
        except (BlockingIOError, OSError):
            pass
        return True

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        self._sock.close()
