"""The peer channel's core (engine/peer_channel.py), bytes in and events out: a real Noise IK
handshake between two cores, messages larger than one Noise message, and every failure
closing the channel."""

from __future__ import annotations

import os

import pytest
from noise.connection import Keypair, NoiseConnection

from engine.noise_session import MAX_MESSAGE, LengthPrefixDeframer, StaticKey, frame_message
from engine.peer_channel import (PROLOGUE, PROTOCOL_NAME, ChannelClosed, ChannelOpen,
                                 MessageReceived, PeerChannel, PeerIdentified, State)


def keypair():
    private = os.urandom(32)
    return private, StaticKey(private).public


def pump(src: PeerChannel, dst: PeerChannel) -> list:
    dst.receive_data(src.data_to_send())
    return dst.events_received()


def opened():
    (a, a_pub), (b, b_pub) = keypair(), keypair()
    dialler = PeerChannel(a, initiator=True, remote_static=b_pub)
    listener = PeerChannel(b, initiator=False)
    assert pump(dialler, listener) == [PeerIdentified(a_pub)]
    listener.accept()
    assert pump(listener, dialler) == [ChannelOpen()]
    assert listener.events_received() == [ChannelOpen()]
    return dialler, listener


def test_ik_handshake_names_the_dialler_and_carries_messages_both_ways():
    dialler, listener = opened()
    big = os.urandom(100_000)          # more than one Noise message (65,535 bytes) holds
    dialler.send(big)
    dialler.send(b"")
    dialler.send(b"small")
    wire = dialler.data_to_send()
    records = LengthPrefixDeframer().feed(wire)
    assert len(records) == 2 and all(len(r) <= MAX_MESSAGE for r in records)
    for i in range(0, len(wire), 1000):     # any cut of the stream
        listener.receive_data(wire[i:i + 1000])
    assert listener.events_received() == [MessageReceived(big), MessageReceived(b""),
                                          MessageReceived(b"small")]
    listener.send(b"back")
    assert pump(listener, dialler) == [MessageReceived(b"back")]


def test_messages_queued_before_the_channel_opens_go_after_the_handshake():
    (a, _), (b, b_pub) = keypair(), keypair()
    dialler = PeerChannel(a, initiator=True, remote_static=b_pub)
    dialler.send(b"early")
    listener = PeerChannel(b, initiator=False)
    pump(dialler, listener)
    listener.accept()
    pump(listener, dialler)
    pump(listener, dialler)
    assert pump(dialler, listener) == [ChannelOpen(), MessageReceived(b"early")]


def test_a_rejected_dialler_gets_no_answer():
    (a, _), (b, b_pub) = keypair(), keypair()
    dialler = PeerChannel(a, initiator=True, remote_static=b_pub)
    listener = PeerChannel(b, initiator=False)
    pump(dialler, listener)
    listener.reject()
    assert listener.data_to_send() == b""
    assert listener.events_received() == [ChannelClosed("rejected")]
    assert listener.state is State.CLOSED


def test_a_listener_with_another_key_than_the_listed_one_fails_the_handshake():
    (a, _), (b, _), (_, listed) = keypair(), keypair(), keypair()
    dialler = PeerChannel(a, initiator=True, remote_static=listed)
    listener = PeerChannel(b, initiator=False)
    assert pump(dialler, listener) == [ChannelClosed("handshake_failed")]


def test_another_prologue_or_pattern_does_not_open_a_channel():
    """A Noise IK initiator of the spec (the package, used directly) with another prologue."""
    (a, _), (b, b_pub) = keypair(), keypair()
    other = NoiseConnection.from_name(PROTOCOL_NAME)
    other.set_as_initiator()
    other.set_keypair_from_private_bytes(Keypair.STATIC, a)
    other.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, b_pub)
    other.set_prologue(b"relay-peer/0")
    other.start_handshake()
    listener = PeerChannel(b, initiator=False)
    listener.receive_data(frame_message(other.write_message(b"")))
    assert listener.events_received() == [ChannelClosed("handshake_failed")]
    # the same with our prologue opens: the layout is the spec's, not only our encoder's
    same = NoiseConnection.from_name(PROTOCOL_NAME)
    same.set_as_initiator()
    same.set_keypair_from_private_bytes(Keypair.STATIC, a)
    same.set_keypair_from_public_bytes(Keypair.REMOTE_STATIC, b_pub)
    same.set_prologue(PROLOGUE)
    same.start_handshake()
    listener = PeerChannel(b, initiator=False)
    msg1 = same.write_message(b"")
    assert len(msg1) == 96          # e (32) + encrypted s (48) + empty payload's tag (16)
    listener.receive_data(frame_message(msg1))
    assert [type(e) for e in listener.events_received()] == [PeerIdentified]
    listener.accept()
    same.read_message(LengthPrefixDeframer().feed(listener.data_to_send())[0])
    assert same.handshake_finished
    listener.events_received()
    listener.receive_data(frame_message(same.encrypt(b"\x00\x00\x00\x02hi")))
    assert listener.events_received() == [MessageReceived(b"hi")]


def test_a_tampered_transport_message_or_an_oversized_length_closes_the_channel():
    dialler, listener = opened()
    dialler.send(b"payload")
    wire = bytearray(dialler.data_to_send())
    wire[-1] ^= 1
    listener.receive_data(bytes(wire))
    assert listener.events_received() == [ChannelClosed("decrypt_failed")]

    dialler, listener = opened()
    # the dialler's own cipher, to write a length the listener refuses
    raw = dialler._conn.encrypt((listener.max_message + 1).to_bytes(4, "big"))
    listener.receive_data(frame_message(raw))
    assert listener.events_received() == [ChannelClosed("oversized")]
    with pytest.raises(ValueError):
        dialler.send(b"x" * (dialler.max_message + 1))


def test_a_dialler_speaking_before_it_is_answered_is_closed():
    (a, _), (b, b_pub) = keypair(), keypair()
    dialler = PeerChannel(a, initiator=True, remote_static=b_pub)
    listener = PeerChannel(b, initiator=False)
    listener.receive_data(dialler.data_to_send() + frame_message(b"x" * 40))
    assert [type(e) for e in listener.events_received()] == [PeerIdentified, ChannelClosed]


def test_repr_shows_no_key():
    (a, a_pub), (_, b_pub) = keypair(), keypair()
    text = repr(PeerChannel(a, initiator=True, remote_static=b_pub))
    assert b_pub.hex() not in text and a.hex() not in text
    assert a_pub.hex() not in repr(PeerIdentified(a_pub))
