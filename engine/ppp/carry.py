"""Carry groups (spec 004 §8), pure: what a registration, a leave and a courier's fetch sign,
and who may do what. The relay side of the BLE courier (`ingress/ppp_carry.py` runs it).

§8 gives REGISTER_CARRY_GROUP {group_id, members, couriers, sig} and a "signed leave" but
not who signs, nor over which bytes. Our choices, and why:

* **Consent is each member's own.** §8's carry group is "a set of users who consent"; a
  member says yes in CARRY_GROUP_ACCEPT, which the relay cannot read (gift-wrapped). So the
  relay takes a member's consent only from that member: the first registration of a
  group_id makes its signer the group's *owner* (who may be a member or a courier) and sets
  the definition (members, couriers); each other member registers the *same* definition
  with its own key. A member's events are carried only once it has registered, so nobody
  can have a stranger's mail carried by naming them. The owner may change the definition:
  consents stay for members still listed, unless a courier was added, which asks every
  member again (more people would carry their mail).
* **Signed bytes** are domain-separated, so no signature made for one purpose (§5.1's AUTH
  over a bare 32-byte challenge, the courier's AUTH_RESPONSE) is valid for another:

      register  REGISTER_CONTEXT || group_id (16) || u16 BE n || n sorted member keys
                || u16 BE m || m sorted courier keys
      leave     LEAVE_CONTEXT || group_id
      fetch     FETCH_CONTEXT || group_id || since (u64 BE)

  Lists are sorted (and may not repeat a key), so one group has one byte string whatever
  order a client lists it in.
* **Leaving** (LEAVE_CARRY_GROUP {group_id, sig}): a member withdraws its consent (its events
  are no longer fetched), a courier stops being one, the owner dissolves the group.
* **Fetching**: only a listed courier gets anything, and only the events of consenting
  members other than itself; any other asker, and an unknown group, get one answer, so a
  group's existence is not shown to whoever guesses an id.

Budgets (appendix C sets none; this relay's): at most `MAX_CARRY_MEMBERS` members and
`MAX_CARRY_COURIERS` couriers per group, `MAX_CARRY_GROUPS_OWNED` groups owned per pubkey.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

GROUP_ID_LEN = 16
KEY_LEN = 32
MAX_CARRY_MEMBERS = 64
MAX_CARRY_COURIERS = 16
MAX_CARRY_GROUPS_OWNED = 16
REGISTER_CONTEXT = b"PPP-carry-register-v1\x00"
LEAVE_CONTEXT = b"PPP-carry-leave-v1\x00"
FETCH_CONTEXT = b"PPP-carry-fetch-v1\x00"

OP_REGISTER = "register"
OP_LEAVE = "leave"

# One answer for "no such group" and "you are not its courier" (see the module docstring).
UNKNOWN = "unknown carry group"


class CarryError(ValueError):
    """A registration or leave that is refused; `args[0]` is the reason sent back."""


@dataclass(frozen=True)
class Definition:
    """A group's member and courier lists, each sorted and without repeats."""
    members: tuple[bytes, ...]
    couriers: tuple[bytes, ...]

    def __repr__(self) -> str:            # counts only: a key list is who talks to whom
        return f"Definition({len(self.members)} members, {len(self.couriers)} couriers)"

    @classmethod
    def of(cls, members, couriers) -> "Definition":
        ms, cs = sorted(members), sorted(couriers)
        if not ms:
            raise CarryError("a carry group needs members")
        if not cs:
            raise CarryError("a carry group needs couriers")
        if len(ms) > MAX_CARRY_MEMBERS or len(cs) > MAX_CARRY_COURIERS:
            raise CarryError("carry group too large")
        if any(len(k) != KEY_LEN for k in ms + cs):
            raise CarryError("keys are 32 bytes")
        if len(set(ms)) != len(ms) or len(set(cs)) != len(cs):
            raise CarryError("a key is listed twice")
        return cls(tuple(ms), tuple(cs))

    def pack(self) -> tuple[bytes, bytes]:
        """(members, couriers) as the control table stores them: keys end to end."""
        return b"".join(self.members), b"".join(self.couriers)

    @classmethod
    def unpack(cls, members: bytes, couriers: bytes) -> "Definition":
        split = lambda b: [b[i:i + KEY_LEN] for i in range(0, len(b), KEY_LEN)]   # noqa: E731
        return cls.of(split(members), split(couriers))


def register_message(group_id: bytes, d: Definition) -> bytes:
    return (REGISTER_CONTEXT + group_id + struct.pack(">H", len(d.members)) + b"".join(d.members)
            + struct.pack(">H", len(d.couriers)) + b"".join(d.couriers))


def leave_message(group_id: bytes) -> bytes:
    return LEAVE_CONTEXT + group_id


def fetch_message(group_id: bytes, since: int) -> bytes:
    return FETCH_CONTEXT + group_id + struct.pack(">Q", since)


def sign(signing_key, message: bytes) -> bytes:
    """The 64-byte signature a client puts in `sig` (PyNaCl SigningKey)."""
    return signing_key.sign(message).signature


def verified(pubkey: bytes, message: bytes, sig: bytes) -> bool:
    try:
        VerifyKey(pubkey).verify(message, sig)
        return True
    except (BadSignatureError, ValueError, TypeError):
        return False


@dataclass
class CarryGroup:
    owner: bytes
    definition: Definition
    consented: set[bytes]
    rows: list[int] = field(default_factory=list)   # `at` of every row since it was created

    def __repr__(self) -> str:
        return f"CarryGroup({self.definition!r}, {len(self.consented)} consented)"

    def carried(self, courier: bytes) -> frozenset[bytes]:
        """Whose events `courier` may carry: consenting members but itself."""
        return frozenset(m for m in self.definition.members if m in self.consented) - {courier}


@dataclass
class CarryGroups:
    """Every carry group, folded from its rows in `at` order (`apply`): the live path checks
    and writes a row, then applies it; a restart applies the same rows again."""
    groups: dict[bytes, CarryGroup] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"CarryGroups({len(self.groups)})"

    def owned(self, pubkey: bytes) -> int:
        return sum(1 for g in self.groups.values() if g.owner == pubkey)

    def check(self, op: str, signer: bytes, group_id: bytes,
              d: Definition | None = None) -> str | None:
        """The refusal reason for this change, or None when it applies."""
        g = self.groups.get(group_id)
        if op == OP_REGISTER:
            if g is None:
                if signer not in d.members and signer not in d.couriers:
                    return "the owner must be a member or a courier"
                if self.owned(signer) >= MAX_CARRY_GROUPS_OWNED:
                    return "too many carry groups"
                return None
            if signer == g.owner:
                if signer not in d.members and signer not in d.couriers:
                    return "the owner must be a member or a courier"
                return None
            if signer not in g.definition.members:
                return "not a member of this carry group"
            if d != g.definition:
                return "carry group differs"       # consent is to exactly this group
            return None
        if op == OP_LEAVE:
            if g is None or (signer != g.owner and signer not in g.definition.members
                             and signer not in g.definition.couriers):
                return "not in this carry group"
            return None
        raise ValueError(op)

    def apply(self, op: str, signer: bytes, group_id: bytes, d: Definition | None,
              at: int) -> bool:
        """Apply a row (refused ones change nothing: False)."""
        if self.check(op, signer, group_id, d) is not None:
            return False
        g = self.groups.get(group_id)
        if op == OP_REGISTER:
            if g is None:
                self.groups[group_id] = CarryGroup(signer, d, {signer} & set(d.members), [at])
                return True
            g.rows.append(at)
            if signer == g.owner:
                added = set(d.couriers) - set(g.definition.couriers)
                keep = set() if added else g.consented
                g.consented = (keep | {signer}) & set(d.members)
                g.definition = d
            else:
                g.consented.add(signer)
            return True
        if signer == g.owner:
            del self.groups[group_id]
            return True
        g.rows.append(at)
        g.consented.discard(signer)
        if signer in g.definition.couriers:
            g.definition = Definition(g.definition.members,
                                      tuple(c for c in g.definition.couriers if c != signer))
        return True

    def carried(self, group_id: bytes, courier: bytes) -> frozenset[bytes] | None:
        """The members `courier` carries for in this group; None: not a courier of it (or no
        such group, the same answer)."""
        g = self.groups.get(group_id)
        if g is None or courier not in g.definition.couriers:
            return None
        return g.carried(courier)

    def needed_at(self) -> set[int]:
        """Rows a compaction must keep: every row of each live group since its creation
        (replayed in order they rebuild its consents); a dissolved group's rows may go."""
        return {at for g in self.groups.values() for at in g.rows}
