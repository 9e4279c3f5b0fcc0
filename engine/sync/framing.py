"""Frames: `u32_be(len) ‖ message`, one frame per stream direction (cursor-sync-interop §1.2).

The length prefix is checked against `MAX_MESSAGE_SIZE` before a single body byte is buffered
or decoded (seed ST-001; 0k-sync `session.rs:195-200`: `len > MAX` refused, `len == MAX` allowed).
`FrameReader` is fed stream bytes as they arrive and yields complete message bodies.
"""

from __future__ import annotations

import struct

from .limits import MAX_MESSAGE_SIZE


class FrameError(ValueError):
    """Oversize length prefix, or a stream that ended inside a frame."""


def frame(body: bytes, max_size: int = MAX_MESSAGE_SIZE) -> bytes:
    if len(body) > max_size:
        raise FrameError("message over the size limit")
    return struct.pack(">I", len(body)) + body


class FrameReader:
    """Bytes in, whole message bodies out. Refuses an oversize prefix as soon as its four
    bytes are in, so a hostile length never makes the relay buffer the body."""

    def __init__(self, max_size: int = MAX_MESSAGE_SIZE):
        self.max_size = max_size
        self._buf = bytearray()
        self._need: int | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buf) < 4:
                    return out
                (n,) = struct.unpack_from(">I", self._buf)
                if n > self.max_size:
                    raise FrameError("frame length over the size limit")
                self._need = n
                del self._buf[:4]
            if len(self._buf) < self._need:
                return out
            out.append(bytes(self._buf[:self._need]))
            del self._buf[:self._need]
            self._need = None

    def end(self) -> None:
        """The peer sent FIN: anything half-read is an error."""
        if self._buf or self._need is not None:
            raise FrameError("stream ended inside a frame")
