"""A courier for people (`relay ppp courier`, `relay ppp courier-receive`): what it carries on
disk, fetching for its carry groups while online, and the BLE sessions
(`relay/courier_ble.py`) while offline.

The carried events live in one file (0600, written whole and renamed: a crash leaves the old
or the new one): a MessagePack list of `{event, hop_count, max_hops, fetched_at, delivered}`,
`event` the GiftWrap as the relay stored it. Events a recipient acked over BLE stay in it,
marked delivered, until the courier is online and has reported them (ACK_CARRY).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack

from engine.ppp import courier as C
from engine.ppp.keys import Identity

from .ppp_client import PppClient


def load_store(path: str | Path) -> C.CourierStore:
    store = C.CourierStore()
    p = Path(path)
    if not p.exists():
        return store
    now = int(time.time())
    for m in msgpack.unpackb(p.read_bytes(), raw=False):
        e = C.CarriedEvent.fetched(m["event"], m["fetched_at"])
        e.hop_count, e.max_hops, e.delivered = m["hop_count"], m["max_hops"], m["delivered"]
        if e.expires_at > now:      # couriers MUST discard expired events
            store.events[e.event_id] = e
    return store


def save_store(path: str | Path, store: C.CourierStore) -> None:
    p = Path(path)
    data = msgpack.packb([{"event": e.event, "hop_count": e.hop_count, "max_hops": e.max_hops,
                           "fetched_at": e.fetched_at, "delivered": e.delivered}
                          for e in store.events.values()], use_bin_type=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent or ".", prefix=f".{p.name}.")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class Sync:
    fetched: int = 0        # new events taken from the relay
    reported: int = 0       # handed-over events the relay had not heard of yet

    def to_json(self) -> dict:
        return {"fetched": self.fetched, "reported": self.reported}


async def sync_with_relay(url: str, me: Identity, groups: list[bytes],
                          store: C.CourierStore) -> Sync:
    """While online: report what was handed over (ACK_CARRY, then forget it) and fetch every
    group's undelivered events (FETCH_CARRY, all pages)."""
    out = Sync()
    now = int(time.time())
    store.expire(now)
    async with await PppClient.connect(url, me) as c:
        delivered = [e.event_id for e in store.events.values() if e.delivered]
        for g in groups:
            if delivered:
                out.reported += await c.ack_carry(g, delivered)
        for eid in delivered:
            del store.events[eid]
        for g in groups:
            for event in await c.fetch_carry_all(g):
                out.fetched += store.add(C.CarriedEvent.fetched(event, now), now)
    return out
