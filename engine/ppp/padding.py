"""Bucket padding before the outer (GiftWrap) encryption (spec §11, metadata protection).

    padded_length = next_bucket(plaintext_length)
    padded_input  = plaintext || 0x01 || randombytes(padded_length - plaintext_length - 2) || 0x00

Buckets are 256, 1024, 4096 and 16384 bytes; `next_bucket` is the smallest bucket that holds
the plaintext plus the two marker bytes. The spec lists no bucket above 16384 and says
payloads MUST be padded to a bucket, so a plaintext longer than 16382 bytes is refused
(`PaddingError`) rather than sent at a size that identifies it.

Unpadding. The padding is random, so it may itself contain 0x01 (and the plaintext may too):
neither a forward nor a backward scan finds the delimiter reliably. What we pad is always one
MessagePack object (the serialised Seal), which is self-delimiting, so `unpad` reads exactly
one object and then insists, strictly: the total length is a bucket, and the smallest one
that fits; the byte after the object is 0x01; the last byte is 0x00. The random bytes between
are not constrained. Any other shape is a `PaddingError`.
"""

from __future__ import annotations

from typing import Callable

import msgpack
import nacl.utils

BUCKETS = (256, 1024, 4096, 16384)
DELIMITER = 0x01
TERMINATOR = 0x00
MAX_PLAINTEXT = BUCKETS[-1] - 2


class PaddingError(ValueError):
    """Not a well-formed padded payload (or too large to pad)."""


def next_bucket(plaintext_length: int) -> int:
    for bucket in BUCKETS:
        if plaintext_length + 2 <= bucket:
            return bucket
    raise PaddingError(f"payload of {plaintext_length} bytes exceeds the largest bucket "
                       f"({BUCKETS[-1]} bytes incl. 2 marker bytes)")


def pad(plaintext: bytes, randbytes: Callable[[int], bytes] = nacl.utils.random) -> bytes:
    n = next_bucket(len(plaintext)) - len(plaintext) - 2
    filler = randbytes(n) if n else b""
    if len(filler) != n:
        raise ValueError("randbytes returned the wrong length")
    return plaintext + bytes([DELIMITER]) + filler + bytes([TERMINATOR])


def msgpack_length(data: bytes) -> int:
    """Length of the single MessagePack object at the start of `data`."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=len(data))
    unpacker.feed(data)
    try:
        unpacker.skip()
    except Exception as e:   # OutOfData, ExtraData, FormatError, StackError...
        raise PaddingError("padded payload does not start with a MessagePack object") from e
    return unpacker.tell()


def unpad(padded: bytes, length_of: Callable[[bytes], int] = msgpack_length) -> bytes:
    """The plaintext of `padded`; `length_of` tells where the plaintext ends (see module)."""
    size = len(padded)
    if size not in BUCKETS:
        raise PaddingError(f"padded length {size} is not a bucket size")
    if padded[-1] != TERMINATOR:
        raise PaddingError("missing 0x00 terminator")
    n = length_of(padded)
    if n + 2 > size:
        raise PaddingError("no room for the delimiter and terminator")
    if padded[n] != DELIMITER:
        raise PaddingError("missing 0x01 delimiter after the payload")
    if next_bucket(n) != size:
        raise PaddingError("padded to a larger bucket than the payload needs")
    return padded[:n]
