"""The BLE courier of spec 004 §8, pure: the GATT exchange, chunking, and what a courier holds.

Roles. The courier is the GATT server (peripheral) and the recipient the client (central):
§8's exchange has the courier *notify* EVENT_STREAM (only a server notifies) and *verify*
the AUTH_RESPONSE before it reveals anything, and `relay ppp courier-receive` "scans" (only a
central scans). The service (`SERVICE_UUID`) has four characteristics:

    HANDSHAKE_NONCE  read    32 bytes, new for each session: the courier's ephemeral X25519
                             public key (see "Sealed stream")
    AUTH_RESPONSE    write   pubkey (32) || Ed25519 sig (64), §8's layout; the signature is
                             over AUTH_CONTEXT || nonce (see "Why a context")
    EVENT_STREAM     notify  chunks of the events carried for that pubkey, sealed to it
    EVENT_ACK        write   one 32-byte event id (the authenticated-path id, §4.5)

§8 leaves the 128-bit UUID "TBD": ours spell "PPP1" in their first four bytes.

Why a context. §5.1's AUTH signs the relay's 32-byte CHALLENGE as is. Had AUTH_RESPONSE
signed the bare nonce too, a courier could show the relay's CHALLENGE as its nonce and log
in to the relay as the recipient with the answer (and ACK away its mail). So the recipient
signs `AUTH_CONTEXT || nonce`, which no relay challenge can equal.

Bystander rule (§8 MUST): before a valid AUTH_RESPONSE from a pubkey the courier carries
for, the courier says nothing but the nonce: no count, no notification, every ack refused;
an AUTH_RESPONSE that fails (bad signature, a stranger) ends the session the same way
whatever the reason, so a scanner cannot even learn whether a pubkey is carried for.

Sealed stream. A GiftWrap shows its recipient's pubkey, and BLE without pairing is readable
over the air; BlueZ (the Linux GATT server) also notifies a characteristic's value to every
subscribed central, not to one. So after AUTH_RESPONSE each event is sealed to the
authenticated peer with crypto_box (X25519 of the courier's ephemeral key, the nonce, and of
the peer's Ed25519 key; XSalsa20-Poly1305; 24-byte box nonce || ciphertext) and chunked:
whoever else hears EVENT_STREAM hears ciphertext it cannot open or attribute.

Chunks. Every notification is one chunk `sequence u16 BE || total u16 BE || data` (§8's
`Chunk {sequence, total, data}`, fields in that order, big-endian as the rest of the
relay's binary framings), carrying at most MTU - 3 bytes (the ATT header) for MTU 23-517.
An event always travels as chunks, `total` = 1 for a small one: one framing, no guessing.
Events follow one another: the next event starts at sequence 0. Reassembly refuses a gap,
a duplicate, a total that changes mid-event, a total of 0, an empty chunk, and any event
over `MAX_CARRIED_EVENT` bytes.

Carried events (§8 `CarriedEvent`): the GiftWrap as the relay stored it, when it was
fetched, `hop_count` (0 when fetched from the relay) and `max_hops` (3). Handing events to
another courier of the group (multi-hop, §8 SHOULD) sends the *transfer form*: the GiftWrap
map with §3's keys 12 (hop_count, already incremented) and 13 (max_hops) added; an event
whose hop_count has reached max_hops is never handed on. A recipient gets the plain
GiftWrap (keys 1-6), as from the relay. Expired events are dropped (§ "couriers MUST
discard expired events").
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import VerifyKey

from .giftwrap import GiftWrap, GiftWrapError
from .limits import MAX_CIPHERTEXT_SIZE
from .maps import MapError, unpack_map

SERVICE_UUID = "50505031-c0de-4a11-9e5e-000000000000"
HANDSHAKE_NONCE_UUID = "50505031-c0de-4a11-9e5e-000000000001"
AUTH_RESPONSE_UUID = "50505031-c0de-4a11-9e5e-000000000002"
EVENT_STREAM_UUID = "50505031-c0de-4a11-9e5e-000000000003"
EVENT_ACK_UUID = "50505031-c0de-4a11-9e5e-000000000004"

NONCE_LEN = 32
PUBKEY_LEN = 32
SIGNATURE_LEN = 64
EVENT_ID_LEN = 32
MIN_MTU, MAX_MTU = 23, 517
ATT_HEADER = 3
_CHUNK = struct.Struct(">HH")
MAX_CHUNKS = 0xFFFF
DEFAULT_MAX_HOPS = 3
K_HOP_COUNT, K_MAX_HOPS = 12, 13
# The largest GiftWrap the relay accepts (64 KiB ciphertext) with its MessagePack keys and
# the transfer form's two small integers, rounded up.
MAX_CARRIED_EVENT = MAX_CIPHERTEXT_SIZE + 1024
# What AUTH_RESPONSE signs before the nonce ("Why a context"); 20 bytes, so the signed
# message is 52 bytes long and can never be a 32-byte relay CHALLENGE.
AUTH_CONTEXT = b"PPP-courier-auth-v1\x00"


class CourierError(ValueError):
    """Bytes a courier or recipient must refuse; `args[0]` is a short reason."""


# --- chunks ---------------------------------------------------------------------------------

def chunk_payload(mtu: int) -> int:
    """Data bytes per chunk at this MTU."""
    if not MIN_MTU <= mtu <= MAX_MTU:
        raise CourierError(f"MTU must be {MIN_MTU}-{MAX_MTU}")
    return mtu - ATT_HEADER - _CHUNK.size


def chunks(event: bytes, mtu: int) -> list[bytes]:
    size = chunk_payload(mtu)
    if not 0 < len(event) <= MAX_CARRIED_EVENT:
        raise CourierError("event size out of range")
    parts = [event[i:i + size] for i in range(0, len(event), size)]
    if len(parts) > MAX_CHUNKS:
        raise CourierError("too many chunks")
    return [_CHUNK.pack(i, len(parts)) + p for i, p in enumerate(parts)]


class Reassembler:
    """Chunks in, whole events out, one event at a time."""

    def __init__(self, max_event: int = MAX_CARRIED_EVENT):
        self.max_event = max_event
        self._parts: list[bytes] = []
        self._total = 0
        self._size = 0

    @property
    def in_progress(self) -> bool:
        return bool(self._parts)

    def feed(self, chunk: bytes) -> bytes | None:
        """The event this chunk completes, or None; CourierError on anything out of order
        (the partial event is dropped: the sender starts it again)."""
        try:
            return self._feed(chunk)
        except CourierError:
            self._parts, self._total, self._size = [], 0, 0
            raise

    def _feed(self, chunk: bytes) -> bytes | None:
        if len(chunk) <= _CHUNK.size:
            raise CourierError("empty chunk")
        seq, total = _CHUNK.unpack_from(chunk)
        data = chunk[_CHUNK.size:]
        if total == 0:
            raise CourierError("total must be at least 1")
        if not self._parts:
            if seq != 0:
                raise CourierError("an event starts at sequence 0")
            self._total = total
        elif total != self._total:
            raise CourierError("total changed")
        elif seq != len(self._parts):
            raise CourierError("duplicate chunk" if seq < len(self._parts) else "chunk gap")
        self._size += len(data)
        if self._size > self.max_event:
            raise CourierError("event too large")
        self._parts.append(data)
        if len(self._parts) < self._total:
            return None
        event = b"".join(self._parts)
        self._parts, self._total, self._size = [], 0, 0
        return event


# --- the handshake --------------------------------------------------------------------------

def auth_response(nonce: bytes, signing_key) -> bytes:
    """What a recipient writes to AUTH_RESPONSE: pubkey || sign(AUTH_CONTEXT || nonce)
    (PyNaCl SigningKey)."""
    if len(nonce) != NONCE_LEN:
        raise CourierError("nonce must be 32 bytes")
    return bytes(signing_key.verify_key) + signing_key.sign(AUTH_CONTEXT + nonce).signature


def verify_auth(nonce: bytes, data: bytes) -> bytes:
    """The pubkey that signed this session's nonce; CourierError otherwise."""
    if len(data) != PUBKEY_LEN + SIGNATURE_LEN:
        raise CourierError("not authenticated")
    pk, sig = data[:PUBKEY_LEN], data[PUBKEY_LEN:]
    try:
        VerifyKey(pk).verify(AUTH_CONTEXT + nonce, sig)
    except (BadSignatureError, ValueError):
        raise CourierError("not authenticated") from None
    return pk


def _peer_box(own: PrivateKey, peer_ed25519: bytes) -> Box:
    return Box(own, VerifyKey(peer_ed25519).to_curve25519_public_key())


def _opener(signing_key, nonce: bytes) -> Box:
    """The peer's side of the sealed stream: its X25519 key and the courier's nonce."""
    try:
        return Box(signing_key.to_curve25519_private_key(), PublicKey(nonce))
    except (CryptoError, ValueError, TypeError):
        raise CourierError("nonce must be 32 bytes") from None


def _open(box: Box | None, sealed: bytes) -> bytes:
    if box is None:
        raise CourierError("no session: read the nonce first")
    try:
        return box.decrypt(sealed)
    except (CryptoError, ValueError):
        raise CourierError("not sealed for this session") from None


# --- what a courier carries -----------------------------------------------------------------

@dataclass
class CarriedEvent:
    event: bytes                 # the GiftWrap as stored by the relay (keys 1-6)
    recipient: bytes
    event_id: bytes
    expires_at: int
    fetched_at: int
    hop_count: int = 0
    max_hops: int = DEFAULT_MAX_HOPS
    delivered: bool = False

    def __repr__(self) -> str:   # never the ciphertext or the recipient
        return f"CarriedEvent(hop={self.hop_count}/{self.max_hops}, delivered={self.delivered})"

    @classmethod
    def fetched(cls, event: bytes, now: int) -> "CarriedEvent":
        """An event as a courier got it from the relay."""
        gw = _giftwrap(event)
        return cls(event, gw.recipient, gw.event_id, gw.expires_at, now)

    @property
    def relayable(self) -> bool:
        """May be handed to another courier (§8: hop_count >= max_hops are not relayed)."""
        return self.hop_count < self.max_hops

    def transfer_form(self) -> bytes:
        """What another courier receives: the GiftWrap map with keys 12 and 13, the hop
        already counted."""
        if not self.relayable:
            raise CourierError("hop limit reached")
        m = _giftwrap(self.event).to_map()
        m[K_HOP_COUNT], m[K_MAX_HOPS] = self.hop_count + 1, self.max_hops
        return msgpack.packb(m, use_bin_type=True)


def _giftwrap(event: bytes) -> GiftWrap:
    try:
        return GiftWrap.decode(event)
    except GiftWrapError as e:
        raise CourierError(f"not a GiftWrap: {e.args[0]}") from None


def from_transfer(data: bytes, now: int) -> CarriedEvent:
    """A carried event another courier handed over (its transfer form)."""
    try:
        m = unpack_map(data, int)
    except MapError as e:
        raise CourierError(e.args[0]) from None
    if not isinstance(m, dict) or set(m) != set(range(1, 7)) | {K_HOP_COUNT, K_MAX_HOPS}:
        raise CourierError("a transfer has keys 1-6, 12 and 13")
    hop, top = m.pop(K_HOP_COUNT), m.pop(K_MAX_HOPS)
    for v in (hop, top):
        if type(v) is not int or not 0 <= v <= 255:
            raise CourierError("hop_count and max_hops are u8")
    if hop > top:
        raise CourierError("hop_count past max_hops")
    try:
        gw = GiftWrap.from_map(m)
    except GiftWrapError as e:
        raise CourierError(f"not a GiftWrap: {e.args[0]}") from None
    return CarriedEvent(gw.encode(), gw.recipient, gw.event_id, gw.expires_at, now, hop, top)


@dataclass
class CourierStore:
    """The events a courier carries, by event id."""
    events: dict[bytes, CarriedEvent] = field(default_factory=dict)

    def add(self, e: CarriedEvent, now: int) -> bool:
        """False for an expired event or one held already (the lower hop count is kept)."""
        if e.expires_at <= now:
            return False
        old = self.events.get(e.event_id)
        if old is not None and old.hop_count <= e.hop_count:
            return False
        self.events[e.event_id] = e
        return True

    def for_recipient(self, pk: bytes, now: int) -> list[CarriedEvent]:
        return [e for e in self.events.values()
                if e.recipient == pk and not e.delivered and e.expires_at > now]

    def relayable(self, now: int) -> list[CarriedEvent]:
        return [e for e in self.events.values()
                if e.relayable and not e.delivered and e.expires_at > now]

    def delivered(self, event_id: bytes) -> bool:
        e = self.events.get(event_id)
        if e is None or e.delivered:
            return False
        e.delivered = True
        return True

    def expire(self, now: int) -> int:
        gone = [k for k, e in self.events.items() if e.expires_at <= now]
        for k in gone:
            del self.events[k]
        return len(gone)


# --- one BLE connection, courier side --------------------------------------------------------

class CourierSession:
    """The GATT server's state for one connection: `nonce` (read), `on_auth` (write),
    `notifications` (what to notify, in order), `on_ack` (write)."""

    def __init__(self, store: CourierStore, mtu: int, now: int, *,
                 carried_for: frozenset[bytes], couriers: frozenset[bytes] = frozenset(),
                 ephemeral: PrivateKey | None = None):
        """`carried_for`: the members of the carry groups this courier carries for;
        `couriers`: their other couriers (they get the transfer form); `ephemeral`: this
        session's X25519 key (new by default; its public half is the nonce)."""
        chunk_payload(mtu)
        self.store = store
        self._ephemeral = ephemeral or PrivateKey.generate()
        self.nonce = bytes(self._ephemeral.public_key)
        self._box: Box | None = None
        self.mtu = mtu
        self.now = now
        self.carried_for = carried_for
        self.couriers = couriers
        self.peer: bytes | None = None
        self.closed = False
        self._sent: set[bytes] = set()

    def __repr__(self) -> str:
        return f"CourierSession(authenticated={self.peer is not None}, closed={self.closed})"

    def on_auth(self, data: bytes) -> None:
        """A valid AUTH_RESPONSE from someone this courier carries for opens the stream;
        anything else closes the session (`closed`), with one reason for every failure."""
        if self.closed or self.peer is not None:
            self.closed = True
            raise CourierError("not authenticated")
        try:
            pk = verify_auth(self.nonce, data)
        except CourierError:
            self.closed = True
            raise
        if pk not in self.carried_for and pk not in self.couriers:
            self.closed = True
            raise CourierError("not authenticated")
        self.peer = pk
        self._box = _peer_box(self._ephemeral, pk)

    def notifications(self) -> list[bytes]:
        """The chunks to notify now: the peer's own events (a recipient), or every event that
        may travel one more hop (another courier). Empty before authentication."""
        if self.peer is None or self.closed:
            return []
        out: list[bytes] = []
        if self.peer in self.carried_for:
            events = [(e.event_id, e.event) for e in self.store.for_recipient(self.peer, self.now)]
        else:
            events = [(e.event_id, e.transfer_form()) for e in self.store.relayable(self.now)]
        for eid, data in events:
            if eid not in self._sent:
                self._sent.add(eid)
                out.extend(chunks(bytes(self._box.encrypt(data)), self.mtu))
        return out

    def on_ack(self, data: bytes) -> bool:
        """EVENT_ACK: the peer has the event (a recipient: delivered, its ACK reaches the
        relay when either of them is online). Only ids streamed in this session count."""
        if self.peer is None or self.closed:
            raise CourierError("not authenticated")
        if len(data) != EVENT_ID_LEN:
            raise CourierError("an ack is one 32-byte event id")
        if data not in self._sent:
            return False
        if self.peer in self.carried_for:
            return self.store.delivered(data)
        return True


# --- one BLE connection, recipient side -----------------------------------------------------

class _Central:
    """What a recipient and a taking courier share as the central: reading the nonce starts
    a session (the AUTH_RESPONSE to write, the box that opens the stream, a new reassembly);
    chunks in, opened events out."""

    def __init__(self, signing_key):
        self.key = signing_key
        self.reassembler = Reassembler()
        self._box: Box | None = None

    def on_nonce(self, nonce: bytes) -> bytes:
        """A new session: the AUTH_RESPONSE to write."""
        response = auth_response(nonce, self.key)
        self._box = _opener(self.key, nonce)
        self.reassembler = Reassembler()
        return response

    def _opened(self, chunk: bytes) -> bytes | None:
        """The event this chunk completes, unsealed, or None."""
        sealed = self.reassembler.feed(chunk)
        return None if sealed is None else _open(self._box, sealed)


class RecipientSession(_Central):
    """The central's state: answer the nonce, reassemble notifications into GiftWraps meant
    for this pubkey, and name the acks to write."""

    def __init__(self, signing_key):
        super().__init__(signing_key)
        self.pubkey = bytes(signing_key.verify_key)
        self.received: dict[bytes, GiftWrap] = {}

    def on_notification(self, chunk: bytes) -> tuple[GiftWrap | None, bytes | None]:
        """(a new event, the EVENT_ACK to write) when a chunk completes one; a repeat of an
        event already held is acked again but not returned."""
        data = self._opened(chunk)
        if data is None:
            return None, None
        gw = _giftwrap(data)
        if gw.recipient != self.pubkey:
            raise CourierError("an event for someone else")
        eid = gw.event_id
        if eid in self.received:
            return None, eid
        self.received[eid] = gw
        return gw, eid


class TransferSession(_Central):
    """Another courier of the group, as a central: reassembles transfer forms into its own
    store (hop already counted) and acks each."""

    def __init__(self, signing_key, store: CourierStore, now: int):
        super().__init__(signing_key)
        self.store = store
        self.now = now
        self.taken = 0

    def on_notification(self, chunk: bytes) -> bytes | None:
        """The EVENT_ACK to write when a chunk completes an event."""
        data = self._opened(chunk)
        if data is None:
            return None
        e = from_transfer(data, self.now)
        self.taken += self.store.add(e, self.now)
        return e.event_id
