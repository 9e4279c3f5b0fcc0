"""The written-out NK responder (engine/noise_nk.py) against the `noiseprotocol` package's
initiator: an independent implementation of Noise_NK_25519_ChaChaPoly_BLAKE2s on the client
side, so both ends are not our code."""

import os

import pytest
from noise.connection import Keypair, NoiseConnection

from engine.noise_nk import NKResponder
from engine.noise_session import PROTOCOL_NAMES, NoiseFailure, NoiseResponder, StaticKey

STATIC = StaticKey(bytes(range(1, 33)))


def initiator(relay_public: bytes = STATIC.public) -> NoiseConnection:
    c = NoiseConnection.from_name(PROTOCOL_NAMES["NK"])
    c.set_as_initiator()
    c.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, relay_public)
    c.start_handshake()
    return c


@pytest.mark.parametrize("payload", [b"", b"a client payload, read and ignored"])
def test_handshake_and_transport_both_ways_in_order(payload):
    c, r = initiator(), NKResponder(STATIC)
    msg1 = c.write_message(payload)
    assert len(msg1) == 48 + len(payload)
    (msg2,) = r.receive_handshake(msg1)
    assert len(msg2) == 48 and r.handshake_complete and r.remote_static is None
    c.read_message(msg2)
    assert c.handshake_finished
    for i in range(3):
        assert r.decrypt(c.encrypt(b"push %d" % i)) == b"push %d" % i
        assert c.decrypt(r.encrypt(b"ack %d" % i)) == b"ack %d" % i


def test_same_wire_as_the_package_responder():
    """Each message 2 answers its own message 1 under the relay key: the package's
    responder and ours are interchangeable for a client."""
    for make in (lambda: NoiseResponder("NK", STATIC), lambda: NKResponder(STATIC)):
        c = initiator()
        (msg2,) = make().receive_handshake(c.write_message(b""))
        c.read_message(msg2)
        assert c.handshake_finished


def test_wrong_relay_key_short_or_flipped_message_fails_and_stays_failed():
    other = StaticKey(os.urandom(32))
    bad = [initiator(other.public).write_message(b""), initiator().write_message(b"")[:47]]
    flipped = bytearray(initiator().write_message(b""))
    flipped[40] ^= 1
    bad.append(bytes(flipped))
    for msg in bad:
        r = NKResponder(STATIC)
        with pytest.raises(NoiseFailure):
            r.receive_handshake(msg)
        assert r.failed and not r.handshake_complete
        with pytest.raises(NoiseFailure):
            r.receive_handshake(initiator().write_message(b""))
        with pytest.raises(NoiseFailure):
            r.decrypt(b"\x00" * 32)


def test_out_of_order_or_replayed_transport_fails():
    c, r = initiator(), NKResponder(STATIC)
    (msg2,) = r.receive_handshake(c.write_message(b""))
    c.read_message(msg2)
    first, second = c.encrypt(b"one"), c.encrypt(b"two")
    with pytest.raises(NoiseFailure):
        r.decrypt(second)
    with pytest.raises(NoiseFailure):        # failed for good
        r.decrypt(first)


def test_no_second_handshake_and_no_key_in_repr():
    c, r = initiator(), NKResponder(STATIC)
    r.receive_handshake(c.write_message(b""))
    with pytest.raises(NoiseFailure):
        r.receive_handshake(initiator().write_message(b""))
    assert STATIC.public.hex()[:8] not in repr(r) and "open" in repr(r)
