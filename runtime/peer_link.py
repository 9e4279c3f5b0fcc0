"""asyncio shell of the peer channel: a process hands landed envelopes to the processes on
other hosts that have their recipients online.

The local hand-off (runtime/handoff.py) reaches egress on the same host only. Across hosts:

* The trueseal push ingress listens (`PeerListener`, [cluster] peer_listen) and lists its
  peer key and endpoint in the store (delta_tables/peer_registry.py) under its lease epoch.
* Egress (`PeerDialer`, [cluster] peer_dial) lists its own key, dials every live ingress
  that listens (Noise IK: it must know the listener's key from the store, and the listener
  accepts only a key the store lists for a live host), and subscribes the trueseal
  mailboxes that have a session on it: on the first session, unsubscribed when the last
  closes, and again on every new channel. Subscriptions live with the channel.
* Right after a landing commit, ingress sends the hand-off over every channel that
  subscribed its mailbox (`PeerListener.send`), besides the local Unix hand-off; egress
  delivers it as an early envelope (`MailboxHub.add_early`). The stream stays the authority:
  the inbox row still comes and is matched by event_id, so a lost or late hand-off costs
  only earliness, and a duplicate one is ignored.
* The listener never blocks or raises into the push listener: past
  `cluster.peer_send_buffer_bytes` waiting for one peer, hand-offs to it are dropped (counted).
* PPP (and each protocol whose listener serves its own recipients) is both sides in one
  process, with one registration listing its protocols: its `PeerListener` sends its own
  STOREs' hand-offs, its `PeerDialer` (`register=False`) dials the other hosts' listeners
  of the same protocol and subscribes its own online recipients. A dialler dials only
  listeners whose registration lists one of its protocols.
* Every `peer_refresh_seconds` both sides read the live peers again: a channel whose other
  end is no longer listed (its lease or registration expired, it stopped) is closed.

* Heya and cursor-sync number their messages in the stream (a HAVE's seq, a NOTIFY's
  cursor), so nothing of theirs can be served before its inbox row, on one host or many.
  What the channel carries for them (and for PPP's rows) is the stream's wake-up: the
  listener on the stream's host, signalled by its commit (runtime/inbox_signal.py), sends
  WAKE to the same protocol's listeners on other hosts, which poll the inbox at once
  instead of at `egress.poll_interval_ms`. A dialler asks for them with a subscription of
  the empty mailbox.

Messages (the channel's payloads): one byte of kind, then SUBSCRIBE / UNSUBSCRIBE msgpack
[protocol, mailbox], HANDOFF `runtime.handoff.encode`, or WAKE msgpack [protocol]. Logs
name peers by node name only: no key bytes, no addresses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Protocol

import msgpack

from engine.peer_channel import (ChannelClosed, ChannelOpen, MessageReceived, PeerChannel,
                                 PeerIdentified, State)

from . import keys
from .handoff import Handoff, decode, encode

log = logging.getLogger("relay.peer")

PEER_KEY_FILE = "peer_static.key"
SUBSCRIBE, UNSUBSCRIBE, HANDOFF, WAKE = 1, 2, 3, 4
EVERY_MAILBOX = b""     # a subscription to a protocol's WAKEs
READ_SIZE = 65536
HANDSHAKE_TIMEOUT_SECONDS = 10.0
MAX_CHANNELS = 256              # connections to a listener, handshakes included
MAX_SUBSCRIPTIONS = 200_000     # mailboxes one channel may subscribe
# A forced read of the store when an unknown key knocks: at most this often.
LOOKUP_MIN_SECONDS = 1.0


def peer_key(data_dir) -> keys.RelayKey:
    """This host's peer key, `<data>/keys/peer_static.key` (0600, created on first start)."""
    return keys.load_or_create(data_dir, PEER_KEY_FILE)


def _sub(kind: int, protocol: str, mailbox: bytes) -> bytes:
    return bytes([kind]) + msgpack.packb([protocol, mailbox])


def _woken(payload: bytes) -> str | None:
    try:
        (protocol,) = msgpack.unpackb(payload[1:])
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    return protocol if isinstance(protocol, str) else None


class Peer(Protocol):
    """A registration as the store lists it (delta_tables.peer_registry.Peer)."""
    name: str
    role: str
    key: bytes
    endpoint: str

    def serves(self, protocol: str) -> bool: ...


class PeerStore(Protocol):
    """What the channel needs of the store, handed in by the role that opens it
    (delta_tables.peer_registry.PeerStore), so runtime/ stays below delta_tables/: the live
    registrations, and one of this process's own (register / renew / release)."""

    def live(self) -> list[Peer]: ...

    def registration(self, name: str, role: str, key: bytes, endpoint: str = "", **kw): ...


class PeerDirectory:
    """The live peers as the store lists them, read at most every `refresh_seconds` (in a
    worker thread) and at once, at most every `LOOKUP_MIN_SECONDS`, for an unknown key."""

    def __init__(self, store: PeerStore, refresh_seconds: float):
        self.store = store
        self.refresh_seconds = refresh_seconds
        self.peers: list[Peer] = []
        self._read_at = -1e9
        self._lock = asyncio.Lock()

    async def refresh(self, force: bool = False) -> list[Peer]:
        async with self._lock:
            now = time.monotonic()
            wait = LOOKUP_MIN_SECONDS if force else self.refresh_seconds
            if now - self._read_at >= wait:
                try:
                    self.peers = await asyncio.to_thread(self.store.live)
                except Exception as exc:   # the store out of reach: keep the last view
                    log.warning("peer list not read", extra={
                        "event": "peer_list_failed", "error": type(exc).__name__})
                self._read_at = time.monotonic()
            return self.peers

    def by_key(self, key: bytes) -> Peer | None:
        return next((p for p in self.peers if p.key == key), None)

    async def lookup(self, key: bytes) -> Peer | None:
        """The live peer with this key; an unknown key reads the store once more first (a
        host that registered since the last read)."""
        peer = self.by_key(key)
        if peer is None:
            await self.refresh(force=True)
            peer = self.by_key(key)
        return peer


class _Link:
    """One channel over one TCP connection: reads feed the core, sends are written on the
    next loop turn (a burst of hand-offs shares one Noise message), bounded."""

    def __init__(self, core: PeerChannel, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, buffer_max: int):
        self.core = core
        self.reader = reader
        self.writer = writer
        self.buffer_max = buffer_max
        self.peer: Peer | None = None
        self.subscribed: set[tuple[str, bytes]] = set()
        self._flushing = False
        self.sent = 0
        self.dropped = 0

    @property
    def open(self) -> bool:
        return self.core.state is State.OPEN and not self.writer.is_closing()

    def send(self, payload: bytes) -> bool:
        if self.core.state is State.CLOSED or self.writer.is_closing() \
                or len(payload) > self.core.max_message:
            return False
        if self.writer.transport.get_write_buffer_size() + self.core.queued + len(payload) \
                > self.buffer_max:
            self.dropped += 1
            return False
        self.core.send(payload)
        self.sent += 1
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self.flush)
        return True

    def flush(self) -> None:
        self._flushing = False
        data = self.core.data_to_send()
        if data and not self.writer.is_closing():
            self.writer.write(data)

    async def read_events(self) -> list:
        """The core's events after the next read; [ChannelClosed] at EOF or an error."""
        try:
            data = await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            data = b""
        if data:
            self.core.receive_data(data)
        else:
            self.core.receive_eof()
        return self.core.events_received()

    def close(self) -> None:
        self.core.close()
        self.writer.close()


class _Registered:
    """A registration renewed in the background (the listener's and the dialer's)."""

    def __init__(self, registration, renew_seconds: float):
        self.registration = registration
        self.renew_seconds = renew_seconds
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.registration.register)
        self._task = asyncio.create_task(self._renew(), name="peer-registration")

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                await asyncio.to_thread(self.registration.renew)
            except Exception as exc:   # retried at the next beat; past its expiry it lapses
                log.warning("peer registration not renewed", extra={
                    "event": "peer_register_failed", "error": type(exc).__name__})

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.to_thread(self.registration.release)


class PeerListener:
    """Ingress's side (a process that lands `protocols`): accepts the hosts the store lists,
    keeps their subscriptions, and `send`s each landed hand-off to the subscribers."""

    def __init__(self, settings, key: keys.RelayKey, store: PeerStore, name: str, *,
                 epoch: int = 0, host: str | None = None, port: int | None = None,
                 protocols=("trueseal",)):
        conf = settings.cluster
        self.conf = conf
        self.key = key
        self.host = host if host is not None else (conf.peer_bind or settings.bind)
        self.port = conf.peer_port if port is None else port
        self.advertise = conf.peer_advertise
        self.store = store
        self.name = name
        self.epoch = epoch
        self.protocols = tuple(protocols)
        self.lease_seconds = settings.ingress.lease_seconds
        self.renew_seconds = min(conf.peer_refresh_seconds, settings.ingress.lease_renew_seconds)
        self.directory = PeerDirectory(store, conf.peer_refresh_seconds)
        self.links: set[_Link] = set()
        self.by_mailbox: dict[tuple[str, bytes], set[_Link]] = {}
        self.bound_port: int | None = None
        self.sent = 0
        self.dropped = 0
        self.rejected = 0
        self._server: asyncio.base_events.Server | None = None
        self._registered: _Registered | None = None
        self._tasks: set[asyncio.Task] = set()
        self._watch: asyncio.Task | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.advertise or self.host}:{self.bound_port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.bound_port = self._server.sockets[0].getsockname()[1]
        self._registered = _Registered(
            self.store.registration(self.name, "ingress", self.key.public, self.endpoint,
                                    epoch=self.epoch, seconds=self.lease_seconds,
                                    protocols=self.protocols),
            self.renew_seconds)
        await self._registered.start()
        self._watch = asyncio.create_task(self._revalidate(), name="peer-revalidate")
        log.info("peer channel listening", extra={"event": "peer_listening",
                                                  "port": self.bound_port, "node": self.name})

    def send(self, h: Handoff) -> None:
        """After the landing commit: to every channel whose host has `h.mailbox` online."""
        links = self.by_mailbox.get((h.protocol, h.mailbox))
        if not links:
            return
        payload = bytes([HANDOFF]) + encode(h)
        for link in links:
            if link.send(payload):
                self.sent += 1
            else:
                self.dropped += 1

    def wake(self, protocol: str) -> None:
        """The stream on this host committed: to every channel that asked for `protocol`'s
        wake-ups."""
        links = self.by_mailbox.get((protocol, EVERY_MAILBOX))
        if not links:
            return
        payload = bytes([WAKE]) + msgpack.packb([protocol])
        for link in links:
            link.send(payload)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        if len(self._tasks) > MAX_CHANNELS:
            self._tasks.discard(task)
            writer.close()
            return
        link = _Link(PeerChannel(self.key.private_bytes, initiator=False), reader, writer,
                     self.conf.peer_send_buffer_bytes)
        try:
            if await asyncio.wait_for(self._handshake(link), HANDSHAKE_TIMEOUT_SECONDS):
                await self._serve(link)
        except asyncio.TimeoutError:
            log.info("peer handshake timed out", extra={"event": "peer_handshake_failed",
                                                        "reason": "timeout"})
        except asyncio.CancelledError:
            pass
        finally:
            self._drop(link)
            link.close()
            self._tasks.discard(task)

    async def _handshake(self, link: _Link) -> bool:
        while True:
            for ev in await link.read_events():
                if isinstance(ev, PeerIdentified):
                    peer = await self.directory.lookup(ev.remote_static)
                    if peer is None:
                        self.rejected += 1
                        log.warning("peer refused: its key is not listed for a live node",
                                    extra={"event": "peer_rejected", "reason": "not_listed"})
                        link.core.reject()
                        return False
                    link.peer = peer
                    link.core.accept()
                    link.flush()
                    self.links.add(link)
                    log.info("peer connected", extra={"event": "peer_connected",
                                                      "peer": peer.name})
                    return True
                if isinstance(ev, ChannelClosed):
                    if ev.reason != "eof":
                        log.info("peer handshake failed", extra={
                            "event": "peer_handshake_failed", "reason": ev.reason})
                    return False

    async def _serve(self, link: _Link) -> None:
        while True:
            for ev in await link.read_events():
                if isinstance(ev, MessageReceived):
                    self._message(link, ev.payload)
                elif isinstance(ev, ChannelClosed):
                    log.info("peer disconnected", extra={"event": "peer_disconnected",
                                                         "peer": link.peer.name,
                                                         "reason": ev.reason})
                    return

    def _message(self, link: _Link, payload: bytes) -> None:
        try:
            kind = payload[0]
            protocol, mailbox = msgpack.unpackb(payload[1:])
            if kind not in (SUBSCRIBE, UNSUBSCRIBE) or not isinstance(protocol, str) \
                    or not isinstance(mailbox, bytes):
                raise ValueError(kind)
        except (IndexError, ValueError, TypeError, msgpack.UnpackException):
            return      # not a message this version reads; the channel stays
        key = (protocol, mailbox)
        if kind == SUBSCRIBE:
            if key in link.subscribed or len(link.subscribed) >= MAX_SUBSCRIPTIONS:
                return
            link.subscribed.add(key)
            self.by_mailbox.setdefault(key, set()).add(link)
        elif key in link.subscribed:
            link.subscribed.discard(key)
            self._unsubscribe(link, key)

    def _unsubscribe(self, link: _Link, key) -> None:
        links = self.by_mailbox.get(key)
        if links is not None:
            links.discard(link)
            if not links:
                del self.by_mailbox[key]

    def _drop(self, link: _Link) -> None:
        self.links.discard(link)
        for key in link.subscribed:
            self._unsubscribe(link, key)
        link.subscribed.clear()

    async def _revalidate(self) -> None:
        """Close the channels of peers the store no longer lists as live."""
        while True:
            await asyncio.sleep(self.conf.peer_refresh_seconds)
            await self.directory.refresh()
            for link in list(self.links):
                if link.peer is not None and self.directory.by_key(link.peer.key) is None:
                    log.info("peer expired; channel closed", extra={
                        "event": "peer_expired", "peer": link.peer.name})
                    self._drop(link)
                    link.close()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._registered is not None:
            await self._registered.stop()


class PeerDialer:
    """The receiving side (egress; a PPP listener): dials every live listener of one of
    `protocols`, subscribes those protocols' mailboxes online here, and passes each
    hand-off to `deliver`. `register=False`: the process's `PeerListener` lists its key."""

    def __init__(self, settings, key: keys.RelayKey, store: PeerStore, name: str,
                 deliver: Callable[[Handoff], None],
                 online: Callable[[str], list[bytes]], *, protocols=("trueseal",),
                 register: bool = True, wakes: Callable[[str], None] | None = None):
        conf = settings.cluster
        self.conf = conf
        self.key = key
        self.store = store
        self.name = name
        self.deliver = deliver
        self.online = online
        self.protocols = tuple(protocols)
        self.wakes = wakes      # (protocol): another host's stream committed
        self.directory = PeerDirectory(store, conf.peer_refresh_seconds)
        self.renew_seconds = min(conf.peer_refresh_seconds, settings.ingress.lease_renew_seconds)
        self._registered = _Registered(
            store.registration(name, "egress", key.public,
                               seconds=settings.ingress.lease_seconds, protocols=self.protocols),
            self.renew_seconds) if register else None
        # by (name, key) of the listener: processes on one host share its key (one data dir)
        self.links: dict[tuple, _Link] = {}         # listener -> its channel
        self._dialing: dict[tuple, asyncio.Task] = {}  # listener -> its channel's task
        self._unreached: set[tuple] = set()     # dialled and failed since the last success
        self._loop_task: asyncio.Task | None = None
        self.received = 0
        self.malformed = 0

    async def start(self) -> None:
        if self._registered is not None:
            await self._registered.start()
        self._loop_task = asyncio.create_task(self._run(), name="peer-dialer")

    def watch(self, protocol: str, mailbox: bytes, online: bool) -> None:
        """MailboxHub.watch: a mailbox's first session opened, or its last closed."""
        if protocol not in self.protocols:
            return
        payload = _sub(SUBSCRIBE if online else UNSUBSCRIBE, protocol, mailbox)
        for link in self.links.values():
            if link.open:
                link.send(payload)

    async def _run(self) -> None:
        while True:
            peers = await self.directory.refresh()
            wanted = {(p.name, p.key): p for p in peers
                      if p.role == "ingress" and p.endpoint and p.key != self.key.public
                      and any(p.serves(proto) for proto in self.protocols)}
            for key, link in list(self.links.items()):
                if key not in wanted:
                    log.info("peer expired; channel closed", extra={
                        "event": "peer_expired", "peer": link.peer.name if link.peer else ""})
                    link.close()
            for key, peer in wanted.items():
                if key not in self._dialing:
                    task = asyncio.create_task(self._dial(peer), name="peer-dial")
                    self._dialing[key] = task
            await asyncio.sleep(self.conf.peer_refresh_seconds)

    async def _dial(self, peer: Peer) -> None:
        link = None
        try:
            host, _, port = peer.endpoint.rpartition(":")
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), HANDSHAKE_TIMEOUT_SECONDS)
            link = _Link(PeerChannel(self.key.private_bytes, initiator=True,
                                     remote_static=peer.key),
                         reader, writer, self.conf.peer_send_buffer_bytes)
            link.peer = peer
            link.flush()
            if not await asyncio.wait_for(self._opened(link), HANDSHAKE_TIMEOUT_SECONDS):
                return
            self.links[(peer.name, peer.key)] = link
            self._unreached.discard((peer.name, peer.key))
            for protocol in self.protocols:
                if self.wakes is not None:
                    link.send(_sub(SUBSCRIBE, protocol, EVERY_MAILBOX))
                for mailbox in self.online(protocol):
                    link.send(_sub(SUBSCRIBE, protocol, mailbox))
            log.info("peer connected", extra={"event": "peer_connected", "peer": peer.name})
            await self._serve(link)
        except (OSError, ValueError, asyncio.TimeoutError) as exc:
            if (peer.name, peer.key) not in self._unreached:    # once, not at every refresh
                self._unreached.add((peer.name, peer.key))
                log.info("peer not reached", extra={"event": "peer_dial_failed",
                                                    "peer": peer.name,
                                                    "error": type(exc).__name__})
        finally:
            self._dialing.pop((peer.name, peer.key), None)
            if link is not None:
                if self.links.get((peer.name, peer.key)) is link:
                    del self.links[(peer.name, peer.key)]
                link.close()

    async def _opened(self, link: _Link) -> bool:
        while True:
            for ev in await link.read_events():
                if isinstance(ev, ChannelOpen):
                    return True
                if isinstance(ev, ChannelClosed):
                    # a listener that does not list this host closes without a word; one
                    # whose key is not the one the store lists fails the handshake
                    log.warning("peer handshake failed", extra={
                        "event": "peer_handshake_failed", "peer": link.peer.name,
                        "reason": ev.reason})
                    return False

    async def _serve(self, link: _Link) -> None:
        while True:
            for ev in await link.read_events():
                if isinstance(ev, MessageReceived):
                    if ev.payload[:1] == bytes([WAKE]) and self.wakes is not None:
                        protocol = _woken(ev.payload)
                        if protocol in self.protocols:
                            self.wakes(protocol)
                            continue
                    h = decode(ev.payload[1:]) if ev.payload[:1] == bytes([HANDOFF]) else None
                    if h is None:
                        self.malformed += 1
                        continue
                    self.received += 1
                    self.deliver(h)
                elif isinstance(ev, ChannelClosed):
                    log.info("peer disconnected", extra={"event": "peer_disconnected",
                                                         "peer": link.peer.name,
                                                         "reason": ev.reason})
                    return

    async def close(self) -> None:
        tasks = [t for t in [self._loop_task, *self._dialing.values()] if t is not None]
        for link in list(self.links.values()):
            link.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._registered is not None:
            await self._registered.stop()
