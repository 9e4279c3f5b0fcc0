"""Client backups (spec 004 §6 backups, §1 "back up the seed phrase"), pure.

The recovery phrase is the BIP-39 mnemonic of the 32-byte identity seed (24 words, the
`mnemonic` package's English wordlist and checksum): the phrase alone gives back the
identity, so a new device can AUTH as the same pubkey and FETCH_BACKUP.

The spec says the backup key is "derived client-side from the user's BIP-39 mnemonic via
BLAKE2b with the ppp-backup-v1 domain tag" and gives no vector or formula. Built here:

    bip39_seed = PBKDF2-HMAC-SHA512(mnemonic, "mnemonic" || passphrase, 2048)   (BIP-39)
    backup_key = BLAKE2b(32, in = "ppp-backup-v1", key = bip39_seed)
    blob       = nonce (24) || XChaCha20-Poly1305(backup_key, nonce, payload, ad = "ppp-backup-v1")

BIP-39's own seed step keeps the optional passphrase working (a phrase written down alone
then opens nothing), and keys the backup apart from the identity: knowing the backup key
does not give the signing key. The relay stores the blob as opaque ciphertext (STORE_BACKUP
upserts one per pubkey, its version counting up).
"""

from __future__ import annotations

import hashlib

import msgpack
import nacl.exceptions
import nacl.utils
from mnemonic import Mnemonic
from nacl import bindings

from . import crypto
from .keys import Identity

DOMAIN = b"ppp-backup-v1"
_WORDS = Mnemonic("english")
FORMAT = 1


class BackupError(ValueError):
    """A phrase that is not a valid BIP-39 mnemonic, or a blob that does not open."""


def mnemonic_of(identity: Identity) -> str:
    return _WORDS.to_mnemonic(identity.seed)


def identity_from_mnemonic(phrase: str) -> Identity:
    words = " ".join(phrase.lower().split())
    if not _WORDS.check(words):
        raise BackupError("not a valid recovery phrase (a word or the checksum is wrong)")
    seed = bytes(_WORDS.to_entropy(words))
    if len(seed) != 32:
        raise BackupError("a PPP recovery phrase has 24 words")
    return Identity.from_seed(seed)


def backup_key(phrase: str, passphrase: str = "") -> bytes:
    bip39_seed = Mnemonic.to_seed(" ".join(phrase.lower().split()), passphrase)
    return hashlib.blake2b(DOMAIN, digest_size=32, key=bip39_seed).digest()


def seal_backup(payload: dict, key: bytes, randbytes=nacl.utils.random) -> bytes:
    nonce = randbytes(crypto.NONCE_LEN)
    body = msgpack.packb({"format": FORMAT, "state": payload}, use_bin_type=True)
    return nonce + bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(body, DOMAIN, nonce, key)


def open_backup(blob: bytes, key: bytes) -> dict:
    if len(blob) < crypto.NONCE_LEN + 16:
        raise BackupError("backup too short")
    try:
        body = bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(
            blob[crypto.NONCE_LEN:], DOMAIN, blob[:crypto.NONCE_LEN], key)
    except nacl.exceptions.CryptoError as e:
        raise BackupError("backup does not open with this phrase") from e
    m = msgpack.unpackb(body, raw=False)
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("state"),
                                                                              dict):
        raise BackupError("unknown backup format")
    return m["state"]
