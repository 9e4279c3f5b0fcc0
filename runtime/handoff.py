"""Ingress hands a just-landed envelope to egress at once, over a local Unix socket.

A trueseal push is acked once its landing commit is durable; its inbox row follows a
micro-batch later (~0.2-1 s). A receiver whose session is open need not wait for it: right
after the commit the push listener sends the envelope to every egress process on this host,
which delivers it at once if that mailbox has a session there (`MailboxHub.add_early`). The
stream stays the authority: the inbox row still comes, egress matches it to the early
delivery by `event_id` (never delivered twice in one session) and writes the ack row with
the row's seq. A hand-off that is lost (egress down or busy, another host) costs only the
early delivery: the inbox row delivers it as before.

Why a Unix stream socket: these messages carry envelopes and make egress deliver them, so who
may send matters. The socket lives in a directory only this user can enter (`mkdtemp`, mode
0700): no other local user can inject a Deliver (loopback UDP, as `inbox_signal` uses for
its wake-ups, is open to every local user). A stream keeps the commits' order and queues a
burst in the kernel and asyncio buffers; Unix datagrams were tried first and dropped bursts
(`net.unix.max_dgram_qlen` is 10 here). A registration file
`<data_dir>/run/handoff/<pid>-<name>` names the socket, as `inbox_signal` names ports.

Message: a 4-byte big-endian length, then msgpack
[1, protocol, mailbox, event_id, expires_at µs since the epoch, envelope]. The sender never
blocks or raises into the listener: past `SEND_BUFFER_MAX` bytes waiting for one receiver,
hand-offs to it are dropped (counted).
"""

from __future__ import annotations

import asyncio
import os
import struct
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import msgpack

from runtime.inbox_signal import Registrations
from runtime.local_socket import PrivateUnixServer

VERSION = 1
_LENGTH = struct.Struct(">I")
# The largest message: the largest trueseal envelope with its header, and room to spare.
MESSAGE_MAX = 70_000
# Bytes that may wait for one slow receiver before hand-offs to it are dropped.
SEND_BUFFER_MAX = 4 * 1024 * 1024
TMP_PREFIX = "relay-handoff-"
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = datetime.resolution


def handoff_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir).resolve() / "run" / "handoff"


@dataclass(frozen=True)
class Handoff:
    protocol: str
    mailbox: bytes
    event_id: bytes
    expires_at: datetime
    envelope: bytes

    def __repr__(self) -> str:   # never show envelope bytes or the mailbox key
        return f"Handoff({self.protocol}, size={len(self.envelope)})"


def encode(h: Handoff) -> bytes:
    micros = (h.expires_at - _EPOCH) // _MICROSECOND
    return msgpack.packb([VERSION, h.protocol, h.mailbox, h.event_id, micros, h.envelope])


def decode(data: bytes) -> Handoff | None:
    """A message's hand-off, or None when it is not one this version reads."""
    try:
        v, protocol, mailbox, eid, micros, envelope = msgpack.unpackb(data)
        if v != VERSION or not (isinstance(protocol, str) and isinstance(mailbox, bytes)
                                and isinstance(eid, bytes) and isinstance(micros, int)
                                and isinstance(envelope, bytes)):
            return None
        return Handoff(protocol, mailbox, eid, _EPOCH + micros * _MICROSECOND, envelope)
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException):
        return None


class HandoffSender:
    """An ingress listener's side: `send(handoff)` (on the event loop) after the landing
    commit returned. Connects to each registered receiver on first use."""

    # A push's hand-off looks at the registrations at most this often: a stat of their
    # directory for every push was ~4% of the push listener's CPU in a py-spy profile (5k
    # pushes/s). An egress that registers is sent to from the next look; until then its
    # pushes reach it through the inbox row, as when no egress runs.
    RECHECK_SECONDS = 0.02

    def __init__(self, directory: Path):
        self._registrations = Registrations(Path(directory), self.RECHECK_SECONDS)
        self._links: dict[str, _Link] = {}
        self.sent = 0
        self.dropped = 0     # a receiver that was slow or gone: the inbox row delivers it

    def send(self, h: Handoff) -> None:
        try:
            targets = {path for _, path in self._registrations.current()}
        except OSError:
            targets = set()
        for path in [p for p in self._links if p not in targets]:
            self._links.pop(path).close()       # a receiver that went away
        if not targets:
            return
        payload = encode(h)
        data = _LENGTH.pack(len(payload)) + payload
        for path in targets:
            link = self._links.get(path)
            if link is None or link.dead:
                link = self._links[path] = _Link(path)
            if link.send(data):
                self.sent += 1
            else:
                self.dropped += 1

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


class _Link:
    """One connection to a receiver; what is sent while it connects waits (bounded)."""

    def __init__(self, path: str):
        self.path = path
        self.writer: asyncio.StreamWriter | None = None
        self.waiting: list[bytes] = []
        self.waiting_bytes = 0
        self.dead = False
        self._task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        try:
            _, self.writer = await asyncio.open_unix_connection(self.path)
        except OSError:
            self.dead = True
            return
        for data in self.waiting:
            self.writer.write(data)
        self.waiting.clear()

    def send(self, data: bytes) -> bool:
        if self.dead:
            return False
        if self.writer is None:
            if self.waiting_bytes + len(data) > SEND_BUFFER_MAX:
                return False
            self.waiting.append(data)
            self.waiting_bytes += len(data)
            return True
        if self.writer.is_closing():
            self.dead = True
            return False
        if self.writer.transport.get_write_buffer_size() + len(data) > SEND_BUFFER_MAX:
            return False
        self.writer.write(data)
        return True

    def close(self) -> None:
        self.dead = True
        self._task.cancel()
        if self.writer is not None:
            self.writer.close()


class HandoffReceiver:
    """Egress's side: each hand-off that arrives is passed to `deliver` on the loop."""

    def __init__(self, directory: Path, name: str, deliver: Callable[[Handoff], None]):
        self.directory = Path(directory)
        self.name = name
        self.deliver = deliver
        self._server: PrivateUnixServer | None = None
        self.received = 0
        self.malformed = 0

    @property
    def path(self) -> Path | None:
        """The registration file naming the socket."""
        return None if self._server is None else self._server.path

    @classmethod
    async def open(cls, directory: Path, name: str,
                   deliver: Callable[[Handoff], None]) -> "HandoffReceiver":
        r = cls(directory, name, deliver)
        r._server = await PrivateUnixServer.open(r.directory, name, TMP_PREFIX, r._serve)
        return r

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                if n > MESSAGE_MAX:
                    self.malformed += 1
                    return                      # not a sender of ours: its stream is lost
                h = decode(await reader.readexactly(n))
                if h is None:
                    self.malformed += 1
                    continue
                self.received += 1
                self.deliver(h)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            # (cancelled: the receiver is closing; asyncio would log a handler's cancellation)
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()       # idempotent; `path` still names what was removed
