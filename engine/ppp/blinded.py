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

What is built instead: a mailbox per (recipient, contact, day), derived like §6.2's delivery
tokens from what exactly the two of them share:

    shared   = X25519(my_x25519_sk, their_x25519_pk)              (the same on both sides)
    seed     = BLAKE2b(32, in = "ppp-blinded-mailbox-v1" || recipient_pk || u64be(epoch),
                       key = shared)
    mailbox  = Ed25519 key pair from seed;  mailbox_id = its public key

* The sender computes the recipient's mailbox_id for today and STOREs (or submits sealed) a
  GiftWrap *routed* to it (GiftWrap `recipient` = mailbox_id; the layers are still
  encrypted to the recipient's long-term key, `wrap(route_to=)`).
* The recipient computes the same key pair and opens a WebSocket authenticated *as the
  mailbox* (CHALLENGE signed with the mailbox key): FETCH, ACK and NOTIFY work unchanged,
  and it registers that day's delivery token (`delivery_token_from_secret(shared,
  mailbox_id)`) from that session for sealed notes. The relay sees opaque 32-byte keys,
  a new one per contact per day; no relay change was needed, and plain mailboxes keep
  working beside it (clients opt in).
* The relay cannot link two days (or two contacts) of one recipient without `shared`,
  which needs a private key of one of the two. What remains visible: the network address
  and timing of the sessions that fetch them (use one connection per mailbox, and a proxy or
  Tor for the address), and a sender who STOREs over its own authenticated socket (sealed
  submission hides it).
* Cost: one session per contact per day to fetch, and one delivery token per contact per
  day (the recipient deregisters yesterday's). The per-pair mailbox also means the sender
  could open the mailbox it writes to: it holds nothing but that sender's own messages.
"""

from __future__ import annotations

import hashlib
import struct

from .keys import Identity
from .tokens import delivery_token_from_secret

EPOCH_SECONDS = 86_400
DOMAIN = b"ppp-blinded-mailbox-v1"


def epoch_of(now: float) -> int:
    return int(now // EPOCH_SECONDS)


def _mailbox(shared: bytes, recipient_pk: bytes, epoch: int) -> Identity:
    if len(shared) != 32 or len(recipient_pk) != 32 or epoch < 0:
        raise ValueError("shared secret and recipient key are 32 bytes, epoch >= 0")
    seed = hashlib.blake2b(DOMAIN + recipient_pk + struct.pack(">Q", epoch), digest_size=32,
                           key=shared).digest()
    return Identity.from_seed(seed)


def my_mailbox(me: Identity, contact_pk: bytes, epoch: int) -> Identity:
    """The recipient's key pair for `contact`'s messages on `epoch`: it AUTHs with it."""
    return _mailbox(me.dh(contact_pk), me.pubkey, epoch)


def their_mailbox_id(me: Identity, recipient_pk: bytes, epoch: int) -> bytes:
    """What a sender routes its GiftWrap to on `epoch`."""
    return _mailbox(me.dh(recipient_pk), recipient_pk, epoch).pubkey


def mailbox_delivery_token(me: Identity, contact_pk: bytes, mailbox_id: bytes) -> bytes:
    """The sealed-note token of the pair for that mailbox (both sides compute it)."""
    return delivery_token_from_secret(me.dh(contact_pk), mailbox_id)


def spec_mailbox_id(seed_secret: bytes, epoch: int) -> bytes:
    """The spec's formula, BLAKE2b(32, mailbox_seed || u64be(epoch)), kept to show its flaw."""
    return hashlib.blake2b(seed_secret + struct.pack(">Q", epoch), digest_size=32).digest()
