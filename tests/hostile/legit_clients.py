"""The legitimate clients of the hostile-load suite: one per protocol, each doing a full round
trip (store, then deliver or fetch) every ~2 s from 127.0.0.1, on fresh connections each time
so a listener that locks newcomers out shows, and remembering everything the relay acked so
that the suite can check at the end that none of it was lost.

* trueseal: receive session (Noise XX, device key) opened, Push on a new NK session -> Ack,
  the Deliver of that envelope on the receive session -> DeliverAck.
* Heya: the mailbox certificate connects (greeting with LAST), a sender connects, SEND ->
  RECV, the mailbox gets HAVE, WANT -> GIVE.
* PPP: a new sender key logs in (CHALLENGE/AUTH), STORE -> STORED, the recipient logs in and
  FETCHes until the event is there (a fresh recipient key per round: FETCH is 30/min per key).
* cursor-sync: a member device connects (QUIC, Auth proof, HELLO), PUSH -> PUSH_ACK, another
  member connects and PULLs the blob at its cursor (devices rotate: 10 connections/min each).
* cursor-sync over iroh (`sync_iroh`): the same round as a stock 0k-sync client makes it (the
  device id is the iroh key; Join once, then HELLO on every connection).

`Prober` runs them all on an event loop of its own (a thread), records one `Sample` per round
and can `verify()` the acked messages afterwards.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from nacl.bindings import crypto_scalarmult_base
from nacl.signing import SigningKey

from heya_client import Cert, HeyaClient, recv_line, send_line
from ppp_wire import Ws, giftwrap
from sync_client import Device, device_session, group_id, hello, join, pull, push
from sync_iroh_client import IrohSyncClient, bind
from trueseal_client import ACK, HEARTBEAT, NK, XX, AsyncClient, deliver_ack_frame, push_frame

PROTOCOLS = ("trueseal", "heya", "ppp", "sync", "sync_iroh")
HEYA_END = 4102444800   # AUTH send tokens valid until 2100


@dataclass
class Sample:
    protocol: str
    start: float            # time.time()
    end: float
    ok: bool
    error: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


class Trueseal:
    name = "trueseal"

    def __init__(self, relay) -> None:
        self.push_port = relay.ports["TRUESEAL_PUSH"]
        self.receive_port = relay.ports["TRUESEAL_RECEIVE"]
        self.relay_pub = bytes.fromhex(relay.keys["trueseal"])
        self.device = os.urandom(32)
        self.mailbox = crypto_scalarmult_base(self.device)
        self.acked: set[bytes] = set()
        self.delivered: set[bytes] = set()

    async def setup(self) -> None:
        pass

    async def receive(self) -> AsyncClient:
        return await AsyncClient.connect(self.receive_port, XX, self.relay_pub, self.device)

    async def take(self, rx: AsyncClient, timeout: float) -> bytes | None:
        """The next delivered envelope (acked at once), or None at EOF."""
        while True:
            frame = await rx.recv_frame(timeout)
            if frame is None:
                return None
            if frame[0] == 0x02:               # Deliver: blob_id u64, envelope
                blob_id = int.from_bytes(frame[5:13], "big")
                rx.send(deliver_ack_frame(blob_id))
                envelope = frame[13:5 + int.from_bytes(frame[1:5], "big")]
                self.delivered.add(envelope)
                return envelope
            if frame[0] == 0x03:               # Heartbeat: echoed (interop §7)
                rx.send(HEARTBEAT)

    async def round(self) -> None:
        rx = await self.receive()
        try:
            tx = await AsyncClient.connect(self.push_port, NK, self.relay_pub)
            try:
                envelope = os.urandom(48)
                tx.send(push_frame(self.mailbox, envelope))
                reply = await tx.recv_frame(15)
                assert reply == ACK, f"push answered {reply!r}"
                self.acked.add(envelope)
            finally:
                tx.close()
            while True:
                got = await self.take(rx, 15)
                assert got is not None, "receive session closed before the Deliver"
                if got == envelope:
                    return
        finally:
            rx.close()

    async def verify(self) -> dict:
        rx = await self.receive()
        try:
            while not self.acked <= self.delivered:
                if await self.take(rx, 20) is None:
                    break
        except asyncio.TimeoutError:
            pass
        finally:
            rx.close()
        return {"acked": len(self.acked), "missing": len(self.acked - self.delivered)}


class Heya:
    name = "heya"

    def __init__(self, relay, workdir: Path) -> None:
        self.port = relay.ports["HEYA"]
        self.inbox_token = relay.inbox_token
        self.workdir = workdir
        self.acked: list[bytes] = []
        self.token = b""

    async def setup(self) -> None:
        self.rx_cert = Cert(self.workdir, "legit-mailbox")
        self.tx_cert = Cert(self.workdir, "legit-sender")
        c = await HeyaClient.connect(self.port, self.rx_cert)
        try:
            c.send(b"INCO " + self.inbox_token + b"\n")
            await c.expect(b"INCO " + self.inbox_token + b"\n")
            c.send(b"AUTH 0 %d\n" % HEYA_END)
            line = await c.read_line()
            assert line.startswith(b"AUTH "), line
            self.token = line.split()[1]
        finally:
            c.close()

    async def mailbox(self) -> tuple[HeyaClient, int]:
        """Connected as the mailbox; the next sequence number of the send token (LAST)."""
        rx = await HeyaClient.connect(self.port, self.rx_cert, greeting=None)
        next_seq = 0
        while True:
            line = await rx.read_line(15)
            assert line, "closed during the greeting"
            if line.startswith(b"LAST " + self.token + b" "):
                next_seq = int(line.split()[2])
            if line == b"DONE\n":
                return rx, next_seq

    async def round(self) -> None:
        rx, seq = await self.mailbox()
        try:
            tx = await HeyaClient.connect(self.port, self.tx_cert)
            try:
                body = os.urandom(24).hex().encode()
                tx.send(send_line(self.token, body))
                await tx.expect(recv_line(body), 15)
                self.acked.append(body)
            finally:
                tx.close()
            while True:
                line = await rx.read_line(15)
                assert line, "mailbox connection closed before HAVE"
                if line.startswith(b"HAVE " + self.token + b" ") and int(line.split()[2]) > seq:
                    break
            rx.send(b"WANT %s %d\n" % (self.token, seq))
            await rx.expect(b"GIVE %s %d %d\n%s\n" % (self.token, seq, len(body), body), 15)
        finally:
            rx.close()

    async def verify(self) -> dict:
        rx, top = await self.mailbox()
        got = set()
        try:
            for seq in range(top):
                rx.send(b"WANT %s %d\n" % (self.token, seq))
                head = await rx.read_line(15)
                if head.startswith(b"GIVE "):
                    n = int(head.split()[3])
                    got.add((await rx.read_exact(n + 1, 15))[:-1])
        finally:
            rx.close()
        return {"acked": len(self.acked), "missing": len(set(self.acked) - got)}


class Ppp:
    name = "ppp"

    def __init__(self, relay) -> None:
        self.port = relay.ports["PPP"]
        self.acked: list[tuple[SigningKey, bytes]] = []

    async def setup(self) -> None:
        pass

    async def fetch_until(self, bob: SigningKey, wrap: bytes, budget: float) -> bool:
        b = await Ws.login(self.port, bob)
        try:
            end = time.monotonic() + budget
            polls = 0
            while time.monotonic() < end:
                reply = await b.call({"cmd": "FETCH", "since": 0})
                polls += 1
                if reply.get("cmd") == "EVENTS" and wrap in reply["events"]:
                    return True
                # C.3: FETCH is 30 per minute per key: quick polls first, then slower
                await asyncio.sleep(0.1 if polls < 10 else 0.5)
            return False
        finally:
            await b.close()

    async def round(self) -> None:
        alice, bob = SigningKey.generate(), SigningKey.generate()
        a = await Ws.login(self.port, alice)
        try:
            wrap, _ = giftwrap(bytes(bob.verify_key), ciphertext=os.urandom(200))
            reply = await a.call({"cmd": "STORE", "event": wrap})
            assert reply.get("cmd") == "STORED", reply
            self.acked.append((bob, wrap))
        finally:
            await a.close()
        assert await self.fetch_until(bob, wrap, 14), "never fetched"

    async def verify(self) -> dict:
        missing = 0
        for bob, wrap in self.acked:
            try:
                if not await self.fetch_until(bob, wrap, 5):
                    missing += 1
            except Exception:
                missing += 1
        return {"acked": len(self.acked), "missing": missing}


class Sync:
    name = "sync"
    DEVICES = 4   # per side: each device connects at most every 8 s (10 per minute allowed)

    def __init__(self, relay) -> None:
        self.port = relay.ports["SYNC"]
        self.group = group_id(os.urandom(16))
        self.acked: dict[bytes, int] = {}
        self.turn = 0

    async def session(self, device: Device, *, admission: list | None = None,
                      version: int = 2) -> tuple:
        """A new connection of `device`, joined (with `admission`) and HELLO'd: the client
        and the WELCOME."""
        return await device_session(self.port, device, self.group, admission=admission,
                                    version=version)

    async def setup(self) -> None:
        self.founder = Device()
        c, welcome = await self.session(self.founder, version=1)
        await c.close()
        assert welcome and welcome[0] == "Welcome", welcome
        self.pushers = [Device() for _ in range(self.DEVICES)]
        self.pullers = [Device() for _ in range(self.DEVICES)]
        expires = int(time.time()) + 86400
        for d in self.pushers + self.pullers:
            c, welcome = await self.session(d, admission=[
                self.founder.id, expires, self.founder.admit(self.group, d.id, expires)])
            await c.close()
            assert welcome and welcome[0] == "Welcome", welcome

    async def round(self) -> None:
        pusher = self.pushers[self.turn % self.DEVICES]
        puller = self.pullers[self.turn % self.DEVICES]
        self.turn += 1
        c, welcome = await self.session(pusher)
        try:
            assert welcome and welcome[0] == "Welcome", welcome
            blob = os.urandom(16)
            ack = await c.request(push(blob, os.urandom(64), 0))
            assert ack and ack[0] == "PushAck" and bytes(ack[1]) == blob, ack
            self.acked[blob] = ack[2]
        finally:
            await c.close()
        c, welcome = await self.session(puller)
        try:
            assert welcome and welcome[0] == "Welcome", welcome
            page = await c.request(pull(ack[2] - 1, 10))
            assert page and any(bytes(e[0]) == blob for e in page[1]), page
        finally:
            await c.close()

    async def verify(self) -> dict:
        c, _ = await self.session(self.pullers[0])
        seen: dict[bytes, int] = {}
        try:
            after = 0
            while True:
                page = await c.request(pull(after, 1000))
                for e in page[1]:
                    seen[bytes(e[0])] = e[1]
                if not page[2] or page[3] <= after:
                    break
                after = page[3]
        finally:
            await c.close()
        missing = sum(1 for blob, cur in self.acked.items() if seen.get(blob) != cur)
        return {"acked": len(self.acked), "missing": missing}


class SyncIroh(Sync):
    """The same round over the iroh endpoint, as a stock 0k-sync client makes it: the device
    id is the iroh key, no Auth exchange; Join (our extension) once, HELLO on every
    connection. An endpoint is bound per connection, in the running loop (setup and the
    rounds run on different loops)."""
    name = "sync_iroh"

    def __init__(self, relay) -> None:
        super().__init__(relay)
        self.relay_id = relay.keys["sync-iroh-endpoint-id"]
        self.addresses = [f"127.0.0.1:{relay.ports['SYNC_IROH']}"]

    async def session(self, device: Device, *, admission: list | None = None,
                      version: int = 1) -> tuple:
        c = await IrohSyncClient.connect(self.relay_id, self.addresses,
                                         await bind(bytes(device.key)))
        c._own = True                        # its endpoint closes with it
        try:
            if admission is not None:
                assert await c.request(join(self.group, *admission)) == ["Done", "Join"]
            return c, await c.request(hello(version, "legit", self.group))
        except BaseException:
            await c.close()
            raise


class Prober:
    """Runs every protocol's round trip every `period` seconds in a thread of its own."""

    def __init__(self, relay, workdir: Path, *, period: float = 2.0, timeout: float = 15.0):
        self.clients = [Trueseal(relay), Heya(relay, workdir), Ppp(relay), Sync(relay),
                        SyncIroh(relay)]
        self.period = period
        self.timeout = timeout
        self.samples: list[Sample] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def start(self) -> None:
        """Set every client up (inbox token, mailbox, group...), then start the rounds."""
        async def setup_all():
            errors = {}
            for c in self.clients:
                try:
                    await asyncio.wait_for(c.setup(), 60)
                except Exception as e:
                    errors[c.name] = f"{type(e).__name__}: {e}"
            return errors
        loop = asyncio.new_event_loop()
        try:
            errors = loop.run_until_complete(setup_all())
        finally:
            loop.close()
        if errors:
            raise RuntimeError(f"legitimate client setup failed: {errors}")
        self.resume()

    def resume(self) -> None:
        started = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._stop = asyncio.Event()
            started.set()
            self._loop.run_until_complete(
                asyncio.gather(*(self._loop_one(c) for c in self.clients)))
            self._loop.close()

        self._thread = threading.Thread(target=run, name="legit-prober", daemon=True)
        self._thread.start()
        started.wait(10)

    async def _loop_one(self, client) -> None:
        # spread the protocols over the period so their rounds do not start together
        await asyncio.sleep(self.period * self.clients.index(client) / len(self.clients))
        while not self._stop.is_set():
            start, t0 = time.time(), time.monotonic()
            try:
                await asyncio.wait_for(client.round(), self.timeout)
                sample = Sample(client.name, start, start + time.monotonic() - t0, True)
            except Exception as e:
                sample = Sample(client.name, start, start + time.monotonic() - t0, False,
                                f"{type(e).__name__}: {e}"[:200])
            with self._lock:
                self.samples.append(sample)
            left = self.period - (time.monotonic() - t0)
            if left > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), left)
                except asyncio.TimeoutError:
                    pass

    def between(self, t0: float, t1: float) -> list[Sample]:
        """Rounds whose time overlaps [t0, t1]."""
        with self._lock:
            return [s for s in self.samples if s.start <= t1 and s.end >= t0]

    def count(self, protocol: str, since: float, ok: bool = True) -> int:
        with self._lock:
            return sum(1 for s in self.samples
                       if s.protocol == protocol and s.start >= since and s.ok == ok)

    def pause(self) -> None:
        """Stop the rounds (before `verify`; `resume` starts them again)."""
        if self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(60)

    def verify(self) -> dict:
        """Every acked message delivered / fetchable (run after `pause`)."""
        async def all_of():
            out = {}
            for c in self.clients:
                try:
                    out[c.name] = await asyncio.wait_for(c.verify(), 120)
                except Exception as e:
                    out[c.name] = {"acked": len(c.acked), "missing": None,
                                   "error": f"{type(e).__name__}: {e}"[:200]}
            return out
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(all_of())
        finally:
            loop.close()
