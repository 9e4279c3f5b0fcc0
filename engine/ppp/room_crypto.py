"""Room messages, client side (spec 004 §7): keys, member tokens, encrypt / decrypt.

The spec fixes the cipher (XChaCha20-Poly1305 under the 32-byte symmetric room key, a
24-byte nonce, §7.3 / C.6) and the member token (`tokens.member_token`), not the plaintext.
This library's plaintext, padded to the §11 buckets like every PPP payload, is one
MessagePack map with integer keys:

    1: member_signing_pk (32)  the sender's per-room Ed25519 key (`room_signing_identity`):
                               members can tell senders apart; nobody can link it to the
                               sender's long-term key
    2: sent_at (uint)          unix seconds
    3: body (str)
    4: sig (64)                Ed25519 over "ppp-room-msg-v1" || room_id || u64be(sent_at)
                               || utf-8 body, by that per-room key

so a message names its room (a ciphertext replayed into another room with the same key
fails) and its sender within the room. There is no associated data (the spec's `encrypt`
has none). Ciphertext = padded plaintext + 16-byte tag: the relay sees a bucket + 40 bytes
with the nonce (`stream.padding_overhead.ppp_room`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import msgpack
import nacl.utils

from .crypto import NONCE_LEN, decrypt, encrypt
from .keys import Identity, verify
from .padding import pad, unpad
from .rooms import ROOM_ID_LEN
from .tokens import member_token, room_signing_identity

ROOM_KEY_LEN = 32
MSG_DOMAIN = b"ppp-room-msg-v1"


class RoomMessageError(ValueError):
    """Not a room message of this room under this key (or a bad signature)."""


def new_room_id() -> bytes:
    return nacl.utils.random(ROOM_ID_LEN)


def new_room_key() -> bytes:
    return nacl.utils.random(ROOM_KEY_LEN)


def my_member_token(me: Identity, room_key: bytes, room_id: bytes) -> bytes:
    """What a member asks the admin to register (REGISTER_TOKEN)."""
    return member_token(room_key, room_signing_identity(me, room_id).pubkey, room_id)


def _signed(room_id: bytes, sent_at: int, body: str) -> bytes:
    return MSG_DOMAIN + room_id + struct.pack(">Q", sent_at) + body.encode("utf-8")


@dataclass(frozen=True)
class RoomPlaintext:
    sender: bytes          # per-room signing key
    sent_at: int
    body: str

    def __repr__(self) -> str:
        return f"RoomPlaintext({len(self.body)} chars)"


def encrypt_message(me: Identity, room_key: bytes, room_id: bytes, body: str, sent_at: int,
                    randbytes: Callable[[int], bytes] = nacl.utils.random
                    ) -> tuple[bytes, bytes]:
    """(nonce, ciphertext) for STORE_ROOM / POST /v1/room/submit."""
    signer = room_signing_identity(me, room_id)
    plain = msgpack.packb({1: signer.pubkey, 2: sent_at, 3: body,
                           4: signer.sign(_signed(room_id, sent_at, body))}, use_bin_type=True)
    nonce = randbytes(NONCE_LEN)
    return nonce, encrypt(pad(plain, randbytes), nonce, room_key)


def decrypt_message(room_key: bytes, room_id: bytes, nonce: bytes,
                    ciphertext: bytes) -> RoomPlaintext:
    try:
        m = msgpack.unpackb(unpad(decrypt(ciphertext, nonce, room_key)), strict_map_key=False)
    except Exception as e:   # wrong key, tampered, bad padding or not MessagePack
        raise RoomMessageError("not a message of this room") from e
    if not isinstance(m, dict) or set(m) != {1, 2, 3, 4}:
        raise RoomMessageError("not a room message")
    pk, sent_at, body, sig = m[1], m[2], m[3], m[4]
    if not (isinstance(pk, bytes) and len(pk) == 32 and isinstance(sent_at, int)
            and isinstance(body, str) and isinstance(sig, bytes)):
        raise RoomMessageError("not a room message")
    if not verify(pk, _signed(room_id, sent_at, body), sig):
        raise RoomMessageError("bad sender signature")
    return RoomPlaintext(pk, sent_at, body)
