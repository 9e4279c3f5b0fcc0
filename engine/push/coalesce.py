"""Which offline device to wake, and when: at most one wake-up per device per window, and
never a message left without one.

A device is a registered (platform, token) of one owner. Rules, for a row that arrives for an
owner with no live session (the push job asks the listener that serves it):

* no wake-up in the last `window` seconds: wake at once (SEND). The first message of a burst
  wakes the phone without delay;
* woken within the window, and the device has not been online since that wake-up: the wake-up
  still stands (COVERED): the app will fetch everything when it opens, this row included;
* woken within the window, and the device came online after it (it used that wake-up, and
  this row is news): one more wake-up when the window ends (DEFER), if the device is still
  offline then. Rows that arrive meanwhile join it.

So a burst of messages to a sleeping phone costs one wake-up; a phone that wakes, fetches and
sleeps again is woken again for what came later, at most once per window. `window` defaults to
spec 004's batching window (30 s), which also breaks the timing link between a store and its
wake-up for all but the first message of a burst.

After a crash the planner is rebuilt from the push log (`restore`): a wake-up recorded as sent
counts; one recorded as being sent with no outcome is *unsure* and sent again when its device
comes up (under the same collapse id, so a device that got both shows one).

Pure: times are unix seconds passed in; no I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Decision(enum.Enum):
    SEND = "send"
    COVERED = "covered"
    DEFER = "defer"


@dataclass
class _Device:
    sent_at: float | None = None     # the last wake-up sent (or being sent)
    due: float | None = None         # a deferred wake-up's time
    unsure: bool = False             # restored: being sent when the job stopped


class WakePlanner:
    def __init__(self, window: float):
        self.window = max(0.0, float(window))
        self._devices: dict[bytes, _Device] = {}

    def __len__(self) -> int:
        return len(self._devices)

    def __contains__(self, device: bytes) -> bool:
        return device in self._devices

    def offer(self, device: bytes, now: float, last_seen: float | None) -> Decision:
        """A row for `device`'s owner, who is offline; `last_seen`: when the owner's last
        session ended (None: not seen since this listener started)."""
        d = self._devices.setdefault(device, _Device())
        if d.unsure or d.sent_at is None or now - d.sent_at >= self.window:
            return Decision.SEND
        if d.due is not None:
            return Decision.DEFER
        if last_seen is not None and last_seen > d.sent_at:
            d.due = d.sent_at + self.window
            return Decision.DEFER
        return Decision.COVERED

    def sent(self, device: bytes, now: float) -> None:
        """A wake-up for `device` is being sent at `now` (recorded before it goes out)."""
        d = self._devices.setdefault(device, _Device())
        d.sent_at, d.due, d.unsure = now, None, False

    def due_at(self, device: bytes) -> float | None:
        d = self._devices.get(device)
        return None if d is None else d.due

    def take_due(self, now: float) -> list[bytes]:
        """Devices whose deferred wake-up is due; the caller sends (`sent`) or drops
        (`cancel`) each."""
        return [k for k, d in self._devices.items() if d.due is not None and d.due <= now]

    def cancel(self, device: bytes) -> None:
        d = self._devices.get(device)
        if d is not None:
            d.due = None

    def next_due(self) -> float | None:
        dues = [d.due for d in self._devices.values() if d.due is not None]
        return min(dues) if dues else None

    def restore(self, device: bytes, sent_at: float, *, unsure: bool = False) -> None:
        """Replay of the push log at start, in time order."""
        d = self._devices.setdefault(device, _Device())
        if d.sent_at is None or sent_at >= d.sent_at:
            d.sent_at, d.unsure = sent_at, unsure

    def settle(self, device: bytes) -> None:
        """A restored unsure wake-up got its outcome after all."""
        d = self._devices.get(device)
        if d is not None:
            d.unsure = False

    def prune(self, now: float) -> int:
        """Forget devices whose window has passed with nothing due; how many."""
        old = [k for k, d in self._devices.items()
               if d.due is None and (d.sent_at is None or now - d.sent_at >= self.window)]
        for k in old:
            del self._devices[k]
        return len(old)
