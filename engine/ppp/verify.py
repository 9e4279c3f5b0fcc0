"""Out-of-band verification and pinned contacts (spec 004 §9 "OOB verification"), pure.

The six MUSTs and where each is kept:
1. an OOB mechanism independent of any messaging channel: an invite and an accept as URLs
   (`Invite.url`, `Accept.url`) to pass over whatever channel the two trust;
2. both payloads signed: the invite `sign(invite_token)` by the initiator, the accept
   `sign(sender_pk || invite_token)` by the responder (naming the initiator, so it cannot
   be forwarded to a third party);
3. pin the key after verification, with level, method and time (`PinnedContact`);
4. alert when a verified contact's key changes, louder the higher the level (`KeyChange`:
   level 0 is accepted with a notice; level 1 and 2 keep the old key until the user
   approves the new one, and level 2 asks to verify in person again);
5. invites expire and are single-use (the initiator's `Pending` set: an accept is taken only
   for a token it issued, within `INVITE_TTL`, once);
6. the pin record never goes to the relay (it lives in the device's contacts.json; only the
   encrypted backup carries it).

The spec signs the invite token only, not its timestamp or relay URL: so expiry is enforced
by the initiator (who knows when it issued the token), and a responder's check of `ts` is a
courtesy. KEY_ROTATION (§1, §4.3: `migration_sig = sign(old_pk || new_pk, old_sk)`) and
KEY_EXCHANGE_RETURN (§4.3: bound to the initiator's key) are checked here too.
"""

from __future__ import annotations

import base64
import urllib.parse
from dataclasses import asdict, dataclass

import nacl.utils

from .keys import Identity, verify

PROTOCOL = "ppp-verify-v1"
INVITE_TTL = 24 * 3600
TOKEN_LEN = 16
LEVELS = {0: "discovered", 1: "oob-verified", 2: "in-person"}


class VerifyError(ValueError):
    """A payload that is malformed, forged, expired, reused or meant for someone else."""


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _unb64(s: str, size: int | None, what: str) -> bytes:
    try:
        b = base64.urlsafe_b64decode(s.replace("+", "-").replace("/", "_") + "=" * (-len(s) % 4))
    except (ValueError, TypeError) as e:
        raise VerifyError(f"{what} is not base64") from e
    if size is not None and len(b) != size:
        raise VerifyError(f"{what} must be {size} bytes")
    return b


def _query(url: str, path: str) -> dict[str, str]:
    u = urllib.parse.urlsplit(url.strip())
    if not u.path.endswith(path):
        raise VerifyError(f"not a verification {'invite' if path == '/v' else 'accept'} URL")
    q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
    return {k: v[0] for k, v in q.items() if len(v) == 1}


@dataclass(frozen=True)
class Invite:
    sender_pk: bytes
    invite_token: bytes
    relay_url: str
    sender_sig: bytes
    timestamp: int
    protocol: str = PROTOCOL

    @classmethod
    def make(cls, me: Identity, relay_url: str, now: int, token: bytes | None = None
             ) -> "Invite":
        token = token or nacl.utils.random(TOKEN_LEN)
        return cls(me.pubkey, token, relay_url, me.sign(token), now)

    def url(self, domain: str) -> str:
        q = urllib.parse.urlencode({"p": _b64(self.sender_pk), "t": _b64(self.invite_token),
                                    "r": _b64(self.relay_url.encode()),
                                    "s": _b64(self.sender_sig), "ts": str(self.timestamp)})
        return f"https://{domain}/v?{q}"

    @classmethod
    def parse(cls, url: str, now: int) -> "Invite":
        """The invite in `url`, its signature checked; refused when older than INVITE_TTL."""
        q = _query(url, "/v")
        try:
            inv = cls(_unb64(q["p"], 32, "p"), _unb64(q["t"], TOKEN_LEN, "t"),
                      _unb64(q["r"], None, "r").decode(), _unb64(q["s"], 64, "s"), int(q["ts"]))
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raise VerifyError(f"incomplete invite: {e}") from e
        if not verify(inv.sender_pk, inv.invite_token, inv.sender_sig):
            raise VerifyError("invite signature does not verify")
        if not now - INVITE_TTL <= inv.timestamp <= now + 300:
            raise VerifyError("invite expired")
        return inv


@dataclass(frozen=True)
class Accept:
    responder_pk: bytes
    invite_token: bytes
    responder_sig: bytes
    protocol: str = PROTOCOL

    @classmethod
    def make(cls, me: Identity, invite: Invite) -> "Accept":
        return cls(me.pubkey, invite.invite_token,
                   me.sign(invite.sender_pk + invite.invite_token))

    def url(self, domain: str) -> str:
        q = urllib.parse.urlencode({"p": _b64(self.responder_pk), "t": _b64(self.invite_token),
                                    "s": _b64(self.responder_sig)})
        return f"https://{domain}/va?{q}"

    @classmethod
    def parse(cls, url: str) -> "Accept":
        q = _query(url, "/va")
        try:
            return cls(_unb64(q["p"], 32, "p"), _unb64(q["t"], TOKEN_LEN, "t"),
                       _unb64(q["s"], 64, "s"))
        except KeyError as e:
            raise VerifyError(f"incomplete accept: {e}") from e


def check_accept(me: Identity, accept: Accept, pending: dict[str, dict], now: int) -> dict:
    """The initiator's side of step 7: the accept must name me and a token I issued, not
    yet used and not expired. Removes the token from `pending` (single use) and returns its
    record ({issued_at, ...})."""
    rec = pending.get(accept.invite_token.hex())
    if rec is None:
        raise VerifyError("unknown or already used invite token")
    if now - rec["issued_at"] > INVITE_TTL:
        del pending[accept.invite_token.hex()]
        raise VerifyError("invite expired")
    if not verify(accept.responder_pk, me.pubkey + accept.invite_token, accept.responder_sig):
        raise VerifyError("accept signature does not verify for my key and this token")
    return pending.pop(accept.invite_token.hex())


@dataclass
class PinnedContact:
    contact_id: str            # local only
    pubkey: str                # hex
    verification_level: int
    verified_at: int
    verified_via: str
    relay_url: str = ""
    pending_key: str | None = None     # a changed key waiting for the user (levels 1, 2)
    key_changed_at: int | None = None


@dataclass(frozen=True)
class KeyChange:
    contact_id: str
    old_pubkey: str
    new_pubkey: str
    level: int
    severity: str              # "notice" (level 0) or "warning" (levels 1, 2)
    accepted: bool             # level 0 only; higher levels wait for approve()
    advice: str


def pin(contacts: dict[str, dict], contact_id: str, pubkey: bytes, *, level: int, via: str,
        now: int, relay_url: str = "") -> KeyChange | None:
    """Pin `pubkey` for `contact_id` at `level` (raising a level never lowers one). A
    different key for a known contact is a key change: see `observe_key`."""
    old = contacts.get(contact_id)
    if old is not None and old["pubkey"] != pubkey.hex():
        return observe_key(contacts, contact_id, pubkey, now=now)
    if old is not None and old["verification_level"] > level:
        return None
    contacts[contact_id] = asdict(PinnedContact(contact_id, pubkey.hex(), level, now, via,
                                                relay_url or (old or {}).get("relay_url", "")))
    return None


def observe_key(contacts: dict[str, dict], contact_id: str, new_pk: bytes, *, now: int
                ) -> KeyChange | None:
    """A contact now presents `new_pk` (a KEY_ROTATION, a re-import): None if unchanged,
    else the alert. Level 0 takes the new key (TOFU, with a notice); levels 1 and 2 keep
    the verified key and hold the new one as `pending_key` until `approve`."""
    c = contacts[contact_id]
    if c["pubkey"] == new_pk.hex():
        return None
    level = c["verification_level"]
    change = KeyChange(contact_id, c["pubkey"], new_pk.hex(), level,
                       "notice" if level == 0 else "warning", level == 0,
                       {0: "the key changed (unverified contact)",
                        1: "the key of a verified contact changed: approve it or verify again",
                        2: "the key of a contact verified in person changed: verify again "
                           "in person before trusting it"}[level])
    if level == 0:
        c["pubkey"] = new_pk.hex()
    else:
        c["pending_key"] = new_pk.hex()
    c["key_changed_at"] = now
    return change


def approve(contacts: dict[str, dict], contact_id: str, now: int) -> dict:
    """The user accepts a pending key: pinned again at level 0 (re-verify to raise it)."""
    c = contacts[contact_id]
    if not c.get("pending_key"):
        raise VerifyError(f"{contact_id}: no changed key to approve")
    c.update(pubkey=c.pop("pending_key"), verification_level=0, verified_at=now,
             verified_via="approved key change")
    return c


def by_pubkey(contacts: dict[str, dict], pk: bytes) -> str | None:
    h = pk.hex()
    return next((cid for cid, c in contacts.items() if c["pubkey"] == h), None)


def check_key_rotation(old_pk: bytes, content: object) -> bytes:
    """§4.3 KeyRotationContent from `old_pk` (the rumor's verified sender): the new key if
    migration_sig = sign(old_pk || new_pk, old_sk) verifies."""
    if not isinstance(content, dict) or not isinstance(content.get("new_pubkey"), bytes) \
            or len(content["new_pubkey"]) != 32 or not isinstance(content.get("migration_sig"),
                                                                  bytes):
        raise VerifyError("malformed KEY_ROTATION content")
    if not verify(old_pk, old_pk + content["new_pubkey"], content["migration_sig"]):
        raise VerifyError("KEY_ROTATION migration signature does not verify")
    return content["new_pubkey"]


def key_rotation_content(old: Identity, new_pk: bytes) -> dict:
    return {"new_pubkey": new_pk, "migration_sig": old.sign(old.pubkey + new_pk)}


def check_key_exchange_return(me: Identity, sender_pk: bytes, content: object) -> bytes:
    """§4.3 KEY_EXCHANGE_RETURN: accepted only if it names me as the initiator and returns
    the key that sent it (the rumor's verified sender)."""
    if not isinstance(content, dict) or content.get("initiator_pubkey") != me.pubkey:
        raise VerifyError("KEY_EXCHANGE_RETURN is bound to another initiator")
    if content.get("responder_pubkey") != sender_pk:
        raise VerifyError("KEY_EXCHANGE_RETURN returns a key other than its sender's")
    return sender_pk
