"""What the contact-discovery commands do (spec 004 §9; `engine/ppp/discovery.py` has the
rules and the reasons for them).

* DISCOVERY_PEPPER -> DISCOVERY_PEPPER {pepper, pepper_id, rotates_at}: the current pepper
  of the relay's schedule (`ppp.discovery_pepper_rotation_hours`), derived from the seed in
  `<data>/keys/discovery_pepper.key`.
* DISCOVERY_PUBLISH {hashes, pubkey, pepper_id?}: `pubkey` must be the caller's (nobody files
  hashes under someone else's key); at most 20 hashes; the caller's previous set is
  replaced; -> DISCOVERY_PUBLISHED {count, pepper_id}.
* DISCOVERY_QUERY {hashes, pepper_id?}: at most 500 hashes; charged to the pubkey's budget
  (the session) and to the client address's (here, so Sybil pubkeys from one address share
  one budget); -> DISCOVERY_MATCHES {matches: [{hash, pubkey}]}, the current pepper's only,
  never the caller itself.
* A `pepper_id` other than the current one: STORE_FAIL "stale pepper" (fetch it again).
* PUBLISH and QUERY are charged to the pubkey's hourly quota across hosts
  (`PppControl.spend`, a commit) before they run, a QUERY only once its address has budget
  left: Sybil pubkeys from one spent address cost no commit.
Nothing here logs a hash or a pubkey.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from delta_tables.ppp_control import PppControl
from engine.ppp import discovery as D
from engine.ppp import protocol as P
from engine.ratelimit import SlidingWindowLimiter
from runtime import keys

PEPPER_SEED_FILE = "discovery_pepper.key"


def pepper_seed(settings) -> bytes:
    """The seed the peppers derive from: `ppp.discovery_pepper_seed_file` (the same file on
    every PPP host), or `<data>/keys/discovery_pepper.key`, created on first start."""
    if settings.ppp.discovery_pepper_seed_file:
        return keys._load(Path(settings.ppp.discovery_pepper_seed_file)).private_bytes
    return keys.load_or_create(settings.data_dir, PEPPER_SEED_FILE).private_bytes


class DiscoveryService:
    def __init__(self, control: PppControl, seed: bytes, rotation_seconds: int, fail, *,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.control = control
        self._seed = seed
        self.rotation = rotation_seconds
        self.fail = fail
        self.clock = clock
        self.monotonic = monotonic
        self.per_address = SlidingWindowLimiter(D.QUERY_IP_BUDGET.max_count,
                                                D.QUERY_IP_BUDGET.window_secs)

    def __repr__(self) -> str:
        return f"DiscoveryService(rotation={self.rotation}s, seed=<redacted>)"

    def current(self) -> int:
        return D.pepper_id(self.clock(), self.rotation)

    async def run(self, pubkey: bytes, cmd: P.DiscoveryCommand, rid: str,
                  address: str | None) -> P.Reply:
        pid = self.current()
        if isinstance(cmd, P.DiscoveryPepper):
            return P.discovery_pepper(D.pepper_for(self._seed, pid), pid,
                                      D.rotates_at(pid, self.rotation))
        if (isinstance(cmd, P.DiscoveryQuery) and address is not None
                and self.per_address.remaining(address, self.monotonic()) <= 0):
            return self.fail(cmd.name, "rate limited", rid)
        if not await self.control.spend(pubkey, cmd.name):
            return self.fail(cmd.name, "rate limited", rid)
        if cmd.pepper_id is not None and cmd.pepper_id != pid:
            return self.fail(cmd.name, "stale pepper", rid)
        if isinstance(cmd, P.DiscoveryPublish):
            if cmd.pubkey != pubkey:
                return self.fail(cmd.name, "pubkey must be the caller's", rid)
            count = await self.control.publish_hashes(pubkey, cmd.hashes, pid)
            return P.discovery_published(count, pid)
        if address is not None and not self.per_address.allow(address, self.monotonic()):
            return self.fail(cmd.name, "rate limited", rid)
        found = self.control.state.discovery.matches(cmd.hashes, pid)
        return P.discovery_matches([(h, pk) for h, pk in found if pk != pubkey])

    def sweep(self) -> None:
        self.per_address.sweep(self.monotonic())
