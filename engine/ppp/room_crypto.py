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

Knock grant (§7.4): `ble_grant_encrypt(admin_x25519_sk, knocker_eph_x25519_pk, room_id,
room_key)` = nonce (24) || XChaCha20-Poly1305(room_id || room_key) (48 + 16), under
kdf(X25519(admin_x25519_sk, knocker_eph_x25519_pk), "ppp-ble-grant-v1") with §2's kdf. The
spec gives the wire and the X25519 pair but no KDF context; this one follows §2's
"ppp-<purpose>-v1" names. The knocker decrypts with its ephemeral secret and the admin's
X25519 key (from the Ed25519 `admin_pubkey` of ADMITTED, §1's conversion). 88 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import msgpack
import nacl.utils

from .crypto import NONCE_LEN, DecryptError, decrypt, encrypt, kdf
from .keys import Identity, KeyMaterialError, verify, x25519
from .padding import pad, unpad
from .rooms import ROOM_ID_LEN
from .tokens import member_token, room_signing_identity

ROOM_KEY_LEN = 32
MSG_DOMAIN = b"ppp-room-msg-v1"
GRANT_CONTEXT = b"ppp-ble-grant-v1"
GRANT_LEN = NONCE_LEN + ROOM_ID_LEN + ROOM_KEY_LEN + 16


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


# --- knock / admit grant (§7.4) ---------------------------------------------------------------

def new_knock_key() -> tuple[bytes, bytes]:
    """(x25519 secret, x25519 public): the knocker's ephemeral pair, one per knock."""
    from nacl.public import PrivateKey
    sk = PrivateKey.generate()
    return bytes(sk), bytes(sk.public_key)


def _grant_key(my_x25519_sk: bytes, their_x25519_pk: bytes) -> bytes:
    return kdf(x25519(my_x25519_sk, their_x25519_pk), GRANT_CONTEXT)


def ble_grant_encrypt(admin_x25519_sk: bytes, knocker_eph_x25519_pk: bytes, room_id: bytes,
                      room_key: bytes,
                      randbytes: Callable[[int], bytes] = nacl.utils.random) -> bytes:
    if len(room_id) != ROOM_ID_LEN or len(room_key) != ROOM_KEY_LEN:
        raise ValueError("room_id is 16 bytes and room_key 32")
    nonce = randbytes(NONCE_LEN)
    return nonce + encrypt(room_id + room_key, nonce,
                           _grant_key(admin_x25519_sk, knocker_eph_x25519_pk))


def ble_grant_decrypt(knocker_eph_x25519_sk: bytes, admin_x25519_pk: bytes,
                      grant: bytes) -> tuple[bytes, bytes]:
    """(room_id, room_key); RoomMessageError if it is not a grant to this key pair."""
    if len(grant) != GRANT_LEN:
        raise RoomMessageError("a grant is 88 bytes")
    try:
        plain = decrypt(grant[NONCE_LEN:], grant[:NONCE_LEN],
                        _grant_key(knocker_eph_x25519_sk, admin_x25519_pk))
    except (DecryptError, KeyMaterialError) as e:
        raise RoomMessageError("not a grant for this knock") from e
    return plain[:ROOM_ID_LEN], plain[ROOM_ID_LEN:]
