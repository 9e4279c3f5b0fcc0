"""Deterministic trueseal event ids, so a client's retry of the same blob is a duplicate.

trueseal frames carry no id of their own; the real client retries a blob over a new push
session until it hears Ack (interop §8), so the id is derived from what the relay sees:
BLAKE2b-256(recipient ‖ envelope) under a trueseal-only personalisation (DESIGN.md
"event_id"). The recipient is fixed at 32 bytes, so the concatenation is unambiguous.
"""

from __future__ import annotations

import hashlib

PROTOCOL = "trueseal"            # the `protocol` column value of trueseal rows
EVENT_ID_PERSON = b"trueseal.evt.v1"   # hashlib.blake2b takes at most 16 bytes of person


def event_id(recipient: bytes, envelope: bytes) -> bytes:
    if len(recipient) != 32:
        raise ValueError("recipient must be 32 bytes")
    h = hashlib.blake2b(digest_size=32, person=EVENT_ID_PERSON)
    h.update(recipient)
    h.update(envelope)
    return h.digest()
