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
    unsure: bool = False             # restored: being sent when the job stopped


class WakePlanner:
    """Devices are kept in the order of their last wake-up (`sent` and `restore` move a
    device to the end), so `prune` stops at the first one still inside its window; deferred
    wake-ups (rare: a device back and gone again within its window) are a small map of their
    own. A step of the push job therefore costs what it decides, not every device it knows."""

    def __init__(self, window: float):
        self.window = max(0.0, float(window))
        self._devices: dict[bytes, _Device] = {}
        self._due: dict[bytes, float] = {}

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
        if device in self._due:
            return Decision.DEFER
        if last_seen is not None and last_seen > d.sent_at:
            self._due[device] = d.sent_at + self.window
            return Decision.DEFER
        return Decision.COVERED

    def _latest(self, device: bytes) -> _Device:
        """The device's entry, moved to the end (the newest wake-up)."""
        d = self._devices.pop(device, None) or _Device()
        self._devices[device] = d
        return d

    def sent(self, device: bytes, now: float) -> None:
        """A wake-up for `device` is being sent at `now` (recorded before it goes out)."""
        d = self._latest(device)
        d.sent_at, d.unsure = now, False
        self._due.pop(device, None)

    def due_at(self, device: bytes) -> float | None:
        return self._due.get(device)

    def take_due(self, now: float) -> list[bytes]:
        """Devices whose deferred wake-up is due; the caller sends (`sent`) or drops
        (`cancel`) each."""
        return [k for k, t in self._due.items() if t <= now]

    def cancel(self, device: bytes) -> None:
        self._due.pop(device, None)

    def next_due(self) -> float | None:
        return min(self._due.values(), default=None)

    def restore(self, device: bytes, sent_at: float, *, unsure: bool = False) -> None:
        """Replay of the push log at start, in time order."""
        d = self._devices.get(device)
        if d is None or d.sent_at is None or sent_at >= d.sent_at:
            d = self._latest(device)
            d.sent_at, d.unsure = sent_at, unsure

    def prune(self, now: float) -> int:
        """Forget devices whose window has passed with nothing due; how many."""
        old = []
        for k, d in self._devices.items():
            if k in self._due:
                continue
            if d.sent_at is not None and now - d.sent_at < self.window:
                break             # in wake-up order: every device after this one is newer
            old.append(k)
        for k in old:
            del self._devices[k]
        return len(old)
