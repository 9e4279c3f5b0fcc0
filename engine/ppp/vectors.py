"""PPP test vectors (spec "Test vectors"): `python -m engine.ppp.vectors [--out DIR]`.

Writes one JSON file per primitive into `test-vectors/` (repo root by default): keys, kdf,
seal, wrap, event_id, sealed_event_id, delivery_token, member_token, room_grant, room_message,
discovery, blinded_mailbox, padding, fingerprint.
Everything is deterministic: seeds are SHAKE-256("ppp-test-vector/" + label) and every random
value the wrap draws comes from a SHAKE-256 stream of a label; each drawn value is written out
explicitly, in draw order, so another implementation can replay it without our stream. All
byte strings are lowercase hex; timestamps are unix seconds.

The spec's own vector section lists no concrete values, so these are ours; the conventions
they pin down are in the module docstrings of crypto.py, wrap.py, padding.py and tokens.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
from pathlib import Path

import msgpack
from nacl import bindings

from . import crypto, padding, tokens
from .ids import event_id, sealed_event_id
from .keys import Identity, x25519
from .wrap import Kind, PresenceContent, Region, Rumor, TimeWindow, seal, unwrap, wrap

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "test-vectors"
CREATED_AT = 1_700_000_000
EXPIRES_AT = CREATED_AT + 7 * 86_400


def vector_seed(label: str, n: int = 32) -> bytes:
    return hashlib.shake_256(b"ppp-test-vector/" + label.encode()).digest(n)


class Stream:
    """Deterministic `randbytes`: successive slices of SHAKE-256(label); records each draw."""

    def __init__(self, label: str):
        self.label, self.offset, self.draws = label, 0, []

    def __call__(self, n: int) -> bytes:
        out = hashlib.shake_256(b"ppp-test-vector-rng/" + self.label.encode()).digest(
            self.offset + n)[self.offset:]
        self.offset += n
        self.draws.append(out)
        return out


def _h(b: bytes) -> str:
    return b.hex()


def _file(description: str, spec: str, vectors: list, **extra) -> dict:
    return {"description": description, "spec": spec, **extra, "vectors": vectors}


def _people() -> dict[str, Identity]:
    return {name: Identity.from_seed(vector_seed(name)) for name in ("alice", "bob", "carol")}


def keys_vectors(people) -> dict:
    vs = [{"name": n, "seed": _h(i.seed), "ed25519_pk": _h(i.ed25519_pk),
           "ed25519_sk": _h(i.ed25519_sk), "x25519_pk": _h(i.x25519_pk),
           "x25519_sk": _h(i.x25519_sk),
           "sig_message": _h(b"ppp-test-vector"), "sig": _h(i.sign(b"ppp-test-vector"))}
          for n, i in people.items()]
    return _file("Ed25519 key pair from a 32-byte seed (crypto_sign_seed_keypair), its X25519 "
                 "twin (crypto_sign_ed25519_{pk,sk}_to_curve25519) and a detached signature.",
                 "§1 identity and keys", vs)


def kdf_vectors(people) -> dict:
    a, b = people["alice"], people["bob"]
    shared = x25519(a.x25519_sk, b.x25519_pk)
    vs = [{"alice_x25519_sk": _h(a.x25519_sk), "bob_x25519_pk": _h(b.x25519_pk),
           "shared_secret": _h(shared), "context": ctx.decode(), "context_hex": _h(ctx),
           "key": _h(crypto.kdf(shared, ctx))}
          for ctx in (crypto.CTX_EVENT, crypto.CTX_SEAL, crypto.CTX_WRAP)]
    return _file("shared_secret = crypto_scalarmult(sk, pk); key = crypto_generichash(32, "
                 "in=shared_secret, key=context), i.e. BLAKE2b-256 keyed by the context string.",
                 "§2 key exchange and KDF", vs)


def _presence(sender: Identity, recipient: Identity) -> Rumor:
    content = PresenceContent(
        event_id=vector_seed("presence-event-id", 16), message="Meet at the fountain \u26f2",
        region=Region(52.520008, 13.404954, 150),
        time_window=TimeWindow(CREATED_AT, CREATED_AT + 86_400, "Europe/Berlin"),
        recipients=(recipient.pubkey,))
    return Rumor(sender.pubkey, Kind.PRESENCE, content, CREATED_AT)


def wrap_vectors(people) -> tuple[dict, dict, dict]:
    """The seal layer, the whole wrap, and the event id, all from one deterministic run."""
    a, b = people["alice"], people["bob"]
    rumor = _presence(a, b)
    rng = Stream("wrap/alice->bob")
    gw = wrap(rumor, a, b.pubkey, created_at=CREATED_AT, expires_at=EXPIRES_AT, randbytes=rng)
    seal_seed, seal_nonce, pad_bytes, wrap_seed, wrap_nonce = rng.draws
    # Recompute every intermediate step by step and check it is what wrap() produced.
    e1, e2 = Identity.from_seed(seal_seed), Identity.from_seed(wrap_seed)
    seal_shared = x25519(e1.x25519_sk, b.x25519_pk)
    seal_key = crypto.kdf(seal_shared, crypto.CTX_SEAL)
    s = seal(rumor, a, b.pubkey, Stream("wrap/alice->bob"))
    padded = padding.pad(s.encode(), lambda n: pad_bytes)
    wrap_shared = x25519(e2.x25519_sk, b.x25519_pk)
    wrap_key = crypto.kdf(wrap_shared, crypto.CTX_WRAP)
    assert crypto.encrypt(padded, wrap_nonce, wrap_key) == gw.ciphertext
    assert unwrap(gw.encode(), b).rumor == rumor
    c = rumor.content
    rumor_fields = {"sender": _h(rumor.sender), "kind": rumor.kind, "created_at": CREATED_AT,
                    "content": {"event_id": _h(c.event_id), "message": c.message,
                                "region": {"region_type": 0, "latitude": c.region.latitude,
                                           "longitude": c.region.longitude,
                                           "radius_m": c.region.radius_m},
                                "time_window": {"starts_at": c.time_window.starts_at,
                                                "ends_at": c.time_window.ends_at,
                                                "timezone": c.time_window.timezone},
                                "recipients": [_h(r) for r in c.recipients]}}
    seal_v = {"sender_seed": _h(a.seed), "recipient_seed": _h(b.seed),
              "recipient_pk": _h(b.pubkey), "rumor": rumor_fields,
              "rumor_msgpack": _h(rumor.encode()),
              "seal_ephemeral_seed": _h(seal_seed), "seal_ephemeral_pk": _h(e1.ed25519_pk),
              "seal_shared": _h(seal_shared), "seal_key": _h(seal_key),
              "seal_nonce": _h(seal_nonce), "seal_ciphertext": _h(s.ciphertext),
              "sender_sig": _h(s.sender_sig), "seal_msgpack": _h(s.encode())}
    wrap_v = {**{k: seal_v[k] for k in ("sender_seed", "recipient_seed", "recipient_pk",
                                         "rumor_msgpack", "seal_msgpack")},
              "random_draws_in_order": [_h(d) for d in rng.draws],
              "padding_bytes": _h(pad_bytes), "bucket": len(padded),
              "padded_seal": _h(padded),
              "wrap_ephemeral_seed": _h(wrap_seed), "wrap_ephemeral_pk": _h(e2.ed25519_pk),
              "wrap_shared": _h(wrap_shared), "wrap_key": _h(wrap_key),
              "wrap_nonce": _h(wrap_nonce), "wrap_ciphertext": _h(gw.ciphertext),
              "created_at": CREATED_AT, "expires_at": EXPIRES_AT,
              "giftwrap_msgpack": _h(gw.encode()), "event_id": _h(gw.event_id)}
    conventions = ("MessagePack maps with the §3.x integer keys (rumor 7,8,9,5; seal 2,3,4,10; "
                   "giftwrap 1..6; region_type 14); content fields the table lacks are keyed "
                   "by their spec names. ephemeral_pk is the ephemeral Ed25519 key, converted "
                   "to X25519 for the DH. sender_sig = Ed25519 over the seal ciphertext. The "
                   "serialised seal is padded (0x01 delimiter, random, 0x00 terminator) before "
                   "the wrap encryption. AEAD: XChaCha20-Poly1305-IETF, no associated data.")
    return (_file("Layer 2: the rumor sealed to the recipient and signed by the sender.",
                  "§3 gift wrap, layer 2", [seal_v], conventions=conventions),
            _file("All three layers, with every random draw and intermediate value.",
                  "§3 gift wrap, §11 padding", [wrap_v], conventions=conventions,
                  draw_order=["seal ephemeral seed (32)", "seal nonce (24)",
                              "padding (bucket - len(seal) - 2)", "wrap ephemeral seed (32)",
                              "wrap nonce (24)"]),
            gw)


def event_id_vectors(gw) -> tuple[dict, dict]:
    a = [{"ephemeral_pk": _h(gw.ephemeral_pk), "nonce": _h(gw.nonce),
          "ciphertext": _h(gw.ciphertext), "event_id": _h(gw.event_id)}]
    epk, nonce, ct = vector_seed("eid-epk"), vector_seed("eid-nonce", 24), vector_seed("eid-ct", 48)
    a.append({"ephemeral_pk": _h(epk), "nonce": _h(nonce), "ciphertext": _h(ct),
              "event_id": _h(event_id(epk, nonce, ct))})
    token = vector_seed("eid-token", 12)
    s = [{"domain": "ppp-note-event-id-v1", "ephemeral_pk": _h(epk), "nonce": _h(nonce),
          "ciphertext": _h(ct), "delivery_token": _h(token), "created_at": CREATED_AT,
          "created_at_be64": _h(struct.pack(">Q", CREATED_AT)),
          "event_id": _h(sealed_event_id(epk, nonce, ct, token, CREATED_AT))}]
    return (_file("Authenticated path: BLAKE2b-256(ephemeral_pk || nonce || ciphertext), "
                  "unkeyed. The first vector is the wrap vector's GiftWrap.",
                  "§4.5 event ids", a),
            _file("Sealed-Note path: BLAKE2b-256('ppp-note-event-id-v1' || ephemeral_pk || "
                  "nonce || ciphertext || delivery_token || created_at as big-endian u64), "
                  "unkeyed.", "§4.5 event ids", s))


def delivery_token_vectors(people) -> dict:
    a, b = people["alice"], people["bob"]
    shared = x25519(a.x25519_sk, b.x25519_pk)
    vs = [{"note_to": name, "alice_seed": _h(a.seed), "bob_seed": _h(b.seed),
           "shared_secret": _h(shared), "recipient_pk": _h(rec.pubkey),
           "input": _h(rec.pubkey + tokens.DELIVERY_DOMAIN),
           "delivery_token": _h(tokens.delivery_token_from_secret(shared, rec.pubkey))}
          for name, rec in (("bob", b), ("alice", a))]
    return _file("BLAKE2b(12, key = X25519 shared secret of the pair, in = recipient_pk || "
                 "'ppp-note-delivery-v1'). The sender derives it with the recipient's key, the "
                 "recipient registers the same value.", "§6.2 delivery tokens", vs)


def member_token_vectors(people) -> dict:
    room_id, room_key = vector_seed("room-id", 16), vector_seed("room-key")
    vs = []
    for name in ("alice", "carol"):
        me = people[name]
        room_identity = tokens.room_signing_identity(me, room_id)
        vs.append({"member_seed": _h(me.seed), "member_ed25519_sk_first32": _h(me.ed25519_sk[:32]),
                   "room_id": _h(room_id), "room_signing_seed": _h(room_identity.seed),
                   "member_signing_pk": _h(room_identity.pubkey), "room_key": _h(room_key),
                   "member_token": _h(tokens.member_token(room_key, room_identity.pubkey,
                                                          room_id))})
    return _file("Per-room signing seed = BLAKE2b(32, key = ed25519_sk[0..32], in = room_id || "
                 "'ppp-room-sign-v1'); member_token = BLAKE2b(12, key = room_key, in = "
                 "member_signing_pk || room_id || 'ppp-room-member-v1').",
                 "§7.3 member tokens", vs)


def grant_vectors(people) -> dict:
    """§7.4 knock grant: alice admits carol's knock (an ephemeral X25519 pair of a label)."""
    from . import room_crypto
    room_id, room_key = vector_seed("room-id", 16), vector_seed("room-key")
    admin, eph_sk = people["alice"], vector_seed("knock-eph")
    eph_pk = bindings.crypto_scalarmult_base(eph_sk)
    rng = Stream("grant")
    grant = room_crypto.ble_grant_encrypt(admin.x25519_sk, eph_pk, room_id, room_key, rng)
    shared = x25519(admin.x25519_sk, eph_pk)
    return _file("grant = nonce (24) || XChaCha20-Poly1305(room_id || room_key, nonce, key = "
                 "kdf(X25519(admin_x25519_sk, knocker_eph_x25519_pk), 'ppp-ble-grant-v1')), "
                 "kdf as in kdf.json. The knocker opens it with its ephemeral secret and the "
                 "admin's X25519 key (from admin_pubkey, Ed25519).", "§7.4 knock / admit",
                 [{"admin_seed": _h(admin.seed), "admin_x25519_pk": _h(admin.x25519_pk),
                   "knocker_eph_x25519_sk": _h(eph_sk), "knocker_eph_x25519_pk": _h(eph_pk),
                   "shared_secret": _h(shared),
                   "grant_key": _h(crypto.kdf(shared, room_crypto.GRANT_CONTEXT)),
                   "room_id": _h(room_id), "room_key": _h(room_key), "nonce": _h(rng.draws[0]),
                   "grant": _h(grant)}])


def room_message_vectors(people) -> dict:
    """A room message of this library's plaintext format (`room_crypto.py`)."""
    from . import room_crypto
    room_id, room_key = vector_seed("room-id", 16), vector_seed("room-key")
    carol = people["carol"]
    rng = Stream("room-message")
    nonce, ct = room_crypto.encrypt_message(carol, room_key, room_id, "see you at the tower",
                                            CREATED_AT, rng)
    signer = tokens.room_signing_identity(carol, room_id)
    return _file("Plaintext = MessagePack {1: member_signing_pk, 2: sent_at, 3: body, 4: sig}, "
                 "sig = Ed25519('ppp-room-msg-v1' || room_id || u64be(sent_at) || body) by the "
                 "per-room key; padded (padding.json), then XChaCha20-Poly1305 under room_key. "
                 "randbytes draws, in order: the nonce, then the padding.",
                 "§7.3 room messages (plaintext format: this library's)",
                 [{"member_seed": _h(carol.seed), "member_signing_pk": _h(signer.pubkey),
                   "room_id": _h(room_id), "room_key": _h(room_key), "sent_at": CREATED_AT,
                   "body": "see you at the tower", "draws": [_h(d) for d in rng.draws],
                   "nonce": _h(nonce), "ciphertext": _h(ct)}])


def discovery_vectors() -> dict:
    """§9 contact discovery: normalisation, the pepper schedule, the peppered hash."""
    from . import discovery
    seed = vector_seed("discovery-pepper-seed")
    pid = 2923
    pepper = discovery.pepper_for(seed, pid)
    idents = ["+49 (30) 1234-5678", " +1 415.555.0100 ", "Alice.Liddell@Example.org",
              "a.b+tag@x.org"]
    return _file("pepper = BLAKE2b(32, in = 'ppp-discovery-pepper-v1' || u64be(pepper_id), "
                 "key = pepper_seed); pepper_id = floor(unix_time / rotation_seconds). "
                 "hash = BLAKE2b(32, in = normalized (UTF-8), key = pepper). Normalisation: "
                 "whitespace removed and lowercased; phones: spaces, dashes, dots and "
                 "parentheses removed, '+' and 8-15 digits (E.164); e-mail: dots removed from "
                 "the local part.", "§9 contact discovery",
                 [{"identifier": i, "normalized": discovery.normalize(i),
                   "hash": _h(discovery.identifier_hash(discovery.normalize(i), pepper))}
                  for i in idents],
                 pepper_seed=_h(seed), pepper_id=pid, pepper=_h(pepper))


def blinded_vectors(people) -> dict:
    """Blinded daily mailboxes (`blinded.py`): Bob's mailbox for Alice's messages, two days."""
    from . import blinded
    alice, bob = people["alice"], people["bob"]
    shared = x25519(bob.x25519_sk, alice.x25519_pk)
    challenge = bytes(range(32))
    vs = []
    for epoch in (20_419, 20_420):
        h = blinded._blinding(shared, bob.pubkey, epoch)
        box = blinded.my_mailbox(bob, alice.pubkey, epoch)
        assert box.pubkey == blinded.their_mailbox_id(alice, bob.pubkey, epoch)
        vs.append({"epoch": epoch, "blinding_scalar": _h(blinded._bytes(h)),
                   "mailbox_id": _h(box.pubkey), "challenge": _h(challenge),
                   "auth_sig": _h(box.sign(challenge)),
                   "delivery_token": _h(blinded.mailbox_delivery_token(bob, alice.pubkey,
                                                                       box.pubkey))})
    return _file("shared = X25519(bob_x25519_sk, alice_x25519_pk) (= Alice's side); "
                 "h = BLAKE2b(64, in = 'ppp-blinded-mailbox-v2' || recipient_pk || "
                 "u64be(epoch), key = shared) mod L (little-endian); mailbox_id = h * "
                 "recipient_pk (ed25519 point, no clamping); the recipient signs as the "
                 "mailbox with the scalar h * a mod L (a = its clamped ed25519 scalar), "
                 "an ordinary ed25519 signature under mailbox_id (auth_sig: over challenge); "
                 "delivery_token as delivery_token.json with recipient_pk = mailbox_id. "
                 "epoch = floor(unix_time / 86400).", "metadata section, blinded mailboxes "
                 "(this relay's design: the spec's formula is computable by the relay)", vs,
                 recipient_seed=_h(bob.seed), sender_seed=_h(alice.seed), shared=_h(shared))


def _msgpack_of_length(total: int) -> bytes:
    """A MessagePack bin object of exactly `total` bytes, its payload all 0x01 (so a naive
    scan for the delimiter would go wrong)."""
    n = total - 2 if total - 2 < 256 else total - 3
    out = msgpack.packb(b"\x01" * n, use_bin_type=True)
    assert len(out) == total
    return out


def padding_vectors() -> dict:
    vs = []
    for total in (5, 254, 255, 1022, 1023, 4094, 16382):
        pt = _msgpack_of_length(total)
        rng = Stream(f"padding/{total}")
        padded = padding.pad(pt, rng)
        vs.append({"plaintext": _h(pt), "plaintext_length": total, "bucket": len(padded),
                   "padding": _h(rng.draws[0] if rng.draws else b""), "padded": _h(padded)})
    ok = bytes.fromhex(vs[0]["padded"])
    invalid = [
        {"reason": "length is not a bucket", "padded": _h(ok[:-1])},
        {"reason": "last byte is not the 0x00 terminator", "padded": _h(ok[:-1] + b"\x02")},
        {"reason": "byte after the payload is not the 0x01 delimiter",
         "padded": _h(ok[:5] + b"\x00" + ok[6:])},
        {"reason": "padded to a larger bucket than needed",
         "padded": _h(bytes.fromhex(vs[0]["plaintext"]) + b"\x01" + bytes(1024 - 7) + b"\x00")},
    ]
    return _file("padded = plaintext || 0x01 || padding || 0x00 with len(padded) = the smallest "
                 "bucket >= len(plaintext) + 2; buckets 256, 1024, 4096, 16384; a plaintext "
                 "over 16382 bytes is refused. The plaintext is always one MessagePack object "
                 "(the seal), which is how the receiver finds the delimiter.",
                 "§11 padding", vs, buckets=list(padding.BUCKETS),
                 too_large={"plaintext_length": padding.MAX_PLAINTEXT + 1, "result": "error"},
                 invalid=invalid)


def fingerprint_vectors(people) -> dict:
    vs = []
    for x, y in (("alice", "bob"), ("bob", "carol")):
        pa, pb = people[x].pubkey, people[y].pubkey
        fp = tokens.fingerprint(pa, pb)
        vs.append({"pk_a": _h(pa), "pk_b": _h(pb), "sorted_concat": _h(b"".join(sorted((pa, pb)))),
                   "blake2b_16": _h(tokens.fingerprint_bytes(pa, pb)), "fingerprint": fp,
                   "display": tokens.display_fingerprint(fp)})
    return _file("fingerprint = base64(BLAKE2b(16, min(pk_a, pk_b) || max(pk_a, pk_b))), "
                 "unkeyed, RFC 4648 standard alphabet with padding; display = unpadded, "
                 "groups of four.", "§9.7 OOB verification fingerprint", vs)


def generate() -> dict[str, dict]:
    people = _people()
    seal_f, wrap_f, gw = wrap_vectors(people)
    auth_f, sealed_f = event_id_vectors(gw)
    return {"keys.json": keys_vectors(people), "kdf.json": kdf_vectors(people),
            "seal.json": seal_f, "wrap.json": wrap_f, "event_id.json": auth_f,
            "sealed_event_id.json": sealed_f,
            "delivery_token.json": delivery_token_vectors(people),
            "member_token.json": member_token_vectors(people),
            "room_grant.json": grant_vectors(people),
            "room_message.json": room_message_vectors(people),
            "discovery.json": discovery_vectors(),
            "blinded_mailbox.json": blinded_vectors(people),
            "padding.json": padding_vectors(), "fingerprint.json": fingerprint_vectors(people)}


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def write(out_dir: Path = DEFAULT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, doc in generate().items():
        path = out_dir / name
        path.write_text(render(doc), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.ppp.vectors", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_DIR, help=f"default {DEFAULT_DIR}")
    for path in write(p.parse_args(argv).out):
        print(path)


if __name__ == "__main__":
    main()
