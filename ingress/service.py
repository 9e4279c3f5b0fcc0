"""An ingress node: protocol listeners over one group-committed landing table.

One node runs every listener (`relay ingress`) or one protocol's (`relay ingress --protocol
P`, what `relay up` starts for each protocol by default: ingress.process_per_protocol). The
Heya, PPP and cursor-sync listeners both send (-> landing, through the node's appender) and
receive (they read the inbox), and their control tables are owned by the process that runs
them: one process per protocol keeps a single owner."""

from __future__ import annotations

import asyncio
import logging

from delta_tables.group_commit import GroupCommitAppender, LandingTarget
from delta_tables.layout import Layout
from delta_tables.node_claim import NodeClaim
from delta_tables.node_lease import LeaseLost, NodeLease
from runtime import keys, metrics, open_files
from runtime.operator_errors import operator_line
from runtime.config import INGRESS_PROTOCOLS, Settings, ingress_protocols, ingress_role
from runtime.role import run_role

# Each listener's module is imported only by a process that runs it: a process of one
# protocol (`relay up`'s default) then starts without the others' libraries (FastAPI alone
# is ~0.7 s of imports), and four of them starting together on two cores ack sooner.

log = logging.getLogger("relay.ingress")


class IngressNode:
    def __init__(self, settings: Settings, *, fsync: bool = True, protocol: str | None = None,
                 lease: NodeLease | None = None):
        """Every listener, or only `protocol`'s. A process of one protocol is a node of its
        own (`<node_id>-<protocol>`, its own landing tables: one writer per table) and the
        owner of that protocol's control tables."""
        if protocol is not None and protocol not in INGRESS_PROTOCOLS:
            raise ValueError(f"unknown protocol {protocol!r}: one of "
                             f"{', '.join(INGRESS_PROTOCOLS)}")
        self.settings = settings
        self.layout = Layout.of(settings)
        conf = settings.ingress
        self.node_id = node_id(settings, protocol)
        self.target = LandingTarget(self.layout, self.node_id,
                                    commits_per_generation=conf.commits_per_generation,
                                    max_age_seconds=conf.generation_max_age_seconds,
                                    fsync=fsync, lease=lease)
        self.appender = GroupCommitAppender(self.target, max_rows=conf.max_rows_per_commit,
                                            inline_rows=conf.inline_commit_rows)
        wanted = set(ingress_protocols(settings) if protocol is None else [protocol])
        self.key = keys.load_or_create(settings.data_dir)
        self.trueseal = self.heya = self.sync = self.ppp = None
        self.peers = self.dialer = None
        if "trueseal" in wanted:
            from .trueseal_push import PushServer
            self.trueseal = PushServer(settings, self.appender, self.key)
        if "heya" in wanted:
            from .heya import HeyaServer
            self.heya = HeyaServer(settings, self.appender, fsync=fsync)
        if "sync" in wanted:
            from .sync_quic import SyncServer
            self.sync = SyncServer(settings, self.appender, fsync=fsync)
        if "ppp" in wanted:
            from .ppp_app import PppServer
            self.ppp = PppServer(settings, self.appender, fsync=fsync)
        self._peer_channel(settings, lease)

    def _peer_channel(self, settings: Settings, lease) -> None:
        """Other hosts get what lands here at once (`peer_listen`: trueseal pushes for their
        egress, PPP STOREs for their PPP listeners) and the stream's wake-ups this host
        hears (PPP, Heya, cursor-sync); with `peer_dial` a PPP, Heya or cursor-sync listener
        dials the others' for its own. One registration per process, listing its protocols
        (runtime/peer_link.py)."""
        cluster = settings.cluster
        tailing = {p: srv for p, srv in (("ppp", self.ppp), ("heya", self.heya),
                                         ("sync", self.sync)) if srv is not None}
        sends = ["trueseal"] if self.trueseal is not None and settings.trueseal.early_delivery \
            else []
        sends += list(tailing)
        listen = cluster.peer_listen and bool(sends)
        dial = cluster.peer_dial and bool(tailing)
        if not (listen or dial):
            return
        from delta_tables.peer_registry import PeerStore
        from runtime.peer_link import PeerDialer, PeerListener, peer_key
        key = peer_key(settings.data_dir)
        store = PeerStore(self.layout.tables)
        if listen:
            self.peers = PeerListener(settings, key, store, self.node_id,
                                      epoch=lease.epoch if lease is not None else 0,
                                      protocols=sends)
            if "trueseal" in sends:
                self.trueseal.peers = self.peers
            if self.ppp is not None:
                self.ppp.service.peers = self.peers
            for protocol, srv in tailing.items():
                srv.tail.on_signal = lambda p=protocol: self.peers.wake(p)
        if dial:
            ppp = self.ppp.inbox if self.ppp is not None else None
            self.dialer = PeerDialer(
                settings, key, store, f"{self.node_id}-dial", self._handed,
                lambda protocol: ppp.sessions.keys() if protocol == "ppp" and ppp else [],
                protocols=tuple(tailing), register=not listen,
                wakes=lambda protocol: tailing[protocol].tail.poke())
            if ppp is not None:
                ppp.sessions.watch = lambda mailbox, online: self.dialer.watch(
                    "ppp", mailbox, online)

    def _handed(self, h) -> None:
        """A hand-off from another host's listener: early if its recipient is online here."""
        if h.protocol == "ppp" and self.ppp is not None:
            self.ppp.inbox.land_handed(h.mailbox, h.event_id, h.envelope,
                                       h.expires_at.timestamp())

    def _named(self) -> list[tuple[str, object]]:
        return [(name, srv) for name, srv in (("trueseal_push", self.trueseal),
                                              ("heya", self.heya), ("sync", self.sync),
                                              ("ppp", self.ppp)) if srv is not None]

    async def start(self) -> None:
        await self.appender.start()
        for _, srv in self._named():
            await srv.start()
        if self.peers is not None:
            await self.peers.start()
        if self.dialer is not None:
            await self.dialer.start()

    def listeners(self) -> list:
        return [srv for _, srv in self._named()]

    def listening(self) -> dict[str, str]:
        out = {name: f"{self.settings.bind}:{srv.bound_port}" for name, srv in self._named()}
        if self.peers is not None:
            out["peer"] = f"{self.peers.host}:{self.peers.bound_port}"
        if self.sync is not None and self.sync.iroh is not None:
            # what a 0k-sync client dials: endpoint id @ direct address (ingress/sync_iroh.py)
            out["sync_iroh"] = f"{self.sync.iroh.id}@{self.settings.bind}:{self.sync.iroh.bound_port}"
        return out

    async def close(self) -> None:
        """Stop accepting; pushes already being stored finish (and are acked) first."""
        if self.dialer is not None:
            await self.dialer.close()
        for _, srv in self._named():
            await srv.close()
        if self.peers is not None:
            await self.peers.close()
        await self.appender.close()


def node_id(settings: Settings, protocol: str | None) -> str:
    base = settings.ingress.node_id
    return base if protocol is None else f"{base}-{protocol}"


async def run(settings: Settings, stop: asyncio.Event, ready=None,
              protocol: str | None = None) -> None:
    """Serve until `stop`; LeaseLost when another process took the node id over (the node
    stopped writing at once, and stops)."""
    open_files.raise_limit()   # before any socket: the listeners' caps need the descriptors
    layout = Layout.of(settings)
    node_name = node_id(settings, protocol)
    # before its first landing generation: the node id is this process's alone, on this host
    # (the claim) and on every host sharing the tables (the lease)
    claim = NodeClaim(layout.landing_root, layout.state, node_name).acquire()
    lease = None
    try:
        lease = await asyncio.to_thread(_take_lease, layout, settings, node_name,
                                        ingress_role(protocol), claim.lock_identity())
        node = IngressNode(settings, protocol=protocol, lease=lease)
        role = ingress_role(protocol)
        lost: list[LeaseLost] = []
        beat = asyncio.create_task(heartbeat(lease, stop, lost), name="lease-heartbeat")
        try:
            await run_role(settings, role, node, metrics.ingress_registry(node, role), stop,
                           ready)
        finally:
            beat.cancel()
        if lost:
            raise lost[0]
    finally:
        if lease is not None:
            await asyncio.to_thread(lease.release)
        claim.release()
    log.info("ingress stopped", extra={"event": "ingress_stopped",
                                       "rows": node.appender.rows_committed})


def _take_lease(layout: Layout, settings: Settings, node: str, role: str,
                lock: str) -> NodeLease:
    conf = settings.ingress
    return NodeLease(layout.tables, node, role, seconds=conf.lease_seconds,
                     renew_seconds=conf.lease_renew_seconds).acquire(
                         max(layout.generations(node), default=0), lock)


async def heartbeat(lease: NodeLease, stop: asyncio.Event, lost: list) -> None:
    """Renew the lease until `stop`. Lost to another process: stop the node. The store out of
    reach: keep trying; the node's own commits stop once the lease may have expired
    (`NodeLease.check`)."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), lease.renew_seconds)
            return
        except asyncio.TimeoutError:
            pass
        try:
            await asyncio.to_thread(lease.renew)
        except LeaseLost as exc:
            lost.append(exc)
            stop.set()
            return
        except Exception as exc:   # the store: retried at the next beat
            log.warning("lease renewal failed: %s", operator_line(exc),
                        extra={"event": "lease_renew_failed", "node": lease.node})
