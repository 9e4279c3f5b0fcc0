"""MessagePack maps as PPP types them: one key type, each key once (spec 004 §5.1, §3.x).

Commands are maps keyed by field-name strings; a GiftWrap is a map keyed by the integers
1-6. Python's dict cannot tell those keys apart from look-alikes: `True == 1` and
`1.0 == 1` hash equal, so `{1.0: ...}` or `{True: ...}` would pass a `set(m) == {1, ...}`
test, and a map that names a key twice keeps only the last value (msgpack-python merges
them silently). A relay that lands what it was sent must not read a map other readers of
the same bytes may read differently, so `unpack_map` refuses all three.
"""

from __future__ import annotations

import msgpack


class MapError(ValueError):
    """Not one map of the expected key type; `args[0]` is a short reason safe to send back."""


def _pairs(pairs: list) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:       # also True vs 1 and 1.0 vs 1: equal keys are one key twice
            raise MapError("a map key appears twice")
        out[k] = v
    return out


def unpack_map(data: bytes, key_type: type) -> dict:
    """One MessagePack map, nothing after it, whose top-level keys are all exactly
    `key_type` (`int` refuses `bool`, and `float` whatever its value), none twice (at any
    depth). Raises `MapError`."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=False, object_pairs_hook=_pairs)
    except MapError:
        raise
    except Exception as e:   # msgpack raises several unrelated types
        raise MapError("malformed MessagePack") from e
    if not isinstance(m, dict):
        raise MapError("message is not a map")
    if any(type(k) is not key_type for k in m):
        raise MapError(f"map keys must be {'integers' if key_type is int else 'strings'}")
    return m
