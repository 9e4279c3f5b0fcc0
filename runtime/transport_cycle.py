"""A socket transport that ends is freed by reference counting, not by the cyclic collector.

CPython 3.11's `_SelectorSocketTransport` keeps `_read_ready_cb`, a bound method of itself:
a reference cycle that holds the transport, its socket objects, its buffer and its extra-info
dict until a full collection. 3.12 drops it in `close()` (gh-100348) but not when a peer
resets the connection (`_force_close`), which is how a flood of connections leaves (the
hostile suite's attacker aborts thousands at once). Measured 2026-11-29 on the PPP ingress:
9,000 idle authenticated WebSockets reset at once left 54,000 objects in these cycles,
holding ~234,000 objects in all; the heap trimmer's full collection after the flood freed
them in one stop of the event loop of 0.23-0.27 s on this machine (0.5 s on one core),
which a client's round trip begun then waits out.

`install()` (idempotent, run when `runtime.listener` is imported: every listener imports it)
drops the callback once the transport has told its protocol the connection is lost. Nothing
reads it after that: the transport's reader was removed before `_call_connection_lost` was
scheduled (`_force_close` and `close` both do), and 3.12's `close()` leaves it None too.
"""

from __future__ import annotations

from asyncio import selector_events

_Transport = selector_events._SelectorSocketTransport


def install() -> bool:
    """Patch the class once; False where this CPython has no such callback (nothing to do)."""
    if getattr(_Transport, "_relay_drops_read_cb", False):
        return True
    if "_read_ready_cb" not in _Transport.__init__.__code__.co_names:
        return False
    lost = _Transport._call_connection_lost

    def _call_connection_lost(self, exc):
        try:
            lost(self, exc)
        finally:
            self._read_ready_cb = None

    _Transport._call_connection_lost = _call_connection_lost
    _Transport._relay_drops_read_cb = True
    return True
