"""Structure-aware inputs for the fuzz targets: valid messages bent a little.

Random bytes alone rarely get past a codec's first check, so each target also draws a valid
message (built from the spec's byte layout) and applies a few of these mutations: byte flips
and interesting values, insertions, deletions, duplicated and truncated spans. For the
MessagePack codecs, `bend_object` mutates the decoded structure instead: values swapped for any
MessagePack value, integer keys and values swapped for the equal float or bool (1 == 1.0 ==
True in Python, so a decoder that compares with == lets them through), keys dropped or added.
"""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

# Bytes that sit on boundaries of the formats under test: lengths, msgpack type bytes,
# separators of the line protocol, sign bits.
INTERESTING_BYTES = (0x00, 0x01, 0x0A, 0x0D, 0x20, 0x7F, 0x80, 0xFF, 0x90, 0x9F, 0xC0, 0xC2,
                     0xC3, 0xC4, 0xC5, 0xC6, 0xCA, 0xCB, 0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3,
                     0xD4, 0xD9, 0xDA, 0xDB, 0xDC, 0xDD, 0xDE, 0xDF, 0xE0, 0x30, 0x39, 0x41,
                     0x61, 0x66, 0x67)


@st.composite
def mutated(draw, valid: st.SearchStrategy[bytes], max_mutations: int = 4) -> bytes:
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, max_mutations))):
        op = draw(st.sampled_from(("flip", "set", "insert", "delete", "duplicate", "truncate",
                                   "append", "splice_u32")))
        pos = draw(st.integers(0, len(data))) if data else 0
        if op == "flip" and data:
            i = min(pos, len(data) - 1)
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            i = min(pos, len(data) - 1)
            data[i] = draw(st.sampled_from(INTERESTING_BYTES) | st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and data:
            n = draw(st.integers(1, max(1, len(data) - pos)))
            del data[pos:pos + n]
        elif op == "duplicate" and data:
            n = draw(st.integers(1, 32))
            data[pos:pos] = data[pos:pos + n]
        elif op == "truncate":
            del data[pos:]
        elif op == "append":
            data += draw(st.binary(min_size=1, max_size=32))
        elif op == "splice_u32":
            # a length field replaced by a boundary value
            value = draw(st.sampled_from((0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x10000, 0x7FFFFFFF,
                                          0xFFFFFFFF)))
            data[pos:pos + 4] = value.to_bytes(4, "big")
    return bytes(data)


# --- MessagePack values ------------------------------------------------------------------------

_scalars = (st.none() | st.booleans()
            | st.integers(-(2**63), 2**64 - 1)
            | st.sampled_from((0, 1, 2, 3, 4, 5, 6, 7, 255, 256, 2**32 - 1, 2**32, 2**64 - 1, -1))
            | st.floats(allow_nan=True) | st.sampled_from((1.0, 2.0, 6.0, 0.0, -0.0))
            | st.text(max_size=24) | st.binary(max_size=40)
            | st.sampled_from(("cmd", "type", "event", "since", "STORE", "AUTH", "FETCH", "ACK",
                               "Hello", "Push", "Pull")))
_keys = _scalars.filter(lambda k: k == k)   # NaN keys make maps that cannot be looked up

msgpack_values = st.recursive(
    _scalars,
    lambda inner: (st.lists(inner, max_size=6)
                   | st.dictionaries(_keys, inner, max_size=6)
                   | st.builds(lambda code, data: msgpack.ExtType(code, data),
                               st.integers(0, 127), st.binary(max_size=12))),
    max_leaves=16)


def _retyped(draw, v):
    """A value Python finds == to `v` but of another MessagePack type (drawn where there are
    several), or None."""
    other = _equal_other_type(v)
    return draw(st.sampled_from(other)) if isinstance(other, tuple) else other


def _equal_other_type(v):
    """The values Python finds == to `v` but of another MessagePack type: one, a tuple of
    them, or None."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        if v in (0, 1):
            return (bool(v), float(v))
        if abs(v) < 2**53:
            return float(v)
    if isinstance(v, bytes):
        return list(v)   # an array of ints where bin is expected, and the reverse below
    if isinstance(v, list) and all(type(x) is int and 0 <= x < 256 for x in v):
        return bytes(v)
    return None


@st.composite
def bend_object(draw, obj):
    """One to three structural mutations of a decoded MessagePack object (map or array)."""
    obj = _copy(obj)
    for _ in range(draw(st.integers(1, 3))):
        obj = _bend_once(draw, obj)
    return obj


def _copy(obj):
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return obj


def _bend_once(draw, obj):
    if isinstance(obj, dict) and obj:
        key = draw(st.sampled_from(sorted(obj, key=repr)))
        op = draw(st.sampled_from(("value", "retype_value", "retype_key", "drop", "add",
                                   "descend")))
        if op == "value":
            obj[key] = draw(msgpack_values)
        elif op == "retype_value":
            other = _retyped(draw, obj[key])
            if other is not None:
                obj[key] = other
        elif op == "retype_key":
            other = _retyped(draw, key)
            if other is not None and not isinstance(other, (list, bytes)):
                # rebuild so the new key sits where the old one was
                obj = {(other if k == key and type(k) is type(key) else k): v
                       for k, v in obj.items()}
        elif op == "drop":
            del obj[key]
        elif op == "add":
            obj[draw(_keys)] = draw(msgpack_values)
        elif op == "descend" and isinstance(obj[key], (dict, list)):
            obj[key] = _bend_once(draw, obj[key])
        return obj
    if isinstance(obj, list) and obj:
        i = draw(st.integers(0, len(obj) - 1))
        op = draw(st.sampled_from(("value", "retype_value", "drop", "add", "descend")))
        if op == "value":
            obj[i] = draw(msgpack_values)
        elif op == "retype_value":
            other = _retyped(draw, obj[i])
            if other is not None:
                obj[i] = other
        elif op == "drop":
            del obj[i]
        elif op == "add":
            obj.insert(i, draw(msgpack_values))
        elif op == "descend" and isinstance(obj[i], (dict, list)):
            obj[i] = _bend_once(draw, obj[i])
        return obj
    return draw(msgpack_values)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def strictly_equal(a, b) -> bool:
    """== that also compares types (1, 1.0 and True differ; bytes and bytearray do not)."""
    if isinstance(a, (bytes, bytearray)) and isinstance(b, (bytes, bytearray)):
        return bytes(a) == bytes(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        for (ka, va), (kb, vb) in zip(sorted(a.items(), key=lambda kv: repr(kv[0])),
                                      sorted(b.items(), key=lambda kv: repr(kv[0]))):
            if not strictly_equal(ka, kb) or not strictly_equal(va, vb):
                return False
        return True
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(strictly_equal(x, y) for x, y in zip(a, b))
    return a == b
