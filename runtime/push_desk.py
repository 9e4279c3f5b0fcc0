"""The push job asks the process that serves a protocol whom to wake, over a local socket.

Only that process knows who is online (its sessions) and holds the protocol's push
registrations (its control tables, which it alone writes). So each listener process opens a
*desk* (`PushDesk.open`), and the push job (`egress/push/`), for the inbox rows it reads, asks
the desk of their protocol: which registered devices of this mailbox are offline, still owed
this row, and when were they last online? And when a provider says a token is dead, the job
asks the desk to deregister it: the owner writes that durably, as it writes every change.

A desk that cannot be reached (its process restarting) answers nothing: the job keeps those
rows and asks again, so no wake-up is lost to a restart.

Transport as `runtime/handoff.py`: a Unix stream socket in a directory only this user can
enter (the answers carry push tokens), registered as `<data>/run/push-desk/<pid>-<protocol>`.
One request at a time per connection: a 4-byte big-endian length, then msgpack
`[1, op, protocol, args]`; the answer likewise. Ops:

* `wake`, args `[[mailbox, cursor, meta], ...]` -> per row `[[owner, platform, token,
  last_seen], ...]`: the devices to wake for it (offline, registered, owed the row);
* `owner`, args `owner` -> `[online, [[owner, platform, token, last_seen], ...]]`: a deferred
  wake-up's re-check;
* `drop`, args `[owner, platform, token]` -> `true` once deregistered (durably);
* `pending`, no args -> `[[owner, platform, token, last_seen], ...]`: wake-ups the process
  asks for itself (a PPP knock for an offline room admin), each given once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgpack

from runtime.inbox_signal import Registrations
from runtime.local_socket import PrivateUnixServer

log = logging.getLogger("relay.push_desk")
VERSION = 1
_LENGTH = struct.Struct(">I")
MESSAGE_MAX = 64 * 1024 * 1024
TMP_PREFIX = "relay-push-desk-"


def desk_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir).resolve() / "run" / "push-desk"


@dataclass(frozen=True)
class Device:
    """A registered push token of one owner (a PPP pubkey, a Heya mailbox, a cursor-sync
    group and device)."""
    owner: bytes
    platform: str
    token: bytes
    last_seen: float | None     # when the owner was last online (unix s); None: unknown

    def __repr__(self) -> str:   # the token addresses one device; the owner is a key
        return f"Device({self.platform})"


class DeskBackend(Protocol):
    def wake(self, mailbox: bytes, cursor: int, meta: bytes | None) -> list[Device]: ...
    def owner(self, owner: bytes) -> tuple[bool, list[Device]]: ...
    async def drop(self, owner: bytes, platform: str, token: bytes) -> bool: ...
    def pending(self) -> list[Device]: ...


def _dev(d: Device) -> list:
    return [d.owner, d.platform, d.token, d.last_seen]


async def _read(reader: asyncio.StreamReader):
    (n,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if n > MESSAGE_MAX:
        raise ValueError("message too large")
    return msgpack.unpackb(await reader.readexactly(n))


def _frame(obj) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(data)) + data


class PushDesk:
    """A listener process's desk for one protocol."""

    def __init__(self, directory: Path, protocol: str, backend: DeskBackend):
        self.directory = Path(directory)
        self.protocol = protocol
        self.backend = backend
        self._server: PrivateUnixServer | None = None

    @property
    def path(self) -> Path | None:
        return None if self._server is None else self._server.path

    @classmethod
    async def open(cls, directory: Path, protocol: str, backend: DeskBackend) -> "PushDesk":
        d = cls(directory, protocol, backend)
        d._server = await PrivateUnixServer.open(d.directory, protocol, TMP_PREFIX, d._serve)
        return d

    async def _answer(self, req) -> object:
        v, op, protocol, args = req
        if v != VERSION or protocol != self.protocol:
            raise ValueError("not a request for this desk")
        if op == "wake":
            return [[_dev(d) for d in self.backend.wake(bytes(m), int(c), meta)]
                    for m, c, meta in args]
        if op == "owner":
            online, devices = self.backend.owner(bytes(args))
            return [online, [_dev(d) for d in devices]]
        if op == "pending":
            return [_dev(d) for d in self.backend.pending()]
        if op == "drop":
            owner, platform, token = args
            return await self.backend.drop(bytes(owner), str(platform), bytes(token))
        raise ValueError("unknown op")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                req = await _read(reader)
                writer.write(_frame(await self._answer(req)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        except Exception as e:   # a malformed request: that connection ends
            log.warning("push desk request refused", extra={
                "event": "push_desk_refused", "error": type(e).__name__})
        finally:
            writer.close()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()       # idempotent; `path` still names what was removed


class DeskUnavailable(Exception):
    """No desk of that protocol answers (its process is down or restarting)."""


def _device(x) -> Device:
    owner, platform, token, last_seen = x
    return Device(bytes(owner), str(platform), bytes(token),
                  None if last_seen is None else float(last_seen))


class DeskClient:
    """The push job's side: one connection per protocol's desk, reconnected as needed."""

    def __init__(self, directory: Path, timeout: float = 10.0):
        self._registrations = Registrations(Path(directory))
        self.timeout = timeout
        self._conns: dict[str, tuple[str, asyncio.StreamReader, asyncio.StreamWriter]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def _path(self, protocol: str) -> str | None:
        try:
            regs = self._registrations.current()
        except OSError:
            return None
        for entry, address in regs:
            if entry.name.partition("-")[2] == protocol:
                return address
        return None

    async def _ask(self, protocol: str, op: str, args) -> object:
        lock = self._locks.setdefault(protocol, asyncio.Lock())
        async with lock:
            path = self._path(protocol)
            if path is None:
                self._drop_conn(protocol)
                raise DeskUnavailable(protocol)
            conn = self._conns.get(protocol)
            if conn is None or conn[0] != path:
                self._drop_conn(protocol)
                try:
                    r, w = await asyncio.wait_for(asyncio.open_unix_connection(path),
                                                  self.timeout)
                except (OSError, asyncio.TimeoutError):
                    raise DeskUnavailable(protocol) from None
                conn = self._conns[protocol] = (path, r, w)
            _, r, w = conn
            try:
                w.write(_frame([VERSION, op, protocol, args]))
                await w.drain()
                return await asyncio.wait_for(_read(r), self.timeout)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
                self._drop_conn(protocol)
                raise DeskUnavailable(protocol) from None

    def _drop_conn(self, protocol: str) -> None:
        conn = self._conns.pop(protocol, None)
        if conn is not None:
            conn[2].close()

    async def wake(self, protocol: str,
                   rows: list[tuple[bytes, int, bytes | None]]) -> list[list[Device]]:
        answer = await self._ask(protocol, "wake", [list(r) for r in rows])
        return [[_device(x) for x in per_row] for per_row in answer]

    async def owner(self, protocol: str, owner: bytes) -> tuple[bool, list[Device]]:
        online, devices = await self._ask(protocol, "owner", owner)
        return bool(online), [_device(x) for x in devices]

    async def drop(self, protocol: str, owner: bytes, platform: str, token: bytes) -> bool:
        return bool(await self._ask(protocol, "drop", [owner, platform, token]))

    async def pending(self, protocol: str) -> list[Device]:
        return [_device(x) for x in await self._ask(protocol, "pending", None)]

    def close(self) -> None:
        for protocol in list(self._conns):
            self._drop_conn(protocol)
