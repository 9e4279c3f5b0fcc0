"""Blinded daily mailboxes (spec 004 metadata section), client side, pure.

What the spec writes, and why it is not built as written:

    epoch        = floor(unix_time / 86400)
    mailbox_seed = X25519(user_sk, relay_pk)
    mailbox_id   = BLAKE2b(32, mailbox_seed || epoch)

1. **The relay can compute it.** X25519 is symmetric: X25519(user_sk, relay_pk) =
   X25519(relay_sk, user_pk). The relay holds relay_sk and learns every user's pubkey (AUTH),
   so it derives every user's mailbox_id for every day and links them trivially: the one
   party the rotation is meant to blind is the one that can undo it
   (`tests/test_ppp_blinded.py` shows it).
2. **A sender cannot compute it** (it needs the recipient's or the relay's secret key), so
   nobody could address a message to a blinded mailbox.
3. Fetching it with the recipient's long-term AUTH would link it to the pubkey anyway, and
   the epoch's encoding is not given.

What is built instead: a mailbox per (recipient, contact, day) whose *id* both of them can
compute but whose *key* only the recipient holds, by Ed25519 key blinding (the construction
of Tor's v3 onion service keys):

    shared   = X25519(my_x25519_sk, their_x25519_pk)              (the same on both sides)
    h        = BLAKE2b(64, in = "ppp-blinded-mailbox-v2" || recipient_pk || u64be(epoch),
                       key = shared)  mod L                        (a scalar, never 0)
    mailbox_id = h · recipient_pk                                  (a point: anyone with h)
    mailbox_sk = h · a  mod L      a = the recipient's clamped Ed25519 scalar (only the
                                   recipient; mailbox_sk · B = h · a · B = mailbox_id)

* The sender computes the recipient's mailbox_id for a day and STOREs (or submits sealed) a
  GiftWrap *routed* to it (GiftWrap `recipient` = mailbox_id; the layers are still
  encrypted to the recipient's long-term key, `wrap(route_to=)`).
* The recipient opens a WebSocket authenticated *as the mailbox*: the CHALLENGE is signed
  with mailbox_sk, an ordinary Ed25519 signature the relay verifies against mailbox_id, so
  FETCH, ACK and NOTIFY work unchanged; it registers that day's delivery token
  (`delivery_token_from_secret(shared, mailbox_id)`) from that session for sealed notes.
* **The sender cannot fetch or acknowledge** what it wrote: signing as the mailbox needs
  `a`, the recipient's secret. (The first version derived the whole mailbox key pair from
  `shared`, so the sender held it and could ACK, i.e. delete, unread mail.) What the sender
  can still do is what any sender can: write to that mailbox, and know its id (so it can
  tell when the recipient's session for it is online, by timing at the relay: nothing the
  relay does not see anyway).
* The relay cannot link two days (or two contacts) of one recipient: h needs `shared`, a
  private key of one of the two. What remains visible: the network address and timing of the
  sessions that fetch them (use one connection per mailbox, and a proxy or Tor for the
  address), and a sender who STOREs over its own authenticated socket (sealed submission
  hides it).
* Cost: one session per contact per day to fetch. A sender may give an event any lifetime up
  to the relay's clamp (C.2 MAX_EVENT_TTL_SECS, 30 days), so the recipient walks every day
  back to that bound (`epochs_to_walk`), less the days it has already emptied.
"""

from __future__ import annotations

import hashlib
import struct

from nacl import bindings

from .keys import Identity, KeyMaterialError
from .tokens import delivery_token_from_secret

EPOCH_SECONDS = 86_400
DOMAIN = b"ppp-blinded-mailbox-v2"
NONCE_DOMAIN = b"ppp-blinded-nonce-v1"
MAX_EVENT_TTL_SECS = 30 * 24 * 60 * 60          # 004 C.2: the longest lifetime a sender gets
L = 2 ** 252 + 27742317777372353535851937790883648493   # the Ed25519 group order


def epoch_of(now: float) -> int:
    return int(now // EPOCH_SECONDS)


def epochs_to_walk(now: float, *, max_ttl: int = MAX_EVENT_TTL_SECS,
                   drained_before: int | None = None) -> range:
    """Every day whose mailbox may still hold mail at `now`: from the day an event sent with
    the longest lifetime would still be alive (now - max_ttl) to tomorrow (a sender whose
    clock runs ahead across midnight), skipping days before `drained_before` (emptied and
    acknowledged already, so nothing new can be there: a sender writes only to today's)."""
    first = epoch_of(max(0.0, now - max_ttl))
    if drained_before is not None:
        first = max(first, drained_before)
    return range(first, epoch_of(now) + 2)


def _scalar(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _bytes(n: int) -> bytes:
    return n.to_bytes(32, "little")


def _blinding(shared: bytes, recipient_pk: bytes, epoch: int) -> int:
    if len(shared) != 32 or len(recipient_pk) != 32 or epoch < 0:
        raise ValueError("shared secret and recipient key are 32 bytes, epoch >= 0")
    h = hashlib.blake2b(DOMAIN + recipient_pk + struct.pack(">Q", epoch), digest_size=64,
                        key=shared).digest()
    return _scalar(h) % L or 1


def _blind_point(h: int, pk: bytes) -> bytes:
    try:
        return bindings.crypto_scalarmult_ed25519_noclamp(_bytes(h), pk)
    except Exception as e:   # nacl raises RuntimeError / ValueError for a bad point
        raise KeyMaterialError("not a valid ed25519 public key") from e


class MailboxKey:
    """The recipient's key for one blinded mailbox: `pubkey` (= mailbox_id) and `sign`, all
    PppClient.connect needs to AUTH as the mailbox. Signatures are standard Ed25519
    (RFC 8032 verification) made with the blinded scalar; the nonce is derived from the
    recipient's secret prefix, so it is deterministic and secret like Ed25519's own."""

    __slots__ = ("pubkey", "_scalar", "_prefix")

    def __init__(self, me: Identity, h: int):
        digest = hashlib.sha512(me.seed).digest()
        a = bytearray(digest[:32])
        a[0] &= 248
        a[31] &= 127
        a[31] |= 64
        self._scalar = (_scalar(bytes(a)) * h) % L
        self.pubkey = bindings.crypto_scalarmult_ed25519_base_noclamp(_bytes(self._scalar))
        self._prefix = hashlib.blake2b(NONCE_DOMAIN + self.pubkey, digest_size=32,
                                       key=digest[32:]).digest()

    def sign(self, message: bytes) -> bytes:
        r = _scalar(hashlib.sha512(self._prefix + message).digest()) % L
        big_r = bindings.crypto_scalarmult_ed25519_base_noclamp(_bytes(r))
        k = _scalar(hashlib.sha512(big_r + self.pubkey + message).digest()) % L
        return big_r + _bytes((r + k * self._scalar) % L)

    def __repr__(self) -> str:
        return f"MailboxKey(id={self.pubkey.hex()[:16]}…, secrets=<redacted>)"


def my_mailbox(me: Identity, contact_pk: bytes, epoch: int) -> MailboxKey:
    """The recipient's key for `contact`'s messages on `epoch`: it AUTHs with it."""
    return MailboxKey(me, _blinding(me.dh(contact_pk), me.pubkey, epoch))


def their_mailbox_id(me: Identity, recipient_pk: bytes, epoch: int) -> bytes:
    """What a sender routes its GiftWrap to on `epoch` (it cannot sign as it)."""
    return _blind_point(_blinding(me.dh(recipient_pk), recipient_pk, epoch), recipient_pk)


def mailbox_delivery_token(me: Identity, contact_pk: bytes, mailbox_id: bytes) -> bytes:
    """The sealed-note token of the pair for that mailbox (both sides compute it)."""
    return delivery_token_from_secret(me.dh(contact_pk), mailbox_id)


def spec_mailbox_id(seed_secret: bytes, epoch: int) -> bytes:
    """The spec's formula, BLAKE2b(32, mailbox_seed || u64be(epoch)), kept to show its flaw."""
    return hashlib.blake2b(seed_secret + struct.pack(">Q", epoch), digest_size=32).digest()
