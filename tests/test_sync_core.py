"""cursor-sync sans-I/O core: the codec against the golden vectors of cursor-sync-interop.md
(matched there byte for byte against rmp_serde), what decode refuses (what Rust refuses),
framing, the hardening helpers, token buckets, the state table, the identity checks."""

from __future__ import annotations

import random

import pytest
from nacl.signing import SigningKey

from egress.sync_inbox import SyncInbox
from engine.sync import identity, limits
from engine.sync import messages as m
from engine.sync.framing import FrameError, FrameReader, frame
from engine.sync.session import Code, Refused, Session, State
from engine.sync.token_bucket import KeyedBuckets, TokenBucket

B16 = bytes(range(16))
HELLO_GROUP = bytes.fromhex("882b82ff8d66cd953609be43f78d765684bf5db7b05f44f96631d632005786e8")

# (message, hex of rmp_serde::to_vec) from the interop notes' golden vectors
GOLDEN = [
    (m.Pull(100, 50), "93 a4 50756c6c 64 32"),
    (m.Welcome(1, 0, 0), "94 a7 57656c636f6d65 01 00 00"),
    (m.Welcome(1, 300, 70000), "94 a7 57656c636f6d65 01 cd012c ce00011170"),
    (m.Hello(1, "My Phone", HELLO_GROUP, 0),
     "95 a5 48656c6c6f 01 a8 4d792050686f6e65 dc 00 20 cc88 2b cc82 ccff cc8d 66 cccd cc95 36 "
     "09 ccbe 43 ccf7 cc8d 76 56 cc84 ccbf 5d ccb7 ccb0 5f 44 ccf9 66 31 ccd6 32 00 57 cc86 "
     "cce8 00"),
    (m.Push(B16, bytes([1, 2, 0x80, 0xFF]), 0),
     "94 a4 50757368 c410 000102030405060708090a0b0c0d0e0f 94 01 02 cc80 ccff 00"),
    (m.PushAck(B16, 1), "93 a7 5075736841636b c410 000102030405060708090a0b0c0d0e0f 01"),
    (m.PullResponse([m.PullBlob(B16, 1, bytes([1, 2, 3]), 1705000000)], False, 1),
     "94 ac 50756c6c526573706f6e7365 91 94 c410 000102030405060708090a0b0c0d0e0f 01 "
     "93 010203 ce65a03c40 c2 01"),
    (m.Notify(42, 1), "93 a6 4e6f74696679 2a 01"),
    (m.Bye(None), "92 a3 427965 c0"),
    (m.Bye("client shutdown"), "92 a3 427965 af 636c69656e742073687574646f776e"),
]


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


@pytest.mark.parametrize("msg,hexes", GOLDEN, ids=[g[0].TAG for g in GOLDEN])
def test_golden_vectors_encode_and_decode(msg, hexes):
    assert m.encode(msg) == h(hexes)
    assert m.decode(h(hexes)) == msg


def test_golden_frames():
    assert frame(m.encode(m.Pull(100, 50))).hex() == "00000008" + "93a450756c6c6432"
    assert frame(m.encode(m.Welcome(1, 0, 0)))[:4].hex() == "0000000c"


def test_group_id_of_the_vector():
    import hashlib
    assert hashlib.sha256(b"0k-sync-group-id-v1" + b"test").digest() == HELLO_GROUP


def test_decode_accepts_what_rust_accepts():
    # map form, unknown keys ignored
    assert m.decode(h("83 a4 74797065 a4 50756c6c ac 61667465725f637572736f72 05 a5 6c696d6974 "
                      "07")) == m.Pull(5, 7)
    assert m.decode(h("84 a4 74797065 a4 50756c6c ac 61667465725f637572736f72 05 a5 6c696d6974 "
                      "07 a1 78 01")) == m.Pull(5, 7)
    # integer variant index as the tag (Pull is variant 4)
    assert m.decode(h("93 04 64 32")) == m.Pull(100, 50)
    # a blob id as a hyphenated UUID string
    uid = "00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert m.decode(h("93 a7 5075736841636b d9") + bytes([len(uid)]) + uid.encode()
                    + b"\x01") == m.PushAck(B16, 1)
    # non-minimal int encodings are ints all the same
    assert m.decode(h("93 a4 50756c6c cd0064 ce00000032")) == m.Pull(100, 50)


@pytest.mark.parametrize("hexes,why", [
    ("94 a4 50756c6c 64 32 00", "extra element"),
    ("92 a4 50756c6c 64", "missing element"),
    ("93 a4 50756c6d 64 32", "unknown tag"),
    ("93 0c 64 32", "unknown variant index"),
    ("93 a4 50756c6c a1 61 32", "string for u64"),
    ("93 a4 50756c6c 64 cf0000000100000000", "u32 overflow"),
    ("93 a4 50756c6c ff 32", "negative"),
    ("93 a4 50756c6c ca3f800000 32", "float"),
    ("94 a7 57656c636f6d65 cd0100 00 00", "u8 over 255"),
    ("94 a4 50757368 c410 000102030405060708090a0b0c0d0e0f c402 0102 00", "bin for Vec<u8>"),
    ("94 a4 50757368 dc0010 000102030405060708090a0b0c0d0e0f 90 00", "blob id as ints"),
    ("94 a4 50757368 c40f 000102030405060708090a0b0c0d0e 90 00", "blob id 15 bytes"),
    ("94 a4 50757368 c410 000102030405060708090a0b0c0d0e0f 91 cd0100 00", "byte over 255"),
    ("94 a4 50757368 c410 000102030405060708090a0b0c0d0e0f 91 c3 00", "bool in bytes"),
    ("95 a5 48656c6c6f 01 a1 41 9f" + "00" * 15 + " 00", "group id 15 bytes"),
    ("95 a5 48656c6c6f 01 a1 41 c420" + "00" * 32 + " 00", "group id as bin"),
    ("94 ac 50756c6c526573706f6e7365 90 01 01", "int for bool"),
    ("92 a3 427965 01", "int for Option<String>"),
    ("92 a3 427965 a2 c328", "invalid UTF-8"),
    ("93 a8 50756c6c426c6f62 01 02", "inner struct as a message"),
    ("a4 50756c6c", "not an array"),
    ("90", "empty array"),
    ("93 a4 50756c6c 64", "truncated"),
    ("93 a4 50756c6c 64 32 00", "trailing bytes"),
])
def test_decode_refuses(hexes, why):
    with pytest.raises(m.DecodeError):
        m.decode(h(hexes))


def test_extension_round_trip_and_redaction():
    ref = m.ContentRef(b"\x11" * 32, b"\x22" * 24, 10, 26)
    assert m.decode(m.encode(ref)) == ref
    assert "11" not in repr(ref) and "redacted" in repr(ref)
    for msg in (m.Auth(1), m.AuthChallenge(b"\x01" * 32), m.AuthProof(b"\x02" * 32, b"\x03" * 64),
                m.Join(b"\x04" * 32, b"\x05" * 32, 99, b"\x06" * 64), m.Done("Join"),
                m.Error(1000, "x"), m.Presence(True),
                m.PresenceList([m.PresenceEntry(b"\x07" * 32, "n", True, 5)]), m.Ack(3),
                m.Delete(B16), m.RevokeDevice(b"\x08" * 32), m.DeviceRevoked(b"\x08" * 32),
                m.RegisterPush("apns", "tok"), m.UnregisterPush("apns", "tok"),
                m.ContentAck(b"\x09" * 32)):
        assert m.decode(m.encode(msg)) == msg
    assert "s3cret" not in repr(m.RegisterPush("apns", "s3cret"))
    assert "\\x03" not in repr(m.AuthProof(b"\x02" * 32, b"\x03" * 64))
    # the new tags are new: none collides with 0k-sync's ten
    assert not {x.TAG for x in m.EXTENSIONS} & {x.TAG for x in m.ZEROK}


def test_framing_checks_the_prefix_before_the_body():
    r = FrameReader(16)
    assert r.feed(b"\x00\x00\x00\x10" + b"x" * 16) == [b"x" * 16]      # len == MAX: allowed
    r = FrameReader(16)
    with pytest.raises(FrameError):
        r.feed(b"\x00\x00\x00\x11")                                      # refused on 4 bytes
    r = FrameReader()
    assert r.feed(b"\x00\x00") == [] and r.feed(b"\x00\x02ab\x00") == [b"ab"]
    with pytest.raises(FrameError):
        r.end()                                                          # FIN inside a frame
    with pytest.raises(FrameError):
        frame(b"x" * 17, 16)
    assert len(frame(b"x" * limits.MAX_MESSAGE_SIZE)) == limits.MAX_MESSAGE_SIZE + 4


def test_device_name_truncation_on_utf8_boundaries():
    assert limits.truncate_utf8("a" * 256) == "a" * 256
    assert limits.truncate_utf8("a" * 257) == "a" * 256
    # 255 ASCII + a 2-byte char = 257 bytes: the char goes whole
    assert limits.truncate_utf8("a" * 255 + "é") == "a" * 255
    assert limits.truncate_utf8("€" * 86) == "€" * 85          # 258 bytes -> 255
    assert limits.truncate_utf8("ok") == "ok"


def test_pull_clamp_and_ttl():
    # 0k-sync session.rs tests: 0->100, 50->50, 1000->1000, 999999->1000, u32::MAX->1000
    assert [limits.clamp_pull_limit(x) for x in (0, 50, 1000, 1001, 999999, m.U32)] == \
        [100, 50, 1000, 1000, 1000, 1000]
    assert limits.effective_ttl(0) == 604800
    assert limits.effective_ttl(60) == 60
    assert limits.effective_ttl(limits.MAX_TTL_SECONDS) == limits.MAX_TTL_SECONDS
    assert limits.effective_ttl(limits.MAX_TTL_SECONDS + 1) == limits.MAX_TTL_SECONDS


def test_token_bucket_burst_then_refill():
    b = TokenBucket(5, 60.0, now=0.0)
    assert [b.take(0.0) for _ in range(6)] == [True] * 5 + [False]   # 0k-sync limits.rs
    assert not b.take(11.9)                 # one cell per 12 s
    assert b.take(12.0) and not b.take(12.0)
    kb = KeyedBuckets(2, 1.0, max_keys=2)
    assert kb.take(b"a", 0) and kb.take(b"a", 0) and not kb.take(b"a", 0)
    assert kb.take(b"b", 0)                 # keys are independent
    kb.take(b"c", 10)                       # over max_keys: refilled keys are dropped
    assert len(kb) <= 2 and "a" not in repr(kb)


def test_keyed_buckets_decide_as_a_token_bucket_and_forget_refilled_keys():
    """One float a key (the generic cell rate algorithm) gives the same decisions as
    `TokenBucket` at random arrival rates below, at and above the quota; `sweep` forgets
    exactly the keys whose bucket is full again (issue 19: what a flood of new device ids
    leaves behind)."""
    rng = random.Random(19)
    for _ in range(100):
        count, period = rng.randint(1, 12), rng.choice([1.0, 5.0, 60.0])
        keyed, single, t = KeyedBuckets(count, period), TokenBucket(count, period, 0.0), 0.0
        for _ in range(200):
            t += rng.expovariate(count / period * rng.choice([0.5, 1.0, 3.0]))
            assert keyed.take(b"k", t) == single.take(t)
    kb = KeyedBuckets(10, 60.0)                 # one cell every 6 s
    for key in (b"a", b"b"):
        assert kb.take(key, 0.0)
    for _ in range(9):
        assert kb.take(b"b", 0.0)
    assert not kb.take(b"b", 0.0)                  # b is empty: full again at 60 s
    assert kb.sweep(5.9) == 0 and len(kb) == 2
    assert kb.sweep(6.0) == 1 and len(kb) == 1     # a is full again, b is not
    assert kb.sweep(59.9) == 0 and kb.sweep(60.0) == 1 and len(kb) == 0
    assert kb.take(b"b", 60.0)                     # forgotten = full: a burst again


def test_a_group_with_nothing_stored_is_forgotten_when_its_last_session_leaves(tmp_path):
    inbox = SyncInbox(tmp_path / "inbox", tmp_path / "acks")
    a, b = object(), object()
    inbox.register(b"g" * 32, a)
    inbox.register(b"g" * 32, b)
    inbox.unregister(b"g" * 32, a)
    assert inbox.sessions_of(b"g" * 32) == [b]
    inbox.unregister(b"g" * 32, b)
    assert "groups=0" in repr(inbox) and inbox.top(b"g" * 32) == 0


def test_state_table():
    s = Session()
    with pytest.raises(Refused) as e:
        s.route(m.Hello(1, "x", b"\0" * 32, 0))
    assert e.value.code == Code.NOT_AUTHENTICATED
    assert s.route(m.Auth(1)) == "auth"
    s.authenticated(b"\1" * 32)
    for early in (m.Push(B16, b"", 0), m.Pull(0, 0), m.Bye(None), m.Auth(1)):
        with pytest.raises(Refused):
            s.route(early)
    assert s.route(m.Join(b"\0" * 32, b"\0" * 32, 0, b"\0" * 64)) == "join"
    with pytest.raises(Refused) as e:
        s.check_hello(m.Hello(3, "x", b"\0" * 32, 0))
    assert e.value.code == Code.UNSUPPORTED_VERSION
    s.activate(m.Hello(1, "x", b"\0" * 32, 0), "x")
    assert s.state is State.ACTIVE
    assert s.route(m.Push(B16, b"", 0)) == "push"
    for wrong in (m.Hello(1, "x", b"\0" * 32, 0), m.Welcome(1, 0, 0), m.Notify(1, 1),
                  m.ContentRef(b"\0" * 32, b"\0" * 24, 0, 16)):   # v1: as 0k-sync
        with pytest.raises(Refused) as e:
            s.route(wrong)
        assert e.value.code == Code.UNEXPECTED_MESSAGE
    # version 1 wants empty FINs for 0k-sync requests, ERROR for extension requests
    assert not s.wants_error(m.Push(B16, b"", 0)) and s.wants_error(m.Delete(B16))
    s.close()
    with pytest.raises(Refused):
        s.route(m.Pull(0, 0))
    v2 = Session.identified(b"\1" * 32)
    v2.activate(m.Hello(2, "x", b"\0" * 32, 0), "x")
    assert v2.wants_error(m.Pull(0, 0)) and v2.route(m.ContentAck(b"\0" * 32)) == "content"


def test_identity_signatures():
    key, other = SigningKey.generate(), SigningKey.generate()
    dev = bytes(key.verify_key)
    nonce, cert = b"\x07" * 32, b"certificate"
    sig = key.sign(identity.auth_message(nonce, cert)).signature
    assert identity.auth_ok(dev, sig, nonce, cert)
    assert not identity.auth_ok(dev, sig, b"\x08" * 32, cert)        # another connection
    assert not identity.auth_ok(dev, sig, nonce, b"another relay")
    assert not identity.auth_ok(bytes(other.verify_key), sig, nonce, cert)
    g, joiner = b"\x01" * 32, b"\x02" * 32
    adm = key.sign(identity.admit_message(g, joiner, 100)).signature
    assert identity.admission_ok(g, joiner, dev, 100, adm, now_unix=100)
    assert not identity.admission_ok(g, joiner, dev, 100, adm, now_unix=101)   # expired
    assert not identity.admission_ok(g, b"\x03" * 32, dev, 100, adm, now_unix=0)  # other device
    assert not identity.admission_ok(b"\x09" * 32, joiner, dev, 100, adm, now_unix=0)


# --- the seed spec's Envelope form (engine/sync/envelope.py) ----------------------------------

def _env_bytes(msg_type: int, payload: bytes, version: int = 1) -> bytes:
    from sync_client import arr, byte_arr, uint
    return (arr(8) + uint(version) + uint(msg_type) + byte_arr(bytes(32)) + byte_arr(bytes(32))
            + uint(0) + uint(0) + byte_arr(bytes(24)) + byte_arr(payload))


def test_envelope_requests_decode_to_the_tagged_messages():
    import msgpack

    from engine.sync import envelope as spec
    from sync_client import arr, bin16, byte_arr, s, uint

    def dec(data: bytes):
        return spec.decode_request(msgpack.unpackb(data, raw=False))

    g = bytes(range(32))
    r = dec(_env_bytes(0x01, arr(4) + uint(1) + s("n") + byte_arr(g) + uint(7)))
    assert r.msg_type == 0x01 and r.msg == m.Hello(1, "n", g, 7)
    blob = bytes(range(16))
    # a spec blob id is [u8; 16] (array of uints); bin16 is accepted too
    for bid in (byte_arr(blob), bin16(blob)):
        r = dec(_env_bytes(0x10, arr(3) + bid + byte_arr(b"\x01\xff") + uint(0)))
        assert r.msg == m.Push(blob, b"\x01\xff", 0)
    assert dec(_env_bytes(0x20, arr(2) + uint(5) + uint(0))).msg == m.Pull(5, 0)
    bad = [
        _env_bytes(0x99, arr(2) + uint(5) + uint(0)),                 # unknown msg_type
        _env_bytes(0x20, arr(3) + uint(5) + uint(0) + uint(1)),       # payload shape
        _env_bytes(0x20, b"\xc1"),                                    # payload not msgpack
        _env_bytes(0x20, arr(2) + uint(5) + uint(0), version=300),    # version not a u8
    ]
    for data in bad:
        with pytest.raises(m.DecodeError):
            dec(data)
    # an 8-element array with an integer first is the Envelope; tagged forms are unchanged
    assert spec.is_envelope(msgpack.unpackb(_env_bytes(0x20, b"\x90")))
    assert not spec.is_envelope(["Pull", 1, 2])


def test_envelope_replies_carry_the_spec_fields():
    import msgpack

    from engine.sync import envelope as spec
    out = msgpack.unpackb(spec.push_ack(bytes(16), 9, 1700000000, group_id=bytes(range(32)),
                                        timestamp=5))
    assert out[:2] == [1, 0x11] and bytes(out[3]) == bytes(range(32)) and out[4:6] == [9, 5]
    assert msgpack.unpackb(bytes(out[7])) == [[0] * 16, 9, 1700000000]
    out = msgpack.unpackb(spec.welcome(1, "relay", 3, 2))
    assert msgpack.unpackb(bytes(out[7])) == [1, "relay", 3, 2]
    note = spec.notify(spec.SpecBlob(b"\x01" * 16, 4, b"\x02" * 32, 600, 77))
    out = msgpack.unpackb(note)
    assert out[1] == 0x31 and bytes(out[2]) == b"\x02" * 32 and out[4] == 4
    assert msgpack.unpackb(bytes(out[7])) == [[1] * 16, 4, [2] * 32, 77, 600]
