"""Fuzz trueseal: frames (`engine.trueseal.frames`) and the push / receive session cores
(`engine.trueseal.push`, `engine.trueseal.receive`) fed plaintext frames through a real Noise
initiator (tests/trueseal_client.py, which shares no code with the relay), plus raw bytes in
place of a handshake.

Contract (000 "Wire Format", interop §4): `parse` returns a frame or raises `MalformedFrame`
(`UnknownTag` included), nothing else; a frame it returns serialises back to the bytes it read
(trailing bytes ignored), and a frame built from the spec layout parses to itself. The session
cores never raise on what a peer sends: malformed, unknown or misplaced frames, garbage
handshakes and undecryptable messages close the session with a reason (one ConnectionClosed,
the last event); a push session answers every Push exactly once, in Push order, whatever
order the shell finishes the stores in.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from nacl.bindings import crypto_scalarmult_base

from engine.trueseal import frames as F
from engine.trueseal.events import (CloseReason, ConnectionClosed, DeliverAckReceived,
                                    HandshakeComplete, HeartbeatReceived, PushReceived,
                                    PushRejected)
from engine.trueseal.push import PushSession
from engine.trueseal.receive import ReceiveSession
from engine.trueseal.session import State
from fuzzing import fuzz_target
from mutations import mutated
from trueseal_client import NK, XX, Client

pytestmark = pytest.mark.fuzz

RELAY_PRIV = bytes(range(32))
RELAY_PUB = crypto_scalarmult_base(RELAY_PRIV)
MAX_ENVELOPE = 300   # small, so oversize pushes are cheap to draw

recipient = st.binary(min_size=32, max_size=32)
envelope = st.binary(max_size=MAX_ENVELOPE + 20)
u64 = st.integers(0, 2**64 - 1)


def spec_frame(tag: int, body: bytes = b"") -> bytes:
    """000 "Wire Format": [type u8][len u32 BE][body], written out here."""
    return bytes([tag]) + len(body).to_bytes(4, "big") + body


valid_frames = st.one_of(
    st.builds(lambda r, e: (spec_frame(1, r + e), F.Push(r, e)), recipient, envelope),
    st.binary(max_size=31).map(lambda b: (spec_frame(1, b), F.ShortPush(len(b)))),
    st.builds(lambda i, e: (spec_frame(2, i.to_bytes(8, "big") + e), F.Deliver(i, e)),
              u64, envelope),
    st.just((spec_frame(3), F.Heartbeat())),
    st.just((spec_frame(4), F.Ack())),
    st.just((spec_frame(5), F.Error())),
    st.builds(lambda i: (spec_frame(6, i.to_bytes(8, "big")), F.DeliverAck(i)), u64),
)

any_frame_bytes = st.one_of(
    valid_frames.map(lambda f: f[0]),
    valid_frames.flatmap(lambda f: st.binary(max_size=8).map(lambda t: f[0] + t)),
    mutated(valid_frames.map(lambda f: f[0])),
    st.binary(max_size=80),
)


@fuzz_target(case=st.one_of(
    valid_frames,
    valid_frames.flatmap(lambda f: st.binary(min_size=1, max_size=8).map(
        lambda t: (f[0] + t, f[1]))),                    # interop §4: trailing bytes ignored
    any_frame_bytes.map(lambda b: (b, None)),
))
def test_trueseal_frames(case):
    data, expected = case
    try:
        frame = F.parse(data)
    except F.MalformedFrame as e:
        assert expected is None, e
        return
    assert isinstance(frame, F.Frame.__args__), type(frame)
    length = int.from_bytes(data[1:5], "big")
    if isinstance(frame, F.ShortPush):
        assert data[0] == 1 and frame.body_len == length < F.RECIPIENT_LEN
    else:
        assert F.serialize(frame) == data[:5 + length]
        assert F.parse(F.serialize(frame)) == frame
    if expected is not None:
        assert frame == expected


# --- session cores -----------------------------------------------------------------------------

def cut(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted(p % (len(data) + 1) for p in points)
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


class Peer:
    """The client side of one session, fed the relay's bytes; decrypts what it is sent."""

    def __init__(self, pattern: bytes):
        self.client = Client(pattern, RELAY_PUB)
        self.frames: list[bytes] = []
        self.handshaken = False
        self.pattern = pattern

    def hello(self) -> bytes:
        return self.client.hello()

    def take(self, data: bytes) -> bytes:
        """Bytes from the relay; returns what the client sends in answer (XX msg 3)."""
        if not self.handshaken:
            # the relay's only handshake message (NK msg 2, XX msg 2) comes alone
            out = self.client.answer(data)
            self.handshaken = True
            return out
        self.frames.extend(self.client.receive(data))
        return b""


def _frame_one(m: bytes) -> bytes:
    return len(m).to_bytes(2, "big") + m


@st.composite
def session_script(draw, favoured: st.SearchStrategy[bytes]):
    """`favoured`: the frames this session type accepts, drawn three times as often as any
    other frame bytes, so most sessions get past their first frame."""
    raw = draw(st.booleans()) and draw(st.integers(0, 9)) == 0   # 1 in 20: raw garbage only
    frame = st.one_of(favoured, favoured, favoured, any_frame_bytes)
    return {
        "raw": draw(st.binary(max_size=200)) if raw else None,
        "frames": draw(st.lists(frame, max_size=8)),
        # a Noise message that is not the encryption of a frame (decrypt must fail closed)
        "garbage_at": draw(st.none() | st.integers(0, 8)),
        "garbage": draw(st.binary(max_size=40)),
        "cuts": draw(st.lists(st.integers(0, 10_000), max_size=6)),
        "answers": draw(st.lists(st.tuples(st.integers(0, 50),
                                           st.sampled_from(("accept", "reject", "fail"))),
                                 max_size=20)),
        "eof": draw(st.booleans()),
    }


def _events_ok(events: list) -> None:
    closed = [i for i, e in enumerate(events) if isinstance(e, ConnectionClosed)]
    assert len(closed) <= 1 and (not closed or closed[0] == len(events) - 1), events
    for e in events:
        assert isinstance(e, (HandshakeComplete, PushReceived, PushRejected, DeliverAckReceived,
                              HeartbeatReceived, ConnectionClosed)), e


def _run(session, pattern: bytes, script, on_event):
    peer = Peer(pattern)
    events: list = []

    def pump():
        evs = session.events_received()
        events.extend(evs)
        for ev in evs:
            on_event(ev)
        out = session.data_to_send()
        reply = peer.take(out) if (out and script["raw"] is None) else b""
        if reply and not session.closed:
            session.receive_data(reply)
            pump()

    if script["raw"] is not None:
        for piece in cut(script["raw"], script["cuts"]):
            session.receive_data(piece)
            pump()
    else:
        session.receive_data(peer.hello())
        pump()
        stream = b""
        for i, plain in enumerate(script["frames"]):
            if script["garbage_at"] == i:
                stream += _frame_one(script["garbage"])
            stream += peer.client.send(plain) if peer.handshaken else b""
        for piece in cut(stream, script["cuts"]):
            session.receive_data(piece)
            pump()
    return peer, events, pump


PUSH_FRAMES = st.one_of(
    st.builds(lambda r, e: spec_frame(1, r + e), recipient, envelope),
    st.binary(max_size=31).map(lambda b: spec_frame(1, b)),
    st.just(spec_frame(3)))
RECEIVE_FRAMES = st.one_of(u64.map(lambda i: spec_frame(6, i.to_bytes(8, "big"))),
                           st.just(spec_frame(3)))


@fuzz_target(script=session_script(PUSH_FRAMES))
def test_trueseal_push_session(script):
    session = PushSession(RELAY_PRIV, max_envelope=MAX_ENVELOPE)
    pending: list[int] = []
    expected: dict[int, bytes] = {}   # push id -> the reply it must get
    order: list[int] = []             # push ids (and None for heartbeats) in arrival order
    answers = iter(script["answers"])

    def on_event(ev):
        if isinstance(ev, PushReceived):
            assert len(ev.recipient) == 32 and len(ev.envelope) <= MAX_ENVELOPE
            pending.append(ev.push_id)
            order.append(ev.push_id)
        elif isinstance(ev, PushRejected):
            assert ev.reason in ("short_body", "oversize")
            expected[ev.push_id] = F.serialize(F.Error())
            order.append(ev.push_id)
        elif isinstance(ev, HeartbeatReceived):
            order.append(None)

    peer, events, pump = _run(session, NK, script, on_event)
    failed_at = None
    for pick, what in answers:
        if not pending:
            break
        pid = pending.pop(pick % len(pending))
        getattr(session, what)(pid)
        if what == "fail" and failed_at is None:
            failed_at = pid
        expected[pid] = {"accept": F.serialize(F.Ack()), "reject": F.serialize(F.Error()),
                         "fail": None}[what]
        pump()
    if script["eof"]:
        session.receive_eof()
        pump()
    for pid in pending:
        session.accept(pid)
        expected[pid] = F.serialize(F.Ack())
        pump()
    _events_ok(events)

    # one reply per Push (and per Heartbeat), in arrival order, up to a failed store or close
    want = []
    for pid in order:
        reply = F.serialize(F.Heartbeat()) if pid is None else expected[pid]
        if reply is None:
            break
        want.append(reply)
    got = peer.frames
    assert got == want[:len(got)], (got, want)
    if not session.closed:
        assert got == want
    if session.closed and session.close_reason is CloseReason.STORE_FAILED:
        assert got == want


@fuzz_target(script=session_script(RECEIVE_FRAMES), blobs=st.lists(st.tuples(u64, st.binary(max_size=64)),
                                                     max_size=4))
def test_trueseal_receive_session(script, blobs):
    session = ReceiveSession(RELAY_PRIV)
    acks: list[int] = []

    def on_event(ev):
        if isinstance(ev, HandshakeComplete):
            assert ev.remote_static is not None and len(ev.remote_static) == 32
        if isinstance(ev, DeliverAckReceived):
            acks.append(ev.blob_id)

    peer, events, pump = _run(session, XX, script, on_event)
    delivered = []
    for blob_id, env in blobs:
        if session.state is not State.OPEN:
            break   # the shell delivers only on an open session
        if session.deliver(blob_id, env):
            delivered.append(F.serialize(F.Deliver(blob_id, env)))
        pump()
    session.send_heartbeat()
    pump()
    if script["eof"]:
        session.receive_eof()
        pump()
    _events_ok(events)
    if peer.handshaken:
        assert session.remote_static == peer.client.static_pub
    sent_acks = [F.parse(f).blob_id for f in script["frames"]
                 if _parses_as(f, F.DeliverAck)]
    assert acks == sent_acks[:len(acks)]
    assert [f for f in peer.frames if f[0] == 2] == delivered[:len(
        [f for f in peer.frames if f[0] == 2])]


def _parses_as(data: bytes, cls) -> bool:
    try:
        return isinstance(F.parse(data), cls)
    except F.MalformedFrame:
        return False
