"""A Unix stream socket only this user can reach, registered where its peers look for it.

What `runtime/handoff.py` (ingress hands envelopes to egress) and `runtime/push_desk.py` (the
push job asks a listener whom to wake) listen on. The socket lives in a fresh `mkdtemp`
directory (mode 0700): no other local user can connect, which matters because what crosses
it makes a relay process deliver envelopes or hands out push tokens. A registration file
`<directory>/<pid>-<name>` names the socket (`inbox_signal.register`); registrations of
processes that died without closing (kill -9) are removed, with their socket directories,
when a new server opens.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

from runtime.inbox_signal import register, registered

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def remove_dead(directory: Path, prefix: str) -> None:
    if not directory.is_dir():
        return
    for entry, alive in registered(directory):
        if alive:
            continue
        try:
            sock_dir = Path(entry.read_text()).parent
        except OSError:
            continue
        if sock_dir.name.startswith(prefix) and sock_dir.parent == Path(tempfile.gettempdir()):
            shutil.rmtree(sock_dir, ignore_errors=True)
        entry.unlink(missing_ok=True)


class PrivateUnixServer:
    """`open(directory, name, prefix, handler)`; `close()` unregisters, stops serving,
    cancels the connections' handlers and removes the socket's directory."""

    def __init__(self) -> None:
        self._tmp: str | None = None
        self.path: Path | None = None          # the registration file
        self._server: asyncio.AbstractServer | None = None
        self.handlers: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, directory: Path, name: str, prefix: str,
                   handler: Handler) -> "PrivateUnixServer":
        s = cls()
        remove_dead(Path(directory), prefix)
        s._tmp = tempfile.mkdtemp(prefix=prefix)
        sock = os.path.join(s._tmp, "s")

        async def serve(reader, writer) -> None:
            task = asyncio.current_task()
            s.handlers.add(task)
            try:
                await handler(reader, writer)
            finally:
                s.handlers.discard(task)
        try:
            s._server = await asyncio.start_unix_server(serve, path=sock)
        except OSError:
            shutil.rmtree(s._tmp, ignore_errors=True)
            raise
        s.path = register(Path(directory), name, sock)
        return s

    def close(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self.handlers):
            task.cancel()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
