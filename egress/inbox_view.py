"""What a protocol's view of the inbox is: the interface `heya_inbox.py`, `ppp_inbox.py` and
`sync_inbox.py` implement, and the session fan-out two of them share.

A protocol whose clients read by sequence number or cursor (Heya, PPP, cursor-sync) keeps,
in the process that hosts its listener, a view of its own rows of the inbox. It is fed like
the egress hub (`pending.MailboxHub`): `bootstrap()` reads the protocol's rows once and
returns the inbox version it read, then `inbox_tail.InboxTail(protocols={protocol})` follows
the stream's commits and calls `add(protocol, mailbox, envelopes)` with each mailbox's new
rows in cursor order. The connected sessions that want to hear of new rows register under a
key (a Heya mailbox owner, a PPP recipient; cursor-sync keeps them with each group).

The listener composing a view with the ingress half of its protocol is in `ingress/`
(`ingress.COMPOSITION`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterable, Protocol, TypeVar

from .pending import PendingEnvelope

S = TypeVar("S")


class InboxView(Protocol):
    async def bootstrap(self) -> int: ...
    def add(self, protocol: str, mailbox: bytes,
            envelopes: Iterable[PendingEnvelope]) -> None: ...


class LastSeen:
    """When each key's last session ended (unix seconds), for the push job: a device that
    came back after its wake-up used it, so later news needs another (engine/push/coalesce.py).
    Bounded: past `cap` keys the oldest departures are forgotten (a forgotten key reads as
    "not seen since start", which only suppresses a second wake-up within one window)."""

    def __init__(self, cap: int = 100_000, clock=time.time):
        self.cap = cap
        self.clock = clock
        # An OrderedDict, not a dict: forgetting the oldest of a dict (`next(iter(d))` then
        # `del`) leaves deleted slots at its front that every later `next(iter(d))` walks
        # over until the dict is rebuilt (6,500 departures past the cap: 39 ms, against 9 ms).
        self._at: OrderedDict[Hashable, float] = OrderedDict()

    def left(self, key: Hashable) -> None:
        self._at[key] = self.clock()
        self._at.move_to_end(key)
        if len(self._at) > self.cap:
            self._at.popitem(last=False)

    def get(self, key: Hashable) -> float | None:
        return self._at.get(key)

    def forget(self, key: Hashable) -> None:
        self._at.pop(key, None)

    def __len__(self) -> int:
        return len(self._at)


class Sessions(Generic[S]):
    """The connected sessions of each key, to fan news out to, and when each key was last
    online (`last_seen`).

    `remember(key)`: whether a key's departure is worth keeping, asked when its last session
    ends. Only the push job reads `last_seen`, and only for keys with a push registration; a
    key without one keeps nothing here once its last session is gone. Identities are free on
    these protocols (any pubkey, any self-signed certificate), so otherwise every fresh one
    an attacker connected with stayed behind (~170 bytes each, up to `LastSeen`'s cap), and
    each such small object outliving a flood pinned the allocator page it landed on."""

    def __init__(self, remember: Callable[[bytes], bool] | None = None) -> None:
        self._by_key: dict[bytes, set[S]] = {}
        self.last_seen = LastSeen()
        self.remember = remember
        # (key, online): a key's first session opened or its last closed (the peer
        # channel's subscriptions, runtime/peer_link.py)
        self.watch: Callable[[bytes, bool], None] | None = None

    def register(self, key: bytes, session: S) -> None:
        mine = self._by_key.setdefault(key, set())
        mine.add(session)
        if len(mine) == 1 and self.watch is not None:
            self.watch(key, True)

    def unregister(self, key: bytes, session: S) -> None:
        mine = self._by_key.get(key)
        if mine is not None:
            mine.discard(session)
            if not mine:
                del self._by_key[key]
                if self.watch is not None:
                    self.watch(key, False)
                if self.remember is None or self.remember(key):
                    self.last_seen.left(key)
                else:
                    self.last_seen.forget(key)

    def __len__(self) -> int:
        """Keys with a session connected now."""
        return len(self._by_key)

    def keys(self) -> list[bytes]:
        """Keys with a session connected now."""
        return list(self._by_key)

    def of(self, key: bytes) -> set[S]:
        """A copy: a session may unregister while it is told."""
        return set(self._by_key.get(key, ()))

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key
