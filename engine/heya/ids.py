"""Heya `protocol` value and event ids.

A SEND carries no client-chosen id, and the public server stores two identical SENDs as two
messages with two sequence numbers (interop §3 SEND). We keep that: every accepted SEND is a
new message, so its event id must be unique per SEND, not a hash of what the client sent
(which would make the stream drop the second of two identical SENDs as a duplicate after we
had already answered RECV for it: an acked message that never gets a sequence number).

The id is still derived, not bare randomness: BLAKE2b-256 under a Heya-only personalisation
over send token ‖ body digest ‖ a 16-byte per-SEND nonce, so it is unique, says which
protocol made it, and never collides with another protocol's ids. The consequence, written
down in the README: a sender that repeats a SEND after losing the connection before RECV may
store the message twice; the receiver sees two sequence numbers, as with the public server.
"""

from __future__ import annotations

import hashlib
import os

PROTOCOL = "heya"                     # the `protocol` column value of Heya rows
EVENT_ID_PERSON = b"heya.evt.v1"      # hashlib.blake2b takes at most 16 bytes of person
NONCE_LEN = 16


def event_id(send_token: bytes, digest: bytes, nonce: bytes | None = None) -> bytes:
    if len(send_token) != 32 or len(digest) != 32:
        raise ValueError("send token and digest are 32 bytes each")
    nonce = os.urandom(NONCE_LEN) if nonce is None else nonce
    h = hashlib.blake2b(digest_size=32, person=EVENT_ID_PERSON)
    h.update(send_token)
    h.update(digest)
    h.update(nonce)
    return h.digest()
