"""Load generator for `relay bench`: a small asyncio trueseal client written from the spec.

It implements the initiator side of `Noise_NK_25519_ChaChaPoly_BLAKE2s` (push) and
`Noise_XX_25519_ChaChaPoly_BLAKE2s` (receive) directly on `cryptography` + `hashlib`, not on
the `noise` package the relay uses: a client ~2x cheaper per handshake (~200 vs ~450 us)
leaves the relay, not the load generator, as the thing being measured, and sharing no Noise
code with the relay means every handshake in the bench also checks the relay against the
spec. Wire format
(DESIGN.md "trueseal interoperability"): every Noise message is `[u16 BE len][bytes]`, empty
prologue and handshake payloads, one frame `[type u8][len u32 BE][body]` per transport message.

The worker functions at the bottom (`per_connection_worker`, `pipelined_worker`,
`e2e_worker`) run in processes started with the `spawn` method (delta-rs must never be
forked); they take plain picklable arguments and put one result dict on a queue.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import random
import struct
import time
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

NK_NAME = b"Noise_NK_25519_ChaChaPoly_BLAKE2s"
XX_NAME = b"Noise_XX_25519_ChaChaPoly_BLAKE2s"

TAG_PUSH, TAG_DELIVER, TAG_HEARTBEAT, TAG_ACK, TAG_ERROR, TAG_DELIVER_ACK = 1, 2, 3, 4, 5, 6
_HDR = struct.Struct(">BI")
_U64 = struct.Struct(">Q")
# egress/pending.EARLY_BASE: blob ids from here up were delivered before their inbox row (not
# imported: the client processes load none of the relay)
EARLY_BLOB_BASE = 1 << 62
# Bench envelopes start with this, then u64 sequence, u64 push time (ns since the epoch).
BENCH_MAGIC = b"RBENCH01"
_STAMP = struct.Struct(">8sQQ")


# --- Noise (initiator side only) ----------------------------------------------------------

def _hkdf2(ck: bytes, ikm: bytes) -> tuple[bytes, bytes]:
    temp = hmac.digest(ck, ikm, "blake2s")
    o1 = hmac.digest(temp, b"\x01", "blake2s")
    return o1, hmac.digest(temp, o1 + b"\x02", "blake2s")


def _nonce(n: int) -> bytes:
    return b"\x00\x00\x00\x00" + n.to_bytes(8, "little")


class CipherState:
    __slots__ = ("_aead", "n")

    def __init__(self, key: bytes):
        self._aead = ChaCha20Poly1305(key)
        self.n = 0

    def encrypt(self, plaintext: bytes, ad: bytes = b"") -> bytes:
        out = self._aead.encrypt(_nonce(self.n), plaintext, ad)
        self.n += 1
        return out

    def decrypt(self, ciphertext: bytes, ad: bytes = b"") -> bytes:
        out = self._aead.decrypt(_nonce(self.n), ciphertext, ad)
        self.n += 1
        return out


class _Symmetric:
    def __init__(self, name: bytes):
        self.h = name.ljust(32, b"\x00") if len(name) <= 32 else hashlib.blake2s(name).digest()
        self.ck = self.h
        self.cs: CipherState | None = None
        self.mix_hash(b"")   # empty prologue

    def mix_hash(self, data: bytes) -> None:
        self.h = hashlib.blake2s(self.h + data).digest()

    def mix_key(self, ikm: bytes) -> None:
        self.ck, k = _hkdf2(self.ck, ikm)
        self.cs = CipherState(k)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        ct = plaintext if self.cs is None else self.cs.encrypt(plaintext, self.h)
        self.mix_hash(ct)
        return ct

    def decrypt_and_hash(self, ciphertext: bytes) -> bytes:
        pt = ciphertext if self.cs is None else self.cs.decrypt(ciphertext, self.h)
        self.mix_hash(ciphertext)
        return pt

    def split(self) -> tuple[CipherState, CipherState]:
        k1, k2 = _hkdf2(self.ck, b"")
        return CipherState(k1), CipherState(k2)   # initiator: send with k1, receive with k2


def _pub(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes_raw()


def _dh(priv: X25519PrivateKey, pub: bytes) -> bytes:
    return priv.exchange(X25519PublicKey.from_public_bytes(pub))


class NKInitiator:
    """-> e, es   <- e, ee  (the relay's static key is pinned: `rs`)."""

    def __init__(self, relay_pub: bytes):
        self.sym = _Symmetric(NK_NAME)
        self.rs = relay_pub
        self.sym.mix_hash(relay_pub)          # pre-message <- s
        self.e = X25519PrivateKey.generate()

    def message1(self) -> bytes:
        epub = _pub(self.e)
        self.sym.mix_hash(epub)
        self.sym.mix_key(_dh(self.e, self.rs))
        return epub + self.sym.encrypt_and_hash(b"")          # 48 bytes

    def read_message2(self, msg: bytes) -> tuple[CipherState, CipherState]:
        re = msg[:32]
        self.sym.mix_hash(re)
        self.sym.mix_key(_dh(self.e, re))
        self.sym.decrypt_and_hash(msg[32:])                      # raises on a wrong relay key
        return self.sym.split()


class XXInitiator:
    """-> e   <- e, ee, s, es   -> s, se  (our static key is the mailbox)."""

    def __init__(self, static_priv: bytes):
        self.sym = _Symmetric(XX_NAME)
        self.s = X25519PrivateKey.from_private_bytes(static_priv)
        self.e = X25519PrivateKey.generate()
        self.remote_static: bytes | None = None
        self._re = b""

    def message1(self) -> bytes:
        epub = _pub(self.e)
        self.sym.mix_hash(epub)
        return epub + self.sym.encrypt_and_hash(b"")          # 32 bytes (no key yet)

    def read_message2(self, msg: bytes) -> None:
        self._re = msg[:32]
        self.sym.mix_hash(self._re)
        self.sym.mix_key(_dh(self.e, self._re))
        self.remote_static = self.sym.decrypt_and_hash(msg[32:80])
        self.sym.mix_key(_dh(self.e, self.remote_static))
        self.sym.decrypt_and_hash(msg[80:])

    def message3(self) -> tuple[bytes, CipherState, CipherState]:
        out = self.sym.encrypt_and_hash(_pub(self.s))
        self.sym.mix_key(_dh(self.s, self._re))
        out += self.sym.encrypt_and_hash(b"")                    # 64 bytes in all
        send, recv = self.sym.split()
        return out, send, recv


def static_public(priv: bytes) -> bytes:
    return _pub(X25519PrivateKey.from_private_bytes(priv))


# --- framing --------------------------------------------------------------------------------

def u16(msg: bytes) -> bytes:
    return len(msg).to_bytes(2, "big") + msg


def frame(tag: int, body: bytes = b"") -> bytes:
    return _HDR.pack(tag, len(body)) + body


class Deframer:
    """Cuts `[u16 BE len][message]` records out of the byte stream."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out, pos, buf = [], 0, self.buf
        while len(buf) - pos >= 2:
            n = (buf[pos] << 8) | buf[pos + 1]
            if len(buf) - pos - 2 < n:
                break
            out.append(bytes(buf[pos + 2:pos + 2 + n]))
            pos += 2 + n
        del buf[:pos]
        return out


class Closed(Exception):
    pass


class Conn:
    """One open trueseal session (after the handshake)."""

    def __init__(self, reader, writer, send: CipherState, recv: CipherState, deframer: Deframer,
                 early: list[bytes]):
        self.reader, self.writer = reader, writer
        self.send_cs, self.recv_cs = send, recv
        self.deframer = deframer
        self.pending = [self.recv_cs.decrypt(m) for m in early]

    def send_frame(self, plaintext: bytes) -> None:
        self.writer.write(u16(self.send_cs.encrypt(plaintext)))

    async def frames(self) -> list[bytes]:
        """At least one decrypted frame (or Closed at EOF)."""
        while not self.pending:
            data = await self.reader.read(65536)
            if not data:
                raise Closed()
            self.pending = [self.recv_cs.decrypt(m) for m in self.deframer.feed(data)]
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:
            pass


async def _read_message(reader, deframer: Deframer) -> tuple[bytes, list[bytes]]:
    while True:
        data = await reader.read(65536)
        if not data:
            raise Closed("relay closed during the handshake")
        msgs = deframer.feed(data)
        if msgs:
            return msgs[0], msgs[1:]


async def connect_nk(host: str, port: int, relay_pub: bytes,
                     source: str | None = None) -> Conn:
    reader, writer = await asyncio.open_connection(
        host, port, local_addr=(source, 0) if source else None)
    try:
        hs = NKInitiator(relay_pub)
        writer.write(u16(hs.message1()))
        deframer = Deframer()
        msg2, early = await _read_message(reader, deframer)
        send, recv = hs.read_message2(msg2)
        return Conn(reader, writer, send, recv, deframer, early)
    except BaseException:
        writer.close()
        raise


async def connect_xx(host: str, port: int, relay_pub: bytes, static_priv: bytes) -> Conn:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        hs = XXInitiator(static_priv)
        writer.write(u16(hs.message1()))
        deframer = Deframer()
        msg2, early = await _read_message(reader, deframer)
        hs.read_message2(msg2)
        if hs.remote_static != relay_pub:
            raise Closed("relay static key mismatch")
        msg3, send, recv = hs.message3()
        writer.write(u16(msg3))
        return Conn(reader, writer, send, recv, deframer, early)
    except BaseException:
        writer.close()
        raise


def push_frame(recipient: bytes, envelope: bytes) -> bytes:
    return frame(TAG_PUSH, recipient + envelope)


def deliver_ack_frame(blob_id: int) -> bytes:
    return frame(TAG_DELIVER_ACK, _U64.pack(blob_id))


def bench_envelope(seq: int, size: int, filler: bytes) -> bytes:
    """`size` bytes: magic, seq, push time (ns), then filler; unique per seq and time."""
    head = _STAMP.pack(BENCH_MAGIC, seq, time.time_ns())
    return head + filler[:size - len(head)]


def read_stamp(envelope: bytes) -> tuple[int, int] | None:
    if len(envelope) < _STAMP.size or envelope[:8] != BENCH_MAGIC:
        return None
    _, seq, ns = _STAMP.unpack_from(envelope)
    return seq, ns


# --- push shapes ------------------------------------------------------------------------------

async def push_once(host: str, port: int, relay_pub: bytes, recipient: bytes,
                    envelope: bytes, source: str | None = None) -> bool:
    """What the real client does per blob: connect, NK, one Push, wait for its reply, close."""
    conn = await connect_nk(host, port, relay_pub, source)
    try:
        conn.send_frame(push_frame(recipient, envelope))
        replies = await conn.frames()
        return replies[0][0] == TAG_ACK
    finally:
        conn.close()


class _Counter:
    """Acks per 100 ms bucket since `t0` (wall clock), so workers can be summed."""

    def __init__(self, t0: float, buckets: int):
        self.t0 = t0
        self.buckets = [0] * buckets
        self.total = 0
        self.errors = 0

    def add(self, n: int = 1) -> None:
        self.total += n
        i = int((time.time() - self.t0) * 10)
        if 0 <= i < len(self.buckets):
            self.buckets[i] += n


NETNS_SOURCES = 200     # addresses .2-.201 of the load generator's /24 in its namespace


def source_address(seed: int, i: int, host: str = "127.0.0.1") -> str:
    """The loopback address (127.0.0.0/8) the `i`th in-flight push loop of client process
    `seed` connects from. Real clients push from many addresses; 128 connections in flight from
    one address are what the handshake gate (runtime/handshake_gate.py) takes for a flood once
    the loop is busy: past `PER_KEY` queued steps it dropped the address's oldest, and 5-8% of
    the bench's connections ended "relay closed during the handshake" (work wasted on both
    sides). Never 127.0.0.1, which tests and people use. With the relay at `host` in another
    network (`relay bench --trueseal-netns`), one of the load generator's own addresses
    there."""
    if not host.startswith("127."):
        return f"{host.rsplit('.', 1)[0]}.{(seed * 128 + i) % NETNS_SOURCES + 2}"
    return f"127.{seed % 254 + 1}.{i // 250}.{i % 250 + 1}"


def _recipients(n: int, seed: int) -> list[bytes]:
    rnd = random.Random(seed)
    return [rnd.randbytes(32) for _ in range(n)]


async def _wait_go(queue, go) -> float:
    """Tell the coordinator we are ready, wait for its start signal; returns the start time."""
    queue.put({"ok": True, "ready": True})
    await asyncio.to_thread(go.wait)
    return time.time()


async def _per_connection(queue, go, host, port, relay_pub, duration, concurrency, size,
                          mailboxes, seed) -> dict:
    recips = _recipients(mailboxes, seed)
    filler = os.urandom(size)
    seq = seed << 40
    lat: list[float] = []
    failures: list[str] = []
    start_at = await _wait_go(queue, go)
    cpu0 = time.process_time()
    counter = _Counter(start_at, int(duration * 10) + 50)
    end_at = start_at + duration

    async def loop_one(source: str | None) -> None:
        nonlocal seq
        while time.time() < end_at:
            seq += 1
            env = bench_envelope(seq, size, filler)
            t = time.perf_counter()
            try:
                ok = await push_once(host, port, relay_pub, recips[seq % len(recips)], env,
                                     source)
            except (OSError, Closed, asyncio.IncompleteReadError) as exc:
                counter.errors += 1
                if len(failures) < 5:
                    failures.append(f"{type(exc).__name__}: {exc}" if str(exc)
                                    else type(exc).__name__)
                await asyncio.sleep(0.01)
                continue
            if ok:
                counter.add()
                if len(lat) < 200_000:
                    lat.append(time.perf_counter() - t)
            else:
                counter.errors += 1

    await asyncio.gather(*(loop_one(source_address(seed, i, host))
                           for i in range(concurrency)))
    return {"buckets": counter.buckets, "acked": counter.total, "errors": counter.errors,
            "latency_s": lat, "failures": failures, "cpu_s": time.process_time() - cpu0}


async def _pipelined(queue, go, host, port, relay_pub, duration, sessions, window, size,
                     mailboxes, seed) -> dict:
    recips = _recipients(mailboxes, seed)
    filler = os.urandom(size)
    failures: list[str] = []
    conns = []
    for _ in range(sessions):     # open all sessions before the clock starts
        conns.append(await connect_nk(host, port, relay_pub))
    seq0 = [seed << 40]
    start_at = await _wait_go(queue, go)
    cpu0 = time.process_time()
    counter = _Counter(start_at, int(duration * 10) + 50)
    end_at = start_at + duration

    async def run_session(conn: Conn) -> None:
        outstanding = 0
        room = asyncio.Event()
        drained = asyncio.Event()

        async def reader() -> None:
            nonlocal outstanding
            while True:
                for f in await conn.frames():
                    if f[0] == TAG_ACK:
                        counter.add()
                    else:
                        counter.errors += 1
                    outstanding -= 1
                room.set()
                if outstanding == 0:
                    drained.set()

        rtask = asyncio.create_task(reader())
        try:
            while time.time() < end_at:
                if outstanding >= window:
                    room.clear()
                    await room.wait()
                    continue
                n = window - outstanding
                for _ in range(n):
                    seq0[0] += 1
                    s = seq0[0]
                    conn.send_frame(push_frame(recips[s % len(recips)],
                                               bench_envelope(s, size, filler)))
                outstanding += n
                await conn.writer.drain()
            if outstanding:
                drained.clear()
                await asyncio.wait_for(drained.wait(), 60)
        except (OSError, Closed, asyncio.TimeoutError) as exc:
            if len(failures) < 5:
                failures.append(type(exc).__name__)
        finally:
            rtask.cancel()
            conn.close()

    await asyncio.gather(*(run_session(c) for c in conns))
    return {"buckets": counter.buckets, "acked": counter.total, "errors": counter.errors,
            "failures": failures, "cpu_s": time.process_time() - cpu0}


# --- push -> deliver latency ------------------------------------------------------------------

async def _e2e(host, push_port, recv_port, relay_pub, rate, duration, size, receivers, seed,
               drain_timeout, warmup_pushes=20, recv_pub=None) -> dict:
    """`recv_pub`: the receive side's relay key when it is another host's (`--hosts`)."""
    rnd = random.Random(seed)
    privs = [rnd.randbytes(32) for _ in range(receivers)]
    mailboxes = [static_public(p) for p in privs]
    filler = os.urandom(size)
    arrivals: dict[int, int] = {}      # seq -> Deliver arrival ns (first Deliver only)
    duplicates = 0
    early: set[int] = set()            # delivered before their inbox row (provisional blob ids)
    sent: dict[int, int] = {}          # seq -> push time ns (written into the envelope)
    acked_at: dict[int, int] = {}      # seq -> Ack arrival ns
    ack_lat: list[float] = []
    errors = 0
    failures: list[str] = []
    loop = asyncio.get_running_loop()

    async def receive(priv: bytes) -> None:
        nonlocal duplicates
        conn = await connect_xx(host, recv_port, recv_pub or relay_pub, priv)
        try:
            while True:
                for f in await conn.frames():
                    now = time.time_ns()
                    tag = f[0]
                    if tag == TAG_DELIVER:
                        (n,) = struct.unpack_from(">I", f, 1)
                        body = f[5:5 + n]
                        blob_id = _U64.unpack_from(body)[0]
                        stamp = read_stamp(body[8:])
                        if stamp is not None:
                            if stamp[0] in arrivals:
                                duplicates += 1
                            else:
                                arrivals[stamp[0]] = now
                                if blob_id >= EARLY_BLOB_BASE:
                                    early.add(stamp[0])
                        conn.send_frame(deliver_ack_frame(blob_id))
                    elif tag == TAG_HEARTBEAT:
                        conn.send_frame(f)
        except (Closed, OSError, asyncio.CancelledError):
            pass
        finally:
            conn.close()

    async def one(seq: int, record: bool) -> None:
        nonlocal errors
        env = bench_envelope(seq, size, filler)
        sent[seq] = read_stamp(env)[1]
        t = time.perf_counter()
        try:
            ok = await push_once(host, push_port, relay_pub, mailboxes[seq % receivers], env)
        except (OSError, Closed) as exc:
            ok = False
            if len(failures) < 5:
                failures.append(type(exc).__name__)
        if not ok:
            sent.pop(seq, None)
            if record:
                errors += 1
        elif record:
            acked_at[seq] = time.time_ns()
            ack_lat.append(time.perf_counter() - t)

    async def wait_delivered(seqs, timeout: float) -> None:
        deadline = loop.time() + timeout
        while loop.time() < deadline and any(s in sent and s not in arrivals for s in seqs):
            await asyncio.sleep(0.05)

    recv_tasks = [asyncio.create_task(receive(p)) for p in privs]
    await asyncio.sleep(1.0)           # sessions open before the first push
    # Warm-up (not counted): the first micro-batches of a fresh query are slower.
    warm = range(1 << 40, (1 << 40) + warmup_pushes)
    for s in warm:
        await one(s, False)
        await asyncio.sleep(0.05)
    await wait_delivered(warm, 60)
    for s in warm:
        sent.pop(s, None)

    # Open loop at a fixed rate: push i starts at t0 + i/rate, however long others take.
    tasks = []
    t0 = loop.time()
    total = int(rate * duration)
    for i in range(total):
        delay = t0 + i / rate - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, True)))
    await asyncio.gather(*tasks)
    send_seconds = loop.time() - t0
    await wait_delivered(range(total), drain_timeout)
    for t in recv_tasks:
        t.cancel()
    await asyncio.gather(*recv_tasks, return_exceptions=True)
    lat_ms = [(arrivals[s] - sent[s]) / 1e6 for s in range(total)
              if s in sent and s in arrivals]
    # (seq, push ns, ack ns, deliver ns or None): for the per-stage breakdown.
    records = [(s, sent[s], acked_at.get(s), arrivals.get(s)) for s in range(total) if s in sent]
    return {"pushed": total, "acked": sum(1 for s in range(total) if s in sent),
            "push_errors": errors, "delivered": len(lat_ms), "duplicates": duplicates,
            "early": sum(1 for s in range(total) if s in sent and s in early),
            "latency_ms": lat_ms, "ack_latency_ms": [x * 1000 for x in ack_lat],
            "records": records,
            "send_seconds": send_seconds, "failures": failures, "warmup": warmup_pushes}


# --- process entry points (spawned) -------------------------------------------------------------

def _run_worker(queue, fn: Callable, *args) -> None:
    try:
        queue.put({"ok": True, **asyncio.run(fn(*args))})
    except BaseException as exc:   # the coordinator must hear about it, not hang
        queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def per_connection_worker(queue, go, host, port, relay_pub, duration, concurrency, size,
                          mailboxes, seed) -> None:
    _run_worker(queue, _per_connection, queue, go, host, port, relay_pub, duration, concurrency,
                size, mailboxes, seed)


def pipelined_worker(queue, go, host, port, relay_pub, duration, sessions, window, size,
                     mailboxes, seed) -> None:
    _run_worker(queue, _pipelined, queue, go, host, port, relay_pub, duration, sessions, window,
                size, mailboxes, seed)


def e2e_worker(queue, host, push_port, recv_port, relay_pub, rate, duration, size, receivers,
               seed, drain_timeout, recv_pub=None) -> None:
    _run_worker(queue, _e2e, host, push_port, recv_port, relay_pub, rate, duration, size,
                receivers, seed, drain_timeout, 20, recv_pub)
