"""What every sans-I/O protocol core hands its shell: events it parsed, bytes to write.

The cores (trueseal, Heya) append to `_events` and `_out`; the shell drains both after each
`receive_data` and each call it makes into the core.
"""

from __future__ import annotations

from typing import Generic, TypeVar

E = TypeVar("E")


class SansIOOutput(Generic[E]):
    def __init__(self) -> None:
        self._events: list[E] = []
        self._out = bytearray()

    def events_received(self) -> list[E]:
        events, self._events = self._events, []
        return events

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out
