"""Who a connection is, and who may join a group. Pure functions; the shell supplies nonces,
the relay certificate and the clock.

**Device identity (per connection, never from a message).** 0k-sync takes the device id from
iroh's TLS (the peer's Ed25519 key). aioquic cannot do RFC 7250 raw-key TLS or verify client
certificates, so a direct client proves its key on its first stream:

    client: ["Auth", 1]                 (bi stream 0, no FIN)
    relay:  ["AuthChallenge", nonce32]  (32 fresh random bytes)
    client: ["AuthProof", device_id32, sig64] + FIN
    relay:  ["Done", "AuthProof"] + FIN, or CONNECTION_CLOSE code 3 "auth failed"

    sig = Ed25519(device key, "0k-sync-auth-v1" ‖ nonce ‖ SHA-256(relay certificate DER))

The certificate hash binds the proof to this relay (a proof shown to one relay is useless at
another) and the nonce to this connection. The device id is the Ed25519 public key, as iroh's
node id is. A future iroh gateway would connect with its own ALPN and pass the iroh remote id
of each spliced connection instead of this exchange (README "cursor-sync").

**Admission.** The first device to say HELLO for a group id nobody holds creates the group.
Any other device presents, before its HELLO, an admission signed by a current member:

    ["Join", group_id32, admitter32, expires_at_u64, sig64]
    sig = Ed25519(admitter key, "0k-sync-admit-v1" ‖ group_id ‖ joiner device id ‖ u64_be(expires_at))

The joiner's device id is the connection's, so an admission works for exactly one device. A
revoked device is refused whatever admission it shows, and an admitter must still be a member
when the admission is used.
"""

from __future__ import annotations

import hashlib
import struct

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

AUTH_CONTEXT = b"0k-sync-auth-v1"
ADMIT_CONTEXT = b"0k-sync-admit-v1"
NONCE_LEN = 32


def auth_message(nonce: bytes, relay_cert_der: bytes) -> bytes:
    return AUTH_CONTEXT + nonce + hashlib.sha256(relay_cert_der).digest()


def admit_message(group_id: bytes, joiner: bytes, expires_at: int) -> bytes:
    return ADMIT_CONTEXT + group_id + joiner + struct.pack(">Q", expires_at)


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    try:
        VerifyKey(public_key).verify(message, signature)
        return True
    except (BadSignatureError, ValueError, TypeError):
        return False


def auth_ok(device_id: bytes, signature: bytes, nonce: bytes, relay_cert_der: bytes) -> bool:
    return verify(device_id, auth_message(nonce, relay_cert_der), signature)


def admission_ok(group_id: bytes, joiner: bytes, admitter: bytes, expires_at: int,
                 signature: bytes, now_unix: float) -> bool:
    """The signature is the admitter's and the admission has not expired (membership of the
    admitter and revocation of the joiner are the caller's checks)."""
    return now_unix <= expires_at and verify(admitter, admit_message(group_id, joiner,
                                                                     expires_at), signature)
