"""The BLE courier's codecs (spec 004 §8, `engine/ppp/courier.py`): what a peer sends over the
air is chunks on EVENT_STREAM and transfer forms inside them. Any bytes: an event, nothing
yet, or CourierError; a refused chunk leaves no partial event behind."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import strategies as st

from engine.ppp import courier as C
from fuzzing import fuzz_target
from mutations import mutated

pytestmark = pytest.mark.fuzz

MTU = st.integers(C.MIN_MTU, C.MAX_MTU)
events = st.binary(min_size=1, max_size=1500)


def _valid_sequence(ev_mtu):
    ev, mtu = ev_mtu
    return C.chunks(ev, mtu)


chunk_lists = st.one_of(
    st.tuples(events, MTU).map(_valid_sequence),
    st.lists(st.binary(max_size=40), max_size=20),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.binary(max_size=20)).map(
        lambda t: struct.pack(">HH", t[0], t[1]) + t[2]), max_size=20),
    st.tuples(events, MTU).map(_valid_sequence).flatmap(
        lambda cs: st.permutations(cs) if len(cs) < 8 else st.just(cs[::-1])),
)


@fuzz_target(chunks=chunk_lists)
def test_reassembly(chunks):
    r = C.Reassembler(max_event=4096)
    for c in chunks:
        try:
            out = r.feed(c)
        except C.CourierError as e:
            assert isinstance(e.args[0], str) and not r.in_progress
            continue
        assert out is None or (type(out) is bytes and 0 < len(out) <= 4096)


_wrap = {1: b"r" * 32, 2: b"e" * 32, 3: b"n" * 24, 4: b"c" * 40, 5: 1_700_000_000,
         6: 4_000_000_000}
transfers = st.one_of(
    st.builds(lambda h, m: msgpack.packb({**_wrap, 12: h, 13: m}), st.integers(0, 300),
              st.integers(0, 300)),
    mutated(st.just(msgpack.packb({**_wrap, 12: 1, 13: 3}))),
    st.binary(max_size=200),
)


@fuzz_target(data=transfers)
def test_transfer_form(data):
    try:
        e = C.from_transfer(data, 1_800_000_000)
    except C.CourierError as err:
        assert isinstance(err.args[0], str)
        return
    assert 0 <= e.hop_count <= e.max_hops <= 255 and len(e.recipient) == 32
