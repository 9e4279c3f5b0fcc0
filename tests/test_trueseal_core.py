"""The trueseal session cores, driven by a real Noise client (the `noise` package) and
hand-built frames; no sockets. Also the relay key file."""

import logging
import os
import stat

import pytest
from cryptography.hazmat.primitives.asymmetric import x25519
from cryptography.hazmat.primitives import serialization

from engine.noise_session import NoiseResponder, StaticKey
from engine.trueseal.events import (CloseReason, ConnectionClosed, DeliverAckReceived,
                                    HandshakeComplete, HeartbeatReceived, PushReceived,
                                    PushRejected)
from engine.trueseal.push import PushSession
from engine.trueseal.receive import ReceiveSession
from engine.trueseal.session import State
from runtime import keys
from runtime.keys import RelayKey
from trueseal_client import (ACK, ERROR, HEARTBEAT, NK, XX, Client, deliver_ack_frame, frame,
                             keypair, push_frame, u16)

KEY = RelayKey(bytes(range(1, 33)))
R1, R2 = bytes([1]) * 32, bytes([2]) * 32


def open_push(max_envelope=65482):
    core = PushSession(KEY.private_bytes, max_envelope=max_envelope)
    client = Client(NK, KEY.public)
    core.receive_data(client.hello())
    client.answer(core.data_to_send())
    assert core.state is State.OPEN
    assert core.events_received() == [HandshakeComplete(None)]
    return core, client


def open_receive(static_priv=None):
    core = ReceiveSession(KEY.private_bytes)
    client = Client(XX, KEY.public, static_priv)
    core.receive_data(client.hello())
    core.receive_data(client.answer(core.data_to_send()))
    assert core.state is State.OPEN
    assert core.events_received() == [HandshakeComplete(client.static_pub)]
    return core, client


def events(core, kind=None):
    evs = core.events_received()
    return [e for e in evs if kind is None or isinstance(e, kind)]


# --- handshakes ---------------------------------------------------------------------------------
def test_nk_handshake_sizes_48_48():
    core, client = open_push()
    assert client.sizes == [48, 48]   # interop §3
    assert core.remote_static is None


def test_xx_handshake_sizes_32_96_64_and_remote_static():
    core = ReceiveSession(KEY.private_bytes)
    client = Client(XX, KEY.public)
    hello = client.hello()
    assert hello[:2] == b"\x00\x20"
    core.receive_data(hello)
    reply = core.data_to_send()
    assert reply[:2] == (96).to_bytes(2, "big")
    core.receive_data(client.answer(reply))
    assert client.sizes == [32, 96, 64]
    assert core.events_received() == [HandshakeComplete(client.static_pub)]
    assert core.remote_static == client.static_pub


def test_handshake_fed_one_byte_at_a_time():
    core = PushSession(KEY.private_bytes)
    client = Client(NK, KEY.public)
    for b in client.hello():
        core.receive_data(bytes([b]))
    client.answer(core.data_to_send())
    for b in client.send(push_frame(R1, b"x")):
        core.receive_data(bytes([b]))
    assert [type(e) for e in core.events_received()] == [HandshakeComplete, PushReceived]


@pytest.mark.parametrize("garbage", [b"", b"abc", os.urandom(48), os.urandom(200)])
def test_garbage_handshake_closes_with_nothing_sent(garbage):
    core = PushSession(KEY.private_bytes)
    core.receive_data(u16(garbage))
    assert core.closed and core.close_reason is CloseReason.HANDSHAKE_FAILED
    assert core.data_to_send() == b""
    assert core.events_received() == [ConnectionClosed(CloseReason.HANDSHAKE_FAILED)]


def test_wrong_relay_key_fails_msg1_and_nothing_is_accepted():
    core = PushSession(KEY.private_bytes)
    client = Client(NK, keypair()[1])   # pins some other relay
    core.receive_data(client.hello() + b"\x00\x05hello")
    assert core.close_reason is CloseReason.HANDSHAKE_FAILED
    assert core.data_to_send() == b""
    assert not events(core, PushReceived)


def test_xx_bad_msg3_closes():
    core = ReceiveSession(KEY.private_bytes)
    client = Client(XX, KEY.public)
    core.receive_data(client.hello())
    msg3 = bytearray(client.answer(core.data_to_send()))
    msg3[10] ^= 1
    core.receive_data(bytes(msg3))
    assert core.close_reason is CloseReason.HANDSHAKE_FAILED
    assert not events(core, HandshakeComplete)


def test_truncated_handshake_at_eof():
    core = PushSession(KEY.private_bytes)
    core.receive_data(Client(NK, KEY.public).hello()[:30])
    core.receive_eof()
    assert core.close_reason is CloseReason.TRUNCATED
    assert core.data_to_send() == b""


def test_eof_at_a_message_boundary_is_a_clean_close():
    core, _ = open_push()
    core.receive_eof()
    assert core.events_received() == [ConnectionClosed(CloseReason.EOF)]


# --- push: Ack/Error in order ---------------------------------------------------------------------
def test_push_ack_only_after_accept():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"hello")))
    [ev] = core.events_received()
    assert ev == PushReceived(0, R1, b"hello")
    assert core.data_to_send() == b""     # Ack means persisted: nothing before accept
    core.accept(0)
    assert client.receive(core.data_to_send()) == [ACK]


def test_acks_follow_push_order_when_stores_finish_out_of_order():
    core, client = open_push()
    data = b"".join(client.send(push_frame(r, e)) for r, e in
                    [(R1, b"a"), (R2, b"b"), (R1, b"c")])
    core.receive_data(data)
    ids = [e.push_id for e in events(core, PushReceived)]
    assert ids == [0, 1, 2]
    core.accept(2)
    assert core.data_to_send() == b""
    core.accept(0)
    assert client.receive(core.data_to_send()) == [ACK]
    core.reject(1)   # e.g. the store failed
    assert client.receive(core.data_to_send()) == [ERROR, ACK]
    assert core.outstanding == 0
    with pytest.raises(ValueError):
        core.accept(1)


def test_short_push_body_is_answered_error_in_its_turn():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"first")))
    core.receive_data(client.send(frame(0x01, R2[:31])))
    evs = core.events_received()
    assert evs[1] == PushRejected(1, "short_body", 31)
    assert core.data_to_send() == b""     # waits behind push 0
    core.accept(0)
    assert client.receive(core.data_to_send()) == [ACK, ERROR]
    assert core.state is State.OPEN       # 000: the session continues


def test_empty_push_body_is_error():
    core, client = open_push()
    core.receive_data(client.send(frame(0x01)))
    assert events(core) == [PushRejected(0, "short_body", 0)]
    assert client.receive(core.data_to_send()) == [ERROR]


def test_largest_envelope_65482_is_accepted():
    core, client = open_push(max_envelope=65482)
    msg = client.send(push_frame(R1, b"e" * 65482))
    assert msg[:2] == b"\xff\xff"         # exactly one maximal Noise message (interop §4)
    core.receive_data(msg)
    [ev] = core.events_received()
    assert isinstance(ev, PushReceived) and len(ev.envelope) == 65482


def test_envelope_over_the_limit_is_error():
    core, client = open_push(max_envelope=65481)
    core.receive_data(client.send(push_frame(R1, b"e" * 65482)))
    assert core.events_received() == [PushRejected(0, "oversize", 65482)]
    assert client.receive(core.data_to_send()) == [ERROR]
    core2, client2 = open_push(max_envelope=1000)
    core2.receive_data(client2.send(push_frame(R1, b"e" * 1000)))
    core2.receive_data(client2.send(push_frame(R1, b"e" * 1001)))
    evs = core2.events_received()
    assert isinstance(evs[0], PushReceived) and evs[1] == PushRejected(1, "oversize", 1001)
    core2.accept(0)
    assert client2.receive(core2.data_to_send()) == [ACK, ERROR]


def test_envelope_65483_cannot_even_reach_the_relay():
    # 5 + 32 + 65,483 + 16 = 65,536 bytes of Noise message: more than a u16 can announce, so
    # the client cannot send it (interop §5); the relay limit is a backstop for smaller ones.
    _, client = open_push()
    ct = client.conn.encrypt(push_frame(R1, b"e" * 65483))
    assert len(ct) == 65536


def test_heartbeat_on_push_session_is_echoed_in_reply_order():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"a")) + client.send(HEARTBEAT))
    evs = core.events_received()
    assert evs[1] == HeartbeatReceived(echo=False)
    assert core.data_to_send() == b""
    core.accept(0)
    assert client.receive(core.data_to_send()) == [ACK, HEARTBEAT]


def test_eof_with_replies_owed_drains_then_closes():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"a")) + client.send(push_frame(R2, b"b")))
    core.events_received()
    core.receive_eof()
    assert core.state is State.DRAINING
    core.receive_data(client.send(push_frame(R1, b"late")))   # nothing is read any more
    assert core.events_received() == []
    core.accept(1)
    core.accept(0)
    assert client.receive(core.data_to_send()) == [ACK, ACK]
    assert core.events_received() == [ConnectionClosed(CloseReason.EOF)]


@pytest.mark.parametrize("plaintext,reason", [
    (frame(0x07), CloseReason.MALFORMED_FRAME),               # unknown tag
    (frame(0x00), CloseReason.MALFORMED_FRAME),
    (bytes([0x01, 0, 0, 0, 100]) + R1, CloseReason.MALFORMED_FRAME),   # body shorter than len
    (b"\x01\x00", CloseReason.MALFORMED_FRAME),                # < 5 bytes
    (b"", CloseReason.MALFORMED_FRAME),
    (frame(0x03, b"x"), CloseReason.MALFORMED_FRAME),          # Heartbeat with a body
    (frame(0x02, bytes(8) + b"env"), CloseReason.UNEXPECTED_FRAME),   # Deliver
    (deliver_ack_frame(5), CloseReason.UNEXPECTED_FRAME),      # DeliverAck on a push session
    (ACK, CloseReason.UNEXPECTED_FRAME),
    (ERROR, CloseReason.UNEXPECTED_FRAME),
])
def test_bad_frames_close_the_push_session(plaintext, reason):
    core, client = open_push()
    core.receive_data(client.send(plaintext) + client.send(push_frame(R1, b"after")))
    assert core.events_received() == [ConnectionClosed(reason)]
    assert core.data_to_send() == b""
    core.receive_data(client.send(push_frame(R1, b"more")))    # ignored once closed
    assert core.events_received() == []


def test_decrypt_failure_closes_and_nothing_is_accepted():
    core, client = open_push()
    msg = bytearray(client.send(push_frame(R1, b"x")))
    msg[-1] ^= 0x80
    core.receive_data(bytes(msg))
    assert core.events_received() == [ConnectionClosed(CloseReason.DECRYPT_FAILED)]


def test_out_of_order_transport_message_fails_to_decrypt():
    core, client = open_push()
    first = client.send(push_frame(R1, b"1"))
    second = client.send(push_frame(R1, b"2"))
    core.receive_data(second + first)
    assert core.events_received() == [ConnectionClosed(CloseReason.DECRYPT_FAILED)]


def test_empty_noise_message_after_handshake_closes():
    core, _ = open_push()
    core.receive_data(b"\x00\x00")
    assert core.close_reason is CloseReason.DECRYPT_FAILED


def test_replies_queued_before_a_protocol_error_are_still_sent():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"a")))
    core.accept(0)
    core.receive_data(client.send(frame(0x09)))
    assert core.closed
    assert client.receive(core.data_to_send()) == [ACK]


def test_accept_after_close_is_a_no_op():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"a")))
    core.close()
    core.accept(0)
    assert core.data_to_send() == b""
    assert events(core, ConnectionClosed) == [ConnectionClosed(CloseReason.LOCAL)]


# --- receive -----------------------------------------------------------------------------------
def test_deliver_bytes_on_the_wire():
    core, client = open_receive()
    assert core.deliver(7, b"envelope")
    [pt] = client.receive(core.data_to_send())
    assert pt == bytes([0x02, 0, 0, 0, 16]) + (7).to_bytes(8, "big") + b"envelope"


def test_largest_deliver_fits_one_message():
    core, client = open_receive()
    core.deliver(2**64 - 1, b"e" * 65482)
    out = core.data_to_send()
    assert len(out) == 2 + 5 + 8 + 65482 + 16
    [pt] = client.receive(out)
    assert pt[5:13] == b"\xff" * 8


def test_deliver_ack_is_reported():
    core, client = open_receive()
    core.deliver(1, b"a")
    core.deliver(2, b"b")
    client.receive(core.data_to_send())
    core.receive_data(client.send(deliver_ack_frame(2)) + client.send(deliver_ack_frame(1)))
    assert core.events_received() == [DeliverAckReceived(2), DeliverAckReceived(1)]


def test_deliver_ack_right_behind_msg3_in_one_read():
    core = ReceiveSession(KEY.private_bytes)
    client = Client(XX, KEY.public)
    core.receive_data(client.hello())
    msg3 = client.answer(core.data_to_send())
    core.receive_data(msg3 + client.send(deliver_ack_frame(42)))
    assert core.events_received() == [HandshakeComplete(client.static_pub), DeliverAckReceived(42)]


@pytest.mark.parametrize("body_len", [7, 9])
def test_bad_deliver_ack_closes(body_len):
    core, client = open_receive()
    core.receive_data(client.send(frame(0x06, bytes(body_len))))
    assert core.close_reason is CloseReason.MALFORMED_FRAME


@pytest.mark.parametrize("plaintext", [push_frame(R1, b"x"), ACK, ERROR,
                                       frame(0x02, bytes(8))])
def test_frames_not_for_a_receive_session_close_it(plaintext):
    core, client = open_receive()
    core.receive_data(client.send(plaintext))
    assert core.close_reason is CloseReason.UNEXPECTED_FRAME


def test_client_heartbeat_is_echoed():
    core, client = open_receive()
    core.receive_data(client.send(HEARTBEAT))
    assert core.events_received() == [HeartbeatReceived(echo=False)]
    assert client.receive(core.data_to_send()) == [HEARTBEAT]


def test_our_heartbeat_answered_is_not_echoed_back():
    core, client = open_receive()
    assert core.send_heartbeat()
    assert client.receive(core.data_to_send()) == [HEARTBEAT]
    core.receive_data(client.send(HEARTBEAT))   # the client's echo
    assert core.events_received() == [HeartbeatReceived(echo=True)]
    assert core.data_to_send() == b""
    assert core.heartbeats_unanswered == 0


def test_heartbeat_and_deliver_share_one_nonce_sequence():
    core, client = open_receive()
    core.deliver(1, b"a")
    core.send_heartbeat()
    core.deliver(2, b"b")
    pts = client.receive(core.data_to_send())
    assert [p[0] for p in pts] == [2, 3, 2]


def test_deliver_refusals():
    core = ReceiveSession(KEY.private_bytes)
    with pytest.raises(RuntimeError):
        core.deliver(1, b"x")             # before the handshake
    core, _ = open_receive()
    with pytest.raises(ValueError):
        core.deliver(1, b"e" * (65519 - 13 + 1))   # one byte over a maximal Deliver
    with pytest.raises(ValueError):
        core.deliver(-1, b"")
    core.close()
    assert core.deliver(1, b"x") is False
    assert core.send_heartbeat() is False


# --- reprs: no keys, no envelopes ------------------------------------------------------------------
def test_reprs_are_redacted():
    core, client = open_push()
    core.receive_data(client.send(push_frame(R1, b"TOPSECRET")))
    [ev] = core.events_received()
    for text in (repr(ev), repr(core), repr(KEY), str(KEY), repr(core._noise)):
        assert "TOPSECRET" not in text and b"TOPSECRET".hex() not in text
        assert KEY.private_bytes.hex() not in text
        assert R1.hex() not in text
    assert repr(KEY) == f"RelayKey(public={KEY.public.hex()})"
    rcore = ReceiveSession(KEY.private_bytes)
    rclient = Client(XX, KEY.public)
    rcore.receive_data(rclient.hello())
    rcore.receive_data(rclient.answer(rcore.data_to_send()))
    for text in (repr(rcore), repr(rcore.events_received())):
        assert rclient.static_pub.hex() not in text


def test_noise_responder_rejects_bad_construction():
    with pytest.raises(ValueError):
        NoiseResponder("IK", KEY.private_bytes)
    with pytest.raises(ValueError):
        NoiseResponder("NK", b"short")


# --- relay key file ---------------------------------------------------------------------------------
def test_key_created_once_with_mode_0600(tmp_path):
    k1 = keys.load_or_create(tmp_path)
    path = tmp_path / "keys" / "trueseal_static.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert bytes.fromhex(text.strip()) == k1.private_bytes
    k2 = keys.load_or_create(tmp_path)
    assert k2.private_bytes == k1.private_bytes and k2.public == k1.public
    assert [p.name for p in path.parent.iterdir()] == ["trueseal_static.key"]   # no temp left


def test_public_key_is_x25519_of_the_private_key():
    # interop §1: public = X25519(priv, basepoint); the Noise library must agree.
    priv = x25519.X25519PrivateKey.from_private_bytes(KEY.private_bytes)
    raw = priv.public_key().public_bytes(serialization.Encoding.Raw,
                                         serialization.PublicFormat.Raw)
    assert raw == KEY.public


def test_key_file_written_by_the_public_relay_loads(tmp_path):
    (tmp_path / "keys").mkdir()
    path = tmp_path / "keys" / "trueseal_static.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"  " + KEY.private_bytes.hex().upper().encode() + b"\n\n")
    os.close(fd)
    assert keys.load_or_create(tmp_path).public == KEY.public


def test_readable_key_file_is_fixed_to_0600_with_a_warning(tmp_path, caplog):
    keys.load_or_create(tmp_path)
    path = keys.key_path(tmp_path)
    os.chmod(path, 0o644)
    with caplog.at_level(logging.WARNING, logger="relay.keys"):
        keys.load_or_create(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert any(getattr(r, "event", None) == "key_mode_fixed" for r in caplog.records)
    assert all(KEY.private_bytes.hex() not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content", [b"not hex", b"abcd", b""])
def test_bad_key_file_refuses_to_start(tmp_path, content):
    (tmp_path / "keys").mkdir()
    path = keys.key_path(tmp_path)
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(ValueError):
        keys.load_or_create(tmp_path)


def test_static_key_prepared_once_works_and_is_redacted():
    sk = StaticKey(KEY.private_bytes)
    assert sk.public == KEY.public
    assert KEY.private_bytes.hex() not in repr(sk) and KEY.public.hex() not in repr(sk)
    for _ in range(2):   # one StaticKey serves many sessions
        core = PushSession(sk)
        client = Client(NK, KEY.public)
        core.receive_data(client.hello())
        client.answer(core.data_to_send())
        core.receive_data(client.send(push_frame(R1, b"x")))
        assert [type(e) for e in core.events_received()] == [HandshakeComplete, PushReceived]
