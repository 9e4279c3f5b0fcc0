"""Fair connection budgets: which connection may hold a slot, and which one loses it.

Pure, like the protocol cores (python-websockets `protocol.py`): no socket, clock or task.
A listener's shell asks it at accept and at each stage a connection reaches, closes what it
says to close, and tells it when a connection is gone. Every listener (trueseal, Heya, PPP,
cursor-sync) counts its connections through one `Admission`.

Stages, in order (a connection only moves forward; moving frees the slot it held):

* `HANDSHAKE`: accepted, transport handshake not finished (Noise, TLS, QUIC; for HTTP, no
  complete request head / upgrade yet).
* `UNAUTH`: transport up, client not authenticated; for an anonymous protocol (trueseal
  push after NK) the anonymous session.
* `AUTH`: authenticated (a device key, a mailbox, a send token, AUTH_OK, HELLO...).

Limits: per stage a total and a per-address cap, and a total over all stages. "Address" is
`address_key(host)`: an IPv4 address, or the /64 of an IPv6 one (a host owns a /64).

Rules (first-come slots cannot be hoarded):

1. An address at its per-address cap of `HANDSHAKE` is refused that stage; others are not.
   At its cap of `UNAUTH` or `AUTH`, the least useful of the address's connections in that
   stage goes for the newcomer: the one idle longest in application terms (`touch` marks a
   message sent or received; keep-alives do not count; entering a stage counts), never one
   mid-delivery (`owe` / `paid` or the shell's `delivering`: a Deliver not yet acked, a
   store not yet answered, a write in progress), for at most `MID_DELIVERY_SECONDS` after
   its last message, so a client cannot keep its slot by never acking. All of them
   mid-delivery: the newcomer is refused. So a carrier NAT's real users are not locked out
   by a neighbour's idle sessions, however authenticated (any key passes Noise XX, any
   self-signed certificate passes Heya): to keep a slot an address must keep doing real,
   rate-limited work on it. A handshake lasts seconds at most (the shells' deadlines) and
   costs CPU, so there the cap still refuses.
1a. An identity (`advance(..., identity=)`: a certificate digest, a device key, a pubkey)
   holds at most `per_identity` sessions: at that, its least useful session goes, as in 1
   (a real client reconnecting replaces the session it lost; an attacker reusing one key
   replaces its own). All mid-delivery: refused `IDENTITY_CAP`.
2. `HANDSHAKE` or `UNAUTH` full: the least useful connection (rule 1) of that stage, of
   the address that holds the most in it, is evicted to make room (among addresses holding
   equally many, the one that has held that many longest). A real client crosses these
   stages in milliseconds; an address holding them idle loses them first, the newcomer last.
3. `AUTH` is never displaced by an earlier stage, and only by fair share within itself:
   full, a new authentication takes the least useful session of the biggest holder only if
   that address holds at least two more than the newcomer's (so it still holds at least as
   many after the swap); otherwise the newcomer is refused. Identities are cheap on every
   protocol here (any key passes Noise XX, PPP AUTH, HELLO), so "authenticated" cannot mean
   "kept no matter what": 253 addresses x a per-address cap would otherwise fill the stage
   for good. Equal holders never displace each other (no churn among a spread flood), and a
   lone device behind its own address always gets in. The cost: an address shared by many
   real users (a carrier NAT) that holds the most loses its idlest session to a newcomer.
4. The overall total full: a `HANDSHAKE` connection is evicted as in 2; if there is none,
   the newcomer is refused (trueseal interop §1: closed at once). So keep
   `unauth.total + auth.total` below `total`: then established sessions can never fill the
   house, and a newcomer always finds a slot or a handshake to evict.

API (all a shell needs):

    adm = Admission(Limits(total=1000, handshake=Cap(1000, 64), unauth=Cap(500, 32),
                           auth=Cap(400, 16)))
    d = adm.admit(address_key(host), now)      # accepted: Decision
    for t in d.evicted: t.close()              # the shell closes what lost its slot
    if d.ticket is None: close at once         # d.refused: ADDRESS_CAP | STAGE_FULL | TOTAL_FULL
    d.ticket.closer = transport.abort          # how to close it should it be evicted
    d = adm.advance(ticket, Stage.UNAUTH, now) # handshake done: same Decision; if refused,
                                               # close the connection (it keeps its old slot
                                               # until `release`)
    d = adm.advance(ticket, Stage.AUTH, now, identity=digest)   # rule 1a
    adm.touch(ticket, now)                     # an application message: not idle
    ticket.owe(); ...; ticket.paid()           # mid-delivery: not evicted meanwhile (or
    ticket.delivering = session.busy          # the shell's own question)
    adm.release(ticket)                        # connection gone (idempotent; also after an
                                               # eviction)
    adm.count(Stage.HANDSHAKE), adm.count_of(addr, stage), adm.total  # for metrics
    adm.released, adm.peak, adm.reset_peak()   # waves of connections (runtime/memory_trim.py)

`now` is the shell's clock (any monotonic float); it is kept as `ticket.since`, the time the
ticket entered its stage, for the shell's deadlines and metrics, and `ticket.active`, its last
application activity. Eviction order does not depend on the values (the order of arrivals and
touches does). Every operation is O(1) but for skipping connections mid-delivery.

Every decision is counted in `decisions[(stage, reason)]` (`admitted`, a refusal's reason,
`evicted_<why>` under the victim's stage) for the metrics (runtime/metrics.py).
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

# Why a connection was refused (the shell's counters use these names).
ADDRESS_CAP = "address_cap"   # rule 1
STAGE_FULL = "stage_full"     # rule 3 (or a stage with a total of 0)
TOTAL_FULL = "total_full"     # rule 4
GONE = "gone"                 # advance() of a ticket already evicted or released
IDENTITY_CAP = "identity_cap" # rule 1a, every session of the identity mid-delivery
# A session is mid-delivery (never evicted) only this long after its last application
# message: past the shells' write timeouts (10-30 s) a delivery still unanswered is a client
# holding its slot (a Deliver it never acks), not a delivery under way.
MID_DELIVERY_SECONDS = 30.0
ADMITTED = "admitted"         # decisions: a connection took a slot in a stage


class Stage(IntEnum):
    HANDSHAKE = 0
    UNAUTH = 1
    AUTH = 2

    @property
    def evictable(self) -> bool:
        """Whether a full stage frees room by eviction unconditionally (rule 2); AUTH only
        by fair share (rule 3)."""
        return self is not Stage.AUTH


@dataclass(frozen=True)
class Cap:
    """One stage's budget: at most `total` connections, at most `per_address` of one address."""
    total: int
    per_address: int


@dataclass(frozen=True)
class Limits:
    total: int            # all stages together: what the listener may hold in descriptors
    handshake: Cap
    unauth: Cap
    auth: Cap
    per_identity: int = 0   # sessions one identity may hold (rule 1a); 0: no such budget

    def cap(self, stage: Stage) -> Cap:
        return (self.handshake, self.unauth, self.auth)[stage]


def address_key(host: str) -> str:
    """What one client is: an IPv4 address, or the /64 of an IPv6 one (an IPv4-mapped IPv6
    address is its IPv4 address; a zone index is dropped). Anything else (a Unix socket
    path, "") is one key of its own."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


class Ticket:
    """One connection's slot. `closer` is the shell's: how to close the connection should it
    be evicted (`close()` calls it, once). `owing`: deliveries and writes under way (`owe`,
    `paid`); `delivering`: the shell's own question, where it keeps the truth elsewhere (a
    receive session's deliveries not acked yet). While `busy()`, it is never evicted."""

    __slots__ = ("address", "stage", "since", "live", "closer", "identity", "active",
                 "owing", "delivering")

    def __init__(self, address: str, stage: Stage, since: float):
        self.address = address
        self.stage = stage
        self.since = since
        self.live = True      # holds a slot (False once evicted or released)
        self.closer: Callable[[], object] | None = None
        self.identity: str | None = None
        self.active = since   # last application activity (or stage entry)
        self.owing = 0
        self.delivering: Callable[[], bool] | None = None

    def busy(self) -> bool:
        return self.owing > 0 or (self.delivering is not None and self.delivering())

    def owe(self) -> None:
        """A delivery or write is under way (a Deliver sent and not acked, a store not yet
        answered): not to be evicted until `paid`."""
        self.owing += 1

    def paid(self) -> None:
        if self.owing:
            self.owing -= 1

    def close(self) -> None:
        closer, self.closer = self.closer, None
        if closer is not None:
            closer()

    def __repr__(self) -> str:   # no address: reprs end up in logs
        return f"Ticket({self.stage.name}, live={self.live})"


@dataclass
class Decision:
    ticket: Ticket | None             # None: refused
    refused: str | None = None        # ADDRESS_CAP | STAGE_FULL | TOTAL_FULL | GONE
    evicted: tuple[Ticket, ...] = ()  # already released here; the shell closes them

    def __bool__(self) -> bool:
        return self.refused is None


class _StageBook:
    """The connections of one stage: per address in arrival order, and the addresses bucketed
    by how many they hold, so the biggest holder is found in O(1)."""

    __slots__ = ("count", "by_address", "buckets", "top")

    def __init__(self) -> None:
        self.count = 0
        self.by_address: dict[str, dict[Ticket, None]] = {}
        self.buckets: dict[int, dict[str, None]] = {}   # n -> addresses holding n (ordered)
        self.top = 0

    def holds(self, address: str) -> int:
        held = self.by_address.get(address)
        return len(held) if held else 0

    def _rebucket(self, address: str, old: int, new: int) -> None:
        if old:
            bucket = self.buckets[old]
            del bucket[address]
            if not bucket:
                del self.buckets[old]
        if new:
            self.buckets.setdefault(new, {})[address] = None
        if new > self.top:
            self.top = new
        elif old == self.top and old not in self.buckets:
            self.top = new   # one step down: nobody holds more than `new` now

    def add(self, ticket: Ticket) -> None:
        held = self.by_address.setdefault(ticket.address, {})
        held[ticket] = None
        self.count += 1
        self._rebucket(ticket.address, len(held) - 1, len(held))

    def remove(self, ticket: Ticket) -> None:
        held = self.by_address[ticket.address]
        del held[ticket]
        self.count -= 1
        if not held:
            del self.by_address[ticket.address]
        self._rebucket(ticket.address, len(held) + 1, len(held))

    def touch(self, ticket: Ticket) -> None:
        """Move `ticket` behind its address's others: the order is by last activity."""
        held = self.by_address[ticket.address]
        del held[ticket]
        held[ticket] = None

    def idlest(self, address: str, now: float) -> Ticket | None:
        """The address's connection idle longest and not mid-delivery."""
        return _idlest(self.by_address.get(address, ()), now)

    def victim(self, now: float) -> Ticket | None:
        """The connection idle longest (not mid-delivery) of the address holding the most."""
        if not self.top:
            return None
        return self.idlest(next(iter(self.buckets[self.top])), now)


def _idlest(tickets, now: float) -> Ticket | None:
    for ticket in tickets:
        if not ticket.busy() or now - ticket.active > MID_DELIVERY_SECONDS:
            return ticket
    return None


class Admission:
    def __init__(self, limits: Limits):
        self.limits = limits
        self.total = 0
        self._books = {stage: _StageBook() for stage in Stage}
        self.evictions = 0     # counters for metrics: connections evicted (rules 2 and 4)
        self.refusals = 0      # and refused (rules 1, 3 and 4)
        self.released = 0      # slots given back (ended or evicted), ever
        self.peak = 0          # most held at once since `reset_peak` (a wave's height)
        # (stage name, reason) -> count: every decision, for metrics (module docstring)
        self.decisions: Counter[tuple[str, str]] = Counter()
        # identity -> its sessions, idle longest first (rule 1a)
        self._identities: dict[str, dict[Ticket, None]] = {}

    # --- questions --------------------------------------------------------------------------
    def count(self, stage: Stage) -> int:
        return self._books[stage].count

    def count_of(self, address: str, stage: Stage) -> int:
        return self._books[stage].holds(address)

    def held_by(self, address: str) -> int:
        """Connections `address` holds in all stages together."""
        return sum(book.holds(address) for book in self._books.values())

    def counts(self) -> dict[Stage, int]:
        return {stage: book.count for stage, book in self._books.items()}

    def sessions_of(self, identity: str) -> int:
        held = self._identities.get(identity)
        return len(held) if held else 0

    # --- activity -----------------------------------------------------------------------------
    def touch(self, ticket: Ticket, now: float) -> None:
        """An application message was sent or received on `ticket`'s connection (not a
        keep-alive): it goes behind the address's and the identity's others in eviction order."""
        if not ticket.live:
            return
        ticket.active = now
        self._books[ticket.stage].touch(ticket)
        if ticket.identity is not None:
            held = self._identities[ticket.identity]
            del held[ticket]
            held[ticket] = None

    # --- decisions ----------------------------------------------------------------------------
    def admit(self, address: str, now: float) -> Decision:
        """A connection was accepted from `address`: a ticket in HANDSHAKE, or a refusal."""
        refused = self._refused_by_address(address, Stage.HANDSHAKE)
        if refused is not None:
            return refused
        evicted: list[Ticket] = []
        book, cap = self._books[Stage.HANDSHAKE], self.limits.handshake
        while self.total >= self.limits.total or book.count >= cap.total:
            victim = book.victim(now)
            full = TOTAL_FULL if self.total >= self.limits.total else STAGE_FULL
            if victim is None:
                return self._refuse(Stage.HANDSHAKE, full, evicted)
            self._evict(victim, full)
            evicted.append(victim)
        self.decisions[("handshake", ADMITTED)] += 1
        ticket = Ticket(address, Stage.HANDSHAKE, now)
        book.add(ticket)
        self.total += 1
        if self.total > self.peak:
            self.peak = self.total
        return Decision(ticket, None, tuple(evicted))

    def advance(self, ticket: Ticket, stage: Stage, now: float, *,
                identity: str | None = None) -> Decision:
        """`ticket` reached `stage` (a later one), as `identity` if it authenticated as one
        (rule 1a). Refused: it keeps its slot in the stage it was in, and the shell is
        expected to close the connection and `release` it."""
        if not ticket.live:
            return Decision(None, GONE)
        if stage <= ticket.stage:
            raise ValueError(f"cannot move from {ticket.stage.name} to {stage.name}")
        evicted: list[Ticket] = []
        per_identity = self.limits.per_identity
        if identity is not None and per_identity:
            held = self._identities.get(identity, {})
            while len(held) >= per_identity:
                victim = _idlest(held, now)
                if victim is None:
                    return self._refuse(stage, IDENTITY_CAP, evicted)
                self._evict(victim, IDENTITY_CAP)
                evicted.append(victim)
        book, cap = self._books[stage], self.limits.cap(stage)
        while book.holds(ticket.address) >= cap.per_address:     # rule 1
            victim = book.idlest(ticket.address, now)
            if victim is None:
                return self._refuse(stage, ADDRESS_CAP, evicted)
            self._evict(victim, ADDRESS_CAP)
            evicted.append(victim)
        while book.count >= cap.total:
            victim = book.victim(now)
            if victim is not None and not stage.evictable and (
                    book.holds(victim.address) < book.holds(ticket.address) + 2):
                victim = None          # rule 3: no fair-share gain in swapping
            if victim is None:
                return self._refuse(stage, STAGE_FULL, evicted)
            self._evict(victim, STAGE_FULL)
            evicted.append(victim)
        self._books[ticket.stage].remove(ticket)
        ticket.stage, ticket.since, ticket.active = stage, now, now
        book.add(ticket)
        if identity is not None:
            ticket.identity = identity
            self._identities.setdefault(identity, {})[ticket] = None
        self.decisions[(stage.name.lower(), ADMITTED)] += 1
        return Decision(ticket, None, tuple(evicted))

    def release(self, ticket: Ticket) -> None:
        """The connection is gone. Idempotent; a no-op for an evicted ticket."""
        if ticket.live:
            ticket.live = False
            self._books[ticket.stage].remove(ticket)
            if ticket.identity is not None:
                held = self._identities[ticket.identity]
                del held[ticket]
                if not held:
                    del self._identities[ticket.identity]
            self.total -= 1
            self.released += 1

    def reset_peak(self) -> None:
        """Start measuring the next wave from what is held now."""
        self.peak = self.total

    # --- inside -------------------------------------------------------------------------------
    def _refused_by_address(self, address: str, stage: Stage) -> Decision | None:
        if self._books[stage].holds(address) >= self.limits.cap(stage).per_address:
            return self._refuse(stage, ADDRESS_CAP, [])
        return None

    def _refuse(self, stage: Stage, reason: str, evicted: list[Ticket]) -> Decision:
        self.refusals += 1
        self.decisions[(stage.name.lower(), reason)] += 1
        return Decision(None, reason, tuple(evicted))

    def _evict(self, ticket: Ticket, why: str) -> None:
        self.decisions[(ticket.stage.name.lower(), f"evicted_{why}")] += 1
        self.release(ticket)
        self.evictions += 1
